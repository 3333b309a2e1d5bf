package bench

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/mlp"
)

// writeRows writes v as a results file named name in dir.
func writeRows(t *testing.T, dir, name string, v any) string {
	t.Helper()
	p := filepath.Join(dir, name)
	testutil.WriteJSON(t, p, v)
	return p
}

// TestTable lists MLP-block and model rows with their switches and
// headline figures, adds the TwELL / dense decode ratios, skips a file that
// is not a list of rows, and names a file it cannot parse.
func TestTable(t *testing.T) {
	dir := t.TempDir()
	sw := map[string]string{"TWELL_TAIL": "sorted", "TWELL_CUDA_LIB_DIR": "/usr/lib/cuda"}
	ffn := []FFNResult{{Row: Row{Schema: FFNSchema, Switches: sw}, M: 64, Density: 0.005, Dist: "skewed",
		DenseMS: 0.0386, TwELLMS: 0.0212, Speedup: 0.0386 / 0.0212, Tail: "sorted", AutoMS: 0.0213, AutoSpeedup: 1.81, AutoPath: "sparse", RelErr: 2.6e-3}}
	dec := func(tps ...float64) []DecodePoint {
		var out []DecodePoint
		for i, v := range tps {
			out = append(out, DecodePoint{Batch: []int{1, 64}[i], Context: 512, TokensPerSec: v})
		}
		return out
	}
	tr := &TraceSummary{Steps: 16, KernelsPerStep: 197, WallMS: 1.1, BusyMS: 0.95,
		Kernels: []KernelShare{{Name: "gemv_act<1,true,false>", AddsUS: 310}, {Name: "qkv_rope1", AddsUS: 250}}}
	ffn[0].TwELLTrace = tr
	model := []ModelResult{
		{Row: Row{Schema: ModelSchema}, Path: "twell", PrefillTokPerMS: 206.1, Speedup: 1.2, Decode: dec(900, 12600)},
		{Row: Row{Schema: ModelSchema}, Path: "dense", PrefillTokPerMS: 171.8, Speedup: 1, Decode: dec(600, 12000)},
		{Row: Row{Schema: ModelSchema, Switches: map[string]string{"TWELL_LLM_FUSE_NORMS": "0"}}, Path: "twell", Decode: dec(960, 14400)},
	}
	model[0].Decode[0].Trace = tr
	model[0].Decode[1].Steps, model[0].Decode[1].SparseLayers = 40, 28
	writeRows(t, dir, "a-ffn.json", ffn)
	mixed := ffn[0]
	mixed.Switches, mixed.TwELLTrace = nil, nil
	mixed.AutoMS, mixed.AutoSpeedup, mixed.AutoPath, mixed.AutoCalls = 0.0388, 0.99, "dense", map[string]int{"sparse": 3, "dense": 30}
	writeRows(t, dir, "a2-ffn.json", []FFNResult{mixed})
	writeRows(t, dir, "b-model.json", model)
	writeRows(t, dir, "c-trace.json", map[string]any{"traceEvents": []int{}})
	writeRows(t, dir, "d-train.json", []TrainStepResult{{Row: Row{Schema: TrainStepSchema}, Path: "auto", Batch: 8, Seq: 2048,
		StepMS: 239.4, TokensPerMS: 68.4, MFU: 0.463, SparseLayers: 28}})
	writeRows(t, dir, "f-other.json", []Row{{Schema: "twell.bench.future/1", Date: "2026-12-05T00:00:00Z"}})
	writeRows(t, dir, "g-serve.json", ServeResult{Row: Row{Schema: ServeSchema}, Requests: 64, Completed: 63, OutputTokPerS: 1234,
		TTFT: Dist{Median: 12.5}, TPOT: Dist{Median: 3.25}}) // one row, not a list
	var out bytes.Buffer
	if err := Table(&out, []string{dir}); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	for _, want := range []string{
		"a-ffn.json [TAIL=sorted]: ffn m 64, 0.5% skewed: dense 0.0386 ms, twell 0.0212 ms (1.82x, sorted tail), auto 0.0213 ms (1.81x, sparse), rel err 0.0026\n",
		"a2-ffn.json: ffn m 64, 0.5% skewed: dense 0.0386 ms, twell 0.0212 ms (1.82x, sorted tail), auto 0.0388 ms (0.99x, dense; sparse in 3 of 33 calls), rel err 0.0026\n",
		"b-model.json: model twell: prefill 206.1 tokens/ms (1.20x dense), b1@512 900 tokens/s, b64@512 12600 tokens/s (28 sparse layers)\n",
		"b-model.json: twell / dense: b1@512 1.500x b64@512 1.050x\n",
		"b-model.json: twell [LLM_FUSE_NORMS=0] / dense: b1@512 1.600x b64@512 1.200x\n",
		"a-ffn.json:   trace twell: busy 0.95 of 1.1 ms a step, 197 kernels; gemv_act<1,true,false> 310 us qkv_rope1 250 us\n",
		"b-model.json:   trace twell decode b1: busy 0.95 of 1.1 ms a step, 197 kernels;",
		"c-trace.json: not a result row or a list of them, skipped\n",
		"g-serve.json: serve 63/64 requests: 1234 output tokens/s, TTFT median 12.5 ms, TPOT median 3.25 ms\n",
		"d-train.json: train-step auto, 8 x 2048 tokens: 239.4 ms a step, 68.4 tokens/ms, MFU 46.3%, 28 sparse layers\n",
		"f-other.json: twell.bench.future/1, 2026-12-05T00:00:00Z\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("table lacks %q; got:\n%s", want, got)
		}
	}
	if strings.Contains(got, "CUDA_LIB_DIR") {
		t.Errorf("table lists a path variable as a switch:\n%s", got)
	}
	bad := filepath.Join(t.TempDir(), "e-bad.json")
	if err := os.WriteFile(bad, []byte("[{"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Table(&out, []string{bad}); err == nil || !strings.Contains(err.Error(), "e-bad.json") {
		t.Errorf("Table of a broken file: %v, want an error naming it", err)
	}
	if err := Table(&out, []string{filepath.Join(dir, "missing.json")}); err == nil {
		t.Error("Table of a missing file: no error")
	}
	if err := Table(&out, nil); err == nil {
		t.Error("Table of no files: no error")
	}
}

// FuzzTable feeds arbitrary bytes as a results file: the table returns an
// error or writes lines, and never panics.
func FuzzTable(f *testing.F) {
	f.Add([]byte(`[{"schema":"twell.bench.ffn/1","m":4}]`))
	f.Add([]byte(`[{"schema":"twell.bench.model/1","path":"twell","decode":[{"batch":1}]},{"schema":"twell.bench.model/1","path":"dense","decode":[{"batch":1,"tokens_per_s":0}]}]`))
	f.Add([]byte(`{"traceEvents":[]}`))
	f.Add([]byte(`[1,2]`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var out bytes.Buffer
		_ = tableFile(&out, "x.json", b)
	})
}

// TestAutoSummary names the path most of the automatic path's calls ran,
// and counts them by path only when both ran.
func TestAutoSummary(t *testing.T) {
	for _, c := range []struct {
		sparse, dense int
		want          string
		both          bool
	}{{30, 0, "sparse", false}, {0, 33, "dense", false}, {3, 30, "dense", true}, {30, 3, "sparse", true}, {5, 5, "sparse", true}} {
		path, calls := autoSummary(map[mlp.Path]int{mlp.Sparse: c.sparse, mlp.Dense: c.dense})
		if path != c.want || (calls != nil) != c.both || (c.both && (calls["sparse"] != c.sparse || calls["dense"] != c.dense)) {
			t.Errorf("%d sparse, %d dense calls: %q %v, want %q (counts %v)", c.sparse, c.dense, path, calls, c.want, c.both)
		}
	}
}
