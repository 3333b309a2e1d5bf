package gpu

import (
	"fmt"
	"math"
	"slices"
	"testing"

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
// dense, a call of at least denseD2TMinRows tokens runs DenseInD2T (the
// same bits), in Forward and in Queue, and with DenseOnCuBLAS the cuBLASLt
// path (its bits), which a fixed mlp.Dense always runs.
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
	run := func(queue func(y *cuda.Buffer) error) []uint16 {
		t.Helper()
		yb := cudatest.Alloc(t, dev, 2*m*d)
		if err := queue(yb); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if err := dev.Synchronize(); err != nil {
			t.Fatal(err)
		}
		out := make([]uint16, m*d)
		if err := dev.CopyDtoH(cuda.Bytes(out), yb); err != nil {
			t.Fatal(err)
		}
		return out
	}
	inD2T := run(func(y *cuda.Buffer) error { return l.DenseInD2T(nil, y, xb, m) })
	onBLAS := run(func(y *cuda.Buffer) error { return l.Dense(nil, y, xb, m) })
	if slices.Equal(inD2T, onBLAS) {
		t.Fatalf("seed %d: the two dense forms gave the same bits; the test cannot tell them apart", seed)
	}
	for _, c := range []struct {
		onBLAS bool
		want   []uint16
	}{{false, inD2T}, {true, onBLAS}} {
		l.DenseOnCuBLAS = c.onBLAS
		var path mlp.Path
		for i := 0; i < 3; i++ { // the first call's count sends the later ones dense
			got := run(func(y *cuda.Buffer) error {
				p, err := l.Forward(nil, y, xb, m)
				path = p
				return err
			})
			if i == 2 && (path != mlp.Dense || !slices.Equal(got, c.want)) {
				t.Errorf("seed %d: DenseOnCuBLAS %v: the third call ran %v, same bits as the expected dense form: %v",
					seed, c.onBLAS, path, slices.Equal(got, c.want))
			}
		}
		// Queue, the form recorded into graphs, runs the same dense arm.
		if got := run(func(y *cuda.Buffer) error { return l.Queue(nil, y, xb, m, mlp.Dense) }); !slices.Equal(got, c.want) {
			t.Errorf("seed %d: DenseOnCuBLAS %v: Queue's dense arm differs from Forward's", seed, c.onBLAS)
		}
	}
	// A fixed mlp.Dense is the cuBLASLt baseline.
	l.DenseOnCuBLAS, l.Path = false, mlp.Dense
	if got := run(func(y *cuda.Buffer) error { _, err := l.Forward(nil, y, xb, m); return err }); !slices.Equal(got, onBLAS) {
		t.Errorf("seed %d: Path mlp.Dense did not run the cuBLASLt path", seed)
	}
}
