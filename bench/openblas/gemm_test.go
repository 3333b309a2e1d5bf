package openblas

import (
	"fmt"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/twell-ai/twell/cpu"
	"github.com/twell-ai/twell/internal/testutil"
)

// open loads OpenBLAS from $TWELL_OPENBLAS_DIR, or skips: the library is
// fetched by run.sh, never by the tests.
func open(tb testing.TB) *Lib {
	dir := os.Getenv("TWELL_OPENBLAS_DIR")
	if dir == "" {
		tb.Skip("TWELL_OPENBLAS_DIR not set: run bench/openblas/run.sh to fetch OpenBLAS and compare")
	}
	l, err := Open(dir)
	if err != nil {
		tb.Fatal(err)
	}
	return l
}

func randMat(r *rand.Rand, n int) []float32 {
	a := make([]float32, n)
	for i := range a {
		a[i] = float32(r.NormFloat64())
	}
	return a
}

func TestAgreesWithTwell(t *testing.T) {
	l := open(t)
	r, seed := testutil.Rand(t)
	m, n, k := 77, 300, 129
	a, b := randMat(r, m*k), randMat(r, n*k)
	want := make([]float32, m*n)
	if err := l.GemmNT(want, a, b, m, n, k); err != nil {
		t.Fatal(err)
	}
	pb, _ := cpu.PackB(b, n, k)
	got := make([]float32, m*n)
	if err := cpu.Gemm(got, a, m, pb); err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if d := got[i] - want[i]; d > 1e-3 || d < -1e-3 {
			t.Fatalf("seed %d: element %d: twell %g, OpenBLAS %g", seed, i, got[i], want[i])
		}
	}
}

// BenchmarkGEMM times twell's GEMM and OpenBLAS sgemm on the same inputs in
// the same process, alternating sizes, reporting GFLOP/s.
func BenchmarkGEMM(b *testing.B) {
	l := open(b)
	b.Logf("OpenBLAS: %s; twell workers: %d", l.Config(), cpu.Workers())
	for _, s := range [][3]int{{1024, 2048, 2048}, {1024, 5632, 2048}, {1024, 2048, 5632}, {2048, 2048, 2048}} {
		m, n, k := s[0], s[1], s[2]
		r := rand.New(rand.NewPCG(uint64(m*n), uint64(k)))
		a, w := randMat(r, m*k), randMat(r, n*k)
		c := make([]float32, m*n)
		flops := 2 * float64(m) * float64(n) * float64(k)
		name := fmt.Sprintf("%dx%dx%d", m, n, k)
		b.Run("twell/"+name, func(b *testing.B) {
			pb, _ := cpu.PackB(w, n, k) // weights are packed once, at load time
			for b.Loop() {
				cpu.Gemm(c, a, m, pb)
			}
			b.ReportMetric(flops*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
		b.Run("openblas/"+name, func(b *testing.B) {
			for b.Loop() {
				l.GemmNT(c, a, w, m, n, k)
			}
			b.ReportMetric(flops*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
	}
}
