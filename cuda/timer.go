package cuda

import (
	"errors"
	"time"
)

// Timer times work queued on a stream between two events: the one helper
// the benchmarks share for CUDA event timing.
type Timer struct {
	start, end *Event
}

// NewTimer creates a timer's two events on dev.
func (dev *Device) NewTimer() (*Timer, error) {
	start, err := dev.NewEvent()
	if err != nil {
		return nil, err
	}
	end, err := dev.NewEvent()
	if err != nil {
		start.Destroy()
		return nil, err
	}
	return &Timer{start: start, end: end}, nil
}

// Time records the start event on s (nil: the default stream), calls queue
// (which queues work on s), records the end event, waits for it and
// returns the GPU time between the two events.
func (t *Timer) Time(s *Stream, queue func() error) (time.Duration, error) {
	if err := t.start.Record(s); err != nil {
		return 0, err
	}
	if err := queue(); err != nil {
		return 0, err
	}
	if err := t.end.Record(s); err != nil {
		return 0, err
	}
	if err := t.end.Synchronize(); err != nil {
		return 0, err
	}
	return t.start.Elapsed(t.end)
}

// TimeMS is Time in milliseconds.
func (t *Timer) TimeMS(s *Stream, queue func() error) (float64, error) {
	d, err := t.Time(s, queue)
	return float64(d.Nanoseconds()) / 1e6, err
}

// Destroy frees the timer's events.
func (t *Timer) Destroy() error {
	return errors.Join(t.start.Destroy(), t.end.Destroy())
}
