package bench

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	cpullm "github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cupti"
	"github.com/twell-ai/twell/cuda/nvml"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/gpu"
	"github.com/twell-ai/twell/gpu/llm"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/sample"
)

// ModelCUDAResult is one path (dense or TwELL) of the whole-model benchmark
// on a GPU: the fields of the CPU benchmark plus device memory and a check
// against the CPU model.
type ModelCUDAResult struct {
	ModelResult
	// PeakDeviceBytes is the most device memory in use through twell's
	// allocator after any forward pass of this path: weights, KV caches,
	// workspaces (package gpu keeps each layer's), cuBLAS workspace. TwELL
	// runs first, so its figure excludes the dense workspaces, and the
	// dense figure includes the (smaller) sparse ones.
	PeakDeviceBytes int64 `json:"peak_device_bytes"`
	WeightBytes     int64 `json:"weight_bytes"`
	KVCacheBytes    int64 `json:"kv_cache_bytes"` // the prefill batch's caches
	// EnergySeconds is the wall time the energy figure was measured over,
	// and PrefillWatts the mean power in it; PowerLimitWatts is the board's
	// enforced power limit.
	EnergySeconds   float64 `json:"energy_seconds,omitempty"`
	PrefillWatts    float64 `json:"prefill_watts,omitempty"`
	PowerLimitWatts float64 `json:"power_limit_watts,omitempty"`
	// PrefillSMClockMHz is the median SM clock sampled every 10 ms through
	// that window (MaxSMClockMHz the clock's maximum), and
	// PrefillPowerCapped the share of those samples in which the driver held
	// the clocks down to keep within the power limit (null where not
	// readable): near 1, the prefill's speed is set by its energy per token,
	// not by its kernels' time at full clock.
	PrefillSMClockMHz  int      `json:"prefill_sm_clock_mhz,omitempty"`
	MaxSMClockMHz      int      `json:"max_sm_clock_mhz,omitempty"`
	PrefillPowerCapped *float64 `json:"prefill_power_capped,omitempty"`
	// CPUCheckRelDiff is max |GPU - CPU| / max |CPU| over the logits of a
	// short prompt run by the GPU engine and by the float32 CPU model.
	CPUCheckRelDiff float64 `json:"cpu_check_rel_diff"`
	TwELLLayers     int     `json:"twell_layers"`
	// HotUnits is, per layer, how many units the TwELL MLP computes densely
	// after the prefill passes calibrated it (llm.Engine.HotUnitCounts; null
	// on the dense path and without hot units), and CalibrationError why a
	// calibration failed and left them off.
	HotUnits         []int  `json:"hot_units,omitempty"`
	CalibrationError string `json:"calibration_error,omitempty"`
	// AttentionKernel is the attention kernel of the prefill passes.
	AttentionKernel string `json:"attention_kernel"`
	// PrefillStepMS is the GPU time of each kind of step (llm.Stats.StepMS)
	// in one more prefill pass, timed with CUDA events between the steps.
	PrefillStepMS map[string]float64 `json:"prefill_step_ms"`
	// PrefillTrace is what the kernel trace of one more prefill pass shows
	// (ModelOptions.TraceSteps).
	PrefillTrace *TraceSummary `json:"prefill_trace,omitempty"`
	// PrefillTraceError says why there is no PrefillTrace when the tracer
	// failed.
	PrefillTraceError string `json:"prefill_trace_error,omitempty"`
	// Traces holds the traced kernels, one section per prefill pass and
	// decode batch, for WriteChromeTrace.
	Traces []TraceSection `json:"-"`
}

// TraceErrors returns the tracer's failures in r, if any.
func (r ModelCUDAResult) TraceErrors() []string {
	var out []string
	if r.PrefillTraceError != "" {
		out = append(out, r.Path+" prefill: "+r.PrefillTraceError)
	}
	for _, d := range r.Decode {
		if d.TraceError != "" {
			out = append(out, fmt.Sprintf("%s decode b=%d: %s", r.Path, d.Batch, d.TraceError))
		}
	}
	return out
}

// formatSteps lists step times in the order a layer runs them, and their sum.
func formatSteps(ms map[string]float64) string {
	var b strings.Builder
	sum := 0.0
	for _, k := range []string{"embed", "norm", "qkv", "rope", "attention", "o_proj", "mlp", "head"} {
		if v, ok := ms[k]; ok {
			fmt.Fprintf(&b, "%s %.3g, ", k, v)
			sum += v
		}
	}
	fmt.Fprintf(&b, "sum %.3g", sum)
	return b.String()
}

// ModelCUDA runs the whole-model benchmark on CUDA device 0 with the
// engine of package gpu/llm: prefill of o.Batch sequences of o.PromptLen
// tokens (one forward pass, logits of each last token) with the MLPs on
// the TwELL path (automatic sparse/dense choice) and on the dense cuBLASLt
// path, on the same weights and tokens; then decode steps at each of
// o.DecodeBatches. Times come from CUDA events around each call on the
// engine's stream (one warm-up, median of o.Reps); energy from NVML's
// counter over back-to-back prefill calls (at least o.Reps and minEnergyWindow).
// Before timing, the engine's logits on a short prompt are checked against
// the float32 CPU model.
func ModelCUDA(o ModelOptions, progress func(string)) ([]ModelCUDAResult, error) {
	if progress == nil {
		progress = func(string) {}
	}
	if o.TraceSteps > 0 {
		if err := cupti.Available(); err != nil {
			return nil, fmt.Errorf("kernel traces: %w", err)
		}
	}
	m, name, r, err := prepareModel(o, progress)
	if err != nil {
		return nil, err
	}
	c := m.Config
	dev, err := cuda.Open(0)
	if err != nil {
		return nil, err
	}
	props := dev.Properties()
	progress(fmt.Sprintf("uploading the weights to %s", props.Name))
	e, err := llm.NewEngine(dev, m)
	if err != nil {
		return nil, err
	}
	defer e.Close()
	meter, nvErr := nvml.DeviceByPCIBusID(props.PCIBusID)
	if nvErr != nil {
		progress(fmt.Sprintf("no energy figures: %v", nvErr))
	}
	peak := int64(0)
	notePeak := func() { peak = max(peak, dev.MemStats().InUse) }

	// Check against the CPU model on a short prompt, on the sparse path:
	// under "auto" the dense first positions of this short prompt would
	// make the next call (the first timed path's warm-up) run dense.
	if err := e.SetMLPPath(mlp.Sparse); err != nil {
		return nil, err
	}
	checkLen := min(32, o.PromptLen)
	check := randTokens(r, checkLen, c.VocabSize)
	ce, err := cpullm.New(m, cpullm.Options{})
	if err != nil {
		return nil, err
	}
	want, err := allLogits(ce, check)
	ce.Close()
	if err != nil {
		return nil, err
	}
	got, err := allLogits(e, check)
	if err != nil {
		return nil, err
	}
	cpuDiff := relMaxDiff(got, want)
	if math.IsInf(cpuDiff, 0) || cpuDiff > 0.1 {
		return nil, fmt.Errorf("GPU logits differ from the CPU model's: max |diff| / max |logit| = %g on a %d-token prompt", cpuDiff, checkLen)
	}
	progress(fmt.Sprintf("GPU vs CPU logits on a %d-token prompt: max |diff| / max |logit| = %.2e", checkLen, cpuDiff))

	prompts := make([][]int, o.Batch)
	for i := range prompts {
		prompts[i] = randTokens(r, o.PromptLen, c.VocabSize)
	}
	// measure runs the benchmark of one path on engine e: prefill, its
	// energy, profile and trace, then each decode batch. sw are the
	// switches a variant sets over the environment's (nil: none).
	measure := func(e *llm.Engine, path string, sw map[string]string) (*ModelCUDAResult, [][]float32, error) {
		caches := make([]engine.Cache, o.Batch)
		for i := range caches {
			var err error
			if caches[i], err = e.NewCache(o.PromptLen); err != nil {
				return nil, nil, err
			}
			defer caches[i].Free()
		}
		timer, err := dev.NewTimer()
		if err != nil {
			return nil, nil, err
		}
		defer timer.Destroy()
		// timed runs f between two events on the engine's stream.
		timed := func(f func() error) (float64, error) { return timer.TimeMS(e.Stream(), f) }
		attnKernel, err := e.AttentionKernel()
		if err != nil {
			return nil, nil, err
		}
		if err := e.SetMLPPath(map[string]mlp.Path{"dense": mlp.Dense, "twell": mlp.Auto}[path]); err != nil {
			return nil, nil, err
		}
		res := &ModelCUDAResult{ModelResult: ModelResult{Row: newRow(ModelSchema, "cuda", props.Name+" / "+CPUName()), Model: name, Params: c.ParamCount(), Path: path,
			PrefillTokens: o.Batch * o.PromptLen, MLPWidth: c.IntermediateSize},
			WeightBytes: e.WeightBytes(), CPUCheckRelDiff: cpuDiff, TwELLLayers: e.TwELLLayers(),
			AttentionKernel: attnKernel}
		res.Switches = overlay(res.Switches, sw)
		path += switchString(sw)
		peak = 0
		progress(fmt.Sprintf("%s: prefill %d x %d tokens (attention kernel %s)", path, o.Batch, o.PromptLen, attnKernel))
		var logits [][]float32
		var stats *engine.Stats
		// As a serving loop, which samples the last tokens' logits and
		// drops them, prefill takes its logits in the engine's page-locked
		// buffer (with a fresh pageable slice for 64 x 49152 floats, the
		// profiled prefill's LM head step, a 64-row GEMM and that copy,
		// took 7.7 ms); they are copied out once the prefill passes are
		// done.
		defer func(v bool) { e.ReuseLogits = v }(e.ReuseLogits)
		e.ReuseLogits = true
		prefill := func() error {
			if err := truncateAll(caches, 0); err != nil {
				return err
			}
			var err error
			logits, stats, err = e.Forward(caches, prompts, false)
			notePeak()
			return err
		}
		// Warm up (kernel compilation, workspaces) until the automatic MLP
		// path has timed both paths at this size and settled (four passes
		// where the paths are far apart, eight where they are close), so
		// that the timed passes run its choice rather than its exploration.
		warm := 0
		for warm < 12 && (warm == 0 || !e.MLPSettled(o.Batch*o.PromptLen)) {
			if err := prefill(); err != nil {
				return nil, nil, err
			}
			warm++
		}
		progress(fmt.Sprintf("%s: %d warm-up passes (MLP paths settled: %v)", path, warm, e.MLPSettled(o.Batch*o.PromptLen)))
		if path != "dense" {
			if err := e.CalibrationError(); err != nil {
				res.CalibrationError = err.Error()
				progress(fmt.Sprintf("%s: hot units off: %v", path, err))
			} else if hot := e.HotUnitCounts(); slices.ContainsFunc(hot, func(n int) bool { return n > 0 }) {
				res.HotUnits = hot
				progress(fmt.Sprintf("%s: hot units per layer: %v", path, hot))
			}
		}
		for _, cache := range caches { // the pages a prefill takes
			res.KVCacheBytes += e.CacheBytes(cache)
		}
		times := make([]float64, 0, o.Reps)
		for range o.Reps {
			ms, err := timed(prefill)
			if err != nil {
				return nil, nil, err
			}
			times = append(times, ms)
		}
		if nvErr == nil {
			n := 0
			w, err := MeasureEnergy(meter, func() error {
				for t0 := time.Now(); n < o.Reps || time.Since(t0) < minEnergyWindow; n++ {
					if err := prefill(); err != nil {
						return err
					}
				}
				return nil
			})
			if err != nil {
				return nil, nil, err
			}
			if w.OK {
				v := w.Joules / float64(n*res.PrefillTokens)
				res.JoulesPerToken, res.EnergySeconds, res.PrefillWatts = &v, w.Seconds, w.Watts
			}
			res.PrefillSMClockMHz, res.PrefillPowerCapped = w.SMClockMHz, w.PowerCapped
			res.PowerLimitWatts, _ = meter.PowerLimit()
			res.MaxSMClockMHz, _ = meter.MaxSMClock()
		}
		res.PrefillMS = Median(times)
		res.PrefillTokPerMS = float64(res.PrefillTokens) / res.PrefillMS
		// One more prefill, profiled: where its time goes, step by step.
		e.Profile = true
		err = prefill()
		e.Profile = false
		if err != nil {
			return nil, nil, err
		}
		res.PrefillStepMS = stats.StepMS
		progress(fmt.Sprintf("%s: profiled prefill, ms by step: %s", path, formatSteps(stats.StepMS)))
		if o.TraceSteps > 0 {
			label := fmt.Sprintf("%s prefill %d x %d", path, o.Batch, o.PromptLen)
			sum, sec, err := traceSteps(label, 1, nil, prefill)
			if msg, ok := traceFailure(err); ok {
				res.PrefillTraceError = msg
				progress(fmt.Sprintf("%s: %s", label, msg))
			} else if err != nil {
				return nil, nil, fmt.Errorf("%s: %w", label, err)
			} else {
				res.PrefillTrace = &sum
				res.Traces = append(res.Traces, sec)
				progress(fmt.Sprintf("%s: traced prefill, %s", path, sum))
			}
		}
		if res.Path == "twell" {
			res.MLPActive = append(res.MLPActive, stats.MeanActive...)
		}
		for i, row := range logits { // before decode steps reuse the buffer
			logits[i] = slices.Clone(row)
		}
		for _, b := range o.DecodeBatches {
			progress(fmt.Sprintf("%s: decode batch %d, context %d", path, b, o.DecodeContext))
			pt, secs, err := decodeSpeedCUDA(e, r, b, o, path, timed, notePeak)
			if err != nil {
				return nil, nil, err
			}
			progress(fmt.Sprintf("%s: profiled decode step, batch %d, ms by step: %s", path, b, formatSteps(pt.StepMS)))
			if pt.GEMVTimeline != nil {
				progress(fmt.Sprintf("%s: gemv_mlp timeline, batch %d (us after its first block starts, median block / last block): %s",
					path, b, formatGEMVTimeline(pt.GEMVTimeline)))
			}
			if pt.Trace != nil {
				res.Traces = append(res.Traces, secs...)
				progress(fmt.Sprintf("%s: traced decode steps, batch %d, %s", path, b, pt.Trace))
				if pt.GreedyTrace != nil {
					progress(fmt.Sprintf("%s: traced greedy decoder steps, batch %d, %s", path, b, pt.GreedyTrace))
				}
			}
			if pt.TraceError != "" {
				progress(fmt.Sprintf("%s: decode batch %d: %s", path, b, pt.TraceError))
			}
			res.Decode = append(res.Decode, pt)
		}
		res.PeakDeviceBytes = peak
		res.PeakRSSBytes = peakRSS()
		return res, logits, nil
	}
	byPath := map[string]*ModelCUDAResult{}
	logitsOf := map[string][][]float32{}
	for _, path := range []string{"twell", "dense"} {
		res, logits, err := measure(e, path, nil)
		if err != nil {
			return nil, err
		}
		byPath[path], logitsOf[path] = res, logits
	}
	// Each variant: the TwELL path again, on an engine of its own settings
	// over the same weights (uploaded again). The first engine goes first,
	// so that a variant's peak memory is its own and two engines' KV pools
	// never need to fit at once.
	if len(o.Variants) > 0 {
		if err := e.Close(); err != nil {
			return nil, err
		}
	}
	var variantRows []ModelCUDAResult
	for _, v := range o.Variants {
		opts, err := llm.OptionsFrom(variantEnv(v))
		if err != nil {
			return nil, err
		}
		progress(fmt.Sprintf("variant%s: uploading the weights again", switchString(v)))
		ev, err := llm.NewEngineWith(dev, m, opts)
		if err != nil {
			return nil, err
		}
		res, logits, err := measure(ev, "twell", v)
		ev.Close()
		if err != nil {
			return nil, err
		}
		res.MaxLogitDiff = maxAbsDiff(logits, logitsOf["dense"])
		variantRows = append(variantRows, *res)
	}
	d := maxAbsDiff(logitsOf["twell"], logitsOf["dense"])
	if math.IsNaN(d) || math.IsInf(d, 0) {
		return nil, fmt.Errorf("prefill logits are not finite (TwELL vs dense difference %v)", d)
	}
	byPath["twell"].MaxLogitDiff = d
	results := append([]ModelCUDAResult{*byPath["dense"], *byPath["twell"]}, variantRows...)
	for i := range results {
		results[i].Speedup = results[0].PrefillMS / results[i].PrefillMS
	}
	return results, nil
}

// ParseModelVariants reads ModelOptions.Variants, in the form of
// ParseVariants, for the GPU engine's switches (llm.Switches).
func ParseModelVariants(s string) ([]map[string]string, error) {
	return parseVariants(s, "the GPU engine's", llm.Switches, func(v map[string]string) error {
		_, err := llm.OptionsFrom(variantEnv(v))
		return err
	})
}

// gemvTimeline runs steps more one-token decode steps from ctx cached
// tokens on e, whose TwELL layers run the measuring build of the
// small-batch kernels, and sums up the stamps the last layer's gemv_mlp
// left in each (GEMVTimelineOf); it also returns the last step's blocks.
func gemvTimeline(e *llm.Engine, caches []engine.Cache, toks [][]int, ctx, steps int, r *rand.Rand) ([]GEMVPhase, []GEMVBlock, error) {
	if err := truncateAll(caches, ctx); err != nil {
		return nil, nil, err
	}
	var stamps [][][]uint64
	var sms []int
	for range steps {
		for i := range toks {
			toks[i] = []int{r.IntN(e.Config().VocabSize)}
		}
		if _, _, err := e.Forward(caches, toks, false); err != nil {
			return nil, nil, err
		}
		s, sm, err := e.GEMVStamps()
		if err != nil {
			return nil, nil, err
		}
		stamps, sms = append(stamps, s), sm
	}
	return GEMVTimelineOf(stamps, gpu.GEMVPoints), gemvBlocks(stamps[len(stamps)-1], sms), nil
}

// decodeSpeedCUDA times o.DecodeSteps single-token decode steps for batch
// sequences after a prompt of o.DecodeContext tokens each (prefill
// untimed): CUDA events around the steps, median of o.Reps after one
// warm-up repetition. With o.TraceSteps, that many more steps from the
// same context are traced (the section of the trace is returned). One more
// step, profiled, gives the point's StepMS.
func decodeSpeedCUDA(e *llm.Engine, r *rand.Rand, batch int, o ModelOptions, path string, timed func(func() error) (float64, error), notePeak func()) (DecodePoint, []TraceSection, error) {
	c := e.Config()
	ctx, steps, reps := o.DecodeContext, o.DecodeSteps, o.Reps
	caches := make([]engine.Cache, batch)
	for i := range caches {
		var err error
		if caches[i], err = e.NewCache(ctx + max(steps, o.TraceSteps+1) + 1); err != nil {
			return DecodePoint{}, nil, err
		}
		defer caches[i].Free()
	}
	toks := make([][]int, batch)
	times, greedy, drawn := make([]float64, 0, reps), make([]float64, 0, reps), make([]float64, 0, reps)
	draws := make([]sample.Draw, batch)
	for i := range draws {
		draws[i] = sample.Draw{Temperature: 1, TopP: 0.95, Seed: r.Uint64()}
	}
	graphs0, records0 := e.GraphReplays(), e.GraphRecords()
	// A serving loop samples each step's logits and drops them: reuse one
	// page-locked buffer rather than allocating batch x vocabulary floats
	// per step.
	defer func(v bool) { e.ReuseLogits = v }(e.ReuseLogits)
	e.ReuseLogits = true
	sparse := 0
	for rep := -1; rep < reps; rep++ {
		for i := range caches {
			if err := caches[i].Truncate(0); err != nil {
				return DecodePoint{}, nil, err
			}
			toks[i] = randTokens(r, ctx, c.VocabSize)
		}
		if _, _, err := e.Forward(caches, toks, false); err != nil {
			return DecodePoint{}, nil, err
		}
		ms, err := timed(func() error {
			for s := 0; s < steps; s++ {
				for i := range toks {
					toks[i] = []int{r.IntN(c.VocabSize)}
				}
				_, st, err := e.Forward(caches, toks, false)
				if err != nil {
					return err
				}
				sparse = 0
				for _, p := range st.Paths {
					if p == mlp.Sparse {
						sparse++
					}
				}
			}
			return nil
		})
		if err != nil {
			return DecodePoint{}, nil, err
		}
		gms, err := decoderSteps(e, caches, r, ctx, steps, nil, timed)
		if err != nil {
			return DecodePoint{}, nil, fmt.Errorf("greedy decoder: %w", err)
		}
		dms, err := decoderSteps(e, caches, r, ctx, steps, draws, timed)
		if err != nil {
			return DecodePoint{}, nil, fmt.Errorf("decoder drawing at temperature 1, top-p 0.95: %w", err)
		}
		notePeak()
		if rep >= 0 {
			times = append(times, ms)
			greedy = append(greedy, gms)
			drawn = append(drawn, dms)
		}
	}
	med, gmed, dmed := Median(times), Median(greedy), Median(drawn)
	pt := DecodePoint{Batch: batch, Context: ctx, TokensPerSec: float64(batch*steps) / med * 1000, MSPerStep: med / float64(steps),
		GreedyTokensPerSec: float64(batch*steps) / gmed * 1000, GreedyMSPerStep: gmed / float64(steps),
		DrawnTokensPerSec: float64(batch*steps) / dmed * 1000, DrawnMSPerStep: dmed / float64(steps),
		GraphSteps: e.GraphReplays() - graphs0, Steps: (reps + 1) * steps, GraphRecords: e.GraphRecords() - records0,
		SparseLayers: sparse}
	if batch == 1 && e.GEMVTimeline() {
		var err error
		if pt.GEMVTimeline, pt.GEMVBlocks, err = gemvTimeline(e, caches, toks, ctx, steps, r); err != nil {
			return DecodePoint{}, nil, err
		}
	}
	var sec TraceSection
	var gsecs []TraceSection
	if o.TraceSteps > 0 {
		if err := truncateAll(caches, ctx); err != nil {
			return DecodePoint{}, nil, err
		}
		label := fmt.Sprintf("%s decode b=%d at %d cached", path, batch, ctx)
		step := func() error {
			for i := range toks {
				toks[i] = []int{r.IntN(c.VocabSize)}
			}
			_, _, err := e.Forward(caches, toks, false)
			return err
		}
		// The graphs are recorded again while the tracer runs.
		prepare := func() error { return errors.Join(e.ResetGraphs(), step()) }
		sum, s, err := traceSteps(label, o.TraceSteps, prepare, step)
		msg, traceFailed := traceFailure(err)
		if err != nil && !traceFailed {
			return DecodePoint{}, nil, fmt.Errorf("%s: %w", label, err)
		}
		// Graphs recorded under the tracer are not used for timing.
		if err := e.ResetGraphs(); err != nil {
			return DecodePoint{}, nil, err
		}
		if traceFailed {
			pt.TraceError = msg
		} else {
			pt.Trace, sec = &sum, s
			gsum, gsec, err := traceGreedy(e, caches, r, label+", greedy decoder", ctx, o.TraceSteps)
			if msg, failed := traceFailure(err); failed {
				pt.TraceError = msg
			} else if err != nil {
				return DecodePoint{}, nil, fmt.Errorf("%s: greedy decoder: %w", label, err)
			} else {
				pt.GreedyTrace, gsecs = &gsum, []TraceSection{gsec}
			}
		}
	}
	// One more step, profiled: where a decode step's time goes. It runs
	// kernel by kernel (a step replayed from a graph is not timed).
	for i := range toks {
		toks[i] = []int{r.IntN(c.VocabSize)}
	}
	noGraphs := e.NoGraphs
	e.Profile, e.NoGraphs = true, true
	_, st, err := e.Forward(caches, toks, false)
	e.Profile, e.NoGraphs = false, noGraphs
	if err != nil {
		return DecodePoint{}, nil, err
	}
	pt.StepMS = st.StepMS
	if pt.Trace == nil {
		return pt, nil, nil
	}
	return pt, append([]TraceSection{sec}, gsecs...), nil
}

// decoderRun drives steps decode steps of a batch through an
// engine.Decoder, the step after each one queued before its picks are
// read.
type decoderRun struct {
	d          engine.Decoder
	first      []int // the first step's tokens
	steps, got int   // steps to run; steps whose picks were read
}

// newDecoderRun truncates caches to ctx and returns a decoderRun of steps
// steps on them, fed random first tokens, its picks drawn as draws says
// (nil: greedy).
func newDecoderRun(e *llm.Engine, caches []engine.Cache, r *rand.Rand, ctx, steps int, draws []sample.Draw) (*decoderRun, error) {
	if err := truncateAll(caches, ctx); err != nil {
		return nil, err
	}
	d, err := e.NewDecoder(caches, 0, draws)
	if err != nil {
		return nil, err
	}
	return &decoderRun{d: d, first: randTokens(r, len(caches), e.Config().VocabSize), steps: steps}, nil
}

// start queues the first step.
func (g *decoderRun) start() error { return g.d.Queue(g.first) }

// step queues the step after the oldest unread one, unless that is the
// last, and waits for the oldest one's picks.
func (g *decoderRun) step() error {
	if g.got++; g.got < g.steps {
		if err := g.d.Queue(nil); err != nil {
			return err
		}
	}
	_, err := g.d.Next()
	return err
}

// decoderSteps times steps decode steps from ctx cached tokens in caches
// (truncated to ctx first), run by a decoderRun with draws.
func decoderSteps(e *llm.Engine, caches []engine.Cache, r *rand.Rand, ctx, steps int, draws []sample.Draw, timed func(func() error) (float64, error)) (float64, error) {
	g, err := newDecoderRun(e, caches, r, ctx, steps, draws)
	if err != nil {
		return 0, err
	}
	ms, err := timed(func() error {
		if err := g.start(); err != nil {
			return err
		}
		for range steps {
			if err := g.step(); err != nil {
				return err
			}
		}
		return nil
	})
	return ms, errors.Join(err, g.d.Close())
}

// traceGreedy traces steps greedy decode steps from ctx cached tokens in
// caches (truncated to ctx first) run by a greedy decoderRun, each step of
// the trace one decoderRun.step (the graphs recorded again while the tracer
// runs, and dropped after).
func traceGreedy(e *llm.Engine, caches []engine.Cache, r *rand.Rand, label string, ctx, steps int) (TraceSummary, TraceSection, error) {
	g, err := newDecoderRun(e, caches, r, ctx, steps, nil)
	if err != nil {
		return TraceSummary{}, TraceSection{}, err
	}
	prepare := func() error { return errors.Join(e.ResetGraphs(), g.start()) }
	sum, sec, err := traceSteps(label, steps, prepare, g.step)
	return sum, sec, errors.Join(err, g.d.Close(), e.ResetGraphs())
}

// truncateAll truncates every cache to n positions.
func truncateAll(caches []engine.Cache, n int) error {
	for _, c := range caches {
		if err := c.Truncate(n); err != nil {
			return err
		}
	}
	return nil
}

// allLogits runs tokens, one sequence, through e in a fresh cache and
// returns the logits of every position.
func allLogits(e engine.Engine, tokens []int) ([][]float32, error) {
	c, err := e.NewCache(len(tokens))
	if err != nil {
		return nil, err
	}
	defer c.Free()
	l, _, err := e.Forward([]engine.Cache{c}, [][]int{tokens}, true)
	return l, err
}

func randTokens(r *rand.Rand, n, vocab int) []int {
	t := make([]int, n)
	for i := range t {
		t[i] = r.IntN(vocab)
	}
	return t
}

// relMaxDiff returns max |a - b| / max |b| (infinite if a holds NaN or Inf).
func relMaxDiff(a, b [][]float32) float64 {
	var d, m float64
	for i := range a {
		for j := range a[i] {
			x, y := float64(a[i][j]), float64(b[i][j])
			if math.IsNaN(x) || math.IsInf(x, 0) {
				return math.Inf(1)
			}
			d = max(d, math.Abs(x-y))
			m = max(m, math.Abs(y))
		}
	}
	return d / max(m, 1e-30)
}
