package buildinfo

import (
	"runtime/debug"
	"testing"
)

// TestVCS: the revision and the modified flag are read from the settings,
// in any order, and a missing or nil build info gives none.
func TestVCS(t *testing.T) {
	set := func(kv ...string) *debug.BuildInfo {
		bi := &debug.BuildInfo{}
		for i := 0; i+1 < len(kv); i += 2 {
			bi.Settings = append(bi.Settings, debug.BuildSetting{Key: kv[i], Value: kv[i+1]})
		}
		return bi
	}
	const rev = "7683c70a1b2c3d4e5f60718293a4b5c6d7e8f901"
	for _, c := range []struct {
		bi       *debug.BuildInfo
		rev      string
		modified bool
	}{
		{nil, "", false},
		{set(), "", false},
		{set("vcs", "git", "vcs.revision", rev), rev, false},
		{set("vcs.modified", "true", "vcs.revision", rev), rev, true},
		{set("vcs.revision", rev, "vcs.modified", "false"), rev, false},
		{set("vcs.modified", "true"), "", true},
	} {
		rev, modified := VCS(c.bi)
		if rev != c.rev || modified != c.modified {
			t.Errorf("VCS(%v) = %q, %v; want %q, %v", c.bi, rev, modified, c.rev, c.modified)
		}
	}
}
