package bench

import (
	"fmt"
	"time"

	"github.com/twell-ai/twell/cuda/nvml"
)

// minEnergyWindow is the shortest stretch of back-to-back work whose energy
// the benches read from NVML's counter: over half-second windows the same
// 3.8 ms MLP calls read as 576 to 714 W on an H200, over about 2 s the
// prefill passes agree to a few percent.
const minEnergyWindow = 2 * time.Second

// EnergyWindow is what NVML saw over a piece of work: the joules it used
// over its wall time and their mean power (OK: the counter was read), the
// median SM clock sampled every 10 ms, and the share of those samples in
// which the power cap held the clocks down (nil where not readable). Note
// says why the counter was not read, where it was not.
type EnergyWindow struct {
	OK                     bool
	Joules, Seconds, Watts float64
	SMClockMHz             int
	PowerCapped            *float64
	Note                   string
}

// MeasureEnergy runs work under meter's energy counter and clock sampling.
// Without a counter to start it runs nothing and returns a window that is
// not OK; the error is work's.
func MeasureEnergy(meter *nvml.Device, work func() error) (EnergyWindow, error) {
	mt, err := meter.StartMeter()
	if err != nil {
		return EnergyWindow{Note: err.Error()}, nil
	}
	stop := meter.Sample(10 * time.Millisecond)
	err = work()
	smp := stop()
	if err != nil {
		return EnergyWindow{}, err
	}
	w := EnergyWindow{SMClockMHz: smp.MedianSMClock}
	if smp.PowerCapped >= 0 {
		w.PowerCapped = &smp.PowerCapped
	}
	j, el, err := mt.Stop()
	if err != nil {
		w.Note = fmt.Sprintf("energy counter: %v (%.3f J)", err, j)
		return w, nil
	}
	w.OK, w.Joules, w.Seconds, w.Watts = true, j, el.Seconds(), j/el.Seconds()
	return w, nil
}

// energyPerToken runs run(0), run(1), ... back to back, at least reps times
// and for at least minEnergyWindow by its time of ms a call, then sync, all
// under meter, and returns millijoules per token (tokens a call) with the
// window; 0 and a window that is not ok when the counter cannot be read.
func energyPerToken(meter *nvml.Device, sync func() error, run func(i int) error, ms float64, reps, tokens int) (float64, EnergyWindow, error) {
	n := max(reps, int(float64(minEnergyWindow.Milliseconds())/max(ms, 1e-3))+1)
	if err := sync(); err != nil {
		return 0, EnergyWindow{}, err
	}
	w, err := MeasureEnergy(meter, func() error {
		for i := range n {
			if err := run(i); err != nil {
				return err
			}
		}
		return sync()
	})
	if err != nil || !w.OK {
		return 0, w, err
	}
	return 1000 * w.Joules / float64(n*tokens), w, nil
}
