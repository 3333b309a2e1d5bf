package llm

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/internal/testutil"
)

// TestAddRMSNormDeltas runs add_rmsnorm in each of its modes on random
// rows, in its register-resident form (d 2048) and its two-pass form (d
// 130): one delta, two deltas, keep (the residual left as it was) and a
// row list. The residual it writes must be the fp32 sums in delta order,
// bit for bit, the normed rows within bf16 rounding of float64, and a norm
// that adds both deltas must give the bits of two norms that add one each.
func TestAddRMSNormDeltas(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	mod, err := dev.Compile("norm.cu", normSrc, headers()...)
	if err != nil {
		t.Fatal(err)
	}
	fn, err := mod.Function("add_rmsnorm")
	if err != nil {
		t.Fatal(err)
	}
	r, seed := testutil.Rand(t)
	const n, eps = 5, 1e-6
	for _, d := range []int{2048, 130} {
		x, d1, d2, w := randRows(r, n*d, 4), bfRows(r, n*d), bfRows(r, n*d), randRows(r, d, 1)
		bufs := func(xs []float32) (resid, out *cuda.Buffer) {
			resid, out = cudatest.Alloc(t, dev, 4*n*d), cudatest.Alloc(t, dev, 2*n*d)
			if err := dev.CopyHtoD(resid, cuda.Bytes(xs)); err != nil {
				t.Fatal(err)
			}
			return resid, out
		}
		up := func(v []float32) *cuda.Buffer {
			b := cudatest.Alloc(t, dev, 2*len(v))
			upload(t, dev, b, v)
			return b
		}
		db1, db2, wb := up(d1), up(d2), cudatest.Alloc(t, dev, 4*d)
		if err := dev.CopyHtoD(wb, cuda.Bytes(w)); err != nil {
			t.Fatal(err)
		}
		run := func(a normArgs) (resid []float32, out []uint16) {
			a.w, a.n, a.d, a.eps = wb, n, d, eps
			if a.rows != nil {
				a.n = 2
			}
			if err := a.launch(fn, nil); err != nil {
				t.Fatal(err)
			}
			resid, out = make([]float32, n*d), make([]uint16, n*d)
			if err := dev.CopyDtoH(cuda.Bytes(resid), a.resid); err != nil {
				t.Fatal(err)
			}
			if err := dev.CopyDtoH(cuda.Bytes(out), a.out); err != nil {
				t.Fatal(err)
			}
			return resid, out
		}
		// sum is the residual a norm adding the deltas ds (in order) leaves.
		sum := func(ds ...[]float32) []float32 {
			v := append([]float32(nil), x...)
			for _, dd := range ds {
				for i := range v {
					v[i] += dd[i]
				}
			}
			return v
		}
		check := func(what string, gotResid, wantResid []float32, out []uint16, v []float32, rows []int) {
			t.Helper()
			for i := range wantResid {
				if math.Float32bits(gotResid[i]) != math.Float32bits(wantResid[i]) {
					t.Fatalf("d %d, %s (seed %d): resid[%d] = %g, want %g", d, what, seed, i, gotResid[i], wantResid[i])
				}
			}
			for b, row := range rows {
				ss := 0.0
				for k := 0; k < d; k++ {
					ss += float64(v[row*d+k]) * float64(v[row*d+k])
				}
				inv := 1 / math.Sqrt(ss/float64(d)+eps)
				for k := 0; k < d; k++ {
					want := float64(v[row*d+k]) * inv * float64(w[k])
					got := float64(bf16.ToFloat32(out[b*d+k]))
					if math.Abs(got-want) > math.Abs(want)/128+1e-6 {
						t.Fatalf("d %d, %s (seed %d): out row %d col %d = %g, want %g", d, what, seed, b, k, got, want)
					}
				}
			}
		}
		all := []int{0, 1, 2, 3, 4}
		resid, out := bufs(x)
		got, o1 := run(normArgs{resid: resid, delta: db1, out: out})
		check("one delta", got, sum(d1), o1, sum(d1), all)

		resid, out = bufs(x)
		got, o2 := run(normArgs{resid: resid, delta: db1, delta2: db2, out: out})
		check("two deltas", got, sum(d1, d2), o2, sum(d1, d2), all)
		// The same as adding d1, then d2 in a second norm.
		resid, out = bufs(x)
		run(normArgs{resid: resid, delta: db1, out: out})
		got1, o21 := run(normArgs{resid: resid, delta: db2, out: out})
		for i := range o2 {
			if o2[i] != o21[i] || math.Float32bits(got[i]) != math.Float32bits(got1[i]) {
				t.Fatalf("d %d (seed %d): two deltas at once differ from one after the other at %d", d, seed, i)
			}
		}

		resid, out = bufs(x)
		got, ok := run(normArgs{resid: resid, delta: db1, out: out, keep: true})
		check("keep", got, x, ok, sum(d1), all)
		for i := range ok {
			if ok[i] != o1[i] {
				t.Fatalf("d %d (seed %d): keep changed the normed rows at %d", d, seed, i)
			}
		}

		resid, out = bufs(x)
		rows := cudatest.Alloc(t, dev, 8)
		if err := dev.CopyHtoD(rows, cuda.Bytes([]int32{3, 1})); err != nil {
			t.Fatal(err)
		}
		got, or := run(normArgs{resid: resid, delta: db1, delta2: db2, rows: rows, out: out})
		check(fmt.Sprintf("rows %v", []int{3, 1}), got, x, or, sum(d1, d2), []int{3, 1})
	}
}

// randRows returns n normal values scaled by s.
func randRows(r *rand.Rand, n int, s float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(s * r.NormFloat64())
	}
	return v
}

// bfRows returns n normal values rounded to bf16.
func bfRows(r *rand.Rand, n int) []float32 {
	v := randRows(r, n, 1)
	for i := range v {
		v[i] = bf16.Round(v[i])
	}
	return v
}
