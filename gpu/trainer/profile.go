package trainer

import (
	"errors"
	"time"

	"github.com/twell-ai/twell/cuda"
)

// StageTime is the GPU time that the stages of one name took over the
// steps profiled since the last StageTimes call.
type StageTime struct {
	Name  string  `json:"name"`
	MS    float64 `json:"ms"`    // summed over every run of the stage
	Count int     `json:"count"` // runs of the stage (per layer and micro-batch)
}

// stageClock marks the start of each stage of a step with a CUDA event on
// the backend's stream; the time from one mark to the next is the named
// stage's. Events come from a pool that grows to the marks of a step.
type stageClock struct {
	events []*cuda.Event
	names  []string // names[i]: the stage that starts at events[i]
	n      int      // marks since the last collect
}

// Profile turns the stage clock on or off. While on, every stage of a step
// (per layer: norms, projections, RoPE, attention, MLP; the LM head and
// cross-entropy, the embedding, the statistics, clipping and AdamW) is
// bracketed by events; StageTimes sums them. Off (the default), no event is
// recorded.
func (b *Backend) Profile(on bool) error {
	if on {
		if b.prof == nil {
			b.prof = &stageClock{}
		}
		return nil
	}
	err := b.prof.free() // a destroyed event's pending record still completes
	b.prof = nil
	return err
}

// at returns a step of inOrder that marks the start of stage name (with
// profiling off, a shared no-op: the step allocates nothing for it).
func (b *Backend) at(name string) func() error {
	if b.prof == nil {
		return noMark
	}
	return func() error { return b.mark(name) }
}

func noMark() error { return nil }

// runMarked queues steps in order like runSteps; with profiling on, each
// step is a stage of its own, "prefix: step name", so that a profile of the
// whole training step shows the MLP's kernels one by one.
func (b *Backend) runMarked(prefix string, steps []mlpStep) error {
	if b.prof == nil {
		return runSteps(steps, nil)
	}
	return runSteps(steps, func(name string) error { return b.mark(prefix + ": " + name) })
}

// mark records the start of stage name (nothing when profiling is off).
func (b *Backend) mark(name string) error {
	p := b.prof
	if p == nil {
		return nil
	}
	if p.n == len(p.events) {
		e, err := b.dev.NewEvent()
		if err != nil {
			return err
		}
		p.events, p.names = append(p.events, e), append(p.names, "")
	}
	if err := p.events[p.n].Record(b.s); err != nil {
		return err
	}
	p.names[p.n] = name
	p.n++
	return nil
}

// StageTimes waits for the device and returns the time of each stage
// marked since the last call, in the order the names first appeared (nil
// when profiling is off). Call it right after a step, so that the last
// stage ends where the step's work ends. A wait for the host inside a step
// (the statistics and the gradient norm are read back) counts in a stage
// of its own, "host wait".
func (b *Backend) StageTimes() ([]StageTime, error) {
	p := b.prof
	if p == nil {
		return nil, nil
	}
	if err := b.mark("end"); err != nil {
		return nil, err
	}
	if err := p.events[p.n-1].Synchronize(); err != nil {
		return nil, err
	}
	var out []StageTime
	at := map[string]int{}
	for i := 0; i+1 < p.n; i++ {
		d, err := p.events[i].Elapsed(p.events[i+1])
		if err != nil {
			return nil, err
		}
		j, ok := at[p.names[i]]
		if !ok {
			j = len(out)
			at[p.names[i]] = j
			out = append(out, StageTime{Name: p.names[i]})
		}
		out[j].MS += float64(d) / float64(time.Millisecond)
		out[j].Count++
	}
	p.n = 0
	return out, nil
}

// free destroys the pool's events.
func (p *stageClock) free() error {
	if p == nil {
		return nil
	}
	var errs []error
	for _, e := range p.events {
		errs = append(errs, e.Destroy())
	}
	p.events, p.names, p.n = nil, nil, 0
	return errors.Join(errs...)
}
