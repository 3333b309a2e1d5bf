package bench

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/twell-ai/twell/cuda/nvml"
	"github.com/twell-ai/twell/gpu/trainer"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/synth/sparsify"
	"github.com/twell-ai/twell/train"
)

// TrainStepOptions configures the whole-step training benchmark: the
// SparseLM-1.5B shape (optionally fewer layers) with random weights whose
// gates are calibrated to a density, trained on one micro-batch per step.
type TrainStepOptions struct {
	Layers     int // 0: the shape's 28
	Batch, Seq int
	Density    float64
	Dist       synth.Dist
	Steps      int // timed steps per path, after 2 warm-up steps
	Seed       uint64
	L1         float64
	LogitRows  int  // token rows of logits at once in the cross-entropy (0: the trainer's default)
	Recompute  bool // trainer.Options.Recompute: each layer's forward again before its backward
	// Profile adds, after the timed steps, one step per path timed stage
	// by stage (trainer.Backend.Profile; the events it records are not
	// in the timed steps).
	Profile bool
	// Paths are the MLP paths timed, in this order (nil: dense, sparse and
	// auto).
	Paths []mlp.Path
}

// paths returns o.Paths, or all three when it is empty.
func (o TrainStepOptions) paths() []mlp.Path {
	if len(o.Paths) == 0 {
		return []mlp.Path{mlp.Dense, mlp.Sparse, mlp.Auto}
	}
	return o.Paths
}

// Validate reports the first bad option, naming it.
func (o TrainStepOptions) Validate() error {
	switch {
	case o.Layers < 0:
		return fmt.Errorf("-layers %d: must be >= 0", o.Layers)
	case o.Batch < 1 || o.Seq < 1:
		return fmt.Errorf("-batch %d -seq %d: must be positive", o.Batch, o.Seq)
	case !(o.Density > 0 && o.Density < 1):
		return fmt.Errorf("-density %g: must be inside (0, 1)", o.Density)
	case o.Steps < 1:
		return fmt.Errorf("-steps %d: must be positive", o.Steps)
	case o.L1 < 0:
		return fmt.Errorf("-l1 %g: must be >= 0", o.L1)
	case o.LogitRows < 0:
		return fmt.Errorf("-logit-rows %d: must be >= 0", o.LogitRows)
	}
	for i, p := range o.Paths {
		if slices.Contains(o.Paths[:i], p) {
			return fmt.Errorf("-paths: %v given twice", p)
		}
	}
	return nil
}

// TrainStepSchema names the layout of a TrainStepResult row in JSON.
const TrainStepSchema = "twell.bench.train-step/1"

// TrainStepResult is one MLP path's whole training step.
type TrainStepResult struct {
	Row                  // Schema TrainStepSchema
	Model        string  `json:"model"`
	Params       int64   `json:"params"`
	Layers       int     `json:"layers"`
	Batch        int     `json:"batch"`
	Seq          int     `json:"seq"`
	LogitRows    int     `json:"logit_rows"`          // token rows of logits at once in the cross-entropy
	Recompute    bool    `json:"recompute,omitempty"` // activations recomputed in the backward
	Density      float64 `json:"density"`             // the gates' calibrated density
	Path         string  `json:"mlp_path"`
	SparseLayers int     `json:"sparse_layers"` // layers that ran sparse in the timed steps
	L0Mean       float64 `json:"l0_mean"`       // measured active units per token, mean over layers
	StepMS       float64 `json:"step_ms"`       // median
	TokensPerMS  float64 `json:"tokens_per_ms"`
	MFU          float64 `json:"mfu"` // the dense model's training FLOPs per token (the same for every path) at this rate, over the dense bf16 peak
	PeakBytes    int64   `json:"peak_bytes"`
	MJPerToken   float64 `json:"mj_per_token,omitempty"` // NVML energy over the timed steps
	Steps        int     `json:"steps"`
	// Stages is the profiled step's GPU time per stage (Profile).
	Stages []trainer.StageTime `json:"stages,omitempty"`
}

// TrainStepCUDA times whole training steps (forward, backward, clipping,
// AdamW with learning rate 0, so the calibrated gates stay as built) on
// CUDA device 0 for each of o's MLP paths in turn (dense, sparse and
// automatic unless o.Paths names others), one backend at a time, on the
// same weights and tokens; the median step time (wall clock, the device
// synchronised after each step) of o.Steps steps after 2 warm-up steps.
func TrainStepCUDA(o TrainStepOptions, progress func(string)) ([]TrainStepResult, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	say := sayer(progress)
	c := model.SparseLM1B5()
	if o.Layers > 0 {
		c.NumHiddenLayers = o.Layers
	}
	dev, meter, err := openGPU(say)
	if err != nil {
		return nil, err
	}
	props := dev.Properties()
	r := rand.New(rand.NewPCG(o.Seed, 0x57e9))
	say("building the %d-layer model (%.2fB parameters) and calibrating its gates to %g %s (CPU)",
		c.NumHiddenLayers, float64(c.ParamCount())/1e9, o.Density, o.Dist)
	m, err := model.New(c, model.RandomWeights(c, r))
	if err != nil {
		return nil, err
	}
	if err := sparsify.Gates(m, o.Density, o.Dist, r); err != nil {
		return nil, err
	}
	tokens := make([]int, o.Batch*(o.Seq+1))
	for i := range tokens {
		tokens[i] = r.IntN(c.VocabSize)
	}
	h := train.AdamW{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.1}
	flops := train.FLOPsPerToken(c, o.Seq)
	var out []TrainStepResult
	for _, path := range o.paths() {
		say("%v MLP path: loading the model", path)
		b, err := trainer.New(dev, c, m.Weights, trainer.Options{Batch: o.Batch, Seq: o.Seq, MLP: path, LogitRows: o.LogitRows,
			Recompute: o.Recompute})
		if err != nil {
			return nil, fmt.Errorf("%v path: %w", path, err)
		}
		res := TrainStepResult{Row: newRow(TrainStepSchema, "cuda", fmt.Sprintf("%s, %d SMs", props.Name, props.SMs)),
			Model: "SparseLM-1.5B shape, random weights, calibrated gates", Params: c.ParamCount(), Layers: c.NumHiddenLayers,
			Batch: o.Batch, Seq: o.Seq, LogitRows: b.LogitRows(), Recompute: o.Recompute, Density: o.Density, Path: path.String(), Steps: o.Steps}
		var ms []float64
		var mt *nvml.Meter
		for step := range o.Steps + 2 {
			if step == 2 && meter != nil {
				mt, _ = meter.StartMeter() // no figure when the meter cannot start
			}
			sparse := b.SparseLayers()
			t0 := time.Now()
			st, err := trainStep(b, tokens, o, h)
			if err == nil {
				err = dev.Synchronize()
			}
			if err != nil {
				b.Close()
				return nil, fmt.Errorf("%v path, step %d: %w", path, step, err)
			}
			el := float64(time.Since(t0).Microseconds()) / 1e3
			if step >= 2 {
				ms = append(ms, el)
				res.SparseLayers = 0
				for _, s := range sparse {
					if s {
						res.SparseLayers++
					}
				}
				res.L0Mean = 0
				for _, v := range st.L0 {
					res.L0Mean += v / float64(len(st.L0))
				}
			}
		}
		if mt != nil {
			if j, _, err := mt.Stop(); err == nil {
				res.MJPerToken = 1000 * j / float64(o.Steps*o.Batch*o.Seq)
			}
		}
		res.PeakBytes = b.PeakMemory()
		if o.Profile {
			if res.Stages, err = profileStep(b, tokens, o, h); err != nil {
				b.Close()
				return nil, fmt.Errorf("%v path, profiled step: %w", path, err)
			}
		}
		if err := b.Close(); err != nil {
			return nil, err
		}
		// The next path's peak is measured from an empty device.
		if err := dev.EmptyCache(); err != nil {
			return nil, err
		}
		res.StepMS = Median(ms)
		res.TokensPerMS = float64(o.Batch*o.Seq) / res.StepMS
		if peak := b.PeakFLOPS(); peak > 0 {
			res.MFU = flops * res.TokensPerMS * 1e3 / peak
		}
		say("%v MLP path: %.1f ms a step, %.1f tokens/ms, MFU %.1f%%, %d sparse layers, l0 %.1f/%d, peak %.1f GiB, %.3f mJ/token",
			path, res.StepMS, res.TokensPerMS, 100*res.MFU, res.SparseLayers, res.L0Mean, c.IntermediateSize, float64(res.PeakBytes)/(1<<30), res.MJPerToken)
		out = append(out, res)
	}
	return out, nil
}

// profileStep runs one more step with the stage clock on and returns its
// stage times.
func profileStep(b *trainer.Backend, tokens []int, o TrainStepOptions, h train.AdamW) ([]trainer.StageTime, error) {
	if err := b.Profile(true); err != nil {
		return nil, err
	}
	_, err := trainStep(b, tokens, o, h)
	var st []trainer.StageTime
	if err == nil {
		st, err = b.StageTimes()
	}
	return st, errors.Join(err, b.Profile(false))
}

// trainStep runs one step of one micro-batch with learning rate 0.
func trainStep(b *trainer.Backend, tokens []int, o TrainStepOptions, h train.AdamW) (*train.StepStats, error) {
	if err := b.BeginStep(1); err != nil {
		return nil, err
	}
	if err := b.Accumulate(tokens, o.Batch, o.Seq, o.L1); err != nil {
		return nil, err
	}
	st, err := b.EndStep()
	if err != nil {
		return nil, err
	}
	if _, err := b.ClipGradients(1); err != nil {
		return nil, err
	}
	return st, b.Update(h, 0)
}
