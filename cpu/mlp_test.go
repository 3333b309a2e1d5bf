package cpu

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/twell"
)

func newLayer(t *testing.T, r *rand.Rand, d, f int, density float64, dist synth.Dist, gated bool) (*synth.Layer, *MLP) {
	t.Helper()
	sl, err := synth.NewLayer(r, d, f, density, dist, gated)
	if err != nil {
		t.Fatal(err)
	}
	l, err := NewMLP(sl.Gate, sl.Up, sl.Down, d, f)
	if err != nil {
		t.Fatal(err)
	}
	return sl, l
}

func reference(sl *synth.Layer, x []float32, rows []int) [][]float64 {
	want := make([][]float64, len(rows))
	for i, row := range rows {
		want[i], _ = sl.Reference(x[row*sl.D : (row+1)*sl.D])
	}
	return want
}

func allRows(m int) []int {
	rows := make([]int, m)
	for i := range rows {
		rows[i] = i
	}
	return rows
}

// TestSparseMatchesDense checks every MLP path against the float64
// reference on fresh random layers, shapes, densities and layouts.
func TestSparseMatchesDense(t *testing.T) {
	forEachKernel(t, func(t *testing.T) {
		r, seed := testutil.Rand(t)
		layouts := []twell.Layout{{Tile: 256, C: 8}, {Tile: 256, C: 4}, {Tile: 128, C: 2}, {Tile: 128, C: 8}}
		for iter := 0; iter < 6; iter++ {
			d := 2 + r.IntN(200)
			layout := layouts[r.IntN(len(layouts))]
			f := layout.Tile * (1 + r.IntN(4))
			m := 1 + r.IntN(60)
			density := []float64{0.005, 0.03, 0.2}[r.IntN(3)]
			dist := []synth.Dist{synth.Uniform, synth.Skewed}[r.IntN(2)]
			gated := r.IntN(2) == 0
			sl, l := newLayer(t, r, d, f, density, dist, gated)
			x := synth.Tokens(r, m, d)
			want := reference(sl, x, allRows(m))

			yd := make([]float32, m*d)
			if err := l.Dense(yd, x, m); err != nil {
				t.Fatal(err)
			}
			// float32 sums of a few products can cancel: 1e-5 failed once
			// (1.12e-5 at m=2); a wrong result is off by O(1)
			if e := synth.RelErr(yd, d, allRows(m), want); e > 1e-4 {
				t.Fatalf("seed %d: dense d=%d f=%d m=%d gated=%v: rel err %g", seed, d, f, m, gated, e)
			}
			ys := make([]float32, m*d)
			p, err := l.Sparse(ys, x, m, layout)
			if err != nil {
				t.Fatal(err)
			}
			if err := p.Validate(); err != nil {
				t.Fatalf("seed %d: D2T output invalid: %v", seed, err)
			}
			if e := synth.RelErr(ys, d, allRows(m), want); e > 1e-2 {
				t.Fatalf("seed %d: sparse d=%d f=%d m=%d %v density %g %s gated=%v: rel err %g", seed, d, f, m, layout, density, dist, gated, e)
			}
		}
	})
}

// TestD2TMatchesPackedGemm checks that the fused D2T equals packing the
// dense GEMM output, bit for bit.
func TestD2TMatchesPackedGemm(t *testing.T) {
	r, seed := testutil.Rand(t)
	m, d, f := 37, 70, 768
	sl, l := newLayer(t, r, d, f, 0.1, synth.Skewed, true)
	_ = sl
	x := synth.Tokens(r, m, d)
	g := make([]float32, m*f)
	if err := Gemm(g, x, m, l.gate); err != nil {
		t.Fatal(err)
	}
	want, err := twell.Pack(twell.DefaultLayout, g, m, f)
	if err != nil {
		t.Fatal(err)
	}
	got, err := D2T(x, m, l.gate, twell.DefaultLayout)
	if err != nil {
		t.Fatal(err)
	}
	for i := range want.Words {
		if got.Words[i] != want.Words[i] {
			t.Fatalf("seed %d: word %d: D2T %#x, Pack(Gemm) %#x", seed, i, got.Words[i], want.Words[i])
		}
	}
}

// TestOverflowIsExact drives rows and tiles past capacity, dead layers and
// NaN inputs through the sparse path.
func TestOverflowIsExact(t *testing.T) {
	r, seed := testutil.Rand(t)
	d, f, m := 64, 512, 20
	for _, gated := range []bool{true, false} {
		sl, _ := newLayer(t, r, d, f, 0.01, synth.Uniform, gated)
		sparse := sl.Gate
		if !gated {
			sparse = sl.Up
		}
		// Units 0..99 of tile 0 always fire: tile 0 is over capacity on every row.
		for j := 0; j < 100; j++ {
			sparse[j*d] = 40
		}
		l, err := NewMLP(sl.Gate, sl.Up, sl.Down, d, f)
		if err != nil {
			t.Fatal(err)
		}
		x := synth.Tokens(r, m, d)
		x[3*d] = 1e4 // row 3: the bias feature dominates, so every biased unit fires
		ys := make([]float32, m*d)
		p, err := l.Sparse(ys, x, m, twell.DefaultLayout)
		if err != nil {
			t.Fatal(err)
		}
		if len(p.OverflowRows()) != m {
			t.Fatalf("seed %d: %d overflow rows, want all %d", seed, len(p.OverflowRows()), m)
		}
		want := reference(sl, x, allRows(m))
		if e := synth.RelErr(ys, d, allRows(m), want); e > 1e-2 {
			t.Fatalf("seed %d gated=%v: overflowing sparse rel err %g", seed, gated, e)
		}

		// A dead layer: no unit ever fires, so y is exactly zero.
		for j := 0; j < f; j++ {
			sparse[j*d] = -40
		}
		l, _ = NewMLP(sl.Gate, sl.Up, sl.Down, d, f)
		x = synth.Tokens(r, m, d)
		if _, err := l.Sparse(ys, x, m, twell.DefaultLayout); err != nil {
			t.Fatal(err)
		}
		for i, v := range ys {
			if v != 0 {
				t.Fatalf("seed %d: dead layer output[%d] = %g, want 0", seed, i, v)
			}
		}

		// NaN in one token poisons that token's output, as in the dense path.
		x[5*d+7] = float32(math.NaN())
		yd := make([]float32, m*d)
		l.Dense(yd, x, m)
		if _, err := l.Sparse(ys, x, m, twell.DefaultLayout); err != nil {
			t.Fatal(err)
		}
		for i := range ys {
			dn, sn := yd[i] != yd[i], ys[i] != ys[i]
			if dn != sn {
				t.Fatalf("seed %d: NaN input: element %d dense %g, sparse %g", seed, i, yd[i], ys[i])
			}
		}
	}
}

func TestMLPShapeErrors(t *testing.T) {
	if _, err := NewMLP(nil, make([]float32, 10), make([]float32, 12), 2, 6); err == nil {
		t.Error("short up weight accepted")
	}
	l, err := NewMLP(nil, make([]float32, 512), make([]float32, 512), 2, 256)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Dense(make([]float32, 4), make([]float32, 3), 2); err == nil {
		t.Error("short input accepted")
	}
	if _, err := l.Sparse(make([]float32, 4), make([]float32, 4), 2, twell.Layout{Tile: 256, C: 3}); err == nil {
		t.Error("bad layout accepted")
	}
}

func TestForwardPicksPathAndStaysExact(t *testing.T) {
	r, seed := testutil.Rand(t)
	d, f, m := 48, 512, 30
	for _, gated := range []bool{true, false} {
		for _, density := range []float64{0.01, 0.3} {
			sl, l := newLayer(t, r, d, f, density, synth.Uniform, gated)
			x := synth.Tokens(r, m, d)
			y := make([]float32, m*d)
			_, active, path, err := l.Forward(y, x, m, twell.DefaultLayout)
			sparse := path == mlp.Sparse
			if err != nil {
				t.Fatal(err)
			}
			// The dense path counts the active units as well, alike.
			l.Path = mlp.Dense
			_, activeDense, _, err := l.Forward(make([]float32, m*d), x, m, twell.DefaultLayout)
			l.Path = mlp.Auto
			if err != nil {
				t.Fatal(err)
			}
			if want := activeRef(sl, x, m); active < 0 || abs64(active-want) > int64(m*f)/1000 || abs64(activeDense-want) > int64(m*f)/1000 {
				t.Errorf("seed %d: density %g gated=%v: %d active pairs (dense path %d), float64 reference %d", seed, density, gated, active, activeDense, want)
			}
			if sparse != (density < DefaultDenseAbove) {
				t.Errorf("seed %d: density %g gated=%v: sparse path = %v", seed, density, gated, sparse)
			}
			if e := synth.RelErr(y, d, allRows(m), reference(sl, x, allRows(m))); e > 1e-2 {
				t.Fatalf("seed %d: density %g gated=%v: rel err %g", seed, density, gated, e)
			}
		}
	}
}

func TestSiLUDense(t *testing.T) {
	r, seed := testutil.Rand(t)
	d, f, m := 16, 256, 5
	sl, l := newLayer(t, r, d, f, 0.2, synth.Uniform, true)
	l.Act = SiLU
	x := synth.Tokens(r, m, d)
	y := make([]float32, m*d)
	if _, active, path, err := l.Forward(y, x, m, twell.DefaultLayout); err != nil || path == mlp.Sparse || active != -1 {
		t.Fatalf("silu forward: path=%v active=%d err=%v; want dense, -1 (no exact zeros)", path, active, err)
	}
	for row := 0; row < m; row++ {
		for k := 0; k < d; k++ {
			want := 0.0
			for j := 0; j < f; j++ {
				g, u := 0.0, 0.0
				for q := 0; q < d; q++ {
					g += float64(x[row*d+q]) * float64(sl.Gate[j*d+q])
					u += float64(x[row*d+q]) * float64(sl.Up[j*d+q])
				}
				want += g / (1 + math.Exp(-g)) * u * float64(sl.Down[k*f+j])
			}
			if math.Abs(float64(y[row*d+k])-want) > 1e-3*(1+math.Abs(want)) {
				t.Fatalf("seed %d: silu y[%d,%d] = %g, want %g", seed, row, k, y[row*d+k], want)
			}
		}
	}
	if _, err := l.Sparse(y, x, m, twell.DefaultLayout); err == nil {
		t.Error("sparse path accepted a SiLU gate")
	}
}

func TestForwardUntileableWidthRunsDense(t *testing.T) {
	r, seed := testutil.Rand(t)
	d, f, m := 16, 100, 4 // 100 is not a multiple of any tile width
	sl, l := newLayer(t, r, d, f, 0.05, synth.Uniform, true)
	x := synth.Tokens(r, m, d)
	y := make([]float32, m*d)
	p, _, path, err := l.Forward(y, x, m, twell.DefaultLayout)
	sparse := path == mlp.Sparse
	if err != nil || sparse || p != nil {
		t.Fatalf("f=%d: sparse=%v err=%v", f, sparse, err)
	}
	if e := synth.RelErr(y, d, allRows(m), reference(sl, x, allRows(m))); e > 1e-4 { // few active units: see TestSparseMatchesDense
		t.Fatalf("seed %d: rel err %g", seed, e)
	}
}

// activeRef counts, in float64, the (token, unit) pairs whose gate (up,
// when not gated) pre-activation is positive.
func activeRef(sl *synth.Layer, x []float32, m int) int64 {
	w := sl.Gate
	if w == nil { // not gated
		w = sl.Up
	}
	d := len(x) / m
	var n int64
	for i := range m {
		for j := 0; j < len(w)/d; j++ {
			var s float64
			for q := range d {
				s += float64(x[i*d+q]) * float64(w[j*d+q])
			}
			if s > 0 {
				n++
			}
		}
	}
	return n
}

func abs64(v int64) int64 {
	if v < 0 {
		return -v
	}
	return v
}
