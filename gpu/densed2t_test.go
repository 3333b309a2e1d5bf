package gpu

import (
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/twell"
)

// TestDenseInD2TMatchesFloat64 checks the dense MLP whose gate and up
// products run in the wgmma D2T (DenseInD2T) against the float64
// reference, gated and not, for one token, a partial tile and several tile
// pairs, with the units in their order and reordered by hot units; every
// output row is written, and the active-unit counter holds the call's
// active units.
func TestDenseInD2TMatchesFloat64(t *testing.T) {
	dev, blas := setup(t)
	if dev.Properties().Arch != "sm_90a" {
		t.Skip("the dense MLP in D2T runs on the wgmma D2T (sm_90a)")
	}
	for _, c := range []struct {
		d, f    int
		density float64
		gated   bool
		hot     int
	}{
		{2048, 5632, 0.05, true, 0},
		{320, 768, 0.02, true, 256},
		{256, 768, 0.05, false, 0},
		{512, 1024, 0.1, true, 0},
		{576, 1280, 0.3, false, 512},
	} {
		t.Run(fmt.Sprintf("d%d_f%d_p%g_gated%v_hot%d", c.d, c.f, c.density, c.gated, c.hot), func(t *testing.T) {
			r, seed := testutil.Rand(t)
			sl := newLayer(t, r, c.d, c.f, c.density, synth.Skewed, c.gated)
			l := newMLP(t, dev, blas, sl, twell.DefaultLayout, seed)
			if !l.CanDenseInD2T() {
				t.Fatalf("seed %d: CanDenseInD2T is false on sm_90a", seed)
			}
			if c.hot > 0 {
				forceHot(t, seed, l, r, c.hot)
			}
			for _, m := range []int{1, 1 + r.IntN(255), 300 + r.IntN(700)} {
				x := synth.Tokens(r, m, c.d)
				xb := upload(t, dev, x)
				yb := cudatest.Alloc(t, dev, 2*m*c.d)
				if err := dev.Memset8(yb, 0xff, nil); err != nil { // poison: NaN everywhere
					t.Fatal(err)
				}
				if err := l.DenseInD2T(nil, yb, xb, m); err != nil {
					t.Fatalf("seed %d: m=%d: %v", seed, m, err)
				}
				if err := dev.Synchronize(); err != nil {
					t.Fatal(err)
				}
				y, err := Download(dev, yb, m*c.d)
				if err != nil {
					t.Fatal(err)
				}
				if i := slices.IndexFunc(y, func(v float32) bool { return math.IsNaN(float64(v)) }); i >= 0 {
					t.Fatalf("seed %d: m=%d: output %d (row %d) is NaN: not written", seed, m, i, i/c.d)
				}
				rows := synth.SampleRows(r, m, min(m, 48))
				if e := synth.RelErr(y, c.d, rows, refRowsBF16(sl, x, c.d, rows)); !(e <= 1e-2) {
					t.Errorf("seed %d: m=%d: rel err %.3g vs float64 on the bf16 inputs, want <= 1e-2", seed, m, e)
				}
				// The counter holds the call's active units, as the cuBLASLt
				// path's relu_mul counts them, but for the few gates that
				// round differently near zero.
				got := int(downloadNNZ(t, dev, l))
				if err := dev.Memset8(l.nnz, 0, nil); err != nil {
					t.Fatal(err)
				}
				if err := l.Dense(nil, yb, xb, m); err != nil {
					t.Fatal(err)
				}
				if err := dev.Synchronize(); err != nil {
					t.Fatal(err)
				}
				want := int(downloadNNZ(t, dev, l))
				if d := got - want; want == 0 || d < -2-want/1000 || d > 2+want/1000 {
					t.Errorf("seed %d: m=%d: counted %d active units, the cuBLASLt path %d", seed, m, got, want)
				}
			}
		})
	}
}

// TestAutoDenseArmInD2T: under mlp.Auto, once the density rule sends calls
// dense, a call of at least denseD2TMinRows tokens runs DenseInD2T, in
// Forward and in Queue, and with DenseOnCuBLAS the cuBLASLt path, which a
// fixed mlp.Dense always runs. The two forms may give the same bits (h is
// rounded from the same bf16 products), so a call's form is told by the
// cuBLASLt path's gate buffer: poisoned before each call, only that path
// overwrites it. Every dense call's output is checked against DenseInD2T's
// within bf16 rounding.
func TestAutoDenseArmInD2T(t *testing.T) {
	dev, blas := setup(t)
	if dev.Properties().Arch != "sm_90a" {
		t.Skip("the dense MLP in D2T runs on the wgmma D2T (sm_90a)")
	}
	r, seed := testutil.Rand(t)
	d, f := 256, 1024
	m := denseD2TMinRows + r.IntN(600)
	sl := newLayer(t, r, d, f, 0.3, synth.Uniform, true)
	l := newMLP(t, dev, blas, sl, twell.DefaultLayout, seed)
	l.DenseAbove, l.Measure = 0.1, false
	xb := upload(t, dev, synth.Tokens(r, m, d))
	const poison = 0xffff_ffff // bf16 NaN pairs
	// run queues one call after poisoning the cuBLASLt gate buffer (once it
	// exists) and returns the output and whether the call wrote that buffer.
	run := func(queue func(y *cuda.Buffer) error) (out []uint16, onBLAS bool) {
		t.Helper()
		yb := cudatest.Alloc(t, dev, 2*m*d)
		g := l.ws.dn.g
		if g != nil {
			if err := dev.Memset32(g, poison, nil); err != nil {
				t.Fatal(err)
			}
		}
		if err := queue(yb); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if err := dev.Synchronize(); err != nil {
			t.Fatal(err)
		}
		out = make([]uint16, m*d)
		if err := dev.CopyDtoH(cuda.Bytes(out), yb); err != nil {
			t.Fatal(err)
		}
		if g == nil || l.ws.dn.g != g {
			return out, l.ws.dn.g != nil // allocated (or reallocated) by this call
		}
		head := make([]uint32, 256)
		if err := dev.CopyDtoH(cuda.Bytes(head), g); err != nil {
			t.Fatal(err)
		}
		return out, slices.ContainsFunc(head, func(v uint32) bool { return v != poison })
	}
	if _, onBLAS := run(func(y *cuda.Buffer) error { return l.Dense(nil, y, xb, m) }); !onBLAS {
		t.Fatalf("seed %d: the cuBLASLt dense path did not write its gate buffer", seed)
	}
	want, onBLAS := run(func(y *cuda.Buffer) error { return l.DenseInD2T(nil, y, xb, m) })
	if onBLAS {
		t.Fatalf("seed %d: DenseInD2T wrote the cuBLASLt gate buffer", seed)
	}
	near := func(got []uint16) bool {
		for i := range got {
			a, b := bf16.ToFloat32(got[i]), bf16.ToFloat32(want[i])
			if math.IsNaN(float64(a)) || math.Abs(float64(a-b)) > 1e-2*(1+math.Abs(float64(b))) {
				return false
			}
		}
		return true
	}
	for _, wantBLAS := range []bool{false, true} {
		l.DenseOnCuBLAS = wantBLAS
		for i := 0; i < 3; i++ { // the first call's count sends the later ones dense
			var path mlp.Path
			got, onBLAS := run(func(y *cuda.Buffer) error {
				p, err := l.Forward(nil, y, xb, m)
				path = p
				return err
			})
			if path == mlp.Dense && !near(got) { // the sparse path's sums differ more (TestMLPMatchesFloat64)
				t.Errorf("seed %d: DenseOnCuBLAS %v: call %d ran %v, output off DenseInD2T's", seed, wantBLAS, i, path)
			}
			if i == 2 && (path != mlp.Dense || onBLAS != wantBLAS) {
				t.Errorf("seed %d: DenseOnCuBLAS %v: the third call ran %v, on cuBLASLt %v", seed, wantBLAS, path, onBLAS)
			}
		}
		// Queue, the form recorded into graphs, runs the same dense arm.
		got, onBLAS := run(func(y *cuda.Buffer) error { return l.Queue(nil, y, xb, m, mlp.Dense) })
		if !near(got) || onBLAS != wantBLAS {
			t.Errorf("seed %d: DenseOnCuBLAS %v: Queue's dense arm ran on cuBLASLt %v, output close %v", seed, wantBLAS, onBLAS, near(got))
		}
	}
	// A fixed mlp.Dense is the cuBLASLt baseline.
	l.DenseOnCuBLAS, l.Path = false, mlp.Dense
	if got, onBLAS := run(func(y *cuda.Buffer) error { _, err := l.Forward(nil, y, xb, m); return err }); !onBLAS || !near(got) {
		t.Errorf("seed %d: Path mlp.Dense ran on cuBLASLt %v (want true), output close %v", seed, onBLAS, near(got))
	}
}
