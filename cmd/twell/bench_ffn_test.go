package main

import (
	"bytes"
	"encoding/json"
	"github.com/twell-ai/twell/cuda"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestBenchFFNBadInputExits2(t *testing.T) {
	cases := []usageCase{
		{[]string{"bench", "ffn", "-bogus"}, "flag provided but not defined: -bogus"},
		{[]string{"bench", "ffn", "-density", "0"}, "-density 0: must be inside (0, 1)"},
		{[]string{"bench", "ffn", "-density", "1.5"}, "-density 1.5"},
		{[]string{"bench", "ffn", "-density", "abc"}, "is not a number"},
		{[]string{"bench", "ffn", "-f", "1000"}, "-f 1000: the MLP width must be a positive multiple of the tile width 256"},
		{[]string{"bench", "ffn", "-d", "0"}, "-d 0"},
		{[]string{"bench", "ffn", "-dist", "zipf"}, "unknown distribution"},
		{[]string{"bench", "ffn", "-device", "tpu"}, "-device \"tpu\""},
		{[]string{"bench", "ffn", "-c", "3"}, "compression factor 3"},
		{[]string{"bench", "ffn", "-tile", "0"}, "tile width 0"},
		{[]string{"bench", "ffn", "-m", "0"}, "-m 0"},
		{[]string{"bench", "ffn", "-reps", "0"}, "-reps 0"},
		{[]string{"bench", "ffn", "-device", "cpu", "-trace", "t.json"}, "they need -device cuda"},
		{[]string{"bench", "ffn", "-device", "cpu", "-trace-steps", "2"}, "they need -device cuda"},
		{[]string{"bench", "ffn", "-device", "cpu", "-trace-plot", "t.png"}, "they need -device cuda"},
		{[]string{"bench", "ffn", "-device", "cpu", "-variants", "TAIL=sorted"}, "they need -device cuda"},
		{[]string{"bench", "nope"}, "unknown command \"bench nope\""},
	}
	checkUsageErrors(t, cases)
}

// usageCase is a command line that must fail with exit status 2 and one
// line on stderr containing want.
type usageCase struct {
	args []string
	want string
}

func checkUsageErrors(t *testing.T, cases []usageCase) {
	t.Helper()
	for _, c := range cases {
		var out, errb bytes.Buffer
		code := run(c.args, &out, &errb)
		msg := errb.String()
		if code != 2 {
			t.Errorf("%v: exit %d, want 2 (stderr %q)", c.args, code, msg)
		}
		if !strings.Contains(msg, c.want) || strings.Count(strings.TrimSpace(msg), "\n") != 0 {
			t.Errorf("%v: stderr %q, want one line containing %q", c.args, msg, c.want)
		}
	}
}

func TestBenchFFNSmallRun(t *testing.T) {
	dir := t.TempDir()
	js, png := filepath.Join(dir, "r.json"), filepath.Join(dir, "r.png")
	var out, errb bytes.Buffer
	code := run([]string{"bench", "ffn", "-device", "cpu", "-d", "64", "-f", "512", "-m", "40", "-reps", "1",
		"-density", "0.01,0.3", "-dist", "skewed", "-json", js, "-plot", png}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	var rs []map[string]any
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rs); err != nil {
		t.Fatal(err)
	}
	if len(rs) != 2 {
		t.Fatalf("%d results, want 2", len(rs))
	}
	if rs[0]["schema"] != "twell.bench.ffn/1" || len(rs[0]) != len(rs[1]) {
		t.Errorf("rows: schema %v, %d and %d keys; want the schema and the same keys in every row", rs[0]["schema"], len(rs[0]), len(rs[1]))
	}
	for _, key := range []string{"device", "d", "f", "m", "density", "dist", "nnz_mean", "nnz_max", "dense_ms", "twell_ms", "speedup", "rel_err", "dense_act_bytes", "twell_act_bytes", "dense_gflops"} {
		if _, ok := rs[0][key]; !ok {
			t.Errorf("JSON record lacks %q", key)
		}
	}
	if e := rs[1]["rel_err"].(float64); e > 1e-2 {
		t.Errorf("rel_err %g > 1e-2", e)
	}
	if st, err := os.Stat(png); err != nil || st.Size() == 0 {
		t.Errorf("plot not written: %v", err)
	}
	if !strings.Contains(out.String(), "speedup") {
		t.Errorf("no table printed: %q", out.String())
	}
}

// TestBenchFFNCUDATrace traces both paths of a small MLP block on the GPU:
// a summary per path in the JSON, every kernel in the Chrome trace.
func TestBenchFFNCUDATrace(t *testing.T) {
	if n, err := cuda.Count(); err != nil || n == 0 {
		t.Skipf("no GPU: %v", err)
	}
	dir := t.TempDir()
	js, tr := filepath.Join(dir, "r.json"), filepath.Join(dir, "trace.json")
	var out, errb bytes.Buffer
	code := run([]string{"bench", "ffn", "-device", "cuda", "-d", "256", "-f", "1024", "-m", "512", "-reps", "3",
		"-density", "0.01", "-json", js, "-trace", tr, "-trace-steps", "4", "-trace-plot", filepath.Join(dir, "trace.png")}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	type summary struct {
		Steps   int `json:"steps"`
		Kernels []struct {
			Name string `json:"name"`
		} `json:"kernels"`
		BusyMS float64 `json:"busy_ms_per_step"`
	}
	var rs []struct {
		Dense *summary `json:"dense_trace"`
		TwELL *summary `json:"twell_trace"`
	}
	b, _ := os.ReadFile(js)
	if err := json.Unmarshal(b, &rs); err != nil || len(rs) != 1 {
		t.Fatalf("JSON: %v, %d results", err, len(rs))
	}
	for _, s := range []*summary{rs[0].Dense, rs[0].TwELL} {
		if s == nil || s.Steps != 4 || len(s.Kernels) == 0 || s.BusyMS <= 0 {
			t.Errorf("trace %+v, want 4 steps of kernels", s)
		}
	}
	b, _ = os.ReadFile(tr)
	if !json.Valid(b) || !strings.Contains(string(b), "twell m=512") {
		t.Errorf("Chrome trace: valid %v, %d bytes", json.Valid(b), len(b))
	}
	if st, err := os.Stat(filepath.Join(dir, "trace.png")); err != nil || st.Size() == 0 {
		t.Errorf("trace plot: %v", err)
	}
}

// TestBenchFFNCUDAVariants times the TwELL path of a 16-token batch with
// the environment's settings (the warp tail at this size) and with the
// sorted tail, in one run: a row each, the dense figure shared, each row
// naming its kernels and switches.
func TestBenchFFNCUDAVariants(t *testing.T) {
	if n, err := cuda.Count(); err != nil || n == 0 {
		t.Skipf("no GPU: %v", err)
	}
	t.Setenv("TWELL_TAIL", "")
	js := filepath.Join(t.TempDir(), "r.json")
	var out, errb bytes.Buffer
	code := run([]string{"bench", "ffn", "-device", "cuda", "-d", "256", "-f", "1024", "-m", "16", "-reps", "3",
		"-density", "0.02", "-variants", ";TAIL=sorted", "-json", js}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	var rs []struct {
		DenseMS  float64           `json:"dense_ms"`
		TwELLMS  float64           `json:"twell_ms"`
		RelErr   float64           `json:"rel_err"`
		Kernels  string            `json:"tail"`
		Switches map[string]string `json:"switches"`
	}
	b, _ := os.ReadFile(js)
	if err := json.Unmarshal(b, &rs); err != nil || len(rs) != 2 {
		t.Fatalf("JSON: %v, %d rows, want 2", err, len(rs))
	}
	if rs[0].DenseMS != rs[1].DenseMS || rs[0].TwELLMS <= 0 || rs[1].TwELLMS <= 0 {
		t.Errorf("rows %+v: want one dense figure and a TwELL time each", rs)
	}
	if rs[0].Kernels != "warp" || rs[1].Kernels != "sorted" || rs[1].Switches["TWELL_TAIL"] != "sorted" {
		t.Errorf("rows %+v: want the first on the warp tail and the second, with TWELL_TAIL=sorted, on the sorted tail", rs)
	}
	for i, r := range rs {
		if !(r.RelErr <= 1e-2) {
			t.Errorf("row %d: rel err %g > 1e-2", i, r.RelErr)
		}
	}
}

func TestHelpListsCommands(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run(nil, &out, &errb); code != 0 || !strings.Contains(out.String(), "bench ffn") {
		t.Fatalf("help: exit %d, output %q", code, out.String())
	}
}

// TestBenchFFNRefusesWhatCannotFit: a shape past the machine's memory is
// refused up front with both figures, not killed by the kernel.
func TestBenchFFNRefusesWhatCannotFit(t *testing.T) {
	var out, errb bytes.Buffer
	code := run([]string{"bench", "ffn", "-device", "cpu", "-d", "100000000"}, &out, &errb)
	if msg := errb.String(); code != 1 || !strings.Contains(msg, "memory") || !strings.Contains(msg, "available") {
		t.Errorf("exit %d, stderr %q; want exit 1 naming the memory needed and available", code, msg)
	}
}

// TestBenchFFNDumpInputs: -dump-inputs creates the folder and writes the
// batch and one layer file per density.
func TestBenchFFNDumpInputs(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "inputs")
	var out, errb bytes.Buffer
	code := run([]string{"bench", "ffn", "-device", "cpu", "-d", "32", "-f", "256", "-m", "8", "-reps", "1",
		"-density", "0.05,0.1", "-seed", "3", "-dump-inputs", dir}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	for _, name := range []string{"x.safetensors", "layer-0.05.safetensors", "layer-0.1.safetensors"} {
		if st, err := os.Stat(filepath.Join(dir, name)); err != nil || st.Size() == 0 {
			t.Errorf("%s not written: %v", name, err)
		}
	}
}
