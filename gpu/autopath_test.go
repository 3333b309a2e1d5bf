package gpu

import (
	"math"
	"slices"
	"testing"

	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/mlp"
)

// exploreCalls returns how many calls a bucket explores before its timings
// decide, for the given per-token costs: each path's first timing is
// dropped, so four calls keep one timing each; paths closer than farRatio
// then take turns until each keeps keptWindow.
func exploreCalls(sparseMS, denseMS float64) int {
	if max(sparseMS, denseMS) >= farRatio*min(sparseMS, denseMS) {
		return 4
	}
	return 2 + 2*keptWindow
}

// wantExplore returns the path call (from 1) of a bucket's exploration runs:
// sparse twice, dense twice, then in turns.
func wantExplore(call int) mlp.Path {
	switch {
	case call <= 2:
		return mlp.Sparse
	case call <= 4:
		return mlp.Dense
	case call%2 == 1:
		return mlp.Sparse
	}
	return mlp.Dense
}

// TestChooseByTimes drives the measured path choice with made-up timings:
// the first two calls of a batch size run sparse, the next two dense (each
// path's first timing is dropped), then, where the paths are within
// farRatio of each other, both in turns until each keeps keptWindow
// timings; then the faster one, with the slower one re-timed every
// reprobeEvery calls; the density rule overrides the timings; sizes are
// bucketed by powers of two.
func TestChooseByTimes(t *testing.T) {
	r, seed := testutil.Rand(t)
	for trial := 0; trial < 200; trial++ {
		l := &MLP{blas: &cublas.Handle{}, Measure: true}
		m := 1 + r.IntN(1<<16)
		if trial == 0 {
			m = 1 + r.IntN(gemvMaxRows) // the exemption
		}
		sparseMS := 0.1 + r.Float64()
		denseMS := 0.1 + r.Float64()
		if trial%2 == 1 { // close paths: within farRatio of each other
			q := 1 + r.Float64()*(farRatio-1)*0.95
			if r.IntN(2) == 0 {
				q = 1 / q
			}
			denseMS = sparseMS * q
		}
		fast, slow := mlp.Sparse, mlp.Dense
		if denseMS < sparseMS {
			fast, slow = slow, fast
		}
		explore := exploreCalls(sparseMS, denseMS)
		cost := map[mlp.Path]float64{mlp.Sparse: sparseMS, mlp.Dense: denseMS}
		var got []mlp.Path
		for call := 1; call <= 3*reprobeEvery; call++ {
			p, timed := l.choose(m, mlp.Sparse)
			got = append(got, p)
			if call <= explore || call%reprobeEvery == 0 {
				if !timed {
					t.Fatalf("seed %d: call %d (%v) explores or re-times but is not timed", seed, call, p)
				}
			}
			if timed {
				l.record(p, l.bucketOf(m), m, cost[p]*float64(m))
			}
			want := fast
			switch {
			case call <= explore:
				want = wantExplore(call)
			case call%reprobeEvery == 0:
				want = slow
			}
			if p != want {
				t.Fatalf("seed %d: m=%d, sparse %.4f, dense %.4f ms/token: call %d ran %v, want %v (calls %v)",
					seed, m, sparseMS, denseMS, call, p, want, got)
			}
		}
		// batches of at most gemvMaxRows tokens are exempt from the density
		// rule and keep the measured choice
		want := mlp.Dense
		if m <= gemvMaxRows {
			want = fast
		}
		if p, _ := l.choose(m, mlp.Dense); p != want {
			t.Errorf("seed %d: m=%d, the density rule said dense, choose ran %v, want %v", seed, m, p, want)
		}
		// another power-of-two bucket starts over
		if p, timed := l.choose(4*m, mlp.Sparse); p != mlp.Sparse || !timed {
			t.Errorf("seed %d: first call of a new bucket ran %v (timed %v), want sparse, timed", seed, p, timed)
		}
		l.Measure = false
		if p, timed := l.choose(m, mlp.Sparse); p != mlp.Sparse || timed {
			t.Errorf("seed %d: without Measure, choose ran %v (timed %v), want the density rule's sparse, untimed", seed, p, timed)
		}
	}
	if p, _ := (&MLP{Measure: true}).choose(100, mlp.Dense); p != mlp.Sparse {
		t.Errorf("without cuBLAS, choose ran %v, want sparse", p)
	}
	for n := 1; n <= 100; n++ {
		if want := n <= sampleFirst || n%sampleEvery == 0; sampled(n) != want {
			t.Errorf("sampled(%d) = %v, want %v", n, sampled(n), want)
		}
	}
}

// TestChooseOutvotesOneSlowCall: a single slow timing of the faster path
// does not decide a bucket. Within farRatio it is outvoted during the
// exploration; beyond it, it decides only until the slower path's next
// re-timing brings the estimates close, which explores again.
func TestChooseOutvotesOneSlowCall(t *testing.T) {
	r, seed := testutil.Rand(t)
	for trial := 0; trial < 100; trial++ {
		l := &MLP{blas: &cublas.Handle{}, Measure: true}
		m := gemvMaxRows + 1 + r.IntN(1<<16)
		sparseMS := 0.1 + r.Float64()
		denseMS := sparseMS * (0.85 + 0.1*r.Float64()) // dense 5-15% faster
		slowBy := 1.1 + 1.2*r.Float64()                // its first kept timing this much slower
		var got []mlp.Path
		for call := 1; call <= 3*reprobeEvery; call++ {
			p, timed := l.choose(m, mlp.Sparse)
			got = append(got, p)
			if timed {
				ms := sparseMS
				if p == mlp.Dense {
					ms = denseMS
					if l.bucket(l.bucketOf(m)).n[mlp.Dense] == 1 { // the first kept timing
						ms *= slowBy
					}
				}
				l.record(p, l.bucketOf(m), m, ms*float64(m))
			}
		}
		// By the third round of re-probes dense runs, but for sparse's re-probes.
		tail := got[2*reprobeEvery:]
		for i, p := range tail {
			call := 2*reprobeEvery + i + 1
			if p == mlp.Sparse && call%reprobeEvery != 0 {
				t.Fatalf("seed %d: sparse %.4f, dense %.4f ms/token, dense's first kept timing %.2fx slow: call %d ran sparse (calls %v)",
					seed, sparseMS, denseMS, slowBy, call, got)
			}
		}
		if slowBy*denseMS < farRatio*sparseMS {
			// within farRatio the exploration outvotes it: dense from call 9 on
			for call := 2 + 2*keptWindow + 1; call < reprobeEvery; call++ {
				if got[call-1] != mlp.Dense {
					t.Fatalf("seed %d: sparse %.4f, dense %.4f, first kept dense %.2fx slow: call %d ran %v (calls %v)",
						seed, sparseMS, denseMS, slowBy, call, got[call-1], got)
				}
			}
		}
	}
}

// TestBucketEstimate: a path's estimate is the median of its last
// keptWindow kept timings (the first timing dropped), and reading it
// allocates nothing (choose runs on every Forward call).
func TestBucketEstimate(t *testing.T) {
	r, seed := testutil.Rand(t)
	for trial := 0; trial < 200; trial++ {
		l := &MLP{}
		m := 1 + r.IntN(4096)
		b := l.bucketOf(m)
		var kept []float64
		for n := 0; n < 1+r.IntN(10); n++ {
			ms := 0.01 + r.Float64()
			l.record(mlp.Dense, b, m, ms*float64(m))
			if n > 0 {
				kept = append(kept, ms)
			}
		}
		bt := l.bucket(b)
		if len(kept) == 0 {
			if k := bt.keptOf(mlp.Dense); k != 0 {
				t.Fatalf("seed %d: one timing recorded, %d kept", seed, k)
			}
			continue
		}
		last := append([]float64(nil), kept[max(0, len(kept)-keptWindow):]...)
		slices.Sort(last)
		want := last[len(last)/2]
		if len(last)%2 == 0 {
			want = (last[len(last)/2-1] + last[len(last)/2]) / 2
		}
		if got := bt.estimate(mlp.Dense); math.Abs(got-want) > 1e-12*want {
			t.Fatalf("seed %d: kept %v: estimate %g, want the median of the last %d, %g", seed, kept, got, keptWindow, want)
		}
	}
	bt := &bucketTimes{}
	for i := range 5 {
		bt.n[mlp.Sparse], bt.n[mlp.Dense] = i, i
		bt.kept[mlp.Sparse][i%keptWindow], bt.kept[mlp.Dense][i%keptWindow] = 1+r.Float64(), 1+r.Float64()
	}
	if a := testing.AllocsPerRun(100, func() { bt.decided() }); a != 0 {
		t.Errorf("decided allocates %.0f times a call", a)
	}
}

// TestGatheredRows checks how many flagged rows the gathered dense pass is
// sized for: 64 before any report, none after a clean call, 1.5x the last
// rate plus 16 otherwise, in multiples of 16, never above m rounded up or
// maxGatheredRows, and none without cuBLAS.
func TestGatheredRows(t *testing.T) {
	r, seed := testutil.Rand(t)
	for trial := 0; trial < 200; trial++ {
		l := &MLP{blas: &cublas.Handle{}}
		m := 1 + r.IntN(1<<17)
		n := l.gatheredRows(m)
		if want := (min(64, m) + 15) / 16 * 16; n != want {
			t.Fatalf("seed %d: m=%d, no report yet: %d rows, want %d", seed, m, n, want)
		}
		l.flagKnown = true
		if n := l.gatheredRows(m); n != 0 {
			t.Fatalf("seed %d: m=%d after a call without flagged rows: %d rows, want 0", seed, m, n)
		}
		l.flagRate = r.Float64() * 0.3
		n = l.gatheredRows(m)
		need := int(1.5*l.flagRate*float64(m)) + 16
		switch {
		case n%16 != 0:
			t.Fatalf("seed %d: %d rows, not a multiple of 16", seed, n)
		case n > (min(m, maxGatheredRows)+15)/16*16:
			t.Fatalf("seed %d: m=%d: %d rows, over min(m, %d)", seed, m, n, maxGatheredRows)
		case n < min(need, m, maxGatheredRows):
			t.Fatalf("seed %d: m=%d rate %.3f: %d rows, under the %d needed", seed, m, l.flagRate, n, min(need, m, maxGatheredRows))
		}
	}
	if n := (&MLP{}).gatheredRows(100); n != 0 {
		t.Errorf("without cuBLAS: %d gathered rows, want 0", n)
	}
}

// TestUseSplit checks the tail choice: forced by Tail, else split once the
// batch holds at least 4F active pairs (1 per token until measured).
func TestUseSplit(t *testing.T) {
	l := &MLP{F: 5632}
	for _, c := range []struct {
		tail  Tail
		m     int
		known bool
		nnz   float64
		want  bool
	}{
		{TailWarp, 1 << 16, true, 28, false},
		{TailSorted, 1, false, 0, true},
		{TailAuto, 4*5632 - 1, false, 0, false},
		{TailAuto, 4 * 5632, false, 0, true},
		{TailAuto, 4096, true, 28, true},
		{TailAuto, 64, true, 28, false},
		{TailAuto, 1024, true, 0.5, false},
	} {
		l.Tail, l.lastKnown, l.lastNNZ = c.tail, c.known, c.nnz
		if got := l.useSplit(c.m); got != c.want {
			t.Errorf("tail %v, m=%d, measured %v (%g per token): split %v, want %v", c.tail, c.m, c.known, c.nnz, got, c.want)
		}
	}
}

// TestSettled checks when the automatic path's choice counts as settled
// for recording into a graph: not before the density is known, and with
// Measure not before the timings decide (exploreCalls); then the faster
// path, or dense whenever the density rule says so.
func TestSettled(t *testing.T) {
	r, seed := testutil.Rand(t)
	for trial := 0; trial < 50; trial++ {
		l := &MLP{blas: &cublas.Handle{}, Measure: true}
		m := gemvMaxRows + 1 + r.IntN(1<<16)
		if _, ok := l.Settled(m); ok {
			t.Fatalf("seed %d: settled before any density came back", seed)
		}
		l.lastKnown, l.next = true, mlp.Sparse
		sparseMS, denseMS := 0.1+r.Float64(), 0.1+r.Float64()
		cost := map[mlp.Path]float64{mlp.Sparse: sparseMS, mlp.Dense: denseMS}
		explore := exploreCalls(sparseMS, denseMS)
		for call := 1; call <= explore; call++ {
			if _, ok := l.Settled(m); ok {
				t.Fatalf("seed %d: sparse %.4f, dense %.4f ms/token: settled after %d of %d timed calls", seed, sparseMS, denseMS, call-1, explore)
			}
			p, timed := l.choose(m, mlp.Sparse)
			if !timed {
				t.Fatalf("seed %d: call %d not timed", seed, call)
			}
			l.record(p, l.bucketOf(m), m, cost[p]*float64(m))
		}
		want := mlp.Sparse
		if denseMS < sparseMS {
			want = mlp.Dense
		}
		if p, ok := l.Settled(m); !ok || p != want {
			t.Errorf("seed %d: sparse %.3f, dense %.3f ms/token: Settled = %v, %v; want %v, true", seed, sparseMS, denseMS, p, ok, want)
		}
		if _, ok := l.Settled(4 * m); ok {
			t.Errorf("seed %d: an untimed bucket counts as settled", seed)
		}
		l.next = mlp.Dense
		if p, ok := l.Settled(4 * m); !ok || p != mlp.Dense {
			t.Errorf("seed %d: density rule dense: Settled = %v, %v", seed, p, ok)
		}
		// Small batches ignore the density rule: their timings decide.
		small := 1 + r.IntN(gemvMaxRows)
		if p, timed := l.choose(small, mlp.Dense); p != mlp.Sparse || !timed {
			t.Errorf("seed %d: density rule dense, %d tokens: choose = %v, %v; want sparse, timed", seed, small, p, timed)
		}
		if _, ok := l.Settled(small); ok {
			t.Errorf("seed %d: density rule dense, %d tokens: settled before any timing", seed, small)
		}
		l.next, l.Measure = mlp.Sparse, false
		if p, ok := l.Settled(4 * m); !ok || p != mlp.Sparse {
			t.Errorf("seed %d: without Measure: Settled = %v, %v; want sparse, true", seed, p, ok)
		}
	}
}

// TestDenseAboveBand: with Measure the density rule leaves densities up to
// measuredBand times DenseAbove to the timings; without it DenseAbove
// alone decides.
func TestDenseAboveBand(t *testing.T) {
	r, seed := testutil.Rand(t)
	for trial := 0; trial < 100; trial++ {
		above := 0.001 + 0.05*r.Float64()
		density := above * (0.1 + 4*r.Float64())
		l := &MLP{DenseAbove: above}
		want := mlp.Sparse
		if density > above {
			want = mlp.Dense
		}
		if got := mlp.Choose(mlp.Auto, density, l.denseAbove()); got != want {
			t.Errorf("seed %d: density %.4f, DenseAbove %.4f, no Measure: %v, want %v", seed, density, above, got, want)
		}
		l.Measure = true
		want = mlp.Sparse
		if density > measuredBand*above {
			want = mlp.Dense
		}
		if got := mlp.Choose(mlp.Auto, density, l.denseAbove()); got != want {
			t.Errorf("seed %d: density %.4f, DenseAbove %.4f, Measure: %v, want %v", seed, density, above, got, want)
		}
	}
}
