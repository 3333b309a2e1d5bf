package bench

import (
	"image"
	_ "image/png"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// randomTrace makes a summary of n kernels with random adds, long library
// names among them.
func randomTrace(r *rand.Rand, n int, scale float64) *TraceSummary {
	t := &TraceSummary{Steps: 8, KernelsPerStep: float64(n)}
	names := []string{"qkv_rope1", "gemv_act<1, true, false, true>", "attn_dec64", "gemv_rows1", "gemv_down<1, false>",
		"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas",
		"add_rmsnorm", "embed", "cutlass::Kernel<...>"}
	for i := range n {
		adds := scale * r.Float64()
		t.Kernels = append(t.Kernels, KernelShare{Name: names[i%len(names)] + strings.Repeat("x", i/len(names)), CallsPerStep: 28,
			MedianUS: adds / 28, AddsUS: adds})
		t.BusyMS += adds / 1e3
	}
	t.SpanMS, t.WallMS = t.BusyMS*1.1, t.BusyMS*1.2
	return t
}

func TestPlotTraces(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 3))
	dir := t.TempDir()
	if d := os.Getenv("TWELL_PLOT_DIR"); d != "" { // to look at the plots
		dir = d
	}
	var rs []ModelCUDAResult
	for _, path := range []string{"dense", "twell"} {
		res := ModelCUDAResult{ModelResult: ModelResult{Row: newRow(ModelSchema, "cuda", "H200"), Model: "sparselm-1.5b", Path: path,
			PrefillTokens: 512}, PrefillTrace: randomTrace(r, 12, 3e5)}
		for _, b := range []int{1, 8} {
			res.Decode = append(res.Decode, DecodePoint{Batch: b, Context: 512, Trace: randomTrace(r, 9+r.IntN(6), 40)})
		}
		rs = append(rs, res)
	}
	// A kernel time that is not finite is left out with a note, not drawn.
	rs[1].Decode[1].Trace.Kernels[0].AddsUS = math.NaN()
	fs := []FFNResult{{Row: newRow(FFNSchema, "cuda", "H200"), D: 2048, F: 5632, M: 65536, Density: 0.005, Dist: "skewed",
		DenseTrace: randomTrace(r, 5, 6000), TwELLTrace: randomTrace(r, 8, 4000)}}
	for name, draw := range map[string]func(string) error{
		"model": func(p string) error { return PlotModelTraces(rs, p) },
		"ffn":   func(p string) error { return PlotFFNTraces(fs, p) },
	} {
		p := filepath.Join(dir, name+".png")
		if err := draw(p); err != nil {
			t.Fatalf("seed %d: %s: %v", seed, name, err)
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		cfg, _, err := image.DecodeConfig(f)
		f.Close()
		if err != nil || cfg.Width < 700 || cfg.Height < 500 {
			t.Errorf("seed %d: %s plot: %v, %dx%d", seed, name, err, cfg.Width, cfg.Height)
		}
	}
	// Results without traces have nothing to plot.
	for i := range rs {
		rs[i].PrefillTrace = nil
		for j := range rs[i].Decode {
			rs[i].Decode[j].Trace = nil
		}
	}
	if err := PlotModelTraces(rs, filepath.Join(dir, "none.png")); err == nil || !strings.Contains(err.Error(), "no kernel traces") {
		t.Errorf("no traces: err %v", err)
	}
	if err := PlotFFNTraces(nil, filepath.Join(dir, "none.png")); err == nil {
		t.Error("no results: no error")
	}
}

func TestTraceLabelsAreShortAndDistinct(t *testing.T) {
	long := "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_"
	names := []string{"qkv_rope1", long + "a", long + "b", long + "c", "attn_dec64"}
	got := traceLabels(names)
	seen := map[string]bool{}
	for i, l := range got {
		if len(l) > traceLabelMax || seen[l] || l == "" {
			t.Errorf("label %d %q of %q: longer than %d, empty or repeated", i, l, names[i], traceLabelMax)
		}
		seen[l] = true
	}
	if got[0] != "qkv_rope1" || got[4] != "attn_dec64" {
		t.Errorf("short names changed: %q", got)
	}
}
