package bench

import (
	"encoding/json"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// TestReadFFNResultsRoundTrip: rows that bench ffn writes read back as
// written, and ResultSchema names their schema.
func TestReadFFNResultsRoundTrip(t *testing.T) {
	r, seed := testutil.Rand(t)
	rs := ffnRuns(r, 3)
	data, err := json.Marshal(rs)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := ResultSchema(data); err != nil || s != FFNSchema {
		t.Fatalf("seed %d: schema %q, %v", seed, s, err)
	}
	got, err := ReadFFNResults(data)
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	back, _ := json.Marshal(got)
	if string(back) != string(data) {
		t.Errorf("seed %d: read back as\n%s\nwant\n%s", seed, back, data)
	}
}

// TestReadFFNResultsErrors: what is not a bench ffn array is refused with a
// message saying why.
func TestReadFFNResultsErrors(t *testing.T) {
	row := `{"schema":"twell.bench.ffn/1","m":4096}`
	for _, c := range []struct{ in, want string }{
		{``, "not a bench ffn JSON array"},
		{row, "not a bench ffn JSON array"},
		{`[]`, "no rows"},
		{`[` + row + `,{"schema":"twell.bench.model/1","path":"twell"}]`, `row 1: schema "twell.bench.model/1"`},
		{`[` + row + `,{"schema":"twell.bench.ffn/1","m":"x"}]`, "not a bench ffn JSON array"},
	} {
		if _, err := ReadFFNResults([]byte(c.in)); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: error %v, want one containing %q", c.in, err, c.want)
		}
	}
	for _, in := range []string{``, `{}`, `[]`, `[1]`} {
		if _, err := ResultSchema([]byte(in)); err == nil {
			t.Errorf("ResultSchema(%q): no error", in)
		}
	}
}

// FuzzReadFFNResults: any input is refused with an error or read into rows
// that all have the schema; nothing panics, and a figure of what was read
// can be drawn.
func FuzzReadFFNResults(f *testing.F) {
	f.Add([]byte(`[{"schema":"twell.bench.ffn/1","m":4096,"density":0.005,"dist":"uniform","twell_ms":0.3,"d2t_ms":0.16,"commit":"7683c70"}]`))
	f.Add([]byte(`[{"schema":"twell.bench.ffn/1","m":-1,"twell_ms":-1e308,"switches":{"TWELL_X":"1"}},{"schema":"twell.bench.ffn/1","d2t_ms":1e308}]`))
	f.Add([]byte(`[1,2]`))
	f.Fuzz(func(t *testing.T, data []byte) {
		rs, err := ReadFFNResults(data)
		if err != nil {
			return
		}
		for i, r := range rs {
			if r.Schema != FFNSchema {
				t.Fatalf("row %d accepted with schema %q", i, r.Schema)
			}
		}
		if len(rs) <= 8 {
			if err := PlotFFNRuns(rs, t.TempDir()+"/f.png"); err != nil && !strings.Contains(err.Error(), "bench:") {
				t.Fatalf("plot: %v", err)
			}
		}
	})
}

// TestCommitOf: the build's commit is its first 7 hex digits, marked
// "+dirty" for uncommitted changes, and empty where the build records none.
func TestCommitOf(t *testing.T) {
	const rev = "7683c70a1b2c3d4e5f60718293a4b5c6d7e8f901"
	revision := debug.BuildSetting{Key: "vcs.revision", Value: rev}
	modified := debug.BuildSetting{Key: "vcs.modified", Value: "true"}
	for _, c := range []struct {
		bi   *debug.BuildInfo
		want string
	}{
		{nil, ""},
		{&debug.BuildInfo{}, ""},
		{&debug.BuildInfo{Settings: []debug.BuildSetting{modified}}, ""},
		{&debug.BuildInfo{Settings: []debug.BuildSetting{revision}}, "7683c70"},
		{&debug.BuildInfo{Settings: []debug.BuildSetting{modified, revision}}, "7683c70+dirty"},
		{&debug.BuildInfo{Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc"}}}, "abc"},
	} {
		if got := commitOf(c.bi); got != c.want {
			t.Errorf("commitOf(%v) = %q, want %q", c.bi, got, c.want)
		}
	}
}
