// Package buildinfo reads what the Go toolchain recorded about the source a
// binary was built from.
package buildinfo

import "runtime/debug"

// VCS returns the source commit recorded in bi and whether the tree had
// uncommitted changes; revision is "" when bi is nil or records none (test
// binaries, builds with -buildvcs=false or outside a repository).
func VCS(bi *debug.BuildInfo) (revision string, modified bool) {
	if bi == nil {
		return "", false
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			revision = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	return revision, modified
}
