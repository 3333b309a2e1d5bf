package cpu

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

func randMat(r *rand.Rand, n int) []float32 {
	a := make([]float32, n)
	for i := range a {
		a[i] = float32(r.NormFloat64())
	}
	return a
}

// refGemm computes a b^T in float64.
func refGemm(a, b []float32, m, n, k int) []float64 {
	c := make([]float64, m*n)
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			s := 0.0
			for q := 0; q < k; q++ {
				s += float64(a[i*k+q]) * float64(b[j*k+q])
			}
			c[i*n+j] = s
		}
	}
	return c
}

// fp32Exceeds returns the first element of got = a b^T (float32 sums of k
// products) that is further from the float64 product than float32
// summation allows in any order: |error| <= k u sum_q |a_q b_q| (u = 2^-24,
// with 10% slack for the final rounding), or -1. Unlike a relative error of
// the result, the bound holds where the products cancel to near zero.
func fp32Exceeds(got, a, b []float32, m, n, k int) (idx int, err, bound float64) {
	const u = 1.0 / (1 << 24)
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			var s, abs float64
			for q := 0; q < k; q++ {
				p := float64(a[i*k+q]) * float64(b[j*k+q])
				s += p
				abs += math.Abs(p)
			}
			bound := 1.1*float64(k)*u*abs + 1e-30
			if e := math.Abs(float64(got[i*n+j]) - s); !(e <= bound) {
				return i*n + j, e, bound
			}
		}
	}
	return -1, 0, 0
}

// relErr returns ||got - want|| / ||want|| (Frobenius).
func relErr(got []float32, want []float64) float64 {
	var num, den float64
	for i, w := range want {
		d := float64(got[i]) - w
		num += d * d
		den += w * w
	}
	if den == 0 {
		return math.Sqrt(num)
	}
	return math.Sqrt(num / den)
}

func forEachKernel(t *testing.T, f func(t *testing.T)) {
	t.Run("go", func(t *testing.T) { useSIMD(false); defer useSIMD(simdAvailable()); f(t) })
	if simdAvailable() {
		t.Run("simd", f)
	}
}

func TestGemmMatchesFloat64(t *testing.T) {
	forEachKernel(t, func(t *testing.T) {
		r, seed := testutil.Rand(t)
		shapes := [][3]int{{1, 1, 1}, {12, 32, 7}, {13, 33, 300}, {96, 256, 256}, {97, 257, 513}, {200, 70, 64}}
		for i := 0; i < 4; i++ {
			shapes = append(shapes, [3]int{1 + r.IntN(150), 1 + r.IntN(600), 1 + r.IntN(700)})
		}
		for _, s := range shapes {
			m, n, k := s[0], s[1], s[2]
			a, bw := randMat(r, m*k), randMat(r, n*k)
			b, err := PackB(bw, n, k)
			if err != nil {
				t.Fatal(err)
			}
			c := randMat(r, m*n) // garbage in C must be overwritten
			if err := Gemm(c, a, m, b); err != nil {
				t.Fatal(err)
			}
			if i, e, bound := fp32Exceeds(c, a, bw, m, n, k); i >= 0 {
				t.Fatalf("seed %d: gemm %dx%dx%d element %d off by %g, more than float32 summation allows (%g)", seed, m, n, k, i, e, bound)
			}
		}
	})
}

func TestPackBTMatchesPackB(t *testing.T) {
	r, seed := testutil.Rand(t)
	m, n, k := 1+r.IntN(40), 1+r.IntN(100), 1+r.IntN(300)
	a, w := randMat(r, m*k), randMat(r, k*n) // w is k x n
	wt := make([]float32, n*k)
	for q := 0; q < k; q++ {
		for j := 0; j < n; j++ {
			wt[j*k+q] = w[q*n+j]
		}
	}
	b1, _ := PackB(wt, n, k)
	b2, err := PackBT(w, k, n)
	if err != nil {
		t.Fatal(err)
	}
	c1, c2 := make([]float32, m*n), make([]float32, m*n)
	Gemm(c1, a, m, b1)
	Gemm(c2, a, m, b2)
	for i := range c1 {
		if c1[i] != c2[i] {
			t.Fatalf("seed %d: %dx%dx%d element %d: PackB %g, PackBT %g", seed, m, n, k, i, c1[i], c2[i])
		}
	}
}

func TestGemmTA(t *testing.T) {
	forEachKernel(t, func(t *testing.T) {
		r, seed := testutil.Rand(t)
		shapes := [][3]int{{1, 1, 1}, {5, 40, 9}, {13, 33, 300}, {97, 257, 513}}
		for i := 0; i < 4; i++ {
			shapes = append(shapes, [3]int{1 + r.IntN(200), 1 + r.IntN(300), 1 + r.IntN(600)})
		}
		for _, s := range shapes {
			m, n, k := s[0], s[1], s[2]
			a, bw := randMat(r, m*k), randMat(r, n*k)
			at := make([]float32, k*m)
			for i := 0; i < m; i++ {
				for q := 0; q < k; q++ {
					at[q*m+i] = a[i*k+q]
				}
			}
			b, _ := PackB(bw, n, k)
			c := randMat(r, m*n) // overwritten without acc
			if err := GemmTA(c, at, m, b, false); err != nil {
				t.Fatal(err)
			}
			if i, e, bound := fp32Exceeds(c, a, bw, m, n, k); i >= 0 {
				t.Fatalf("seed %d: GemmTA %dx%dx%d element %d off by %g, more than float32 summation allows (%g)", seed, m, n, k, i, e, bound)
			}
			c0 := randMat(r, m*n)
			acc := slices.Clone(c0)
			if err := GemmTA(acc, at, m, b, true); err != nil {
				t.Fatal(err)
			}
			for i := range acc {
				if want := c0[i] + c[i]; acc[i] != want {
					t.Fatalf("seed %d: GemmTA acc %dx%dx%d element %d: %g, want %g + %g", seed, m, n, k, i, acc[i], c0[i], c[i])
				}
			}
		}
		b, _ := PackB(make([]float32, 6), 2, 3)
		if err := GemmTA(make([]float32, 4), make([]float32, 5), 2, b, false); err == nil {
			t.Error("short A^T accepted")
		}
		if err := GemmTA(make([]float32, 3), make([]float32, 6), 2, b, true); err == nil {
			t.Error("short C accepted")
		}
	})
}

func TestGemmShapeErrors(t *testing.T) {
	b, _ := PackB(make([]float32, 6), 2, 3)
	if err := Gemm(make([]float32, 4), make([]float32, 5), 2, b); err == nil {
		t.Error("short A accepted")
	}
	if err := Gemm(make([]float32, 3), make([]float32, 6), 2, b); err == nil {
		t.Error("short C accepted")
	}
	if _, err := PackB(make([]float32, 5), 2, 3); err == nil {
		t.Error("short B accepted")
	}
}

func TestDotAxpyMatchGo(t *testing.T) {
	r, seed := testutil.Rand(t)
	for _, n := range []int{0, 1, 63, 64, 65, 200, 2048} {
		x, y := randMat(r, n), randMat(r, n)
		want := 0.0
		for i := range x {
			want += float64(x[i]) * float64(y[i])
		}
		if got := dotKernel(x, y); math.Abs(float64(got)-want) > 1e-4*(1+math.Abs(want))*math.Sqrt(float64(n+1)) {
			t.Fatalf("seed %d: dot n=%d = %g, want %g", seed, n, got, want)
		}
		y2 := append([]float32(nil), y...)
		axpyKernel(0.5, x, y2)
		for i := range y2 {
			if d := y2[i] - (y[i] + 0.5*x[i]); d > 1e-6 || d < -1e-6 {
				t.Fatalf("seed %d: axpy n=%d element %d off by %g", seed, n, i, d)
			}
		}
	}
}

// BenchmarkGemm times C = A B^T over float32 panels and over compact
// (bf16) ones, at prefill (m 1024) and decode (m 1, 8) sizes.
func BenchmarkGemm(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	n, k := 2048, 2048
	bw := randMat(r, n*k)
	roundAll(bw)
	full, _ := PackB(bw, n, k)
	compact, _ := PackB(bw, n, k)
	compact.Compact()
	for _, m := range []int{1, 8, 1024} {
		a := randMat(r, m*k)
		c := make([]float32, m*n)
		for _, pb := range []struct {
			name string
			p    *PackedB
		}{{"float32", full}, {"compact", compact}} {
			b.Run(fmt.Sprintf("m%d/%s", m, pb.name), func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					Gemm(c, a, m, pb.p)
				}
				b.ReportMetric(2*float64(m*n*k)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
			})
		}
	}
}

func TestSmallMBF16(t *testing.T) {
	forEachKernel(t, func(t *testing.T) {
		r, seed := testutil.Rand(t)
		for _, m := range []int{1, 2, 4, 5, 12, 16, 17, 40} {
			n, k := 1+r.IntN(600), 1+r.IntN(500)
			a, bw := randMat(r, m*k), randMat(r, n*k)
			b, _ := PackB(bw, n, k)
			c32 := make([]float32, m*n)
			Gemm(c32, a, m, b)
			b.UseBF16ForSmallM()
			c16 := make([]float32, m*n)
			Gemm(c16, a, m, b)
			want := refGemm(a, bw, m, n, k)
			if i, e, bound := fp32Exceeds(c32, a, bw, m, n, k); i >= 0 {
				t.Fatalf("seed %d: float32 small-m %dx%dx%d element %d off by %g, more than float32 summation allows (%g)", seed, m, n, k, i, e, bound)
			}
			if m > bf16MaxM { // the float32 panels, bit for bit
				if !slices.Equal(c16, c32) {
					t.Fatalf("seed %d: m=%d (above %d) did not keep the float32 panels", seed, m, bf16MaxM)
				}
				continue
			}
			if e := relErr(c16, want); e > 1e-2 || e < 1e-6 {
				t.Fatalf("seed %d: bf16 small-m %dx%dx%d rel err %g (want bf16-sized, under 1e-2)", seed, m, n, k, e)
			}
		}
	})
}
