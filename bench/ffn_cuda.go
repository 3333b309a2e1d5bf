package bench

import (
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/cuda/cupti"
	"github.com/twell-ai/twell/cuda/nvml"
	"github.com/twell-ai/twell/gpu"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/synth"
)

// FFNCUDA runs the MLP-block benchmark on CUDA device 0. In the same run and
// on the same bf16 weights it times the dense MLP (cuBLASLt: three GEMMs and
// one elementwise kernel), the TwELL MLP (the sparse path: see
// gpu.MLP.KernelsFor),
// the automatic path (MLP.Forward) and the D2T kernel alone, each with CUDA
// events around every repetition, the paths taking turns and L2 flushed before
// each: the median of o.Reps after 3 warm-up calls, rotating among enough
// input batches that they do not fit in L2. Each path's output is checked
// against the float64 reference computed on the bf16 model (weights and inputs
// rounded to bf16 once, as the GPU holds them), so the error measures the
// kernels' arithmetic; energy per token comes from NVML's energy counter over
// back-to-back calls. With o.Variants the TwELL MLP is timed once per
// variant, in the same turns, and each density gives a row per variant.
func FFNCUDA(o FFNOptions, progress func(string)) ([]FFNResult, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if o.RefRows == 0 {
		o.RefRows = 16
	}
	if err := o.checkDumpDir(); err != nil {
		return nil, err
	}
	if o.TraceSteps > 0 {
		if err := cupti.Available(); err != nil {
			return nil, fmt.Errorf("kernel traces: %w", err)
		}
	}
	kernOpts, err := gpu.OptionsFromEnv()
	if err != nil {
		return nil, err
	}
	variants := []ffnVariant{{opts: kernOpts}}
	if len(o.Variants) > 0 {
		variants = variants[:0]
		for _, v := range o.Variants {
			vo, err := variantOptions(v)
			if err != nil {
				return nil, err
			}
			variants = append(variants, ffnVariant{switches: v, opts: vo})
		}
	}
	say := sayer(progress)
	dev, meter, err := openGPU(say)
	if err != nil {
		return nil, err
	}
	blas, err := cublas.New(dev)
	if err != nil {
		return nil, err
	}
	defer blas.Close()
	props := dev.Properties()

	r := rand.New(rand.NewPCG(o.Seed, 0x7e11))
	xBytes := 2 * o.M * o.D
	nbuf := min(max(2, (3*props.L2Bytes+xBytes-1)/xBytes), 8)
	say("uploading %d input batches of %d x %d", nbuf, o.M, o.D)
	x0 := roundBF16(synth.Tokens(r, o.M, o.D))
	xs := make([]*cuda.Buffer, nbuf)
	for i := range xs {
		x := x0
		if i > 0 {
			x = synth.Tokens(r, o.M, o.D)
		}
		if xs[i], err = gpu.Upload(dev, x); err != nil {
			return nil, err
		}
		defer xs[i].Free()
	}
	y, err := dev.Alloc(xBytes)
	if err != nil {
		return nil, err
	}
	defer y.Free()
	gt, err := newGPUTiming(dev)
	if err != nil {
		return nil, err
	}
	defer gt.close()
	flush, timer := gt.flush, gt.timer
	refRows := synth.SampleRows(r, o.M, o.RefRows)
	if o.DumpDir != "" {
		say("writing the inputs to %s", o.DumpDir)
		if err := dumpFFNInputs(o, x0, refRows); err != nil {
			return nil, err
		}
	}

	// timeMS returns, for each of runs, the median event-timed milliseconds
	// over o.Reps repetitions after 3 warm-up calls, rotating the input
	// batches. The runs take turns, one repetition each, so that every path
	// sees the same clocks and temperature (timed one after the other, a
	// path timed after a hot one ran up to 2% slower).
	timeMS := func(runs ...func(x *cuda.Buffer) error) ([]float64, error) {
		for _, run := range runs {
			for i := 0; i < 3; i++ {
				if err := run(xs[i%nbuf]); err != nil {
					return nil, err
				}
			}
		}
		ts := make([][]float64, len(runs))
		for i := range ts {
			ts[i] = make([]float64, o.Reps)
		}
		for i := 0; i < o.Reps; i++ {
			for j, run := range runs {
				if err := dev.Memset8(flush, byte(i+j), nil); err != nil {
					return nil, err
				}
				x := xs[i%nbuf]
				if ts[j][i], err = timer.TimeMS(nil, func() error { return run(x) }); err != nil {
					return nil, err
				}
			}
		}
		med := make([]float64, len(runs))
		for j := range ts {
			med[j] = Median(ts[j])
		}
		return med, nil
	}
	// energy returns millijoules per token over back-to-back calls lasting
	// at least minEnergyWindow, and the window's power and clocks (zero
	// without NVML).
	energy := func(run func(x *cuda.Buffer) error, ms float64) (float64, EnergyWindow, error) {
		if meter == nil || ms <= 0 {
			return 0, EnergyWindow{}, nil
		}
		return energyPerToken(meter, dev.Synchronize, func(i int) error { return run(xs[i%nbuf]) }, ms, o.Reps, o.M)
	}
	// check runs once on batch 0 and returns the rel err of the ref rows.
	check := func(run func(x *cuda.Buffer) error, want [][]float64) (float64, error) {
		if err := dev.Memset8(y, 0xff, nil); err != nil {
			return 0, err
		}
		if err := run(xs[0]); err != nil {
			return 0, err
		}
		if err := dev.Synchronize(); err != nil {
			return 0, err
		}
		got := make([]float32, len(refRows)*o.D) // the reference rows only, in order
		idx := make([]int, len(refRows))
		for i, row := range refRows {
			idx[i] = i
			b, err := y.Slice(2*row*o.D, 2*o.D)
			if err != nil {
				return 0, err
			}
			v, err := gpu.Download(dev, b, o.D)
			if err != nil {
				return 0, err
			}
			copy(got[i*o.D:], v)
		}
		return synth.RelErr(got, o.D, idx, want), nil
	}

	// trace records o.TraceSteps calls of run, each after the L2 flush.
	trace := func(label string, run func(x *cuda.Buffer) error) (TraceSummary, TraceSection, error) {
		i := 0
		return traceSteps(label, o.TraceSteps, nil, func() error {
			if err := dev.Memset8(flush, byte(i), nil); err != nil {
				return err
			}
			err := run(xs[i%nbuf])
			i++
			return errors.Join(err, dev.Synchronize())
		})
	}

	var out []FFNResult
	for _, density := range o.Densities {
		say("density %g: building weights", density)
		sl, err := synth.NewLayer(r, o.D, o.F, density, o.Dist, o.Gated)
		if err != nil {
			return nil, err
		}
		// The GPU model is bf16: round the weights once, so that the float64
		// reference computes the same model the kernels hold.
		for _, w := range [][]float32{sl.Gate, sl.Up, sl.Down} {
			roundBF16(w)
		}
		if o.DumpDir != "" {
			if err := dumpFFNLayer(o, density, sl); err != nil {
				return nil, err
			}
		}
		l, err := gpu.NewMLP(dev, blas, sl.Gate, sl.Up, sl.Down, o.D, o.F, o.Layout)
		if err != nil {
			return nil, err
		}
		l.Apply(kernOpts)
		env := ffnEnv{dev: dev, meter: meter, x0: x0, x: xs[0], y: y, refRows: refRows, base: kernOpts, variants: variants,
			timeMS: timeMS, energy: energy, check: check, trace: trace, say: say}
		if env.hot, env.cal, err = hotMLP(o, sl, blas, env); err != nil {
			l.Close()
			return nil, err
		}
		rows, err := ffnCase(o, density, l, sl, env)
		l.Close()
		if env.hot != nil {
			env.hot.Close()
		}
		if err != nil {
			return nil, err
		}
		for _, res := range rows {
			res.Machine = fmt.Sprintf("%s, %d SMs, %d MiB L2", props.Name, props.SMs, props.L2Bytes>>20)
			res.InputBuffers = nbuf
			out = append(out, res)
		}
	}
	return out, nil
}

// autoSummary returns the path most of the automatic path's calls ran, and
// the calls by path when both ran.
func autoSummary(calls map[mlp.Path]int) (string, map[string]int) {
	most := mlp.Sparse
	if calls[mlp.Dense] > calls[mlp.Sparse] {
		most = mlp.Dense
	}
	if calls[mlp.Sparse] == 0 || calls[mlp.Dense] == 0 {
		return most.String(), nil
	}
	return most.String(), map[string]int{mlp.Sparse.String(): calls[mlp.Sparse], mlp.Dense.String(): calls[mlp.Dense]}
}

// autoDesc names the path the automatic path ran: "sparse", or with both,
// e.g. "dense; sparse in 3 of 33 calls".
func (r FFNResult) autoDesc() string {
	if len(r.AutoCalls) == 0 {
		return r.AutoPath
	}
	other, n := mlp.Sparse.String(), 0
	if r.AutoPath == other {
		other = mlp.Dense.String()
	}
	for _, c := range r.AutoCalls {
		n += c
	}
	return fmt.Sprintf("%s; %s in %d of %d calls", r.AutoPath, other, r.AutoCalls[other], n)
}

// powerSummary describes r's energy windows: "power dense / TwELL / auto:
// 672 / 701 / 699 W, SM clock 1500 / 1710 / 1695 of 1980 MHz, power cap in
// 100 / 100 / 100% of samples", or "" without power figures.
func (r FFNResult) powerSummary() string {
	if r.DenseWatts == 0 && r.TwELLWatts == 0 && r.AutoWatts == 0 && r.D2TWatts == 0 {
		return ""
	}
	s := fmt.Sprintf("power dense / TwELL / auto: %.0f / %.0f / %.0f W", r.DenseWatts, r.TwELLWatts, r.AutoWatts)
	if r.PowerLimitWatts > 0 {
		s += fmt.Sprintf(" (limit %.0f W)", r.PowerLimitWatts)
	}
	s += fmt.Sprintf(", SM clock %d / %d / %d", r.DenseSMClockMHz, r.TwELLSMClockMHz, r.AutoSMClockMHz)
	if r.MaxSMClockMHz > 0 {
		s += fmt.Sprintf(" of %d", r.MaxSMClockMHz)
	}
	s += " MHz"
	share := func(p *float64) string {
		if p == nil {
			return "-"
		}
		return fmt.Sprintf("%.0f", 100**p)
	}
	if r.DensePowerCapped != nil || r.TwELLPowerCapped != nil || r.AutoPowerCapped != nil {
		s += fmt.Sprintf(", power cap in %s / %s / %s%% of samples", share(r.DensePowerCapped), share(r.TwELLPowerCapped), share(r.AutoPowerCapped))
	}
	if r.D2TWatts > 0 {
		s += fmt.Sprintf("; D2T alone %.0f W at %d MHz, power cap in %s%% of samples", r.D2TWatts, r.D2TSMClockMHz, share(r.D2TPowerCapped))
	}
	return s
}

// ffnVariant is one setting of the MLP's switches the TwELL path is timed
// with: the values it sets over the environment's (none: the environment's
// own) and the options they make.
type ffnVariant struct {
	switches map[string]string
	opts     gpu.Options
}

// ffnEnv is what one benchmark case needs from FFNCUDA.
type ffnEnv struct {
	dev      *cuda.Device
	meter    *nvml.Device     // nil: no energy figures
	hot      *gpu.MLP         // a second copy of the layer, calibrated, for the settings without Options.NoHotUnits (nil: none)
	cal      *gpu.Calibration // what its calibration chose
	x0       []float32        // host copy of input batch 0
	x, y     *cuda.Buffer     // input batch 0 and the output every path writes
	refRows  []int
	base     gpu.Options  // the environment's settings: dense and auto run with them
	variants []ffnVariant // the TwELL path's settings, a result row each
	timeMS   func(...func(*cuda.Buffer) error) ([]float64, error)
	energy   func(func(*cuda.Buffer) error, float64) (float64, EnergyWindow, error)
	check    func(func(*cuda.Buffer) error, [][]float64) (float64, error)
	trace    func(string, func(*cuda.Buffer) error) (TraceSummary, TraceSection, error)
	say      func(string, ...any)
}

// ffnCase times and checks one density: the dense path, the TwELL path
// and D2T alone once per variant, and the automatic path, in turns; it
// returns a row per variant.
func ffnCase(o FFNOptions, density float64, l *gpu.MLP, sl *synth.Layer, e ffnEnv) ([]FFNResult, error) {
	l.Apply(e.base)
	res := FFNResult{Row: newRow(FFNSchema, "cuda", ""),
		D: o.D, F: o.F, M: o.M, Density: density, Dist: string(o.Dist), Gated: o.Gated,
		C: o.Layout.C, Reps: o.Reps,
		DenseActBytes: l.DenseActBytes(o.M),
	}
	kern, kerr := l.D2TKernel()
	res.D2TKernel = kern.String()
	if kerr != nil {
		e.say("density %g: D2T kernel %v (%v)", density, kern, kerr)
	}
	want := make([][]float64, len(e.refRows))
	for i, row := range e.refRows {
		want[i], _ = sl.Reference(e.x0[row*o.D : (row+1)*o.D])
	}
	yb := e.y
	var err error
	// Every run sets the options it is timed with: the variants' TwELL
	// runs take turns with the others. Settings with hot units run on the
	// calibrated copy of the layer (its units reordered), the others on l.
	pick := func(opts gpu.Options) *gpu.MLP {
		if !opts.NoHotUnits && e.hot != nil {
			return e.hot
		}
		return l
	}
	dense := func(x *cuda.Buffer) error { l.Apply(e.base); return l.Dense(nil, yb, x, o.M) }
	sparse := make([]func(*cuda.Buffer) error, len(e.variants))
	for i, v := range e.variants {
		lv := pick(v.opts)
		sparse[i] = func(x *cuda.Buffer) error { lv.Apply(v.opts); return lv.Sparse(nil, yb, x, o.M) }
	}
	autoCalls := map[mlp.Path]int{}
	la := pick(e.base)
	auto := func(x *cuda.Buffer) error {
		la.Apply(e.base)
		p, err := la.Forward(nil, yb, x, o.M)
		autoCalls[p]++
		return err
	}
	// D2T alone under each setting: a variant may change the D2T kernel.
	d2t := make([]func(*cuda.Buffer) error, len(e.variants))
	for i, v := range e.variants {
		lv := pick(v.opts)
		d2t[i] = func(x *cuda.Buffer) error { lv.Apply(v.opts); return lv.QueueD2T(nil, x, o.M) }
	}

	// The dense MLP with the gate and up products in D2T, where the
	// device has the wgmma kernel.
	var denseD2T func(*cuda.Buffer) error
	if l.CanDenseInD2T() {
		denseD2T = func(x *cuda.Buffer) error { l.Apply(e.base); return l.DenseInD2T(nil, yb, x, o.M) }
	}

	e.say("density %g: timing dense (cuBLASLt), TwELL and D2T alone (%d settings), the automatic path and the dense MLP in D2T (%v), in turns", density, len(sparse), denseD2T != nil)
	runs := append(append(append([]func(*cuda.Buffer) error{dense}, sparse...), d2t...), auto)
	if denseD2T != nil {
		runs = append(runs, denseD2T)
	}
	ms, err := e.timeMS(runs...)
	if err != nil {
		return nil, fmt.Errorf("timing: %w", err)
	}
	k := len(sparse)
	res.DenseMS, res.AutoMS = ms[0], ms[2*k+1]
	if denseD2T != nil {
		res.DenseD2TMS = ms[2*k+2]
		if res.DenseD2TRelErr, err = e.check(denseD2T, want); err != nil {
			return nil, err
		}
		e.say("density %g: dense in D2T %.3f ms (%.2fx dense), rel err %.1e", density, res.DenseD2TMS, res.DenseMS/res.DenseD2TMS, res.DenseD2TRelErr)
	}
	res.AutoPath, res.AutoCalls = autoSummary(autoCalls)
	res.AutoSpeedup = res.DenseMS / res.AutoMS

	checkPath := func(run func(*cuda.Buffer) error) (float64, error) { return e.check(run, want) }
	if res.DenseRelErr, err = checkPath(dense); err != nil {
		return nil, err
	}
	if res.AutoRelErr, err = checkPath(auto); err != nil {
		return nil, err
	}

	p, err := l.D2T(nil, e.x, o.M)
	if err != nil {
		return nil, err
	}
	res.OverflowRows = len(p.Overflow)
	res.NNZMean = float64(p.NNZ) / float64(o.M)
	for r := 0; r < o.M; r++ {
		res.NNZMax = max(res.NNZMax, p.RowNNZ(r))
	}
	mj, ew, err := e.energy(dense, res.DenseMS)
	if err != nil {
		return nil, err
	}
	res.DenseMJPerToken, res.DenseWatts, res.DenseSMClockMHz, res.DensePowerCapped = mj, ew.Watts, ew.SMClockMHz, ew.PowerCapped
	if mj, ew, err = e.energy(auto, res.AutoMS); err != nil {
		return nil, err
	}
	res.AutoMJPerToken, res.AutoWatts, res.AutoSMClockMHz, res.AutoPowerCapped = mj, ew.Watts, ew.SMClockMHz, ew.PowerCapped
	if e.meter != nil {
		res.PowerLimitWatts, _ = e.meter.PowerLimit()
		res.MaxSMClockMHz, _ = e.meter.MaxSMClock()
	}
	flops := 4.0 * float64(o.M) * float64(o.D) * float64(o.F)
	if o.Gated {
		flops *= 1.5
	}
	res.DenseGFLOPS = flops / res.DenseMS / 1e6
	var denseTrace *TraceSummary
	traceErr := "" // the tracer's failure, once it failed
	rows := make([]FFNResult, len(sparse))
	for i, v := range e.variants {
		r := res
		r.Switches = overlay(res.Switches, v.switches)
		r.TwELLMS, r.D2TMS = ms[1+i], ms[1+k+i]
		r.Speedup = r.DenseMS / r.TwELLMS
		lv := pick(v.opts)
		lv.Apply(v.opts)
		kern, _ := lv.D2TKernel()
		r.D2TKernel = kern.String()
		r.Tail = lv.KernelsFor(o.M) // the kernels this TwELL timing ran
		if lv == e.hot {
			r.HotUnits, r.HotCovered = len(e.cal.Hot), e.cal.Covered
		}
		r.TwELLActBytes = lv.SparseActBytes(o.M)
		if r.RelErr, err = checkPath(sparse[i]); err != nil {
			return nil, err
		}
		mj, ew, err := e.energy(sparse[i], r.TwELLMS)
		if err != nil {
			return nil, err
		}
		r.TwELLMJPerToken, r.TwELLWatts, r.TwELLSMClockMHz, r.TwELLPowerCapped = mj, ew.Watts, ew.SMClockMHz, ew.PowerCapped
		if mj, ew, err = e.energy(d2t[i], r.D2TMS); err != nil {
			return nil, err
		}
		r.D2TMJPerToken, r.D2TWatts, r.D2TSMClockMHz, r.D2TPowerCapped = mj, ew.Watts, ew.SMClockMHz, ew.PowerCapped
		if o.TraceSteps > 0 && traceErr == "" {
			if denseTrace == nil { // the first row holds the dense path's section of the Chrome trace
				if denseTrace, r.Traces, traceErr, err = traceOne(e, o, density, "dense", dense); err != nil {
					return nil, err
				}
			}
			r.DenseTrace = denseTrace
			if traceErr == "" {
				t, sec, msg, err := traceOne(e, o, density, "twell"+switchString(v.switches), sparse[i])
				if err != nil {
					return nil, err
				}
				r.TwELLTrace, traceErr = t, msg
				r.Traces = append(r.Traces, sec...)
			}
		}
		r.TraceError = traceErr
		e.say("density %g%s: dense %.3f ms, TwELL %.3f ms (%.2fx, %s; D2T %.3f ms), auto %.3f ms (%.2fx, %s); rel err %.1e/%.1e/%.1e; mJ/token %.4f/%.4f/%.4f",
			density, switchString(v.switches), r.DenseMS, r.TwELLMS, r.Speedup, r.Tail, r.D2TMS, r.AutoMS, r.AutoSpeedup, r.autoDesc(),
			r.DenseRelErr, r.RelErr, r.AutoRelErr, r.DenseMJPerToken, r.TwELLMJPerToken, r.AutoMJPerToken)
		if p := r.powerSummary(); p != "" {
			e.say("density %g%s: %s", density, switchString(v.switches), p)
		}
		rows[i] = r
	}
	l.Apply(e.base)
	return rows, nil
}

// hotMLP returns, when some setting the TwELL path is timed with turns the
// hot units on (gpu.Options.NoHotUnits unset), a second copy of the layer sl calibrated
// with MLP.Calibrate on a batch of its own (same distribution as the timed
// batches, another random stream; between gpu.CalibrationTokens and
// gpu.CalibrationMaxTokens tokens), and what the calibration chose. The
// other settings keep the uncalibrated layer, whose units stay in their
// order (packing every unit of a calibrated layer would put the hot ones in
// the same tiles).
func hotMLP(o FFNOptions, sl *synth.Layer, blas *cublas.Handle, e ffnEnv) (*gpu.MLP, *gpu.Calibration, error) {
	want := !e.base.NoHotUnits
	for _, v := range e.variants {
		want = want || !v.opts.NoHotUnits
	}
	if !want {
		return nil, nil, nil
	}
	l, err := gpu.NewMLP(e.dev, blas, sl.Gate, sl.Up, sl.Down, o.D, o.F, o.Layout)
	if err != nil {
		return nil, nil, err
	}
	m := min(max(o.M, gpu.CalibrationTokens), gpu.CalibrationMaxTokens)
	x, err := gpu.Upload(e.dev, synth.Tokens(rand.New(rand.NewPCG(o.Seed, 0xca1b)), m, o.D))
	if err != nil {
		l.Close()
		return nil, nil, err
	}
	defer x.Free()
	c, err := l.Calibrate(nil, x, m)
	if err != nil {
		l.Close()
		return nil, nil, fmt.Errorf("calibrating the hot units: %w", err)
	}
	e.say("hot units: %d of %d (%.1f%% of the calibration batch's active pairs, %d tokens)", len(c.Hot), o.F, 100*c.Covered, c.Tokens)
	return l, c, nil
}

// traceOne records the kernels of o.TraceSteps calls of run (path "dense"
// or "twell"). A failure of the tracer comes back as its message, with no
// summary; a failing call is an error.
func traceOne(e ffnEnv, o FFNOptions, density float64, path string, run func(*cuda.Buffer) error) (*TraceSummary, []TraceSection, string, error) {
	label := fmt.Sprintf("%s m=%d density %g %s", path, o.M, density, o.Dist)
	sum, sec, err := e.trace(label, run)
	if msg, ok := traceFailure(err); ok {
		e.say("density %g: %s: %s", density, label, msg)
		return nil, nil, msg, nil
	} else if err != nil {
		return nil, nil, "", fmt.Errorf("%s: %w", label, err)
	}
	e.say("density %g: traced %s, %s", density, path, sum)
	return &sum, []TraceSection{sec}, "", nil
}

// overlay returns base with the values of top set over it (nil when both
// are empty).
func overlay(base, top map[string]string) map[string]string {
	if len(base) == 0 && len(top) == 0 {
		return nil
	}
	m := maps.Clone(base)
	if m == nil {
		m = map[string]string{}
	}
	maps.Copy(m, top)
	return m
}

// roundBF16 rounds v to bf16 values in place and returns it.
func roundBF16(v []float32) []float32 {
	for i, x := range v {
		v[i] = bf16.Round(x)
	}
	return v
}

// gpuTiming is what the GPU benchmarks time with: a buffer twice the size
// of L2, written before every timed call (outside its events) so that each
// starts with no weights in L2, as in a model, whose consecutive layers
// have different weights (with the paths taking turns, a path would
// otherwise find the weights the one before it left); and an event timer.
type gpuTiming struct {
	flush *cuda.Buffer
	timer *cuda.Timer
}

func newGPUTiming(dev *cuda.Device) (*gpuTiming, error) {
	flush, err := dev.Alloc(2 * dev.Properties().L2Bytes)
	if err != nil {
		return nil, err
	}
	timer, err := dev.NewTimer()
	if err != nil {
		flush.Free()
		return nil, err
	}
	return &gpuTiming{flush: flush, timer: timer}, nil
}

func (g *gpuTiming) close() {
	g.timer.Destroy()
	g.flush.Free()
}
