package bench

import (
	"flag"
	"fmt"
	"image/png"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"gonum.org/v1/plot"

	"github.com/twell-ai/twell/gpu/trainer"
	"github.com/twell-ai/twell/internal/testutil"
)

var plotDir = flag.String("plotdir", "", "also write the test figures to this folder, to look at them")

// figurePath returns where a test figure goes: -plotdir when given, else a
// temporary folder.
func figurePath(t *testing.T, name string) string {
	name = strings.NewReplacer("/", "-", " ", "-").Replace(name)
	if *plotDir != "" {
		if err := os.MkdirAll(*plotDir, 0o755); err != nil {
			t.Fatal(err)
		}
		return filepath.Join(*plotDir, name)
	}
	return filepath.Join(t.TempDir(), name)
}

// checkPNG fails unless path holds a PNG of a sensible size.
func checkPNG(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	if b := img.Bounds(); b.Dx() < 500 || b.Dy() < 300 {
		t.Fatalf("%s: %v image", path, b)
	}
}

// drawCases draws each case's results with plot into a figure named
// prefix + the case's name and checks that it is a PNG of a sensible size.
func drawCases[T any](t *testing.T, seed uint64, prefix string, cases map[string]func() []T, plot func([]T, string) error) {
	t.Helper()
	for name, mk := range cases {
		path := figurePath(t, prefix+name+".png")
		if err := plot(mk(), path); err != nil {
			t.Fatalf("seed %d: %s: %v", seed, name, err)
		}
		checkPNG(t, path)
	}
}

var testRow = Row{Device: "cpu", Machine: "2-core test VM", Date: "2026-12-03"}

func modelResults(r *rand.Rand, batches []int) []ModelResult {
	var rs []ModelResult
	for i, p := range []string{"dense", "twell"} {
		res := ModelResult{Row: testRow, Model: "sparselm-1.5b, 2 layers",
			Path: p, PrefillTokens: 256, PrefillTokPerMS: 0.5 + r.Float64()*(1+float64(i)), Speedup: 1 + float64(i)*r.Float64()}
		for _, b := range batches {
			res.Decode = append(res.Decode, DecodePoint{Batch: b, Context: 16, TokensPerSec: float64(b) * (20 + 10*r.Float64()) * (1 + float64(i)*0.4)})
		}
		rs = append(rs, res)
	}
	return rs
}

// withGreedy gives every decode point of rs greedy decoder figures a
// little above its own.
func withGreedy(r *rand.Rand, rs []ModelResult) []ModelResult {
	for i := range rs {
		for k := range rs[i].Decode {
			d := &rs[i].Decode[k]
			d.GreedyTokensPerSec = d.TokensPerSec * (1 + 0.1*r.Float64())
		}
	}
	return rs
}

// variantResults returns the rows of a run with variants: dense, twell and
// two variants, each variant twice, as bench model -variants writes them.
func variantResults(r *rand.Rand, batches []int) []ModelResult {
	rs := modelResults(r, batches)
	for range 2 {
		for _, v := range []string{"twell [A=0]", "twell [A=1]"} {
			row := modelResults(r, batches)[1]
			row.Path = v
			rs = append(rs, row)
		}
	}
	return rs
}

func ffnResults(r *rand.Rand, densities []float64) []FFNResult {
	var rs []FFNResult
	for _, dist := range []string{"uniform", "skewed"} {
		for _, m := range []int{1, 1024} {
			for _, d := range densities {
				rs = append(rs, FFNResult{Row: testRow, D: 2048, F: 5632, C: 8,
					M: m, Density: d, Dist: dist, Gated: true, Speedup: 0.2 / (d + 0.02) * (0.8 + 0.4*r.Float64())})
			}
		}
	}
	return rs
}

// TestPlotModelEdgeCases: zero, negative, NaN and infinite values, a single
// batch size (a log axis once padded to 0) and empty decode lists are drawn
// or left out with a note, never a panic.
func TestPlotModelEdgeCases(t *testing.T) {
	r, seed := testutil.Rand(t)
	cases := map[string]func() []ModelResult{
		"typical":       func() []ModelResult { return modelResults(r, []int{1, 8, 32}) },
		"single batch":  func() []ModelResult { return modelResults(r, []int{1}) },
		"zero tokens/s": func() []ModelResult { rs := modelResults(r, []int{1, 8}); rs[0].Decode[0].TokensPerSec = 0; return rs },
		"all zero decode": func() []ModelResult {
			rs := modelResults(r, []int{1})
			rs[0].Decode[0].TokensPerSec, rs[1].Decode[0].TokensPerSec = 0, 0
			return rs
		},
		"zero batch": func() []ModelResult { rs := modelResults(r, []int{0, 4}); return rs },
		"no decode":  func() []ModelResult { return modelResults(r, nil) },
		"NaN and Inf": func() []ModelResult {
			rs := modelResults(r, []int{1, 2})
			rs[0].PrefillTokPerMS, rs[1].Speedup, rs[1].Decode[1].TokensPerSec = math.NaN(), math.Inf(1), math.Inf(1)
			return rs
		},
		"negative prefill": func() []ModelResult { rs := modelResults(r, []int{2}); rs[1].PrefillTokPerMS = -3; return rs },
		"zero prefill": func() []ModelResult {
			rs := modelResults(r, []int{2, 4})
			rs[0].PrefillTokPerMS, rs[1].PrefillTokPerMS = 0, 0
			return rs
		},
		"variants":              func() []ModelResult { return variantResults(r, []int{1, 8}) },
		"variants no decode":    func() []ModelResult { return variantResults(r, nil) },
		"variants single value": func() []ModelResult { return variantResults(r, []int{4})[:3] },
		"variants NaN and zero": func() []ModelResult {
			rs := variantResults(r, []int{1, 4})
			rs[2].PrefillTokPerMS, rs[3].Decode[0].TokensPerSec, rs[4].Decode[1].TokensPerSec = math.NaN(), 0, math.Inf(-1)
			for i := range rs {
				rs[i].Decode[1].TokensPerSec = math.NaN() // a panel with nothing to draw
			}
			return rs
		},
		"variants missing batch": func() []ModelResult {
			rs := variantResults(r, []int{1, 8})
			rs[3].Decode = rs[3].Decode[:1]
			return rs
		},
		"greedy decoder": func() []ModelResult { return withGreedy(r, modelResults(r, []int{1, 8, 64})) },
		"greedy decoder, some missing": func() []ModelResult {
			rs := withGreedy(r, modelResults(r, []int{1, 8}))
			rs[0].Decode[1].GreedyTokensPerSec, rs[1].Decode[0].GreedyTokensPerSec = math.NaN(), 0
			rs[1].Decode[1].TokensPerSec = math.Inf(1)
			return rs
		},
		"equal decode": func() []ModelResult {
			rs := modelResults(r, []int{4})
			rs[1].Decode[0].TokensPerSec = rs[0].Decode[0].TokensPerSec
			return rs
		},
	}
	drawCases(t, seed, "model-", cases, PlotModel)
	if err := PlotModel(nil, filepath.Join(t.TempDir(), "x.png")); err == nil {
		t.Error("no results: no error")
	}
}

// TestRowGroups: rows group by path name in the order names first appear,
// every row in exactly one group.
func TestRowGroups(t *testing.T) {
	r, seed := testutil.Rand(t)
	rs := variantResults(r, []int{1})
	names, rows := rowGroups(rs)
	if want := []string{"dense", "twell", "twell [A=0]", "twell [A=1]"}; !slices.Equal(names, want) {
		t.Fatalf("seed %d: names %q, want %q", seed, names, want)
	}
	seen := map[int]bool{}
	for g, idx := range rows {
		for _, i := range idx {
			if seen[i] || rs[i].Path != names[g] {
				t.Fatalf("seed %d: row %d (%q) in group %d (%q), seen before: %v", seed, i, rs[i].Path, g, names[g], seen[i])
			}
			seen[i] = true
		}
	}
	if len(seen) != len(rs) || len(rows[2]) != 2 || len(rows[3]) != 2 {
		t.Fatalf("seed %d: groups %v over %d rows", seed, rows, len(rs))
	}
	// Builds of two commits (an A/B of builds): each path by commit.
	ab := modelResults(r, []int{1})
	ab = append(ab, modelResults(r, []int{1})...)
	for i := range ab {
		ab[i].Commit = []string{"aaaaaaa", "bbbbbbb"}[i/2]
	}
	names, rows = rowGroups(ab)
	if want := []string{"dense @ aaaaaaa", "twell @ aaaaaaa", "dense @ bbbbbbb", "twell @ bbbbbbb"}; !slices.Equal(names, want) {
		t.Fatalf("seed %d: names %q, want %q", seed, names, want)
	}
	for g, idx := range rows {
		if len(idx) != 1 || idx[0] != g {
			t.Fatalf("seed %d: groups %v", seed, rows)
		}
	}
}

// TestPlotFFNEdgeCases: the same for the MLP figure.
func TestPlotFFNEdgeCases(t *testing.T) {
	r, seed := testutil.Rand(t)
	cases := map[string]func() []FFNResult{
		"typical":        func() []FFNResult { return ffnResults(r, []float64{0.005, 0.02, 0.05}) },
		"one density":    func() []FFNResult { return ffnResults(r, []float64{0.01}) },
		"zero density":   func() []FFNResult { return ffnResults(r, []float64{0, 0.02}) },
		"NaN speedup":    func() []FFNResult { rs := ffnResults(r, []float64{0.01, 0.1}); rs[1].Speedup = math.NaN(); return rs },
		"zero speedup":   func() []FFNResult { rs := ffnResults(r, []float64{0.01, 0.1}); rs[0].Speedup = 0; return rs },
		"nothing usable": func() []FFNResult { return ffnResults(r, []float64{-1}) },
		"GPU paths": func() []FFNResult {
			rs := ffnResults(r, []float64{0.005, 0.02, 0.05})
			for i := range rs {
				rs[i].DenseMS, rs[i].AutoSpeedup = 1+r.Float64(), 0.9+0.5*r.Float64()
				if i%3 != 0 { // some rows without the dense MLP in D2T
					rs[i].DenseD2TMS = 0.9 + r.Float64()
				}
			}
			return append(rs, rs...) // a variant's rows repeat the automatic path's
		},
	}
	drawCases(t, seed, "ffn-", cases, PlotFFN)
}

// ffnRuns returns the rows of an A/B of builds as bench ffn writes them:
// three builds (one of them also with a switch), rounds rounds of two
// shapes each, random times.
func ffnRuns(r *rand.Rand, rounds int) []FFNResult {
	var rs []FFNResult
	for range rounds {
		for _, b := range []struct {
			commit string
			sw     map[string]string
		}{{"ab460e2", nil}, {"a36a257", nil}, {"7683c70+dirty", nil}, {"7683c70+dirty", map[string]string{"TWELL_HOT_UNITS": "0"}}} {
			for _, sh := range []struct {
				m    int
				dist string
			}{{4096, "uniform"}, {65536, "skewed"}} {
				row := testRow
				row.Schema, row.Device, row.Commit, row.Switches = FFNSchema, "cuda", b.commit, b.sw
				ms := float64(sh.m) / 16384 * (0.9 + 0.2*r.Float64())
				rs = append(rs, FFNResult{Row: row, D: 2048, F: 5632, C: 8, M: sh.m, Density: 0.005, Dist: sh.dist, Gated: true,
					DenseMS: 1.6 * ms, TwELLMS: ms, D2TMS: 0.55 * ms})
			}
		}
	}
	return rs
}

// TestPlotFFNRuns: an A/B of builds is drawn a panel per shape and
// measure (energy too where NVML was read), its rows grouped by build;
// zero, negative, NaN and infinite times, rows without a D2T time or energy
// and rows of an unknown build are drawn or left out with a note, never a
// panic.
func TestPlotFFNRuns(t *testing.T) {
	r, seed := testutil.Rand(t)
	rs := ffnRuns(r, 2)
	names := map[string]int{}
	for _, x := range rs {
		names[FFNBuildName(x, rs[0].Switches)]++
	}
	want := map[string]int{"ab460e2": 4, "a36a257": 4, "7683c70+dirty": 4, "7683c70+dirty [HOT_UNITS=0]": 4}
	if len(names) != len(want) {
		t.Fatalf("seed %d: builds %v, want %v", seed, names, want)
	}
	for k, n := range want {
		if names[k] != n {
			t.Errorf("seed %d: build %q has %d rows, want %d", seed, k, names[k], n)
		}
	}
	cases := map[string]func() []FFNResult{
		"typical": func() []FFNResult { return ffnRuns(r, 2) },
		"one run": func() []FFNResult { return ffnRuns(r, 1)[:1] },
		"bad times": func() []FFNResult {
			rs := ffnRuns(r, 2)
			rs[0].TwELLMS, rs[1].TwELLMS, rs[2].D2TMS, rs[3].TwELLMS = math.NaN(), math.Inf(1), -1, 0
			return rs
		},
		"energy": func() []FFNResult {
			rs := ffnRuns(r, 2)
			for i := range rs {
				rs[i].TwELLMJPerToken, rs[i].D2TMJPerToken = 0.03+0.02*r.Float64(), 0.02+0.01*r.Float64()
			}
			rs[1].D2TMJPerToken = 0 // not read in one run
			return rs
		},
		"no D2T, no commit": func() []FFNResult {
			rs := ffnRuns(r, 2)
			for i := range rs {
				rs[i].D2TMS, rs[i].Commit = 0, ""
			}
			return rs
		},
		"nothing usable": func() []FFNResult {
			rs := ffnRuns(r, 1)
			for i := range rs {
				rs[i].TwELLMS, rs[i].D2TMS = math.NaN(), -2
			}
			return rs
		},
	}
	drawCases(t, seed, "ffn-runs-", cases, PlotFFNRuns)
	if err := PlotFFNRuns(nil, figurePath(t, "ffn-runs-none.png")); err == nil {
		t.Error("no rows: no error")
	}
}

// labels returns the labelled tick values.
func labels(ts []plot.Tick) []float64 {
	var vs []float64
	for _, t := range ts {
		if t.Label != "" {
			vs = append(vs, t.Value)
		}
	}
	return vs
}

// TestTicksReadable: on random ranges, both tickers label at least three
// values inside the range, ascending, with labels that parse back to a value
// close to the tick, and the log axis set from data keeps every value in view.
func TestTicksReadable(t *testing.T) {
	r, seed := testutil.Rand(t)
	for i := 0; i < 2000; i++ {
		lo := math.Pow(10, -6+12*r.Float64())
		var vs []float64
		for k := 1 + r.IntN(5); k > 0; k-- {
			vs = append(vs, lo*math.Pow(10, 3*r.Float64()*r.Float64()))
		}
		var a plot.Axis
		setLogAxis(&a, vs, r.IntN(2) == 0)
		ts := a.Tick.Marker.Ticks(a.Min, a.Max)
		checkTicks(t, fmt.Sprintf("seed %d: log axis for %v [%g, %g]", seed, vs, a.Min, a.Max), ts, a.Min, a.Max, true)
		for _, v := range vs {
			if v < a.Min || v > a.Max {
				t.Fatalf("seed %d: value %g outside the log axis [%g, %g]", seed, v, a.Min, a.Max)
			}
		}
		setLinearAxis(&a, vs, r.IntN(2) == 0)
		ts = a.Tick.Marker.Ticks(a.Min, a.Max)
		checkTicks(t, fmt.Sprintf("seed %d: linear axis for %v [%g, %g]", seed, vs, a.Min, a.Max), ts, a.Min, a.Max, false)
	}
}

func checkTicks(t *testing.T, what string, ts []plot.Tick, lo, hi float64, log bool) {
	t.Helper()
	ls := labels(ts)
	if len(ls) < 3 {
		t.Fatalf("%s: %d labelled ticks %v, want >= 3", what, len(ls), ls)
	}
	if !slices.IsSorted(ls) {
		t.Fatalf("%s: ticks not ascending: %v", what, ls)
	}
	for i := 1; i < len(ls); i++ { // labels that would overlap
		if log && ls[i]/ls[i-1] < 1.08 || !log && ls[i]-ls[i-1] < (hi-lo)/30 {
			t.Fatalf("%s: labels %g and %g too close", what, ls[i-1], ls[i])
		}
	}
	for _, tk := range ts {
		if tk.Value < lo*(1-1e-9) || tk.Value > hi*(1+1e-9) {
			t.Fatalf("%s: tick %g outside the range", what, tk.Value)
		}
		if log && !(tk.Value > 0) {
			t.Fatalf("%s: tick %g on a log axis", what, tk.Value)
		}
		if tk.Label == "" {
			continue
		}
		v, err := strconv.ParseFloat(tk.Label, 64)
		if err != nil || math.Abs(v-tk.Value) > 0.01*math.Max(math.Abs(tk.Value), (hi-lo)/10) {
			t.Fatalf("%s: tick %g labelled %q", what, tk.Value, tk.Label)
		}
	}
}

func TestPlotTrainMLPEdgeCases(t *testing.T) {
	r, seed := testutil.Rand(t)
	mk := func(ds ...float64) []TrainMLPResult {
		var rs []TrainMLPResult
		for _, d := range ds {
			rs = append(rs, TrainMLPResult{Row: testRow, D: 2048, F: 5632, M: 16384, Density: d, Dist: "uniform",
				Speedup: 0.2 + 2*r.Float64(), AutoSpeedup: 1 + r.Float64()})
		}
		return rs
	}
	cases := map[string]func() []TrainMLPResult{
		"typical":      func() []TrainMLPResult { return mk(0.005, 0.01, 0.02, 0.05) },
		"one density":  func() []TrainMLPResult { return mk(0.01) },
		"zero density": func() []TrainMLPResult { return mk(0, 0.02) },
		"NaN speedup":  func() []TrainMLPResult { rs := mk(0.01, 0.1); rs[1].Speedup = math.NaN(); return rs },
		"infinite":     func() []TrainMLPResult { rs := mk(0.01, 0.1); rs[0].AutoSpeedup = math.Inf(1); return rs },
		"nothing":      func() []TrainMLPResult { return mk(-1) },
	}
	drawCases(t, seed, "train-mlp-", cases, PlotTrainMLP)
	if err := PlotTrainMLP(nil, figurePath(t, "train-mlp-empty.png")); err == nil {
		t.Error("no results: no error")
	}
}

func TestPlotTrainStepEdgeCases(t *testing.T) {
	r, seed := testutil.Rand(t)
	stages := func() []trainer.StageTime {
		var st []trainer.StageTime
		for _, n := range []string{"embedding", "norm fwd", "mlp fwd", "attention bwd", "mlp bwd", "adamw"} {
			st = append(st, trainer.StageTime{Name: n, MS: 100 * r.Float64() * r.Float64(), Count: 1 + r.IntN(57)})
		}
		return st
	}
	mk := func(profile bool) []TrainStepResult {
		var rs []TrainStepResult
		for _, p := range []string{"dense", "sparse", "auto"} {
			x := TrainStepResult{Row: testRow, Model: "SparseLM-1.5B shape", Layers: 28, Batch: 8, Seq: 2048, Density: 0.005,
				Path: p, StepMS: 250 + 150*r.Float64()}
			if profile {
				x.Stages = stages()
			}
			rs = append(rs, x)
		}
		return rs
	}
	cases := map[string]func() []TrainStepResult{
		"typical":  func() []TrainStepResult { return mk(false) },
		"profiled": func() []TrainStepResult { return mk(true) },
		"no dense": func() []TrainStepResult { return mk(true)[1:] },
		"NaN step": func() []TrainStepResult { rs := mk(true); rs[1].StepMS = math.NaN(); return rs },
		"bad stage": func() []TrainStepResult {
			rs := mk(true)
			rs[0].Stages[2].MS = math.Inf(1)
			rs[2].Stages[0].MS = -1
			return rs
		},
		"one profiled": func() []TrainStepResult { rs := mk(false); rs[2].Stages = stages(); return rs },
		"zero steps": func() []TrainStepResult {
			rs := mk(true)
			rs[0].StepMS, rs[1].StepMS, rs[2].StepMS = 0, 0, 0
			return rs
		},
	}
	drawCases(t, seed, "train-step-", cases, PlotTrainStep)
	if err := PlotTrainStep(nil, figurePath(t, "train-step-empty.png")); err == nil {
		t.Error("no results: no error")
	}
}
