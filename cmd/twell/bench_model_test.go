package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twell-ai/twell/bench"
	"github.com/twell-ai/twell/cuda"
)

func TestBenchModelOnCheckpoint(t *testing.T) {
	dir := tinyCheckpoint(t)
	js := filepath.Join(t.TempDir(), "m.json")
	png := filepath.Join(t.TempDir(), "m.png")
	var out, errb bytes.Buffer
	code := run([]string{"bench", "model", "-model", dir, "-batch", "2", "-prompt-len", "8", "-decode-batch", "1,3", "-decode-steps", "2", "-decode-context", "5", "-reps", "1", "-json", js, "-plot", png}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	checkFigure(t, png)
	var rs []map[string]any
	b, _ := os.ReadFile(js)
	if err := json.Unmarshal(b, &rs); err != nil || len(rs) != 2 {
		t.Fatalf("JSON: %v, %d results", err, len(rs))
	}
	if p, rss := rs[1]["params"].(float64), rs[1]["peak_rss_bytes"].(float64); p < 1000 || rss < 1e6 {
		t.Errorf("params %v, peak RSS %v: want the model's count and a real figure", p, rss)
	}
	if strings.Contains(errb.String(), "0.00B") || strings.Contains(errb.String(), " 0.0 GiB") {
		t.Errorf("stderr reports zero parameters or memory: %q", errb.String())
	}
	if rs[0]["schema"] != "twell.bench.model/1" || len(rs[0]) != len(rs[1]) {
		t.Errorf("rows: schema %v, %d and %d keys; want the schema and the same keys in every row", rs[0]["schema"], len(rs[0]), len(rs[1]))
	}
	if rs[0]["path"] != "dense" || rs[1]["path"] != "twell" {
		t.Errorf("paths %v, %v", rs[0]["path"], rs[1]["path"])
	}
	if d := rs[1]["max_logit_diff_vs_dense"].(float64); d > 0.05 {
		t.Errorf("TwELL logits differ from dense by %g", d)
	}
	if dec := rs[1]["decode"].([]any); len(dec) != 2 || dec[1].(map[string]any)["context"] != 5.0 {
		t.Errorf("decode points %v, want two with context 5", dec)
	}
	if !strings.Contains(out.String(), "decode b=3 tok/s") || !strings.Contains(out.String(), "5 tokens cached per sequence") {
		t.Errorf("table: %q", out.String())
	}
}

// TestBenchModelTooLong: a decode context past the model's positions is
// refused, naming both flags.
func TestBenchModelTooLong(t *testing.T) {
	dir := tinyCheckpoint(t)
	var out, errb bytes.Buffer
	code := run([]string{"bench", "model", "-model", dir, "-prompt-len", "8", "-decode-context", "100000", "-reps", "1"}, &out, &errb)
	if code == 0 || !strings.Contains(errb.String(), "-decode-context 100000 plus -decode-steps 8 exceeds") {
		t.Errorf("exit %d, stderr %q", code, errb.String())
	}
}

func TestBenchModelBadInput(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"bench", "model"}, "give -model DIR or -preset NAME"},
		{[]string{"bench", "model", "-preset", "gpt5"}, "sparselm-1.5b"},
		{[]string{"bench", "model", "-preset", "sparselm-1.5b", "-density", "2"}, "-density 2"},
		{[]string{"bench", "model", "-preset", "sparselm-1.5b", "-decode-batch", "x"}, "not an integer"},
		{[]string{"bench", "model", "-preset", "sparselm-1.5b", "-decode-context", "0"}, "-decode-context 0 must be positive"},
		{[]string{"bench", "model", "-preset", "sparselm-1.5b", "-layers", "-1"}, "-layers -1: must be between 1 and the preset's 28"},
		{[]string{"bench", "model", "-preset", "sparselm-1.5b", "-layers", "99999"}, "-layers 99999"},
		{[]string{"bench", "model", "-preset", "sparselm-1.5b", "-layers", "0"}, "-layers 0"},
		{[]string{"bench", "model", "-preset", "sparselm-1.5b", "-trace-steps", "-1"}, "-trace-steps -1 must not be negative"},
		{[]string{"bench", "model", "-preset", "sparselm-1.5b", "-device", "cpu", "-trace", "t.json"}, "they need -device cuda"},
		{[]string{"bench", "model", "-preset", "sparselm-1.5b", "-device", "cpu", "-trace-steps", "4"}, "they need -device cuda"},
		{[]string{"bench", "model", "-preset", "sparselm-1.5b", "-device", "cpu", "-trace-plot", "t.png"}, "they need -device cuda"},
		{[]string{"bench", "model", "-preset", "sparselm-1.5b", "-device", "cpu", "-variants", "LLM_FUSE_NORMS=0"}, "they need -device cuda"},
	} {
		var out, errb bytes.Buffer
		if code := run(c.args, &out, &errb); code != 2 || !strings.Contains(errb.String(), c.want) {
			t.Errorf("%v: exit %d, stderr %q, want 2 and %q", c.args, code, errb.String(), c.want)
		}
	}
	// An output folder that does not exist fails before any work.
	var out, errb bytes.Buffer
	args := []string{"bench", "model", "-preset", "sparselm-1.5b", "-plot", "/nonexistent/dir/m.png"}
	if code := run(args, &out, &errb); code != 1 || !strings.Contains(errb.String(), "folder /nonexistent/dir does not exist") {
		t.Errorf("%v: exit %d, stderr %q", args, code, errb.String())
	}
}

// TestBenchModelCUDAWithoutGPU fails at once, before building a model.
func TestBenchModelCUDAWithoutGPU(t *testing.T) {
	if n, err := cuda.Count(); err == nil && n > 0 {
		t.Skip("a GPU is present")
	}
	var out, errb bytes.Buffer
	if code := run([]string{"bench", "model", "-preset", "sparselm-1.5b", "-device", "cuda"}, &out, &errb); code != 1 || !strings.Contains(errb.String(), "no GPU found") {
		t.Errorf("exit %d, stderr %q", code, errb.String())
	}
}

// TestBenchModelCUDAVariants runs the TwELL path again on engines of other
// settings: a row each after the dense and TwELL rows, recording the
// settings, with decode points and a check against the dense logits.
func TestBenchModelCUDAVariants(t *testing.T) {
	if n, err := cuda.Count(); err != nil || n == 0 {
		t.Skipf("no GPU: %v", err)
	}
	for _, k := range []string{"TWELL_LLM_FUSE_NORMS", "TWELL_LLM_ATTENTION", "TWELL_TAIL"} {
		t.Setenv(k, "")
	}
	dir := tinyCheckpoint(t)
	js := filepath.Join(t.TempDir(), "m.json")
	var out, errb bytes.Buffer
	code := run([]string{"bench", "model", "-device", "cuda", "-model", dir, "-batch", "2", "-prompt-len", "8", "-decode-batch", "1,12",
		"-decode-steps", "2", "-decode-context", "5", "-reps", "1", "-json", js,
		"-variants", "LLM_FUSE_NORMS=1;TAIL=sorted LLM_ATTENTION=mma"}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	var rs []struct {
		Path     string            `json:"path"`
		Switches map[string]string `json:"switches"`
		Diff     float64           `json:"max_logit_diff_vs_dense"`
		Decode   []struct {
			TokensPerSec float64 `json:"tokens_per_s"`
		} `json:"decode"`
	}
	b, _ := os.ReadFile(js)
	if err := json.Unmarshal(b, &rs); err != nil || len(rs) != 4 {
		t.Fatalf("JSON: %v, %d results, want 4", err, len(rs))
	}
	want := []map[string]string{nil, nil, {"TWELL_LLM_FUSE_NORMS": "1"}, {"TWELL_TAIL": "sorted", "TWELL_LLM_ATTENTION": "mma"}}
	for i, r := range rs {
		if i > 0 && r.Path != "twell" {
			t.Errorf("row %d: path %q, want twell", i, r.Path)
		}
		for k, v := range want[i] {
			if r.Switches[k] != v {
				t.Errorf("row %d: switches %v, want %s=%s", i, r.Switches, k, v)
			}
		}
		if len(r.Decode) != 2 || r.Decode[1].TokensPerSec <= 0 {
			t.Errorf("row %d: decode %+v, want two points", i, r.Decode)
		}
		if i > 0 && !(r.Diff < 0.5) {
			t.Errorf("row %d: max |logit - dense logit| %g", i, r.Diff)
		}
	}
	if !strings.Contains(out.String(), "twell [LLM_ATTENTION=mma TAIL=sorted]") {
		t.Errorf("the table does not name the variants:\n%s", out.String())
	}
}

// TestBenchModelCUDATrace traces a small model's prefill and decode steps
// on the GPU: summaries in the JSON, every kernel in the Chrome trace.
func TestBenchModelCUDATrace(t *testing.T) {
	if n, err := cuda.Count(); err != nil || n == 0 {
		t.Skipf("no GPU: %v", err)
	}
	dir := tinyCheckpoint(t)
	tmp := t.TempDir()
	js, tr := filepath.Join(tmp, "m.json"), filepath.Join(tmp, "trace.json")
	var out, errb bytes.Buffer
	code := run([]string{"bench", "model", "-device", "cuda", "-model", dir, "-batch", "2", "-prompt-len", "8", "-decode-batch", "1,3",
		"-decode-steps", "2", "-decode-context", "5", "-reps", "1", "-json", js, "-trace", tr, "-trace-steps", "3",
		"-trace-plot", filepath.Join(tmp, "trace.png")}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	var rs []struct {
		Path         string `json:"path"`
		PrefillTrace *struct {
			Steps   int               `json:"steps"`
			Kernels []json.RawMessage `json:"kernels"`
		} `json:"prefill_trace"`
		Decode []struct {
			Batch int `json:"batch"`
			Trace *struct {
				Steps          int     `json:"steps"`
				KernelsPerStep float64 `json:"kernels_per_step"`
				SpanMS         float64 `json:"span_ms_per_step"`
				BusyMS         float64 `json:"busy_ms_per_step"`
				WallMS         float64 `json:"wall_ms_per_step"`
			} `json:"trace"`
		} `json:"decode"`
	}
	b, _ := os.ReadFile(js)
	if err := json.Unmarshal(b, &rs); err != nil || len(rs) != 2 {
		t.Fatalf("JSON: %v, %d results", err, len(rs))
	}
	for _, r := range rs {
		if r.PrefillTrace == nil || r.PrefillTrace.Steps != 1 || len(r.PrefillTrace.Kernels) == 0 {
			t.Errorf("%s: prefill trace %+v", r.Path, r.PrefillTrace)
		}
		for _, d := range r.Decode {
			tr := d.Trace
			if tr == nil || tr.Steps != 3 || tr.KernelsPerStep < 3 || !(tr.BusyMS > 0 && tr.BusyMS <= tr.SpanMS+1e-9 && tr.SpanMS <= tr.WallMS+1e-9) {
				t.Errorf("%s decode b=%d: trace %+v; want 3 steps of kernels with busy <= span <= wall", r.Path, d.Batch, tr)
			}
		}
	}
	var chrome struct {
		TraceEvents []struct {
			Ph   string `json:"ph"`
			Name string `json:"name"`
		} `json:"traceEvents"`
	}
	b, _ = os.ReadFile(tr)
	if err := json.Unmarshal(b, &chrome); err != nil {
		t.Fatalf("Chrome trace: %v", err)
	}
	kernels := 0
	for _, e := range chrome.TraceEvents {
		if e.Ph == "X" {
			kernels++
		}
	}
	if kernels < 2*3*3 {
		t.Errorf("%d kernel events in the Chrome trace", kernels)
	}
	if st, err := os.Stat(filepath.Join(tmp, "trace.png")); err != nil || st.Size() == 0 {
		t.Errorf("trace plot: %v", err)
	}
	if !strings.Contains(errb.String(), "traced decode steps, batch 3") {
		t.Errorf("stderr has no decode trace summary: %s", errb.String())
	}
}

// TestPowerLine: the power line names what the energy window measured and
// leaves out what it could not read.
func TestPowerLine(t *testing.T) {
	capped := 1.0
	for _, c := range []struct {
		r    bench.ModelCUDAResult
		want string
	}{
		{bench.ModelCUDAResult{}, ""},
		{bench.ModelCUDAResult{PrefillWatts: 688.4, PowerLimitWatts: 700, PrefillSMClockMHz: 1530, MaxSMClockMHz: 1980, PrefillPowerCapped: &capped},
			"prefill at 688 W of a 700 W limit, SM clock 1530 of 1980 MHz, power cap in 100% of samples"},
		{bench.ModelCUDAResult{PrefillWatts: 301, PrefillSMClockMHz: 1980}, "prefill at 301 W, SM clock 1980 MHz"},
	} {
		if got := powerLine(c.r); got != c.want {
			t.Errorf("powerLine(%+v) = %q, want %q", c.r, got, c.want)
		}
	}
}
