package bench

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/safetensors"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/synth/sparsify"
)

// ModelOptions configure a whole-model benchmark.
type ModelOptions struct {
	Dir    string // checkpoint folder; empty means Preset
	Preset string // "sparselm-1.5b": random weights at the SparseLM shape
	// Layers keeps only the first Layers decoder layers of a preset (1 to
	// the preset's count; 0 keeps them all), so a large shape fits a small
	// machine.
	Layers int
	// Density and Dist shape the random gates of a preset (realistic
	// sparsity); ignored for checkpoints.
	Density float64
	Dist    synth.Dist
	// Prefill: Batch sequences of PromptLen tokens in one forward pass.
	Batch, PromptLen int
	// Decode: for each batch size, DecodeSteps single-token steps after a
	// prompt of DecodeContext tokens per sequence. Attention
	// reads the whole cache every step, so the context sets its share.
	DecodeBatches []int
	DecodeSteps   int
	DecodeContext int
	Reps          int
	Seed          uint64
	// SaveDir, when set, receives the benchmarked model as a Hugging Face
	// checkpoint (config.json + bf16 model.safetensors), so that other
	// engines can be timed on the same weights (scripts/hf-prefill-bench.py).
	SaveDir string
	// TraceSteps, when positive, records the kernels (package cuda/cupti)
	// of one more prefill pass and of TraceSteps more decode steps per
	// decode batch, after the timed ones (GPU only).
	TraceSteps int
	// Variants (GPU only), after the dense and TwELL paths with the
	// environment's settings, run the TwELL path again once per variant,
	// each on an engine of its own: values of the GPU engine's switches
	// (llm.Switches) over the environment's, a result row each. The model
	// is built and checked once.
	Variants []map[string]string
}

// Validate reports the first bad option, naming it.
func (o ModelOptions) Validate() error {
	switch {
	case o.Dir == "" && o.Preset == "":
		return fmt.Errorf("give -model DIR or -preset NAME")
	case o.Dir != "" && o.Preset != "":
		return fmt.Errorf("give -model or -preset, not both")
	case o.Preset != "" && o.Preset != "sparselm-1.5b":
		return fmt.Errorf("-preset %q: the known preset is sparselm-1.5b", o.Preset)
	case o.Layers < 0 || (o.Preset != "" && o.Layers > model.SparseLM1B5().NumHiddenLayers):
		return fmt.Errorf("-layers %d: must be between 1 and the preset's %d", o.Layers, model.SparseLM1B5().NumHiddenLayers)
	case o.Dir != "" && o.Layers != 0:
		return fmt.Errorf("-layers applies to -preset, not to -model")
	case o.Preset != "" && !(o.Density > 0 && o.Density < 1):
		return fmt.Errorf("-density %g: must be inside (0, 1)", o.Density)
	case o.Batch < 1 || o.PromptLen < 1:
		return fmt.Errorf("-batch %d and -prompt-len %d must be positive", o.Batch, o.PromptLen)
	case o.DecodeSteps < 1 || o.Reps < 1:
		return fmt.Errorf("-decode-steps %d and -reps %d must be positive", o.DecodeSteps, o.Reps)
	case o.DecodeContext < 1:
		return fmt.Errorf("-decode-context %d must be positive", o.DecodeContext)
	case o.TraceSteps < 0:
		return fmt.Errorf("-trace-steps %d must not be negative", o.TraceSteps)
	}
	for _, b := range o.DecodeBatches {
		if b < 1 {
			return fmt.Errorf("-decode-batch %d: must be positive", b)
		}
	}
	return nil
}

// checkPositions reports a prefill or decode longer than the model's
// positions.
func (o ModelOptions) checkPositions(c model.Config) error {
	switch {
	case o.PromptLen > c.MaxPositionEmbeddings:
		return fmt.Errorf("-prompt-len %d exceeds the model's %d positions", o.PromptLen, c.MaxPositionEmbeddings)
	case o.DecodeContext+o.DecodeSteps > c.MaxPositionEmbeddings:
		return fmt.Errorf("-decode-context %d plus -decode-steps %d exceeds the model's %d positions", o.DecodeContext, o.DecodeSteps, c.MaxPositionEmbeddings)
	case o.TraceSteps > 0 && o.DecodeContext+o.TraceSteps+2 > c.MaxPositionEmbeddings:
		// The traced steps follow one that records the graphs, and precede
		// the profiled one.
		return fmt.Errorf("-decode-context %d plus -trace-steps %d and two more steps exceeds the model's %d positions", o.DecodeContext, o.TraceSteps, c.MaxPositionEmbeddings)
	}
	return nil
}

// prepareModel checks o, loads or builds the model and saves it where o
// asks. It returns the model, its name, and the generator that drew its
// weights, which then draws the benchmark's tokens.
func prepareModel(o ModelOptions, progress func(string)) (*model.Model, string, *rand.Rand, error) {
	if err := o.Validate(); err != nil {
		return nil, "", nil, err
	}
	r := rand.New(rand.NewPCG(o.Seed, 0x30de1))
	m, name, err := buildModel(o, r, progress)
	if err != nil {
		return nil, "", nil, err
	}
	if err := saveModel(o, m, progress); err != nil {
		return nil, "", nil, err
	}
	if err := o.checkPositions(m.Config); err != nil {
		return nil, "", nil, err
	}
	return m, name, r, nil
}

// saveModel writes m to o.SaveDir, if set, as a Hugging Face checkpoint.
func saveModel(o ModelOptions, m *model.Model, progress func(string)) error {
	if o.SaveDir == "" {
		return nil
	}
	progress(fmt.Sprintf("saving the model to %s", o.SaveDir))
	return model.Save(o.SaveDir, m.Config, m.Weights, safetensors.BF16)
}

// buildModel loads o.Dir or builds the preset with calibrated sparse gates.
func buildModel(o ModelOptions, r *rand.Rand, progress func(string)) (*model.Model, string, error) {
	if o.Dir != "" {
		m, err := model.Load(o.Dir)
		return m, o.Dir, err
	}
	c := model.SparseLM1B5()
	if o.Layers > 0 {
		c.NumHiddenLayers = o.Layers
	}
	if err := fitsOnHost(c, o); err != nil {
		return nil, "", err
	}
	return PresetModel(o.Layers, o.Density, o.Dist, r, progress)
}

// PresetModel builds the sparselm-1.5b preset: the SparseLM-1.5B shape
// (its first layers when layers > 0) with random weights whose gates are
// calibrated on the CPU to fire at the given mean density under dist, then
// rounded to bfloat16 as a checkpoint's are (so the CPU engine holds them
// in bf16 alone, and the GPU runs on the weights the CPU checks). It
// returns the model and a description of it.
func PresetModel(layers int, density float64, dist synth.Dist, r *rand.Rand, progress func(string)) (*model.Model, string, error) {
	c := model.SparseLM1B5()
	if layers > 0 {
		c.NumHiddenLayers = min(layers, c.NumHiddenLayers)
	}
	if err := memcheck.Fits("the sparselm-1.5b preset's float32 weights", 4*float64(c.ParamCount()), "use fewer layers"); err != nil {
		return nil, "", fmt.Errorf("bench: %w", err)
	}
	name := fmt.Sprintf("sparselm-1.5b (random weights, %d layers, gate density %g %s)", c.NumHiddenLayers, density, dist)
	progress(fmt.Sprintf("building %s", name))
	m, err := model.New(c, model.RandomWeights(c, r))
	if err != nil {
		return nil, "", err
	}
	progress("calibrating the gates (CPU)")
	if err := sparsify.Gates(m, density, dist, r); err != nil {
		return nil, "", err
	}
	m.Weights.RoundBF16(c)
	return m, name, nil
}

// hostBytes estimates the host memory of a whole-model benchmark of the
// preset c: the float32 weights, the CPU engine's packed copies (bf16, the
// preset's weights being bf16 values: 0.6 times the float32 weights, see
// cpu/llm's PackedBytes, plus some slack for a layer's float32 panels while
// packing), the prefill's KV caches and activations.
func hostBytes(c model.Config, o ModelOptions) float64 {
	kv := 8 * float64(c.NumHiddenLayers*c.NumKeyValueHeads*c.HeadDim) * float64(o.Batch*o.PromptLen)
	act := 4 * float64(o.Batch*o.PromptLen) * float64(4*c.HiddenSize+2*c.IntermediateSize)
	return 1.65*c.WeightBytes() + kv + act
}

// fitsOnHost refuses a preset benchmark that would not fit in memory,
// saying how many layers would.
func fitsOnHost(c model.Config, o ModelOptions) error {
	need := hostBytes(c, o)
	one := c
	one.NumHiddenLayers = 1
	perLayer := hostBytes(one, o) - hostBytes(model.Config{VocabSize: c.VocabSize, HiddenSize: c.HiddenSize, TieWordEmbeddings: c.TieWordEmbeddings}, o)
	hint := ""
	if avail, ok := memcheck.Available(); ok && need > float64(avail) {
		fixed := need - float64(c.NumHiddenLayers)*perLayer
		if k := int((float64(avail) - fixed) / perLayer); k >= 1 {
			hint = fmt.Sprintf("-layers %d would fit", k)
		} else {
			hint = "even one layer would not fit: try a smaller -batch or -prompt-len"
		}
	}
	return memcheck.Fits(fmt.Sprintf("the %d-layer benchmark model", c.NumHiddenLayers), need, hint)
}

// DecodePoint is decode speed at one batch size.
type DecodePoint struct {
	Batch        int     `json:"batch"`
	Context      int     `json:"context"` // tokens cached per sequence before the timed steps
	TokensPerSec float64 `json:"tokens_per_s"`
	MSPerStep    float64 `json:"ms_per_step"`
	// GreedyTokensPerSec and GreedyMSPerStep time as many steps from the
	// same context run by a greedy engine.Decoder (GPU only): the picks
	// made on the device and each step queued before the host has the
	// picks of the one before, where TokensPerSec's steps copy their
	// logits back and wait for the host.
	GreedyTokensPerSec float64 `json:"greedy_tokens_per_s,omitempty"`
	GreedyMSPerStep    float64 `json:"greedy_ms_per_step,omitempty"`
	// DrawnTokensPerSec and DrawnMSPerStep are the same for a Decoder
	// whose picks are draws at temperature 1 and top-p 0.95 (GPU only).
	DrawnTokensPerSec float64 `json:"drawn_tokens_per_s,omitempty"`
	DrawnMSPerStep    float64 `json:"drawn_ms_per_step,omitempty"`
	// GraphSteps is how many of the decode steps run (warm-up included)
	// replayed a CUDA graph (GPU only; see gpu/llm).
	GraphSteps int `json:"graph_steps,omitempty"`
	Steps      int `json:"steps,omitempty"`
	// GraphRecords is how many CUDA graphs those steps recorded.
	GraphRecords int `json:"graph_records,omitempty"`
	// SparseLayers is how many layers ran the sparse MLP path in the last
	// step (GPU only).
	SparseLayers int `json:"sparse_layers,omitempty"`
	// StepMS is the GPU time by kind of step of one more decode step,
	// profiled and so not replayed from a graph (GPU only;
	// llm.Stats.StepMS).
	StepMS map[string]float64 `json:"step_ms,omitempty"`
	// Trace is what the kernel trace of ModelOptions.TraceSteps more steps,
	// replayed from graphs like the timed ones, shows (GPU only);
	// TraceError says why there is none when the tracer failed.
	Trace      *TraceSummary `json:"trace,omitempty"`
	TraceError string        `json:"trace_error,omitempty"`
	// GreedyTrace is the same for as many steps run by the greedy
	// engine.Decoder of GreedyTokensPerSec.
	GreedyTrace *TraceSummary `json:"greedy_trace,omitempty"`
	// GEMVTimeline is where the one-token sparse MLP kernel's time goes in
	// graph-replayed steps, when its measuring build ran (GPU, batch 1,
	// TWELL_GEMV_TIMELINE=1; see GEMVTimelineOf).
	GEMVTimeline []GEMVPhase `json:"gemv_timeline,omitempty"`
	// GEMVBlocks are the blocks of the last of those launches.
	GEMVBlocks []GEMVBlock `json:"gemv_blocks,omitempty"`
}

// GEMVBlock is one block of a launch of the one-token sparse MLP kernel:
// the SM it ran on and its stamps (gpu.GEMVPoints), in microseconds after
// the launch's first block started.
type GEMVBlock struct {
	SM int       `json:"sm"`
	US []float64 `json:"us"`
}

// gemvBlocks returns the blocks of one launch (stamps[block][point], ns;
// the SM of each block).
func gemvBlocks(stamps [][]uint64, sms []int) []GEMVBlock {
	us := launchUS(stamps)
	out := make([]GEMVBlock, len(us))
	for i, b := range us {
		out[i] = GEMVBlock{SM: sms[i], US: b}
	}
	return out
}

// launchUS returns one launch's stamps (stamps[block][point], ns) in
// microseconds after its earliest block's first stamp.
func launchUS(stamps [][]uint64) [][]float64 {
	t0 := uint64(math.MaxUint64)
	for _, b := range stamps {
		t0 = min(t0, b[0])
	}
	out := make([][]float64, len(stamps))
	for i, b := range stamps {
		out[i] = make([]float64, len(b))
		for p, t := range b {
			out[i][p] = float64(int64(t-t0)) / 1000
		}
	}
	return out
}

// GEMVPhase is one point of the one-token sparse MLP kernel's timeline
// (gpu.GEMVPoints): when its blocks reach it, in microseconds after the
// kernel's first block started, as the median over steps of the median
// block (MedianUS) and of the last block (LastUS).
type GEMVPhase struct {
	Point    string  `json:"point"`
	MedianUS float64 `json:"median_us"`
	LastUS   float64 `json:"last_us"`
}

// formatGEMVTimeline writes phases as "point median/last" pairs.
func formatGEMVTimeline(phases []GEMVPhase) string {
	parts := make([]string, len(phases))
	for i, p := range phases {
		parts[i] = fmt.Sprintf("%s %.2f/%.2f", p.Point, p.MedianUS, p.LastUS)
	}
	return strings.Join(parts, ", ")
}

// GEMVTimelineOf sums up the stamps of several launches of the one-token
// sparse MLP kernel (steps[i][block][point], ns, points named by points):
// per launch, each point's time after the earliest block's first stamp for
// the median block and the last one; per point, their medians over the
// launches. Nil for no launches.
func GEMVTimelineOf(steps [][][]uint64, points []string) []GEMVPhase {
	if len(steps) == 0 {
		return nil
	}
	med := make([][]float64, len(points))
	last := make([][]float64, len(points))
	for _, launch := range steps {
		us := launchUS(launch)
		for p := range points {
			at := make([]float64, len(us))
			for i, b := range us {
				at[i] = b[p]
			}
			med[p] = append(med[p], Median(at))
			last[p] = append(last[p], slices.Max(at))
		}
	}
	out := make([]GEMVPhase, len(points))
	for p, name := range points {
		out[p] = GEMVPhase{Point: name, MedianUS: Median(med[p]), LastUS: Median(last[p])}
	}
	return out
}

// ModelSchema names the layout of a ModelResult row in JSON (on the GPU,
// a ModelCUDAResult row), and its version.
const ModelSchema = "twell.bench.model/1"

// ModelResult is one path (dense or TwELL) of a whole-model benchmark.
type ModelResult struct {
	Row                           // Schema ModelSchema
	Model           string        `json:"model"`
	Params          int64         `json:"params"`
	Path            string        `json:"path"` // "dense" or "twell"
	PrefillTokens   int           `json:"prefill_tokens"`
	PrefillMS       float64       `json:"prefill_ms"`
	PrefillTokPerMS float64       `json:"prefill_tokens_per_ms"`
	Speedup         float64       `json:"prefill_speedup"` // dense prefill ms / this path's
	Decode          []DecodePoint `json:"decode"`
	// MLPActive is the mean number of active MLP units per token, per layer
	// (TwELL path); MLPWidth is the number of units.
	MLPActive []float64 `json:"mlp_active_per_token"` // null on the dense path
	MLPWidth  int       `json:"mlp_width"`
	// AllocBytesPerToken is Go heap allocated by one prefill pass, per token.
	AllocBytesPerToken float64 `json:"alloc_bytes_per_token"`
	PeakRSSBytes       int64   `json:"peak_rss_bytes"`
	// JoulesPerToken is null where no energy counter is readable (CPU VMs).
	JoulesPerToken *float64 `json:"joules_per_token"`
	MaxLogitDiff   float64  `json:"max_logit_diff_vs_dense"`
}

// ModelCPU runs the whole-model benchmark on the CPU: the plain dense MLP
// path against the TwELL path, on the same weights and tokens.
func ModelCPU(o ModelOptions, progress func(string)) ([]ModelResult, error) {
	m, name, r, err := prepareModel(o, progress)
	if err != nil {
		return nil, err
	}
	// both paths: decode reads bf16 weight copies
	e, err := llm.New(m, llm.Options{DecodeBF16: true})
	if err != nil {
		return nil, err
	}
	defer e.Close()
	c := m.Config
	prompts := make([][]int, o.Batch)
	for i := range prompts {
		prompts[i] = randTokens(r, o.PromptLen, c.VocabSize)
	}
	var results []ModelResult
	var denseLogits [][]float32
	for _, path := range []string{"dense", "twell"} {
		if err := e.SetMLPPath(map[string]mlp.Path{"dense": mlp.Dense, "twell": mlp.Auto}[path]); err != nil {
			return nil, err
		}
		res := ModelResult{Row: newRow(ModelSchema, "cpu", CPUName()), Model: name, Params: c.ParamCount(), Path: path, PrefillTokens: o.Batch * o.PromptLen, MLPWidth: c.IntermediateSize}
		progress(fmt.Sprintf("%s: prefill %d x %d tokens", path, o.Batch, o.PromptLen))
		var logits [][]float32
		var stats *engine.Stats
		var allocated uint64
		var used []engine.Cache // freed after the timing (the CPU engine's hold memory until freed)
		ms, err := timeMS(o.Reps, func(int) error {
			caches := make([]engine.Cache, o.Batch)
			for i := range caches {
				var err error
				if caches[i], err = e.NewCache(o.PromptLen); err != nil {
					return err
				}
				used = append(used, caches[i])
			}
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			var err error
			logits, stats, err = e.Forward(caches, prompts, false)
			runtime.ReadMemStats(&after)
			allocated = after.TotalAlloc - before.TotalAlloc
			return err
		})
		freeCaches(used)
		if err != nil {
			return nil, err
		}
		res.PrefillMS = ms
		res.PrefillTokPerMS = float64(res.PrefillTokens) / ms
		res.AllocBytesPerToken = float64(allocated) / float64(res.PrefillTokens)
		if path == "twell" {
			res.MLPActive = stats.MeanActive
		}
		if path == "dense" {
			denseLogits = logits
		} else {
			res.MaxLogitDiff = maxAbsDiff(logits, denseLogits)
		}
		for _, b := range o.DecodeBatches {
			progress(fmt.Sprintf("%s: decode batch %d, context %d", path, b, o.DecodeContext))
			pt, err := decodeSpeed(e, r, b, o.DecodeContext, o.DecodeSteps, o.Reps)
			if err != nil {
				return nil, err
			}
			res.Decode = append(res.Decode, pt)
		}
		res.PeakRSSBytes = peakRSS()
		results = append(results, res)
	}
	for i := range results {
		results[i].Speedup = results[0].PrefillMS / results[i].PrefillMS
	}
	return results, nil
}

// decodeSpeed times steps single-token decode steps for batch sequences
// after a prompt of ctx tokens each (prefill untimed), median of reps after
// one warm-up repetition.
func decodeSpeed(e engine.Engine, r *rand.Rand, batch, ctx, steps, reps int) (DecodePoint, error) {
	c := e.Config()
	times := make([]float64, 0, reps)
	for rep := -1; rep < reps; rep++ {
		caches := make([]engine.Cache, batch)
		toks := make([][]int, batch)
		for i := range caches {
			var err error
			if caches[i], err = e.NewCache(ctx + steps); err != nil {
				return DecodePoint{}, err
			}
			toks[i] = make([]int, ctx)
			for j := range toks[i] {
				toks[i][j] = r.IntN(c.VocabSize)
			}
		}
		if _, _, err := e.Forward(caches, toks, false); err != nil {
			return DecodePoint{}, err
		}
		t0 := time.Now()
		for s := 0; s < steps; s++ {
			for i := range toks {
				toks[i] = []int{r.IntN(c.VocabSize)}
			}
			if _, _, err := e.Forward(caches, toks, false); err != nil {
				return DecodePoint{}, err
			}
		}
		if rep >= 0 {
			times = append(times, float64(time.Since(t0).Microseconds())/1000)
		}
		freeCaches(caches)
	}
	med := Median(times)
	return DecodePoint{Batch: batch, Context: ctx, TokensPerSec: float64(batch*steps) / med * 1000, MSPerStep: med / float64(steps)}, nil
}

// freeCaches frees the caches that are not nil.
func freeCaches(cs []engine.Cache) {
	for _, c := range cs {
		if c != nil {
			c.Free()
		}
	}
}

func maxAbsDiff(a, b [][]float32) float64 {
	d := 0.0
	for i := range a {
		for j := range a[i] {
			d = max(d, float64(abs32(a[i][j]-b[i][j])))
		}
	}
	return d
}

func abs32(v float32) float32 {
	if v < 0 {
		return -v
	}
	return v
}

// peakRSS returns the process's peak resident memory (VmHWM), or 0.
func peakRSS() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb * 1024
		}
	}
	return 0
}
