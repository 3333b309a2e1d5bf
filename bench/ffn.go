package bench

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"

	"github.com/twell-ai/twell/cpu"
	"github.com/twell-ai/twell/gpu"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/twell"
)

// FFNOptions configure an MLP-block benchmark.
type FFNOptions struct {
	D, F, M   int       // hidden size, MLP width, tokens
	Densities []float64 // fraction of MLP units active per token
	Dist      synth.Dist
	Gated     bool
	Reps      int
	Layout    twell.Layout
	Seed      uint64
	// RefRows is how many tokens are checked against the float64 reference.
	RefRows int
	// DumpDir, when set, is an existing folder that receives the run's
	// inputs as safetensors files (see FFNInputsSchema), so that another
	// implementation can be timed on exactly the same numbers.
	DumpDir string
	// TraceSteps, when positive, records the kernels (package cuda/cupti)
	// of that many more calls of the dense and the TwELL path, each after
	// the L2 flush, as timed (GPU only).
	TraceSteps int
	// Variants, when set (GPU only), time the TwELL path once per variant,
	// in turns with the other paths and each other: a variant is values of
	// the MLP's switches (gpu.Switches) that override the environment's.
	// Each variant gives a result row; the dense, D2T and automatic-path
	// figures, measured with the environment's settings, are the same in
	// all of them.
	Variants []map[string]string
}

// ParseVariants reads FFNOptions.Variants from their command-line form:
// variants separated by ";", each a list of NAME=VALUE separated by spaces
// or commas, names with or without their TWELL_ prefix; an empty variant
// is the environment's settings. It checks the names and values.
func ParseVariants(s string) ([]map[string]string, error) {
	return parseVariants(s, "the MLP's", gpu.Switches, func(v map[string]string) error {
		_, err := variantOptions(v)
		return err
	})
}

// parseVariants reads variants whose names must be among names (whose
// switches they are) and whose values check accepts.
func parseVariants(s, whose string, names []string, check func(map[string]string) error) ([]map[string]string, error) {
	var out []map[string]string
	for _, v := range strings.Split(s, ";") {
		m := map[string]string{}
		for _, kv := range strings.FieldsFunc(v, func(r rune) bool { return r == ' ' || r == ',' }) {
			k, val, ok := strings.Cut(kv, "=")
			if !ok {
				return nil, fmt.Errorf("variant %q: %q is not NAME=VALUE", strings.TrimSpace(v), kv)
			}
			if !strings.HasPrefix(k, "TWELL_") {
				k = "TWELL_" + k
			}
			if !slices.Contains(names, k) {
				return nil, fmt.Errorf("variant %q: %s is not one of %s switches (%s)", strings.TrimSpace(v), k, whose, strings.Join(names, ", "))
			}
			if _, dup := m[k]; dup {
				return nil, fmt.Errorf("variant %q sets %s twice", strings.TrimSpace(v), k)
			}
			m[k] = val
		}
		if err := check(m); err != nil {
			return nil, fmt.Errorf("variant %q: %w", strings.TrimSpace(v), err)
		}
		out = append(out, m)
	}
	return out, nil
}

// variantOptions returns the MLP options of a variant: its values, the
// environment's for the switches it does not set.
func variantOptions(v map[string]string) (gpu.Options, error) { return gpu.OptionsFrom(variantEnv(v)) }

// variantEnv looks a variable up in variant v, then in the environment.
func variantEnv(v map[string]string) func(string) string {
	return func(k string) string {
		if val, ok := v[k]; ok {
			return val
		}
		return os.Getenv(k)
	}
}

// Validate reports the first bad option, naming it.
func (o FFNOptions) Validate() error {
	// The layout first (a one-tile width checks it alone): -tile 0 must
	// not divide by zero below.
	if err := o.Layout.Check(o.Layout.Tile); err != nil {
		return fmt.Errorf("-tile %d -c %d: %w", o.Layout.Tile, o.Layout.C, err)
	}
	switch {
	case o.D < 2:
		return fmt.Errorf("-d %d: the hidden size must be at least 2", o.D)
	case o.F < 1 || o.F%o.Layout.Tile != 0:
		return fmt.Errorf("-f %d: the MLP width must be a positive multiple of the tile width %d", o.F, o.Layout.Tile)
	case o.M < 1:
		return fmt.Errorf("-m %d: the token count must be positive", o.M)
	case o.Reps < 1:
		return fmt.Errorf("-reps %d: must be positive", o.Reps)
	case len(o.Densities) == 0:
		return fmt.Errorf("-density: no densities given")
	case o.TraceSteps < 0:
		return fmt.Errorf("-trace-steps %d must not be negative", o.TraceSteps)
	}
	for _, d := range o.Densities {
		if !(d > 0 && d < 1) {
			return fmt.Errorf("-density %g: must be inside (0, 1)", d)
		}
	}
	return o.Layout.Check(o.F)
}

// HostBytes estimates the host memory of the benchmark: two input batches,
// the float32 weights and the CPU kernels' copies of them, the outputs, the
// dense path's hidden activations and the packed TwELL activation.
func (o FFNOptions) HostBytes() float64 {
	m, d, f := float64(o.M), float64(o.D), float64(o.F)
	c := float64(max(o.Layout.C, 1))
	return 4 * (4*m*d + 7*f*d + 2*m*f + m*f/c)
}

// FFNSchema names the layout of an FFNResult row in JSON, and its version.
const FFNSchema = "twell.bench.ffn/1"

// FFNResult is one measured case. JSON names are those of the bench record.
type FFNResult struct {
	Row                   // Schema FFNSchema
	D             int     `json:"d"`
	F             int     `json:"f"`
	M             int     `json:"m"`
	Density       float64 `json:"density"`
	Dist          string  `json:"dist"`
	Gated         bool    `json:"gated"`
	C             int     `json:"compression"`
	Reps          int     `json:"reps"`
	NNZMean       float64 `json:"nnz_mean"`
	NNZMax        int     `json:"nnz_max"`
	OverflowRows  int     `json:"overflow_rows"`
	DenseMS       float64 `json:"dense_ms"`
	TwELLMS       float64 `json:"twell_ms"`
	Speedup       float64 `json:"speedup"`
	RelErr        float64 `json:"rel_err"`
	DenseRelErr   float64 `json:"dense_rel_err"`
	DenseActBytes int64   `json:"dense_act_bytes"`
	TwELLActBytes int64   `json:"twell_act_bytes"`
	DenseGFLOPS   float64 `json:"dense_gflops"`

	// GPU runs only (FFNCUDA); zero and left out on the CPU.
	D2TKernel string  `json:"d2t_kernel,omitempty"` // wgmma, mma or lt, under the row's settings
	Tail      string  `json:"tail,omitempty"`       // the kernels of the TwELL timing: sorted or warp after D2T ("+hot": with hot units), or small-batch
	D2TMS     float64 `json:"d2t_ms,omitempty"`     // the D2T kernel alone, under the row's settings
	AutoMS    float64 `json:"auto_ms,omitempty"`    // MLP.Forward, the automatic path
	// DenseD2TMS is the dense MLP with its gate and up products in the
	// wgmma D2T kernel (MLP.DenseInD2T; Hopper only), the automatic path's
	// dense arm from gpu's denseD2TMinRows tokens on.
	DenseD2TMS     float64 `json:"dense_d2t_ms,omitempty"`
	DenseD2TRelErr float64 `json:"dense_d2t_rel_err,omitempty"`
	AutoSpeedup    float64 `json:"auto_speedup,omitempty"`
	AutoPath       string  `json:"auto_path,omitempty"` // the path most of its timed calls ran
	// AutoCalls counts the automatic path's timed calls (warm-up calls
	// included) by the path each ran, when both ran.
	AutoCalls       map[string]int `json:"auto_calls,omitempty"`
	AutoRelErr      float64        `json:"auto_rel_err,omitempty"`
	DenseMJPerToken float64        `json:"dense_mj_per_token,omitempty"` // NVML energy per token
	TwELLMJPerToken float64        `json:"twell_mj_per_token,omitempty"`
	AutoMJPerToken  float64        `json:"auto_mj_per_token,omitempty"`
	// The mean power of each path's energy window, the median SM clock
	// sampled every 10 ms through it, and the share of those samples in
	// which the driver held the clocks down to keep within the power limit
	// (null where not readable); the board's power limit and the SM clock's
	// maximum. A share near 1 means the path's time there is set by its
	// energy, not by its kernels at full clock.
	DenseWatts       float64  `json:"dense_watts,omitempty"`
	TwELLWatts       float64  `json:"twell_watts,omitempty"`
	AutoWatts        float64  `json:"auto_watts,omitempty"`
	DenseSMClockMHz  int      `json:"dense_sm_clock_mhz,omitempty"`
	TwELLSMClockMHz  int      `json:"twell_sm_clock_mhz,omitempty"`
	AutoSMClockMHz   int      `json:"auto_sm_clock_mhz,omitempty"`
	DensePowerCapped *float64 `json:"dense_power_capped,omitempty"`
	TwELLPowerCapped *float64 `json:"twell_power_capped,omitempty"`
	AutoPowerCapped  *float64 `json:"auto_power_capped,omitempty"`
	PowerLimitWatts  float64  `json:"power_limit_watts,omitempty"`
	MaxSMClockMHz    int      `json:"max_sm_clock_mhz,omitempty"`
	// The same for the D2T kernel alone under the row's settings: whether
	// the gate GEMM with its packing epilogue is itself held to the power
	// limit, and at what clock.
	D2TMJPerToken  float64  `json:"d2t_mj_per_token,omitempty"`
	D2TWatts       float64  `json:"d2t_watts,omitempty"`
	D2TSMClockMHz  int      `json:"d2t_sm_clock_mhz,omitempty"`
	D2TPowerCapped *float64 `json:"d2t_power_capped,omitempty"`
	InputBuffers   int      `json:"input_buffers,omitempty"` // rotated x batches
	// HotUnits is how many units MLP.Calibrate chose to compute densely (on
	// a batch of its own, before the timings, when some row's settings turn
	// them on; the rows whose settings leave them off run every unit
	// sparse), HotCovered the fraction of the
	// calibration batch's active pairs they held.
	HotUnits   int     `json:"hot_units,omitempty"`
	HotCovered float64 `json:"hot_covered,omitempty"`
	// DenseTrace and TwELLTrace are what kernel traces of FFNOptions.TraceSteps
	// more calls of each path show, a call a step; Traces holds their
	// kernels for WriteChromeTrace.
	DenseTrace *TraceSummary  `json:"dense_trace,omitempty"`
	TwELLTrace *TraceSummary  `json:"twell_trace,omitempty"`
	TraceError string         `json:"trace_error,omitempty"` // why a trace is missing: the tracer failed
	Traces     []TraceSection `json:"-"`
}

// FFNCPU runs the MLP-block benchmark on the CPU: the project's dense MLP
// (blocked AVX-512 GEMMs) against the TwELL MLP, for each density.
func FFNCPU(o FFNOptions, progress func(string)) ([]FFNResult, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if o.RefRows == 0 {
		o.RefRows = 16
	}
	r := rand.New(rand.NewPCG(o.Seed, 0x7e11))
	// Two input batches, alternated between repetitions, so that neither path
	// is timed on data left in cache by the previous call.
	xs := [][]float32{synth.Tokens(r, o.M, o.D), synth.Tokens(r, o.M, o.D)}
	refRows := synth.SampleRows(r, o.M, o.RefRows)
	if err := o.checkDumpDir(); err != nil {
		return nil, err
	}
	if o.DumpDir != "" {
		if err := dumpFFNInputs(o, xs[0], refRows); err != nil {
			return nil, err
		}
	}
	var out []FFNResult
	for _, density := range o.Densities {
		if progress != nil {
			progress(fmt.Sprintf("density %g: building weights", density))
		}
		sl, err := synth.NewLayer(r, o.D, o.F, density, o.Dist, o.Gated)
		if err != nil {
			return nil, err
		}
		if o.M <= 4 {
			// Decode-sized: both paths read bf16 weight copies (bandwidth-bound),
			// so the model is the bf16 one: round the weights once, and the
			// float64 reference below sees the same weights.
			for _, w := range [][]float32{sl.Gate, sl.Up, sl.Down} {
				roundBF16(w)
			}
		}
		if o.DumpDir != "" {
			if err := dumpFFNLayer(o, density, sl); err != nil {
				return nil, err
			}
		}
		l, err := cpu.NewMLP(sl.Gate, sl.Up, sl.Down, o.D, o.F)
		if err != nil {
			return nil, err
		}
		if o.M <= 4 {
			l.UseBF16ForSmallM()
		}
		want := make([][]float64, len(refRows))
		for i, row := range refRows {
			want[i], _ = sl.Reference(xs[0][row*o.D : (row+1)*o.D])
		}
		yd := make([]float32, o.M*o.D)
		ys := make([]float32, o.M*o.D)

		if progress != nil {
			progress(fmt.Sprintf("density %g: timing dense", density))
		}
		denseMS, err := timeMS(o.Reps, func(rep int) error { return l.Dense(yd, xs[(rep+2)%2], o.M) })
		if err != nil {
			return nil, err
		}
		if progress != nil {
			progress(fmt.Sprintf("density %g: timing TwELL", density))
		}
		var packed *twell.Matrix
		twellMS, err := timeMS(o.Reps, func(rep int) error {
			var err error
			packed, err = l.Sparse(ys, xs[(rep+2)%2], o.M, o.Layout)
			return err
		})
		if err != nil {
			return nil, err
		}
		// The last repetition ran on xs[(reps-1)%2]; recompute both outputs on
		// xs[0], the batch the reference rows come from.
		if err := l.Dense(yd, xs[0], o.M); err != nil {
			return nil, err
		}
		if packed, err = l.Sparse(ys, xs[0], o.M, o.Layout); err != nil {
			return nil, err
		}
		res := FFNResult{
			Row: newRow(FFNSchema, "cpu", CPUName()),
			D:   o.D, F: o.F, M: o.M, Density: density, Dist: string(o.Dist), Gated: o.Gated,
			C: o.Layout.C, Reps: o.Reps,
			DenseMS: denseMS, TwELLMS: twellMS, Speedup: denseMS / twellMS,
			RelErr:        synth.RelErr(ys, o.D, refRows, want),
			DenseRelErr:   synth.RelErr(yd, o.D, refRows, want),
			DenseActBytes: int64(l.DenseActBytes(o.M)),
			TwELLActBytes: int64(packed.Bytes() + 4*o.Layout.Tile*len(packed.Spill)),
			OverflowRows:  len(packed.OverflowRows()),
		}
		res.NNZMean, res.NNZMax = nnzStats(packed)
		flops := 4.0 * float64(o.M) * float64(o.D) * float64(o.F)
		if o.Gated {
			flops *= 1.5
		}
		res.DenseGFLOPS = flops / denseMS / 1e6
		out = append(out, res)
	}
	return out, nil
}

func nnzStats(p *twell.Matrix) (mean float64, maxNNZ int) {
	total := 0
	for r := 0; r < p.Rows; r++ {
		n := p.RowNNZ(r)
		total += n
		maxNNZ = max(maxNNZ, n)
	}
	if p.Rows > 0 {
		mean = float64(total) / float64(p.Rows)
	}
	return mean, maxNNZ
}
