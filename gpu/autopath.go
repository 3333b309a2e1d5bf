package gpu

import (
	"encoding/binary"
	"math/bits"
	"slices"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/mlp"
)

// The automatic path (Forward under mlp.Auto) has two guides. The density
// rule (poll, through mlp.Choose): above DenseAbove (with Measure,
// measuredBand times it) the dense path runs (not
// for batches of at most gemvMaxRows tokens: their kernels read every gate
// row once whatever the density, so there the timings alone decide, and
// DenseAbove, a model of D2T's costs, does not apply). Below it, timings:
// Forward brackets calls with CUDA events and keeps, per batch-size bucket
// (powers of two) and path, the time per token of the last keptWindow
// timed calls; a path's estimate is their median. A path's first timing in
// a bucket is dropped (it pays for workspace allocation and first-use
// setup), so the first calls of a bucket run sparse until it has a kept
// timing, then dense until it has one. Where one path is at least
// farRatio times faster than the other (0.5% density at large batches:
// about 1.8x), that decides the bucket; where they are closer, the two
// paths take turns until each has keptWindow kept timings, so that one slow
// call cannot decide alone (a choice on one timing each kept the sparse
// path at 2% on an H100 where the dense one was 7% faster). After that the
// faster path runs, and the slower one again every reprobeEvery calls, so
// the choice follows changes in density; a re-timing that brings the
// estimates within farRatio before each path has keptWindow timings
// explores again.
//
// In the steady state the bookkeeping is thinned out, since each copy back
// and event is a stream operation that a decode step of a few tens of
// microseconds per layer notices: calls are timed while a bucket explores,
// when it re-times the slower path and every retimeEvery calls; the
// active-unit and flagged-row counts are copied back on the first
// sampleFirst calls and then every sampleEvery calls.

const (
	keptWindow   = 3   // kept timings a path's estimate is the median of
	farRatio     = 1.5 // paths closer than this need keptWindow timings each
	reprobeEvery = 32  // calls in a bucket between runs of the slower path
	retimeEvery  = 8   // calls in a bucket between timings of the faster path
	maxInflight  = 64  // timed calls whose events have not completed yet
	sampleFirst  = 8   // calls whose counts are all copied back
	sampleEvery  = 8   // later, calls between count copies
)

// sampled reports whether the n-th call (from 1) copies its counts back.
func sampled(n int) bool { return n <= sampleFirst || n%sampleEvery == 0 }

// bucketTimes are the measured costs of one batch-size bucket.
type bucketTimes struct {
	kept  [3][keptWindow]float64 // ms per token of the last kept timings, by mlp.Path (Sparse, Dense), a ring
	n     [3]int                 // timed calls, by mlp.Path (the first one dropped)
	calls int
}

// keptOf returns how many timings of path p the bucket keeps.
func (bt *bucketTimes) keptOf(p mlp.Path) int { return min(max(bt.n[p]-1, 0), keptWindow) }

// estimate returns the median of path p's kept timings (ms per token); the
// bucket must keep at least one.
func (bt *bucketTimes) estimate(p mlp.Path) float64 {
	k := bt.keptOf(p)
	v := bt.kept[p] // a copy, sorted in place
	w := v[:k]
	slices.Sort(w)
	if k%2 == 1 {
		return w[k/2]
	}
	return (w[k/2-1] + w[k/2]) / 2
}

// decided returns the bucket's faster path and the slower one, and whether
// the timings decide yet: both paths kept, and either far apart (farRatio)
// or keptWindow timings each.
func (bt *bucketTimes) decided() (fast, slow mlp.Path, ok bool) {
	ks, kd := bt.keptOf(mlp.Sparse), bt.keptOf(mlp.Dense)
	if ks == 0 || kd == 0 {
		return mlp.Sparse, mlp.Dense, false
	}
	es, ed := bt.estimate(mlp.Sparse), bt.estimate(mlp.Dense)
	fast, slow = mlp.Sparse, mlp.Dense
	if ed < es {
		fast, slow = slow, fast
	}
	far := max(es, ed) >= farRatio*min(es, ed)
	return fast, slow, far || (ks == keptWindow && kd == keptWindow)
}

// timedCall is a Forward call whose timing has not been read yet.
type timedCall struct {
	path       mlp.Path
	bucket, m  int
	start, end *cuda.Event
}

// bucketOf returns the timing bucket of a call of m tokens: powers of two.
func (l *MLP) bucketOf(m int) int { return bits.Len(uint(m)) }

// choose returns the path for a call of m tokens, and whether to time it;
// byDensity is the density rule's choice.
func (l *MLP) choose(m int, byDensity mlp.Path) (mlp.Path, bool) {
	if l.blas == nil {
		return mlp.Sparse, false
	}
	byDensity = l.densityRule(m, byDensity)
	if !l.Measure || byDensity == mlp.Dense {
		return byDensity, false
	}
	bt := l.bucket(l.bucketOf(m))
	bt.calls++
	if fast, slow, ok := bt.decided(); ok {
		if bt.calls%reprobeEvery == 0 {
			return slow, true
		}
		return fast, bt.calls%retimeEvery == 0
	}
	// Exploring: sparse until it keeps a timing, then dense until it does,
	// then the one with fewer kept timings (sparse on a tie).
	if bt.keptOf(mlp.Dense) < bt.keptOf(mlp.Sparse) {
		return mlp.Dense, true
	}
	return mlp.Sparse, true
}

// densityRule returns the density rule's path for a call of m tokens, given
// its choice for large batches (next): batches of at most gemvMaxRows tokens
// are exempt (see the top of this file).
func (l *MLP) densityRule(m int, next mlp.Path) mlp.Path {
	if m <= gemvMaxRows {
		return mlp.Sparse
	}
	return next
}

// Settled returns the path Forward runs for m tokens, and whether that
// choice is settled: at once for a fixed l.Path; under mlp.Auto once the
// measured density (or, without Measure, the density
// rule alone) has come back, and with Measure once the timings of m's
// batch-size bucket decide (see the top of this file; the faster path is
// returned, and Forward would still re-probe the other now and then). A
// CUDA graph recorded from Queue freezes the choice, so record once it is
// settled.
func (l *MLP) Settled(m int) (mlp.Path, bool) {
	l.poll()
	switch {
	case l.blas == nil || l.Path == mlp.Sparse:
		return mlp.Sparse, true
	case l.Path == mlp.Dense:
		return mlp.Dense, true
	case !l.lastKnown:
		return mlp.Sparse, false
	case !l.Measure || l.densityRule(m, l.next) == mlp.Dense:
		return l.densityRule(m, l.next), true
	}
	bt := l.times[l.bucketOf(m)]
	if bt == nil {
		return mlp.Sparse, false
	}
	fast, _, ok := bt.decided()
	if !ok {
		return mlp.Sparse, false
	}
	return fast, true
}

// bucket returns the timings of bucket b, creating them.
func (l *MLP) bucket(b int) *bucketTimes {
	if l.times == nil {
		l.times = map[int]*bucketTimes{}
	}
	bt := l.times[b]
	if bt == nil {
		bt = &bucketTimes{}
		l.times[b] = bt
	}
	return bt
}

// record adds a timing to its bucket.
func (l *MLP) record(path mlp.Path, bucket, m int, ms float64) {
	bt := l.bucket(bucket)
	if bt.n[path] > 0 { // the first is dropped
		bt.kept[path][(bt.n[path]-1)%keptWindow] = ms / float64(m)
	}
	bt.n[path]++
}

// startTiming records a start event on s for a call about to be queued, or
// returns nil when too many timings are pending.
func (l *MLP) startTiming(s *cuda.Stream) *cuda.Event {
	if len(l.inflight) >= maxInflight {
		return nil
	}
	ev := l.event()
	if ev == nil {
		return nil
	}
	if ev.Record(s) != nil {
		l.evFree = append(l.evFree, ev)
		return nil
	}
	return ev
}

// endTiming records the end event of a call started with startTiming.
func (l *MLP) endTiming(s *cuda.Stream, start *cuda.Event, path mlp.Path, m int) {
	if start == nil {
		return
	}
	end := l.event()
	if end == nil || end.Record(s) != nil {
		l.evFree = append(l.evFree, start)
		if end != nil {
			l.evFree = append(l.evFree, end)
		}
		return
	}
	l.inflight = append(l.inflight, timedCall{path: path, bucket: l.bucketOf(m), m: m, start: start, end: end})
}

// event returns a free event, or nil if none can be made.
func (l *MLP) event() *cuda.Event {
	if n := len(l.evFree); n > 0 {
		ev := l.evFree[n-1]
		l.evFree = l.evFree[:n-1]
		return ev
	}
	ev, err := l.dev.NewEvent()
	if err != nil {
		return nil
	}
	return ev
}

// pollTimes reads the timings of completed calls, in stream order.
func (l *MLP) pollTimes() {
	for len(l.inflight) > 0 {
		c := l.inflight[0]
		if done, err := c.end.Done(); err != nil || !done {
			return
		}
		l.inflight = l.inflight[1:]
		el, err := c.start.Elapsed(c.end)
		l.evFree = append(l.evFree, c.start, c.end)
		if err == nil {
			l.record(c.path, c.bucket, c.m, float64(el.Nanoseconds())/1e6)
		}
	}
}

// destroyEvents frees the timing events.
func (l *MLP) destroyEvents() error {
	var first error
	for _, c := range l.inflight {
		l.evFree = append(l.evFree, c.start, c.end)
	}
	l.inflight = nil
	for _, ev := range l.evFree {
		if err := ev.Destroy(); err != nil && first == nil {
			first = err
		}
	}
	l.evFree = nil
	return first
}

// poll reads the active-unit count of the last call if it has arrived and
// chooses the next path.
func (l *MLP) poll() {
	l.pollFlagged()
	if !l.pending {
		return
	}
	done, err := l.evt.Done()
	if err != nil || !done {
		return
	}
	l.pending = false
	n := binary.LittleEndian.Uint64(l.hostNNZ.Bytes())
	l.lastNNZ, l.lastKnown = float64(n)/float64(l.pendingM), true
	l.next = mlp.Choose(mlp.Auto, l.lastNNZ/float64(l.F), l.denseAbove())
	if l.flagKnown && l.flagRate > maxSparseFlagRate {
		l.next = mlp.Dense
	}
}

// measuredBand is how far past DenseAbove the timings, when Measure is
// on, still decide: the cost model puts the SparseLM shape's threshold at
// about 1%, but at m = 65536 and 2% uniform the sparse path ran 6.748 ms
// against dense's 6.834 (H100, one run), and at 5% 7.172 against 6.823.
// With the band the automatic path ran sparse at 2% (6.923 ms against
// dense's 6.981, H100, in the race against the reference), where the rule
// alone had run dense.
const measuredBand = 3

// denseAbove returns the density above which the density rule runs dense:
// DenseAbove, or measuredBand times it when timings decide below.
func (l *MLP) denseAbove() float64 {
	if l.Measure {
		return measuredBand * l.DenseAbove
	}
	return l.DenseAbove
}

// maxSparseFlagRate is the share of flagged rows above which the automatic
// path runs dense: each flagged row costs the sparse path a dense row on top.
const maxSparseFlagRate = 0.25

// LastActive returns the mean number of active units per token that the
// automatic path last measured, and whether it has measured any.
func (l *MLP) LastActive() (float64, bool) {
	l.poll()
	return l.lastNNZ, l.lastKnown
}
