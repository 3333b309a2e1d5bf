package bench

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/nvml"
	"github.com/twell-ai/twell/gpu/trainer"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/synth"
)

// TrainMLPOptions configures the training MLP-block benchmark: one MLP
// block's forward and backward with the L1 term, dense against sparse.
type TrainMLPOptions struct {
	D, F, M   int
	Densities []float64
	Dist      synth.Dist
	Gated     bool
	Reps      int
	Seed      uint64
	L1        float64 // L1 coefficient on the mean over tokens of Σ|h|
	Profile   bool    // also time each stage of both paths alone
}

// Validate reports the first bad option, naming it.
func (o TrainMLPOptions) Validate() error {
	switch {
	case o.D < 8 || o.D%8 != 0:
		return fmt.Errorf("-d %d: the hidden size must be a positive multiple of 8", o.D)
	case o.F < 8 || o.F%8 != 0:
		return fmt.Errorf("-f %d: the MLP width must be a positive multiple of 8", o.F)
	case o.M < 1:
		return fmt.Errorf("-m %d: the token count must be positive", o.M)
	case int64(o.M)*int64(o.F) >= 1<<31:
		return fmt.Errorf("-m %d -f %d: at most 2^31 - 1 token-unit pairs", o.M, o.F)
	case o.Reps < 1:
		return fmt.Errorf("-reps %d: must be positive", o.Reps)
	case len(o.Densities) == 0:
		return fmt.Errorf("-density: no densities given")
	case o.L1 < 0 || math.IsNaN(o.L1):
		return fmt.Errorf("-l1 %g: must be >= 0", o.L1)
	}
	for _, d := range o.Densities {
		if !(d > 0 && d < 1) {
			return fmt.Errorf("-density %g: must be inside (0, 1)", d)
		}
	}
	return nil
}

// HostBytes estimates the host memory of the benchmark: the float32
// operands and two copies of every result.
func (o TrainMLPOptions) HostBytes() float64 {
	m, d, f := float64(o.M), float64(o.D), float64(o.F)
	return 4 * (2*m*d + 3*f*d + 2*(2*m*d+3*f*d))
}

// TrainMLPSchema names the layout of a TrainMLPResult row in JSON.
const TrainMLPSchema = "twell.bench.train-mlp/1"

// TrainMLPResult is one measured case of TrainMLPCUDA.
type TrainMLPResult struct {
	Row                     // Schema TrainMLPSchema
	D               int     `json:"d"`
	F               int     `json:"f"`
	M               int     `json:"m"`
	Density         float64 `json:"density"`
	Dist            string  `json:"dist"`
	Gated           bool    `json:"gated"`
	L1Coeff         float64 `json:"l1_coeff"`
	Reps            int     `json:"reps"`
	NNZMean         float64 `json:"nnz_mean"`        // measured active units per token
	MaxUnitTokens   int     `json:"max_unit_tokens"` // tokens the busiest unit fired for
	DenseMS         float64 `json:"dense_ms"`        // forward + backward, dense GEMMs
	TwellMS         float64 `json:"twell_ms"`        // forward + backward, sparse kernels
	Speedup         float64 `json:"speedup"`         // dense / sparse
	AutoPath        string  `json:"auto_path"`       // the path mlp.Auto takes at the measured density
	AutoMS          float64 `json:"auto_ms"`         // that path's time
	AutoSpeedup     float64 `json:"auto_speedup"`    // dense / auto
	DenseTFLOPS     float64 `json:"dense_tflops"`    // dense path: 6 GEMMs' worth (9 gated) per token
	OutRelErr       float64 `json:"out_rel_err"`     // sparse against dense, whole tensors
	DXRelErr        float64 `json:"dx_rel_err"`      //
	DGateRelErr     float64 `json:"dgate_rel_err"`   //
	DUpRelErr       float64 `json:"dup_rel_err"`     //
	DDownRelErr     float64 `json:"ddown_rel_err"`   //
	DenseMJPerToken float64 `json:"dense_mj_per_token,omitempty"`
	TwellMJPerToken float64 `json:"twell_mj_per_token,omitempty"`

	DenseStages  []trainer.MLPStage `json:"dense_stages,omitempty"` // with Profile
	SparseStages []trainer.MLPStage `json:"sparse_stages,omitempty"`
}

// TrainMLPCUDA times one MLP block's training forward and backward (the
// code a training step runs per layer, L1 term included) on CUDA device 0,
// dense (cuBLASLt GEMMs) against sparse (sparse.cu), on the same bf16
// operands: the paths take turns, L2 is flushed before each call, CUDA
// events around each; the median of o.Reps after 3 warm-up calls. The
// sparse path's output and gradients are compared with the dense path's.
func TrainMLPCUDA(o TrainMLPOptions, progress func(string)) ([]TrainMLPResult, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	say := sayer(progress)
	dev, meter, err := openGPU(say)
	if err != nil {
		return nil, err
	}
	props := dev.Properties()
	gt, err := newGPUTiming(dev)
	if err != nil {
		return nil, err
	}
	defer gt.close()
	flush, timer := gt.flush, gt.timer
	blk, err := trainer.NewMLPBlock(dev, o.M, o.D, o.F, o.Gated, o.L1)
	if err != nil {
		return nil, err
	}
	defer blk.Close()

	r := rand.New(rand.NewPCG(o.Seed, 0x7a1))
	x := synth.Tokens(r, o.M, o.D)
	dy := make([]float32, o.M*o.D)
	for i := range dy {
		dy[i] = float32(r.NormFloat64())
	}
	s := blk.Stream()
	var out []TrainMLPResult
	for _, density := range o.Densities {
		say("density %g: building weights", density)
		sl, err := synth.NewLayer(r, o.D, o.F, density, o.Dist, o.Gated)
		if err != nil {
			return nil, err
		}
		if err := blk.Load(sl.Gate, sl.Up, sl.Down, x, dy); err != nil {
			return nil, err
		}
		res := TrainMLPResult{Row: newRow(TrainMLPSchema, "cuda", fmt.Sprintf("%s, %d SMs, %d MiB L2", props.Name, props.SMs, props.L2Bytes>>20)),
			D: o.D, F: o.F, M: o.M, Density: density, Dist: string(o.Dist), Gated: o.Gated, L1Coeff: o.L1, Reps: o.Reps}
		var got [2]*trainer.MLPBlockResult
		for i, sparse := range []bool{false, true} {
			if err := blk.Reset(); err != nil {
				return nil, err
			}
			if err := blk.Run(sparse); err != nil {
				return nil, err
			}
			if got[i], err = blk.Result(); err != nil {
				return nil, err
			}
		}
		d, sp := got[0], got[1]
		res.NNZMean = sp.L0
		res.MaxUnitTokens = int(slices.Max(sp.Active))
		res.OutRelErr, res.DXRelErr = relErr32(sp.Out, d.Out), relErr32(sp.DX, d.DX)
		res.DGateRelErr, res.DUpRelErr, res.DDownRelErr = relErr32(sp.DGate, d.DGate), relErr32(sp.DUp, d.DUp), relErr32(sp.DDown, d.DDown)
		auto := mlp.Choose(mlp.Auto, sp.L0/float64(o.F), trainer.DefaultDenseAbove)
		autoSparse := auto == mlp.Sparse
		res.AutoPath = auto.String()

		say("density %g: timing dense, sparse and auto (%s), in turns", density, res.AutoPath)
		runs := []func() error{func() error { return blk.Run(false) }, func() error { return blk.Run(true) },
			func() error { return blk.Run(autoSparse) }}
		for _, run := range runs {
			for range 3 {
				if err := run(); err != nil {
					return nil, err
				}
			}
		}
		ts := make([][]float64, len(runs))
		for i := 0; i < o.Reps; i++ {
			for j, run := range runs {
				if err := dev.Memset8(flush, byte(i+j), s); err != nil {
					return nil, err
				}
				ms, err := timer.TimeMS(s, run)
				if err != nil {
					return nil, err
				}
				ts[j] = append(ts[j], ms)
			}
		}
		res.DenseMS, res.TwellMS, res.AutoMS = Median(ts[0]), Median(ts[1]), Median(ts[2])
		res.Speedup, res.AutoSpeedup = res.DenseMS/res.TwellMS, res.DenseMS/res.AutoMS
		flops := 6.0 * 2 * float64(o.M) * float64(o.D) * float64(o.F)
		if o.Gated {
			flops *= 1.5
		}
		res.DenseTFLOPS = flops / res.DenseMS / 1e9
		if meter != nil {
			for i, p := range []*float64{&res.DenseMJPerToken, &res.TwellMJPerToken} {
				run := runs[i]
				if *p, _, err = energyPerToken(meter, s.Synchronize, func(int) error { return run() }, []float64{res.DenseMS, res.TwellMS}[i], o.Reps, o.M); err != nil {
					return nil, err
				}
			}
		}
		if o.Profile {
			if res.DenseStages, err = blk.Profile(false, 5); err != nil {
				return nil, err
			}
			if res.SparseStages, err = blk.Profile(true, 5); err != nil {
				return nil, err
			}
			for i, stages := range [][]trainer.MLPStage{res.DenseStages, res.SparseStages} {
				for _, st := range stages {
					say("density %g: %s %-40s %.3f ms", density, []string{"dense ", "sparse"}[i], st.Name, st.MS)
				}
			}
		}
		say("density %g: nnz %.1f/token; dense %.3f ms, sparse %.3f ms (%.2fx), auto %s %.3f ms (%.2fx); sparse vs dense rel err out %.1e dx %.1e dWg %.1e dWu %.1e dWd %.1e",
			density, res.NNZMean, res.DenseMS, res.TwellMS, res.Speedup, res.AutoPath, res.AutoMS, res.AutoSpeedup,
			res.OutRelErr, res.DXRelErr, res.DGateRelErr, res.DUpRelErr, res.DDownRelErr)
		out = append(out, res)
	}
	return out, nil
}

// relErr32 is ‖a − b‖ / ‖b‖ (0 for two empty slices).
func relErr32(a, b []float32) float64 {
	var d, n float64
	for i := range b {
		e := float64(a[i]) - float64(b[i])
		d += e * e
		n += float64(b[i]) * float64(b[i])
	}
	if n == 0 {
		return math.Sqrt(d)
	}
	return math.Sqrt(d / n)
}

// sayer formats progress messages for progress (nil: none).
func sayer(progress func(string)) func(string, ...any) {
	return func(format string, a ...any) {
		if progress != nil {
			progress(fmt.Sprintf(format, a...))
		}
	}
}

// openGPU opens CUDA device 0 and its NVML energy meter (nil, said, when
// NVML cannot give one).
func openGPU(say func(string, ...any)) (*cuda.Device, *nvml.Device, error) {
	dev, err := cuda.Open(0)
	if err != nil {
		return nil, nil, err
	}
	meter, err := nvml.DeviceByPCIBusID(dev.Properties().PCIBusID)
	if err != nil {
		say("no energy figures: %v", err)
		meter = nil
	}
	return dev, meter, nil
}
