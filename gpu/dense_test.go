package gpu

import (
	"fmt"
	"math"
	"testing"

	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/internal/testutil"
)

// TestDenseMLPMatchesFloat64 checks NewDenseMLP, gated and not, ReLU and
// SiLU, on widths that take relu_mul (F a multiple of 8) and act_mul, against
// float64 on the bf16 inputs, and two layers sharing one workspace.
func TestDenseMLPMatchesFloat64(t *testing.T) {
	dev, blas := setup(t)
	for _, c := range []struct {
		d, f  int
		gated bool
		act   Activation
	}{{96, 256, true, ActReLU}, {96, 256, true, ActSiLU}, {64, 100, false, ActReLU}, {40, 90, true, ActSiLU}, {64, 100, true, ActReLU}} {
		t.Run(fmt.Sprintf("d%d-f%d-gated%v-act%d", c.d, c.f, c.gated, c.act), func(t *testing.T) {
			r, seed := testutil.Rand(t)
			w := func(n int, scale float64) []float32 {
				v := make([]float32, n)
				for i := range v {
					v[i] = float32(r.NormFloat64() * scale)
				}
				return roundBF16(v)
			}
			var wg []float32
			if c.gated {
				wg = w(c.f*c.d, 1/math.Sqrt(float64(c.d)))
			}
			wu, wd := w(c.f*c.d, 1/math.Sqrt(float64(c.d))), w(c.d*c.f, 1/math.Sqrt(float64(c.f)))
			l, err := NewDenseMLP(dev, blas, wg, wu, wd, c.d, c.f, c.act)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			l2, err := NewDenseMLP(dev, blas, wg, wu, wd, c.d, c.f, c.act)
			if err != nil {
				t.Fatal(err)
			}
			defer l2.Close()
			if err := l2.ShareWorkspace(l); err != nil {
				t.Fatal(err)
			}
			m := 37
			x := w(m*c.d, 1)
			xb := upload(t, dev, x)
			yb := cudatest.Alloc(t, dev, 2*m*c.d)
			var maxDiff, maxWant float64
			for _, layer := range []*DenseMLP{l, l2} {
				if err := layer.Forward(nil, yb, xb, m); err != nil {
					t.Fatalf("seed %d: %v", seed, err)
				}
				y, err := Download(dev, yb, m*c.d)
				if err != nil {
					t.Fatalf("seed %d: %v", seed, err)
				}
				for tk := 0; tk < m; tk++ {
					h := make([]float64, c.f)
					for j := range h {
						var a, u float64
						for k := 0; k < c.d; k++ {
							xv := float64(x[tk*c.d+k])
							u += xv * float64(wu[j*c.d+k])
							if c.gated {
								a += xv * float64(wg[j*c.d+k])
							}
						}
						if !c.gated {
							a, u = u, 1
						}
						if c.act == ActReLU {
							a = max(a, 0)
						} else {
							a /= 1 + math.Exp(-a)
						}
						h[j] = a * u
					}
					for k := 0; k < c.d; k++ {
						var want float64
						for j, hv := range h {
							want += hv * float64(wd[k*c.f+j])
						}
						maxWant = max(maxWant, math.Abs(want))
						maxDiff = max(maxDiff, math.Abs(float64(y[tk*c.d+k])-want))
					}
				}
			}
			if e := maxDiff / maxWant; !(e <= 2e-2) {
				t.Errorf("seed %d: max |diff| / max |want| = %.3g, want <= 2e-2", seed, e)
			}
		})
	}
}
