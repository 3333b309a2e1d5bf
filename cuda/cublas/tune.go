package cublas

import (
	"fmt"
	"slices"
	"time"

	"github.com/twell-ai/twell/cuda"
)

// maxCandidates is how many algorithms a plan asks cuBLASLt's heuristic for.
const maxCandidates = 8

// tuneRounds is how many timed runs of each candidate a tuned choice takes
// the median of (after one untimed run each).
const tuneRounds = 3

// DefaultTuneFlops is a TuneFlops for engines: products of at least 2^34
// flops (a 2048-token pass through a 2048 x 2048 projection and up), where
// a choice that takes tens of milliseconds once is paid back.
const DefaultTuneFlops = 1 << 34

// Candidate is one algorithm cuBLASLt's heuristic offers for a product, as
// timed by a tuned choice (Handle.TuneFlops).
type Candidate struct {
	Rank      int           `json:"rank"`          // place in the heuristic's order (0: its first choice)
	Time      time.Duration `json:"time_ns"`       // median GPU time of the timed runs (0 if it failed)
	Workspace uint64        `json:"workspace"`     // workspace bytes it uses
	Waves     float32       `json:"waves"`         // the heuristic's estimate of the waves it fills
	Err       string        `json:"err,omitempty"` // why it did not run, if it did not
}

// Tuning records one product's tuned choice.
type Tuning struct {
	Gemm       string      `json:"gemm"`   // the product, as errors describe it
	Chosen     int         `json:"chosen"` // rank of the algorithm kept
	Candidates []Candidate `json:"candidates"`
}

// Tunings returns the choices the handle has tuned so far, in the order
// they were made.
func (h *Handle) Tunings() []Tuning {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.tunings)
}

// choosePlan builds the plan of a product seen for the first time: the
// heuristic's first choice, or with tuning (tunes) the fastest of its
// candidates timed on this call's own buffers.
func (h *Handle) choosePlan(s *cuda.Stream, g Gemm, key planKey, a, b, c, d *cuda.Buffer) (*plan, error) {
	var p *plan
	var cands []heuristicResult
	if err := h.dev.Do(func() (err error) { p, cands, err = h.newPlan(g, key); return err }); err != nil {
		return nil, err
	}
	if len(cands) < 2 || !h.tunes(s, g, c, d) {
		return p, nil
	}
	times, err := h.timeCandidates(s, g, p, cands, a, b, c, d)
	if err != nil {
		h.dev.Do(func() error { p.destroy(h.lt); return nil })
		return nil, err
	}
	best := -1
	for i, t := range times {
		if t.Err == "" && (best < 0 || t.Time < times[best].Time) {
			best = i
		}
	}
	if best < 0 { // none ran: keep the heuristic's choice, whose call reports why
		return p, nil
	}
	p.algo, p.workspace = cands[best].algo, cands[best].workspace
	h.mu.Lock()
	h.tunings = append(h.tunings, Tuning{Gemm: g.describe(), Chosen: best, Candidates: times})
	h.mu.Unlock()
	return p, nil
}

// tunes reports whether the first call of product g, writing d from the
// addend c on stream s, chooses its algorithm by timing: TuneFlops set and
// reached, a stream that runs work now (not one capturing a graph), and an
// output that shares no memory with the addend (timing runs the product
// several times, which would add into C again each time; two views of one
// allocation count as shared).
func (h *Handle) tunes(s *cuda.Stream, g Gemm, c, d *cuda.Buffer) bool {
	if h.TuneFlops <= 0 || g.Flops() < h.TuneFlops || (g.Beta != 0 && overlap(c, d)) {
		return false
	}
	capturing, err := s.Capturing()
	return err == nil && !capturing
}

// overlap reports whether buffers x and y share device memory.
func overlap(x, y *cuda.Buffer) bool {
	return x.Ptr() < y.Ptr()+cuda.DevicePtr(y.Len()) && y.Ptr() < x.Ptr()+cuda.DevicePtr(x.Len())
}

// timeCandidates runs each candidate once, then tuneRounds times in turns
// between CUDA events on s, and returns them in the heuristic's order with
// their median times. A candidate whose call fails is kept with its error.
func (h *Handle) timeCandidates(s *cuda.Stream, g Gemm, p *plan, cands []heuristicResult, a, b, c, d *cuda.Buffer) ([]Candidate, error) {
	out := make([]Candidate, len(cands))
	for i, r := range cands {
		out[i] = Candidate{Rank: i, Workspace: r.workspace, Waves: r.waves}
	}
	run := func(i int) error {
		return h.dev.Do(func() error { return h.runLt(s, g, p, &cands[i].algo, cands[i].workspace, a, b, c, d) })
	}
	for i := range cands {
		if err := run(i); err != nil {
			out[i].Err = err.Error()
		}
	}
	type span struct{ start, end *cuda.Event }
	spans := make([][]span, len(cands))
	var last *cuda.Event
	defer func() {
		for _, ss := range spans {
			for _, sp := range ss {
				sp.start.Destroy()
				sp.end.Destroy()
			}
		}
	}()
	for range tuneRounds {
		for i := range cands {
			if out[i].Err != "" {
				continue
			}
			start, err := h.dev.NewEvent()
			if err != nil {
				return nil, err
			}
			end, err := h.dev.NewEvent()
			if err != nil {
				start.Destroy()
				return nil, err
			}
			spans[i] = append(spans[i], span{start, end})
			if err := start.Record(s); err != nil {
				return nil, err
			}
			if err := run(i); err != nil {
				out[i].Err = err.Error()
			}
			if err := end.Record(s); err != nil {
				return nil, err
			}
			last = end
		}
	}
	if last == nil {
		return out, nil
	}
	if err := last.Synchronize(); err != nil {
		return nil, fmt.Errorf("cublas: timing the algorithms of %s: %w", g.describe(), err)
	}
	for i, ss := range spans {
		if out[i].Err != "" {
			continue
		}
		ts := make([]time.Duration, len(ss))
		for j, sp := range ss {
			dt, err := sp.start.Elapsed(sp.end)
			if err != nil {
				return nil, err
			}
			ts[j] = dt
		}
		slices.Sort(ts)
		out[i].Time = ts[len(ts)/2]
	}
	return out, nil
}
