package bench

import (
	"time"

	"github.com/twell-ai/twell/cuda/nvml"
)

// minEnergyWindow is the shortest stretch of back-to-back work whose energy
// the benches read from NVML's counter: over half-second windows the same
// 3.8 ms MLP calls read as 576 to 714 W on an H200, over about 2 s the
// prefill passes agree to a few percent.
const minEnergyWindow = 2 * time.Second

// energyWindow is what NVML saw over a piece of work: the joules it used
// over its wall time and their mean power (ok: the counter was read), the
// median SM clock sampled every 10 ms, and the share of those samples in
// which the power cap held the clocks down (nil where not readable).
type energyWindow struct {
	ok                     bool
	joules, seconds, watts float64
	clock                  int
	capped                 *float64
}

// measureEnergy runs work under meter's energy counter and clock sampling.
// Without a readable counter it runs nothing and returns a window that is
// not ok; the error is work's.
func measureEnergy(meter *nvml.Device, work func() error) (energyWindow, error) {
	mt, err := meter.StartMeter()
	if err != nil {
		return energyWindow{}, nil
	}
	stop := meter.Sample(10 * time.Millisecond)
	err = work()
	smp := stop()
	if err != nil {
		return energyWindow{}, err
	}
	w := energyWindow{clock: smp.MedianSMClock}
	if smp.PowerCapped >= 0 {
		w.capped = &smp.PowerCapped
	}
	if j, el, err := mt.Stop(); err == nil {
		w.ok, w.joules, w.seconds, w.watts = true, j, el.Seconds(), j/el.Seconds()
	}
	return w, nil
}

// energyPerToken runs run(0), run(1), ... back to back, at least reps times
// and for at least minEnergyWindow by its time of ms a call, then sync, all
// under meter, and returns millijoules per token (tokens a call) with the
// window; 0 and a window that is not ok when the counter cannot be read.
func energyPerToken(meter *nvml.Device, sync func() error, run func(i int) error, ms float64, reps, tokens int) (float64, energyWindow, error) {
	n := max(reps, int(float64(minEnergyWindow.Milliseconds())/max(ms, 1e-3))+1)
	if err := sync(); err != nil {
		return 0, energyWindow{}, err
	}
	w, err := measureEnergy(meter, func() error {
		for i := range n {
			if err := run(i); err != nil {
				return err
			}
		}
		return sync()
	})
	if err != nil || !w.ok {
		return 0, w, err
	}
	return 1000 * w.joules / float64(n*tokens), w, nil
}
