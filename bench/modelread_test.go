package bench

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// TestReadModelResultsRoundTrip: rows that bench model writes read back as
// they were, variants named by the switches that differ from the first row.
func TestReadModelResultsRoundTrip(t *testing.T) {
	r, seed := testutil.Rand(t)
	rs := modelResults(r, []int{1, 8})
	for i := range rs {
		rs[i].Schema, rs[i].Switches = ModelSchema, map[string]string{"TWELL_REQUIRE_GPU": "1"}
	}
	v := rs[1]
	v.Switches = map[string]string{"TWELL_REQUIRE_GPU": "1", "TWELL_GEMV_FUSE": "0"}
	rs = append(rs, v)
	data, err := json.Marshal(rs)
	if err != nil {
		t.Fatal(err)
	}
	got, err := ReadModelResults(data)
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	if len(got) != 3 || got[2].Decode[1].TokensPerSec != rs[2].Decode[1].TokensPerSec || got[0].PrefillTokPerMS != rs[0].PrefillTokPerMS {
		t.Fatalf("seed %d: read %d rows %+v, wrote %+v", seed, len(got), got, rs)
	}
	NameVariants(got)
	for i, want := range []string{"dense", "twell", "twell [GEMV_FUSE=0]"} {
		if got[i].Path != want {
			t.Errorf("seed %d: row %d named %q, want %q", seed, i, got[i].Path, want)
		}
	}
}

// TestReadModelResultsErrors: what is not a bench model array is refused
// with a message saying why.
func TestReadModelResultsErrors(t *testing.T) {
	row := `{"schema":"twell.bench.model/1","path":"twell"}`
	for _, c := range []struct{ in, want string }{
		{``, "not a bench model JSON array"},
		{`{"schema":"twell.bench.model/1"}`, "not a bench model JSON array"},
		{`[]`, "no rows"},
		{`[` + row + `,{"schema":"twell.bench.ffn/1","path":"twell"}]`, `row 1: schema "twell.bench.ffn/1"`},
		{`[{"schema":"twell.bench.model/1"}]`, "row 0: no path"},
		{`[` + row + `,{"schema":"twell.bench.model/1","decode":[{"batch":"x"}],"path":"a"}]`, "not a bench model JSON array"},
	} {
		if _, err := ReadModelResults([]byte(c.in)); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: error %v, want one containing %q", c.in, err, c.want)
		}
	}
}

// FuzzReadModelResults: any input is refused with an error or read into
// rows that all have the schema and a path; nothing panics, and a figure
// of what was read can be drawn.
func FuzzReadModelResults(f *testing.F) {
	f.Add([]byte(`[{"schema":"twell.bench.model/1","path":"dense","prefill_tokens_per_ms":1.5,"decode":[{"batch":1,"tokens_per_s":10}]}]`))
	f.Add([]byte(`[{"schema":"twell.bench.model/1","path":"a","switches":{"TWELL_X":"1"}},{"schema":"twell.bench.model/1","path":"b","decode":[{"batch":-3,"tokens_per_s":-1e308}]}]`))
	f.Add([]byte(`[1,2]`))
	f.Fuzz(func(t *testing.T, data []byte) {
		rs, err := ReadModelResults(data)
		if err != nil {
			return
		}
		for i, r := range rs {
			if r.Schema != ModelSchema || r.Path == "" {
				t.Fatalf("row %d accepted with schema %q, path %q", i, r.Schema, r.Path)
			}
		}
		NameVariants(rs)
		if len(rs) <= 8 {
			if err := PlotModel(rs, t.TempDir()+"/f.png"); err != nil && !strings.Contains(err.Error(), "bench:") {
				t.Fatalf("plot: %v", err)
			}
		}
	})
}
