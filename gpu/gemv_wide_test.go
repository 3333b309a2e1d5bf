package gpu

import (
	"fmt"
	"math"
	"regexp"
	"strconv"
	"testing"

	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/twell"
)

// TestWideMatchesFloat64 runs the wide small-batch kernels (MLP.Wide,
// gemv_wide.cu) on 9 to 64 tokens: against float64 on the bf16 inputs,
// bit for bit on a repeat, with the tokens counted and the active pairs
// those of the default sparse path (within rounding); over hidden sizes of
// fewer 64-column steps than the pipeline's stages and of many, two layers
// chained on a stream, and a stress batch (a token firing every unit, NaN
// and Inf inputs).
func TestWideMatchesFloat64(t *testing.T) {
	dev, blas := setup(t)
	if a := dev.Properties().Arch; a != "sm_90a" {
		t.Skipf("the wide kernels need sm_90a; %v is %s", dev, a)
	}
	for _, c := range []struct {
		d, f    int
		density float64
	}{
		{320, 768, 0.02},
		{2048, 5632, 0.005},
		{4160, 512, 0.05},
	} {
		t.Run(fmt.Sprintf("d%d_f%d", c.d, c.f), func(t *testing.T) {
			r, seed := testutil.Rand(t)
			sl := newLayer(t, r, c.d, c.f, c.density, synth.Skewed, true)
			l := newMLP(t, dev, blas, sl, twell.DefaultLayout, seed)
			bl := bf16Layer(sl)
			for _, m := range []int{gemvMaxRows + 1, gemvMaxRows + 2 + r.IntN(wideMaxRows-gemvMaxRows-2), wideMaxRows} {
				x := roundBF16(synth.Tokens(r, m, c.d))
				rows := make([]int, m)
				for i := range rows {
					rows[i] = i
				}
				l.Wide = false
				base := runPath(t, dev, l, "sparse", x, m)
				basePairs := get[uint64](t, dev, l.nnz, 1)[0]
				l.Wide = true
				if k := l.KernelsFor(m); k != "wide" {
					t.Fatalf("seed %d: m %d: the sparse path runs %q, want the wide kernels", seed, m, k)
				}
				y := runPath(t, dev, l, "sparse", x, m)
				if e := synth.RelErr(y, c.d, rows, refRows(bl, x, c.d, rows)); !(e <= 1e-2) {
					t.Errorf("seed %d: m %d: rel err %.3g vs float64 on the bf16 weights, want <= 1e-2", seed, m, e)
				}
				if e := synth.RelErr(y, c.d, rows, toFloat64Rows(base, c.d, m)); !(e <= 1e-2) {
					t.Errorf("seed %d: m %d: rel diff %.3g vs the D2T sparse path, want <= 1e-2", seed, m, e)
				}
				if got := get[uint64](t, dev, l.nnz, 1)[0]; math.Abs(float64(got)-float64(basePairs)) > 0.01*float64(basePairs)+2 {
					t.Errorf("seed %d: m %d: counted %d active (token, unit) pairs, the D2T path %d", seed, m, got, basePairs)
				}
				again := runPath(t, dev, l, "sparse", x, m)
				for i := range y {
					if math.Float32bits(y[i]) != math.Float32bits(again[i]) {
						t.Fatalf("seed %d: m %d: output %d is %v, then %v", seed, m, i, y[i], again[i])
					}
				}
				if l.counted != m {
					t.Errorf("seed %d: m %d: counted %d tokens", seed, m, l.counted)
				}
			}
		})
	}
	// Two layers sharing a workspace, queued back to back on a stream with
	// no host sync between them: the second's TMA reads the first's output
	// after griddepcontrol.wait; run twice, the second time with the x
	// maps kept (same buffers, same m): the same bits.
	t.Run("chained", func(t *testing.T) {
		r, seed := testutil.Rand(t)
		d, f, m := 512, 1024, 17+r.IntN(wideMaxRows-16)
		sl1 := newLayer(t, r, d, f, 0.02, synth.Skewed, true)
		sl2 := newLayer(t, r, d, f, 0.02, synth.Skewed, true)
		l1 := newMLP(t, dev, blas, sl1, twell.DefaultLayout, seed)
		l2 := newMLP(t, dev, blas, sl2, twell.DefaultLayout, seed)
		if err := l2.ShareWorkspace(l1); err != nil {
			t.Fatal(err)
		}
		l1.Wide, l2.Wide = true, true
		s, err := dev.NewStream()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Destroy()
		x := roundBF16(synth.Tokens(r, m, d))
		xb := upload(t, dev, x)
		y1b, y2b := cudatest.Alloc(t, dev, 2*m*d), cudatest.Alloc(t, dev, 2*m*d)
		var first []float32
		for run := range 2 {
			if err := l1.Sparse(s, y1b, xb, m); err != nil {
				t.Fatal(err)
			}
			if err := l2.Sparse(s, y2b, y1b, m); err != nil {
				t.Fatal(err)
			}
			if err := s.Synchronize(); err != nil {
				t.Fatalf("seed %d: %v", seed, err)
			}
			y1, err := Download(dev, y1b, m*d)
			if err != nil {
				t.Fatal(err)
			}
			y2, err := Download(dev, y2b, m*d)
			if err != nil {
				t.Fatal(err)
			}
			rows := make([]int, m)
			for i := range rows {
				rows[i] = i
			}
			if e := synth.RelErr(y1, d, rows, refRows(bf16Layer(sl1), x, d, rows)); !(e <= 1e-2) {
				t.Errorf("seed %d: run %d: first layer: rel err %.3g vs float64, want <= 1e-2", seed, run, e)
			}
			if e := synth.RelErr(y2, d, rows, refRows(bf16Layer(sl2), y1, d, rows)); !(e <= 1e-2) {
				t.Errorf("seed %d: run %d: second layer (on the first's output): rel err %.3g vs float64, want <= 1e-2", seed, run, e)
			}
			if run == 0 {
				first = y2
				continue
			}
			for i := range y2 {
				if math.Float32bits(y2[i]) != math.Float32bits(first[i]) {
					t.Fatalf("seed %d: output %d is %v, then %v", seed, i, first[i], y2[i])
				}
			}
		}
	})
	t.Run("stress", func(t *testing.T) {
		r, seed := testutil.Rand(t)
		d, f := 256, 512
		sl := newLayer(t, r, d, f, 0.01, synth.Uniform, true)
		l := newMLP(t, dev, blas, sl, twell.Layout{Tile: 256, C: 8}, seed)
		l.Wide = true
		checkStressBatch(t, dev, l, sl, r, seed, gemvMaxRows+1+r.IntN(wideMaxRows-gemvMaxRows), "sparse (wide)")
	})
}

// toFloat64Rows returns the m rows of d values in y as float64 rows.
func toFloat64Rows(y []float32, d, m int) [][]float64 {
	out := make([][]float64, m)
	for i := range out {
		out[i] = make([]float64, d)
		for k := range d {
			out[i][k] = float64(y[i*d+k])
		}
	}
	return out
}

// TestWideConstants checks that gemv_wide.go's shapes are gemv_wide.cu's
// (no GPU needed): the launches size their grids and shared memory by them.
func TestWideConstants(t *testing.T) {
	want := map[string]int{"WIDE_TOKENS": wideMaxRows, "WIDE_UNITS": wideUnits, "WIDE_STAGES": wideStages,
		"WIDE_TILE": wideTile, "WIDE_SPLIT": wideSplit, "WIDE_COLS": wideCols}
	got := map[string]int{}
	for _, m := range regexp.MustCompile(`(?m)^#define (WIDE_[A-Z]+) (\d+)`).FindAllStringSubmatch(string(gemvWideSrc), -1) {
		n, err := strconv.Atoi(m[2])
		if err != nil {
			t.Fatal(err)
		}
		got[m[1]] = n
	}
	for name, w := range want {
		if got[name] != w {
			t.Errorf("gemv_wide.cu defines %s %d, gemv_wide.go uses %d", name, got[name], w)
		}
	}
}
