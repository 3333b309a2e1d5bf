package train

import (
	"fmt"

	"github.com/twell-ai/twell/model"
)

// Backend holds a model being trained, its gradients and its optimizer state
// on one device, and does all the math of training: everything that touches
// parameters or activations. The training loop (Run: schedule, data order,
// gradient accumulation count, dead-unit tracking, evaluation, checkpoints,
// metrics, plots, resume) is written once over it. CPU is the float32
// reference implementation; a GPU backend implements the same calls with
// device kernels (its AdamW a fused kernel), so nothing in this interface
// names a CPU type.
//
// One optimizer step is
//
//	BeginStep(n); Accumulate(...) n times; EndStep(); ClipGradients(clip); Update(opt, lr)
//
// optionally followed by ReinitUnits. Host synchronisation: Accumulate may
// return before the device has finished (errors it could not report then
// come from EndStep), and the statistics of a step are read once, by
// EndStep; so a step waits for the device once for the statistics and once
// for the gradient norm, never per micro-batch. Loss (evaluation) waits for
// its result.
//
// A Backend is driven by one goroutine.
type Backend interface {
	// Config returns the configuration of the model being trained.
	Config() model.Config
	// BeginStep starts an optimizer step of microBatches micro-batches: it
	// clears the gradients and the step's statistics.
	BeginStep(microBatches int) error
	// Accumulate runs the forward and backward pass of one micro-batch and
	// adds its gradients and statistics to the step's. tokens holds batch
	// rows of seq+1 ids: the inputs are the first seq ids of a row, the
	// targets the last seq. The loss is the mean cross-entropy plus l1 times
	// the L1 penalty on the MLP hidden activations (mean over tokens of
	// sum_j |h_j|, averaged over layers). The backend may keep tokens only
	// until Accumulate returns.
	Accumulate(tokens []int, batch, seq int, l1 float64) error
	// EndStep waits for the step's micro-batches, makes the gradient the mean
	// of their gradients, and returns the step's statistics: Loss, L1 and L0
	// are means over the micro-batches (each term divided by their count, then
	// summed, in order), Active is summed over them.
	EndStep() (*StepStats, error)
	// ClipGradients scales the gradient so that its global L2 norm (over
	// every parameter) is at most maxNorm (0: no clipping), and returns the
	// norm before clipping.
	ClipGradients(maxNorm float64) (norm float64, err error)
	// Update applies one AdamW step with learning rate lr and the
	// hyperparameters h: decoupled weight decay on the matrices (embeddings,
	// projections, LM head), none on the RMSNorm gains; bias-corrected
	// moments. It advances OptimizerState.Step by one.
	Update(h AdamW, lr float64) error
	// ReinitUnits re-initialises MLP hidden units: unit u.Unit of layer
	// u.Layer gets the gate row u.Gate (gated MLPs only) and the up row u.Up,
	// a zero down column, and zero AdamW moments for all three.
	ReinitUnits(units []UnitInit) error
	// Loss returns the mean cross-entropy of the targets of one batch (laid
	// out as for Accumulate), without the L1 term and without touching the
	// gradients or the step's statistics.
	Loss(tokens []int, batch, seq int) (float64, error)
	// Weights returns the parameters as host model weights, e.g. to save
	// them. They may share memory with the backend: they are valid until
	// the next call that changes parameters, and must not be modified.
	Weights() (*model.Weights, error)
	// OptimizerState returns the AdamW state in host memory, with the same
	// validity as Weights.
	OptimizerState() (*OptimizerState, error)
	// Load replaces the parameters and the optimizer state (nil: fresh
	// moments, step 0), e.g. to resume from a checkpoint. The backend may
	// keep w's memory. Shapes must match Config.
	Load(w *model.Weights, opt *OptimizerState) error
	// Close frees what the backend holds; it must not be used after.
	Close() error
}

// PeakRater is implemented by backends that know their device's peak dense
// bf16 rate; the loop then reports model FLOPs utilisation (MFU) in its
// progress lines.
type PeakRater interface {
	// PeakFLOPS returns the device's peak dense bf16 FLOP/s, or 0 when
	// unknown.
	PeakFLOPS() float64
}

// Parallel is implemented by a backend that can be one rank of a
// data-parallel run (the GPU backend with a communicator). In such a run
// every rank drives its own Run over the same config and data: micro-batch
// a of a step is run by rank MicroBatchRank(a, world) (BeginStep is given
// the step's total; the backend sums gradients and statistics over the
// ranks), every rank evaluates and tracks units alike, ranks agree at each
// step whether to stop, and only rank 0 writes the run folder (metrics,
// checkpoints, plots); every rank takes part in a checkpoint's
// OptimizerState, which gathers the sharded moments.
type Parallel interface {
	// Ranks returns this process's rank and the number of ranks; world 0
	// when the backend is not part of a data-parallel run.
	Ranks() (rank, world int)
	// AnyStop tells every rank whether this one asks to stop and returns
	// whether any does, waiting for all of them.
	AnyStop(stop bool) (bool, error)
}

// MicroBatchRank returns the rank that runs micro-batch a of a step in a
// data-parallel run of world ranks.
func MicroBatchRank(a, world int) int { return a % world }

// PathKeeper is implemented by a backend that chooses each layer's MLP path
// for a step from the density of the step before (the GPU backend under
// mlp.Auto). The loop saves the choice with each checkpoint and gives it
// back on resume, so that a resumed run takes the paths an uninterrupted
// one takes.
type PathKeeper interface {
	// SparseLayers reports, per layer, whether the next step runs the
	// MLP's sparse kernels.
	SparseLayers() []bool
	// SetSparseLayers sets that choice for the next step (one entry per
	// layer). A backend whose path is fixed by its options keeps it.
	SetSparseLayers(sparse []bool) error
}

// StepStats reports a forward and backward pass, or a whole step (see
// Backend.EndStep).
type StepStats struct {
	Loss float64 // cross-entropy (nats per target token)
	L1   float64 // the penalty term added to the loss (lambda included)
	// Active[l][j] counts the tokens for which unit j of layer l fired.
	Active [][]int32
	// L0 is the mean number of active MLP units per token, per layer.
	L0 []float64
	// SparseMLP says, per layer, whether its MLP ran the sparse kernels in
	// the step; nil for a backend whose MLPs always run dense.
	SparseMLP []bool
}

// AdamW holds the hyperparameters of an AdamW update (Loshchilov & Hutter).
type AdamW struct {
	Beta1, Beta2 float64 // moment decay rates, in [0, 1)
	Eps          float64 // added to the root of the second moment
	WeightDecay  float64 // decoupled decay per unit of learning rate
}

// OptimizerState is AdamW's state: the number of updates applied and the
// first (M) and second (V) moments, one slice per parameter tensor in the
// order of Tensors, each of that tensor's size.
type OptimizerState struct {
	Step int64
	M, V [][]float32
}

// UnitInit is the fresh state of one MLP hidden unit (see
// Backend.ReinitUnits). Gate is nil for an ungated MLP.
type UnitInit struct {
	Layer, Unit int
	Gate, Up    []float32 // rows of HiddenSize values
}

// Tensor names one parameter tensor of a model: its Hugging Face name and
// shape.
type Tensor struct {
	Name  string
	Shape []int
}

// Size returns the number of values of the tensor.
func (t Tensor) Size() int {
	n := 1
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// Tensors lists the parameter tensors of a model with config c in the
// order of OptimizerState: the embedding; per layer the attention norm, q,
// k, v, o, the MLP norm, gate (gated MLPs only), up, down; the final norm;
// the LM head (untied models only).
func Tensors(c model.Config) []Tensor {
	h, hd, q, kv, f := c.HiddenSize, c.HeadDim, c.NumAttentionHeads, c.NumKeyValueHeads, c.IntermediateSize
	out := []Tensor{{"model.embed_tokens.weight", []int{c.VocabSize, h}}}
	for i := 0; i < c.NumHiddenLayers; i++ {
		p := fmt.Sprintf("model.layers.%d.", i)
		out = append(out,
			Tensor{p + "input_layernorm.weight", []int{h}},
			Tensor{p + "self_attn.q_proj.weight", []int{q * hd, h}},
			Tensor{p + "self_attn.k_proj.weight", []int{kv * hd, h}},
			Tensor{p + "self_attn.v_proj.weight", []int{kv * hd, h}},
			Tensor{p + "self_attn.o_proj.weight", []int{h, q * hd}},
			Tensor{p + "post_attention_layernorm.weight", []int{h}})
		if c.MLPGated {
			out = append(out, Tensor{p + "mlp.gate_proj.weight", []int{f, h}})
		}
		out = append(out, Tensor{p + "mlp.up_proj.weight", []int{f, h}}, Tensor{p + "mlp.down_proj.weight", []int{h, f}})
	}
	out = append(out, Tensor{"model.norm.weight", []int{h}})
	if !c.TieWordEmbeddings {
		out = append(out, Tensor{"lm_head.weight", []int{c.VocabSize, h}})
	}
	return out
}
