package llm

import (
	"fmt"
	"math"
	"testing"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/gpu"
	"github.com/twell-ai/twell/internal/testutil"
)

// TestWGMMAProbe runs attn_wg64's two products alone (attn_wg64_probe: one
// warpgroup, 64 x 64 q, k, v) against float64, so that a failure of the
// whole kernel can be told apart from a failure of its operand layouts. On
// a mismatch it also says which layout mistake the output matches.
func TestWGMMAProbe(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	if a := dev.Properties().Arch; a != "sm_90a" {
		t.Skipf("wgmma needs sm_90a; %v is %s", dev, a)
	}
	mod, err := dev.Compile("attn_wgmma.cu", attnWGMMASrc, append(headers(), cuda.WithNameExpressions("attn_wg64_probe"))...)
	if err != nil {
		t.Fatal(err)
	}
	fn, err := mod.Function("attn_wg64_probe")
	if err != nil {
		t.Fatal(err)
	}
	r, seed := testutil.Rand(t)
	const n = 64
	mat := func() []float32 {
		m := make([]float32, n*n)
		for i := range m {
			m[i] = bf16.Round(float32(r.NormFloat64()) * 0.5)
		}
		return m
	}
	q, k, v := mat(), mat(), mat()
	var bufs []*cuda.Buffer
	up := func(m []float32) *cuda.Buffer {
		b, err := gpu.Upload(dev, m)
		if err != nil {
			t.Fatal(err)
		}
		bufs = append(bufs, b)
		return b
	}
	out := func() *cuda.Buffer {
		b, err := dev.Alloc(4 * n * n)
		if err != nil {
			t.Fatal(err)
		}
		bufs = append(bufs, b)
		return b
	}
	defer func() {
		for _, b := range bufs {
			b.Free()
		}
	}()
	qb, kb, vb, sb, ob := up(q), up(k), up(v), out(), out()
	if err := fn.Launch(cuda.Dim3{1, 1, 1}, cuda.Dim3{128, 1, 1}, 3*8192+1024, nil, qb, kb, vb, sb, ob); err != nil {
		t.Fatal(err)
	}
	if err := dev.Synchronize(); err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	s, o := make([]float32, n*n), make([]float32, n*n)
	if err := dev.CopyDtoH(cuda.Bytes(s), sb); err != nil {
		t.Fatal(err)
	}
	if err := dev.CopyDtoH(cuda.Bytes(o), ob); err != nil {
		t.Fatal(err)
	}
	// product returns a b^T (transB) or a b for n x n row-major matrices.
	product := func(a, b []float32, transB bool) []float64 {
		c := make([]float64, n*n)
		for i := range n {
			for j := range n {
				var sum float64
				for d := range n {
					bv := b[d*n+j]
					if transB {
						bv = b[j*n+d]
					}
					sum += float64(a[i*n+d]) * float64(bv)
				}
				c[i*n+j] = sum
			}
		}
		return c
	}
	// relErr returns max |got - want| / max |want| and where the largest
	// difference is.
	relErr := func(got []float32, want []float64) (float64, string) {
		var maxD, maxW float64
		at := ""
		for i, w := range want {
			maxW = max(maxW, math.Abs(w))
			d := math.Abs(float64(got[i]) - w)
			if math.IsNaN(d) {
				return math.Inf(1), fmt.Sprintf("row %d col %d: %g, want %g", i/n, i%n, got[i], w)
			}
			if d > maxD {
				maxD, at = d, fmt.Sprintf("row %d col %d: %g, want %g", i/n, i%n, got[i], w)
			}
		}
		return maxD / maxW, at
	}
	const tol = 1e-3
	if e, at := relErr(s, product(q, k, true)); e > tol {
		hint := ""
		if e2, _ := relErr(s, product(q, k, false)); e2 <= tol {
			hint = " (s matches q k, not q k^T: K is read MN-major)"
		}
		t.Fatalf("seed %d: s = q k^T: rel err %.3g at %s%s", seed, e, at, hint)
	}
	p := make([]float32, n*n)
	for i, x := range s {
		p[i] = bf16.Round(x)
	}
	if e, at := relErr(o, product(p, v, false)); e > tol {
		hint := ""
		if e2, _ := relErr(o, product(p, v, true)); e2 <= tol {
			hint = " (o matches p v^T: V is read K-major, the transpose flag or descriptor is wrong)"
		}
		t.Fatalf("seed %d: o = bf16(s) v: rel err %.3g at %s%s", seed, e, at, hint)
	}
}
