package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"image"
	_ "image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twell-ai/twell/bench"
	"github.com/twell-ai/twell/internal/testutil"
)

// writeRun writes a bench model JSON file of a dense row, a TwELL row and
// a variant of it (random figures), of model model, and returns its path.
func writeRun(t *testing.T, dir, name, model string, seed func() float64) string {
	t.Helper()
	var rs []bench.ModelResult
	for i, sw := range []map[string]string{nil, nil, {"TWELL_GEMV_FUSE": "0"}} {
		path := "twell"
		if i == 0 {
			path = "dense"
		}
		rs = append(rs, bench.ModelResult{Row: bench.Row{Schema: bench.ModelSchema, Device: "cuda", Machine: "test", Date: "2026-12-05", Switches: sw},
			Model: model, Path: path, PrefillTokens: 4096, PrefillTokPerMS: 200 + 20*seed(),
			Decode: []bench.DecodePoint{{Batch: 1, Context: 512, TokensPerSec: 800 + 50*seed()}, {Batch: 8, Context: 512, TokensPerSec: 4000 + 100*seed()}}})
	}
	p := filepath.Join(dir, name)
	testutil.WriteJSON(t, p, rs)
	return p
}

// checkFigure fails the test unless path holds a PNG of a readable size.
func checkFigure(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatalf("figure: %v", err)
	}
	defer f.Close()
	cfg, _, err := image.DecodeConfig(f)
	if err != nil || cfg.Width < 500 || cfg.Height < 200 {
		t.Errorf("figure %s: %v, %dx%d", path, err, cfg.Width, cfg.Height)
	}
}

// TestBenchPlot draws two runs' rows in one figure, and refuses what it
// cannot draw with an exit code and a line naming the cause.
func TestBenchPlot(t *testing.T) {
	r, seed := testutil.Rand(t)
	dir := t.TempDir()
	a := writeRun(t, dir, "a.json", "sparselm-1.5b", r.Float64)
	b := writeRun(t, dir, "b.json", "sparselm-1.5b", r.Float64)
	png := filepath.Join(dir, "ab.png")
	var out, errb bytes.Buffer
	if code := run([]string{"bench", "plot", "-o", png, a, b}, &out, &errb); code != 0 {
		t.Fatalf("seed %d: exit %d: %s", seed, code, errb.String())
	}
	if !strings.Contains(out.String(), "6 rows of 2 runs") {
		t.Errorf("stdout %q", out.String())
	}
	checkFigure(t, png)

	other := writeRun(t, dir, "other.json", "tiny", r.Float64)
	bad := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(bad, []byte(`[{"schema":"twell.bench.ffn/1","path":"x"}]`), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{a}, 2, "-o is required"},
		{[]string{"-o", png}, 2, "at least one JSON file"},
		{[]string{"-o", png, filepath.Join(dir, "missing.json")}, 1, "missing.json"},
		{[]string{"-o", png, a, bad}, 1, `bad.json: row 0: schema "twell.bench.ffn/1"`},
		{[]string{"-o", png, a, other}, 1, `model "tiny"`},
		{[]string{"-o", filepath.Join(dir, "no", "such", "dir.png"), a}, 1, "dir.png"},
	} {
		out.Reset()
		errb.Reset()
		code := run(append([]string{"bench", "plot"}, c.args...), &out, &errb)
		if code != c.code || !strings.Contains(errb.String(), c.want) || strings.Count(errb.String(), "\n") != 1 {
			t.Errorf("bench plot %q: exit %d, stderr %q; want exit %d and one line with %q", c.args, code, errb.String(), c.code, c.want)
		}
	}
}

// TestBenchPlotFFN draws bench ffn runs of two builds in one figure, and
// refuses a bench model file among them.
func TestBenchPlotFFN(t *testing.T) {
	r, seed := testutil.Rand(t)
	dir := t.TempDir()
	var paths []string
	for i, commit := range []string{"ab460e2", "7683c70", "ab460e2", "7683c70"} {
		var rs []bench.FFNResult
		for _, m := range []int{4096, 65536} {
			ms := float64(m) / 16384 * (0.9 + 0.2*r.Float64())
			rs = append(rs, bench.FFNResult{Row: bench.Row{Schema: bench.FFNSchema, Device: "cuda", Machine: "test", Date: "2026-12-06", Commit: commit},
				D: 2048, F: 5632, C: 8, M: m, Density: 0.005, Dist: "skewed", Gated: true, DenseMS: 1.7 * ms, TwELLMS: ms, D2TMS: 0.6 * ms})
		}
		p := filepath.Join(dir, fmt.Sprintf("ffn-%d.json", i))
		testutil.WriteJSON(t, p, rs)
		paths = append(paths, p)
	}
	png := filepath.Join(dir, "ffn.png")
	var out, errb bytes.Buffer
	if code := run(append([]string{"bench", "plot", "-o", png}, paths...), &out, &errb); code != 0 {
		t.Fatalf("seed %d: exit %d: %s", seed, code, errb.String())
	}
	if !strings.Contains(out.String(), "8 rows of 4 runs") {
		t.Errorf("stdout %q", out.String())
	}
	checkFigure(t, png)

	model := writeRun(t, dir, "model.json", "sparselm-1.5b", r.Float64)
	out.Reset()
	errb.Reset()
	code := run([]string{"bench", "plot", "-o", png, paths[0], model}, &out, &errb)
	if want := `model.json: rows of schema "twell.bench.model/1", but`; code != 1 || !strings.Contains(errb.String(), want) || strings.Count(errb.String(), "\n") != 1 {
		t.Errorf("ffn and model runs: exit %d, stderr %q; want exit 1 and one line with %q", code, errb.String(), want)
	}
}

// TestBenchPlotGoBench draws go test -bench output and writes its medians,
// and refuses a metric no benchmark reports or -json without -gobench.
func TestBenchPlotGoBench(t *testing.T) {
	r, seed := testutil.Rand(t)
	dir := t.TempDir()
	in := filepath.Join(dir, "bench.txt")
	var sb strings.Builder
	sb.WriteString("pkg: example.com/p\n")
	for i := 0; i < 3; i++ {
		fmt.Fprintf(&sb, "BenchmarkS/n=%d-16\t30\t%d ns/op\t%.1f us/step\n", i, 1000+r.IntN(1000), 500+100*r.Float64())
	}
	if err := os.WriteFile(in, []byte(sb.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	png, js := filepath.Join(dir, "g.png"), filepath.Join(dir, "g.json")
	var out, errb bytes.Buffer
	if code := run([]string{"bench", "plot", "-gobench", "us/step", "-json", js, "-o", png, in}, &out, &errb); code != 0 {
		t.Fatalf("seed %d: exit %d: %s", seed, code, errb.String())
	}
	checkFigure(t, png)
	var got []bench.GoBenchResult
	data, err := os.ReadFile(js)
	if err != nil || json.Unmarshal(data, &got) != nil || len(got) != 3 || got[2].Median["us/step"] < 500 {
		t.Fatalf("seed %d: %s: %v %+v", seed, js, err, got)
	}
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"-gobench", "GB/s", "-o", png, in}, 1, `"GB/s"`},
		{[]string{"-json", js, "-o", png, in}, 2, "go with -gobench"},
		{[]string{"-title", "x", "-o", png, in}, 2, "go with -gobench"},
		{[]string{"-gobench", "us/step", "-o", png}, 2, "go test -bench output"},
	} {
		out.Reset()
		errb.Reset()
		code := run(append([]string{"bench", "plot"}, c.args...), &out, &errb)
		if code != c.code || !strings.Contains(errb.String(), c.want) {
			t.Errorf("bench plot %q: exit %d, stderr %q; want exit %d and %q", c.args, code, errb.String(), c.code, c.want)
		}
	}
}
