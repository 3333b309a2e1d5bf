package gpu

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/twell-ai/twell/cuda/cublas"
)

// TestChooseByTimes drives the measured path choice with made-up timings:
// the first two calls of a batch size run sparse, the next two dense (each
// path's first timing is dropped), then the faster one, with the slower one
// re-timed every reprobeEvery calls; the
// density rule overrides the timings; sizes are bucketed by powers of two.
func TestChooseByTimes(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	r := rand.New(rand.NewPCG(seed, 1))
	for trial := 0; trial < 50; trial++ {
		l := &MLP{blas: &cublas.Handle{}, Measure: true}
		m := 1 + r.IntN(1<<16)
		sparseMS, denseMS := 0.1+r.Float64(), 0.1+r.Float64()
		fast, slow := PathSparse, PathDense
		if denseMS < sparseMS {
			fast, slow = slow, fast
		}
		cost := map[Path]float64{PathSparse: sparseMS, PathDense: denseMS}
		var got []Path
		for call := 1; call <= 3*reprobeEvery; call++ {
			p := l.choose(m, PathSparse)
			got = append(got, p)
			l.record(p, bucketOf(m), m, cost[p]*float64(m))
			want := fast
			switch {
			case call <= 2:
				want = PathSparse
			case call <= 4:
				want = PathDense
			case call%reprobeEvery == 0:
				want = slow
			}
			if p != want {
				t.Fatalf("seed %d: m=%d, sparse %.3f, dense %.3f ms/token: call %d ran %v, want %v (calls %v)",
					seed, m, sparseMS, denseMS, call, p, want, got)
			}
		}
		if p := l.choose(m, PathDense); p != PathDense {
			t.Errorf("seed %d: the density rule said dense, choose ran %v", seed, p)
		}
		// another power-of-two bucket starts over
		if p := l.choose(4*m, PathSparse); p != PathSparse {
			t.Errorf("seed %d: first call of a new bucket ran %v, want sparse", seed, p)
		}
		l.Measure = false
		if p := l.choose(m, PathSparse); p != PathSparse {
			t.Errorf("seed %d: without Measure, choose ran %v, want the density rule's sparse", seed, p)
		}
	}
	if p := (&MLP{Measure: true}).choose(100, PathDense); p != PathSparse {
		t.Errorf("without cuBLAS, choose ran %v, want sparse", p)
	}
}
