package llm

import (
	"errors"

	"github.com/twell-ai/twell/cuda"
)

// stepProfile times the steps of a forward pass (Engine.Profile): a CUDA
// event is recorded on the engine's stream after each step, and the time
// between consecutive events is credited to the step that ended.
type stepProfile struct {
	pool  []*cuda.Event // every event made so far, reused by later passes
	used  int           // events recorded in this pass
	steps []string      // steps[i] ended at pool[i] (steps[0]: the start)
	err   error         // the first failure; the pass then reports nothing
}

// begin starts a pass: it records the start event.
func (p *stepProfile) begin(dev *cuda.Device, s *cuda.Stream) {
	p.used, p.steps, p.err = 0, p.steps[:0], nil
	p.mark(dev, s, "")
}

// mark records the end of step on s.
func (p *stepProfile) mark(dev *cuda.Device, s *cuda.Stream, step string) {
	if p.err != nil {
		return
	}
	if p.used == len(p.pool) {
		ev, err := dev.NewEvent()
		if err != nil {
			p.err = err
			return
		}
		p.pool = append(p.pool, ev)
	}
	if err := p.pool[p.used].Record(s); err != nil {
		p.err = err
		return
	}
	p.used++
	p.steps = append(p.steps, step)
}

// collect returns the milliseconds per step, summed over the pass (the
// stream must have completed it).
func (p *stepProfile) collect() (map[string]float64, error) {
	if p.err != nil {
		return nil, p.err
	}
	ms := map[string]float64{}
	for i := 1; i < p.used; i++ {
		d, err := p.pool[i-1].Elapsed(p.pool[i])
		if err != nil {
			return nil, err
		}
		ms[p.steps[i]] += float64(d.Nanoseconds()) / 1e6
	}
	return ms, nil
}

// close destroys the events.
func (p *stepProfile) close() error {
	var errs []error
	for _, ev := range p.pool {
		errs = append(errs, ev.Destroy())
	}
	p.pool = nil
	return errors.Join(errs...)
}
