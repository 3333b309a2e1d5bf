// Package trainer trains sparse-activation Llama models on one NVIDIA GPU:
// Backend implements train.Backend, so the training loop of package train
// (schedule, data, checkpoints, metrics, resume) drives it unchanged.
//
// Parameters, gradients and AdamW moments are fp32 on the device, each in
// one flat buffer laid out in train.Tensors order (each down projection
// transposed, [f][h]; the host sees train's shapes); a bf16 copy of the
// parameters (refreshed by the AdamW kernel) feeds the cuBLASLt GEMMs,
// which accumulate in fp32. Every layer's forward and backward runs on the
// device and follows train's CPU reference (train/layers.go): embedding,
// RMSNorm, the fused q/k/v projection, RoPE, causal attention, the output
// projection, the dense ReLU MLP with its L1 penalty and firing counts, the
// final norm, the LM head and a cross-entropy computed over chunks of rows
// so that the whole logit matrix never exists at once.
package trainer

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/nccl"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/train"
)

// Options sizes a Backend.
type Options struct {
	// Batch and Seq are the largest micro-batch (sequences, tokens each)
	// the backend will see: its activation memory is sized and checked
	// for them in New. Zero: sized at the first Accumulate or Loss (and
	// grown when a later call is larger).
	Batch, Seq int
	// LogitRows is the number of token rows whose logits exist at once in
	// the cross-entropy (0: a micro-batch's rows in as few even chunks as
	// fit in 512 MiB of fp32 logits each).
	LogitRows int
	// MLP is how the MLP blocks run: mlp.Auto (the zero value) chooses
	// per layer and step from the density the previous step measured
	// (mlp.Choose with DenseAbove; the first step runs dense). Any path
	// but mlp.Dense sizes each layer's saved activations for the sparse
	// path's worst case (every unit firing), so that no row is ever
	// dropped.
	MLP mlp.Path
	// DenseAbove is mlp.Auto's density threshold (0: DefaultDenseAbove).
	DenseAbove float64
	// Recompute keeps only each layer's input from the forward pass and
	// runs a layer's forward again, into buffers that all layers share,
	// just before its backward: one more forward pass a step for the
	// memory of one layer's activations instead of all of them. The
	// kernels are deterministic, so the step's results are bit for bit
	// those without it.
	Recompute bool
	// Comm, when set, makes the backend one rank of a data-parallel run
	// with a sharded optimizer (ZeRO-1; see parallel.go): each rank runs
	// its share of a step's micro-batches, the gradients are
	// reduce-scattered, each rank updates its slice of the fp32 weights
	// and AdamW moments, and the updated weights are all-gathered. Nil: a
	// single GPU.
	Comm *nccl.Comm
	// CommTimeout bounds every wait for collectives (0:
	// DefaultCommTimeout): past it the communicator is aborted and the
	// step fails, so that a dead or stuck rank ends every rank.
	CommTimeout time.Duration
}

// denseAbove returns mlp.Auto's threshold.
func (o Options) denseAbove() float64 {
	if o.DenseAbove > 0 {
		return o.DenseAbove
	}
	return DefaultDenseAbove
}

// Backend is train.Backend on one GPU (see the package comment).
type Backend struct {
	gpuCtx
	c    model.Config
	opts Options
	k    kernels

	specs []train.Tensor
	off   []int // element offset of each tensor in the flat buffers
	n     int   // parameter count

	// Flat fp32 parameters and gradients and bf16 parameters, each of
	// nPad values (n, padded to a whole number of equal shards when
	// sharded); the AdamW moments m and v hold only this rank's shard,
	// values [lo, hi) of the flat order (all n on a single GPU).
	w, g, m, v, wb *cuda.Buffer
	nPad, lo, hi   int
	flag           *cuda.Buffer // int32 scratch of AnyStop
	optStep        int64
	// clip is the factor ClipGradients found for this step's gradient
	// (clipped: below 1); AdamW multiplies each gradient value by it as it
	// reads it, g itself is never scaled. BeginStep, which clears g, drops
	// it.
	clip    float32
	clipped bool

	acts  *activations
	attn  map[[2]int]*attention
	ropes map[int][2]*cuda.Buffer // seq -> cos, sin (fp32 [seq][hd/2])

	// Step statistics on the device: stats fp64 [1+2L] (loss, then per
	// layer the L1 term and L0), active int32 [L][f]; evalStats and
	// evalActive are Loss's scratch copies; norm2 is ClipGradients' (fp64:
	// the sum of squares, then flatGrid partial sums).
	stats, active, evalStats, evalActive, norm2 *cuda.Buffer
	// A step of stepTotal micro-batches over all ranks, of which this
	// rank runs stepN (all of them on a single GPU) and has queued
	// stepDone; inStep is false outside a step and after a failed one.
	stepTotal, stepN, stepDone int
	inStep                     bool

	peak int64 // largest device memory in use seen at a synchronisation

	// sparse[l] says whether layer l's MLP runs sparse (mlp.Auto: decided
	// from the density the last step measured); stepSparse is what the
	// step's micro-batches ran (a layer counts when any of them ran it
	// sparse).
	sparse, stepSparse []bool

	prof *stageClock // nil: profiling off (Profile)
}

// New returns a Backend training w, a model with config c, on dev, with
// fresh optimizer moments. It refuses, naming both figures, a model (and,
// when o gives Batch and Seq, a micro-batch) whose training state does
// not fit in the device's free memory.
func New(dev *cuda.Device, c model.Config, w *model.Weights, o Options) (*Backend, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if o.Batch < 0 || o.Seq < 0 || o.LogitRows < 0 || (o.Batch > 0) != (o.Seq > 0) {
		return nil, fmt.Errorf("trainer: options batch %d, seq %d, logit rows %d: give both batch and seq (or neither), none negative",
			o.Batch, o.Seq, o.LogitRows)
	}
	if o.MLP > mlp.Dense || o.DenseAbove < 0 || o.DenseAbove > 1 {
		return nil, fmt.Errorf("trainer: options MLP path %v, dense above %g: want auto, sparse or dense and a density in [0, 1]",
			o.MLP, o.DenseAbove)
	}
	if o.MLP != mlp.Dense {
		if err := sparseOK(max(1, o.Batch*o.Seq), c.HiddenSize, c.IntermediateSize, sharedPerBlock(dev)); err != nil {
			if o.MLP == mlp.Sparse {
				return nil, err
			}
			o.MLP = mlp.Dense // auto: the sparse kernels cannot take this shape
		}
	}
	if !slices.Contains(attentionHeadDims, c.HeadDim) {
		return nil, fmt.Errorf("trainer: head_dim %d: the GPU attention kernels take %v", c.HeadDim, attentionHeadDims)
	}
	if err := normWidth(c.HiddenSize); err != nil {
		return nil, err
	}
	b := &Backend{gpuCtx: gpuCtx{dev: dev}, c: c, opts: o, specs: train.Tensors(c), attn: map[[2]int]*attention{},
		ropes: map[int][2]*cuda.Buffer{}, sparse: make([]bool, c.NumHiddenLayers), stepSparse: make([]bool, c.NumHiddenLayers)}
	for l := range b.sparse {
		b.sparse[l] = o.MLP == mlp.Sparse
	}
	b.layout()
	if o.Comm != nil {
		b.shard(o.Comm.Rank(), o.Comm.Size())
	} else {
		b.shard(0, 0)
	}
	need := b.stateBytes()
	if o.Batch > 0 {
		need += ActivationBytes(c, o.Batch, o.Seq, o)
	}
	if err := fits(dev, need, c, o.Batch, o.Seq, o); err != nil {
		return nil, err
	}
	if err := b.init(); err != nil {
		b.Close()
		return nil, err
	}
	if err := b.Load(w, nil); err != nil {
		b.Close()
		return nil, err
	}
	if o.Batch > 0 {
		if err := b.ensureActs(o.Batch, o.Seq); err != nil {
			b.Close()
			return nil, err
		}
	}
	return b, nil
}

// layout sets each tensor's offset in the flat buffers and their length.
func (b *Backend) layout() {
	b.off, b.n = nil, 0
	for _, t := range b.specs {
		b.off = append(b.off, b.n)
		b.n += t.Size()
	}
}

// init compiles the kernels and allocates the stream, cuBLAS handle,
// parameter state and statistics.
func (b *Backend) init() error {
	var err error
	if b.k, err = kernelsFor(b.dev); err != nil {
		return err
	}
	if err = b.open(b.k); err != nil {
		return err
	}
	L, f := b.c.NumHiddenLayers, b.c.IntermediateSize
	for _, a := range []struct {
		p *(*cuda.Buffer)
		n int
	}{{&b.w, 4 * b.nPad}, {&b.g, 4 * b.nPad}, {&b.m, 4 * (b.hi - b.lo)}, {&b.v, 4 * (b.hi - b.lo)}, {&b.wb, 2 * b.nPad},
		{&b.stats, 8 * (1 + 2*L)}, {&b.active, 4 * L * f}, {&b.evalStats, 8 * (1 + 2*L)}, {&b.evalActive, 4 * L * f},
		{&b.norm2, 8 * (1 + flatGrid)}, {&b.flag, 4}} {
		if *a.p, err = b.dev.Alloc(a.n); err != nil {
			return fmt.Errorf("trainer: allocating %d bytes of training state: %w", a.n, err)
		}
	}
	if b.nPad > b.n { // the padding takes part in collectives: keep it zero
		for _, buf := range []*cuda.Buffer{b.w, b.g, b.m, b.v, b.wb} {
			if err := b.dev.Memset8(buf, 0, b.s); err != nil {
				return err
			}
		}
	}
	return nil
}

// ParamBytes returns the device memory the training state of a model with
// config c takes: fp32 parameters, gradients and two moments, and a bf16
// copy of the parameters (18 bytes a parameter).
func ParamBytes(c model.Config) int64 {
	n := int64(0)
	for _, t := range train.Tensors(c) {
		n += int64(t.Size())
	}
	return 18 * n
}

// fits returns an error naming both figures when need bytes (with
// batch > 0: including the activations of micro-batches of batch x seq)
// exceed the device's free memory, and what would fit.
func fits(dev *cuda.Device, need int64, c model.Config, batch, seq int, o Options) error {
	free, err := dev.Available()
	if err != nil {
		return err
	}
	return fitError(need, free, dev.String(), c, batch, seq, o)
}

// fitSlack is memory kept free beyond the estimate: cuBLASLt's workspace,
// the kernels, the allocator's rounding.
const fitSlack = 64 << 20

// fitError is fits for a device (named dev) with free bytes free: nil when
// need fits, else an error with both figures and what would fit instead:
// the largest smaller micro-batch, the dense MLP path, recomputation.
func fitError(need, free int64, dev string, c model.Config, batch, seq int, o Options) error {
	if need+fitSlack <= free {
		return nil
	}
	what := fmt.Sprintf("training a %.1fM-parameter model", float64(c.ParamCount())/1e6)
	if o.Comm != nil {
		what += fmt.Sprintf(" (rank %d of %d)", o.Comm.Rank(), o.Comm.Size())
	}
	hint := ""
	state := need
	if batch > 0 {
		what += fmt.Sprintf(" on micro-batches of %d x %d tokens", batch, seq)
		state -= ActivationBytes(c, batch, seq, o)
		fit := 0
		for b := batch - 1; b >= 1 && fit == 0; b-- {
			if state+ActivationBytes(c, b, seq, o)+fitSlack <= free {
				fit = b
			}
		}
		if fit > 0 {
			hint = fmt.Sprintf("; micro-batches of at most %d x %d tokens would fit (use gradient accumulation)", fit, seq)
		} else {
			hint = fmt.Sprintf("; not even one sequence of %d tokens fits", seq)
		}
		if o.MLP != mlp.Dense {
			hint += "; the dense MLP path (-mlp dense) needs less activation memory"
		}
		if !o.Recompute {
			r := o
			r.Recompute = true
			if state+ActivationBytes(c, batch, seq, r)+fitSlack <= free {
				hint += fmt.Sprintf("; with -recompute (each layer's forward again in the backward) %d x %d tokens fit", batch, seq)
			} else {
				hint += "; -recompute keeps one layer's activations instead of all"
			}
		}
	}
	return fmt.Errorf("trainer: %s needs about %s of device memory (%s of weights, gradients and AdamW moments), but %s is free on %s%s",
		what, memcheck.Format(float64(need+fitSlack)), memcheck.Format(float64(state)), memcheck.Format(float64(free)), dev, hint)
}

// Config returns the configuration of the model being trained.
func (b *Backend) Config() model.Config { return b.c }

// PeakMemory returns the largest device memory in use (total less free,
// all processes) seen when the backend waited for the device.
func (b *Backend) PeakMemory() int64 { return b.peak }

// LogitRows returns the token rows whose logits exist at once in the
// cross-entropy (0 before the activations are sized).
func (b *Backend) LogitRows() int {
	if b.acts == nil {
		return 0
	}
	return b.acts.logitRows
}

// PeakFLOPS returns the GPU's peak dense bf16 tensor-core rate at its peak
// clock: 4096 FLOP per cycle and SM on Hopper (sm_90: 989 TFLOP/s for an
// H100 or H200 SXM), 2048 on Ampere and Ada (sm_80, sm_86, sm_89); 0 for
// other GPUs or when the driver reports no clock.
func (b *Backend) PeakFLOPS() float64 {
	p := b.dev.Properties()
	perSM := 0.0
	switch {
	case p.Major == 9:
		perSM = 4096
	case p.Major == 8:
		perSM = 2048
	}
	return perSM * float64(p.SMs) * float64(p.ClockKHz) * 1e3
}

func (b *Backend) samplePeak() {
	if free, total, err := b.dev.MemInfo(); err == nil && total-free > b.peak {
		b.peak = total - free
	}
}

// slicer cuts views of buffers, keeping the first error.
type slicer struct{ err error }

func (s *slicer) at(buf *cuda.Buffer, off, n int) *cuda.Buffer {
	if s.err != nil {
		return nil
	}
	v, err := buf.Slice(off, n)
	if err != nil {
		s.err = err
	}
	return v
}

// tensorView returns tensors [i, j) of a flat buffer of esize-byte values.
func (b *Backend) tensorView(sl *slicer, buf *cuda.Buffer, esize, i, j int) *cuda.Buffer {
	end := b.n
	if j < len(b.off) {
		end = b.off[j]
	}
	return sl.at(buf, esize*b.off[i], esize*(end-b.off[i]))
}

// Tensor indices within a layer, from its first (attention norm).
const (
	tAttnNorm = iota
	tQ
	tK
	tV
	tO
	tMLPNorm
	tGateOrUp // gate (gated) or up (ungated): the start of the fused MLP input matrix
)

// layerBase returns the index in specs of layer l's attention norm.
func (b *Backend) layerBase(l int) int {
	per := 8
	if b.c.MLPGated {
		per = 9
	}
	return 1 + l*per
}

// normIndex and headIndex are the final norm's and the LM head's indices
// (the head is the embedding, 0, when tied).
func (b *Backend) normIndex() int { return b.layerBase(b.c.NumHiddenLayers) }
func (b *Backend) headIndex() int {
	if b.c.TieWordEmbeddings {
		return 0
	}
	return b.normIndex() + 1
}

// hostTensors lists w's tensors in train.Tensors order, checking shapes.
func (b *Backend) hostTensors(w *model.Weights) ([][]float32, error) {
	if w == nil {
		return nil, errors.New("trainer: Load: no weights")
	}
	if len(w.Layers) != b.c.NumHiddenLayers {
		return nil, fmt.Errorf("trainer: weights of %d layers for a %d-layer model", len(w.Layers), b.c.NumHiddenLayers)
	}
	out := [][]float32{w.Embed}
	for _, l := range w.Layers {
		out = append(out, l.AttnNorm, l.Q, l.K, l.V, l.O, l.MLPNorm)
		if b.c.MLPGated {
			out = append(out, l.Gate)
		}
		out = append(out, l.Up, l.Down)
	}
	out = append(out, w.Norm)
	if !b.c.TieWordEmbeddings {
		out = append(out, w.LMHead)
	}
	for i, s := range b.specs {
		if len(out[i]) != s.Size() {
			return nil, fmt.Errorf("trainer: tensor %s has %d values, want %d (shape %v)", s.Name, len(out[i]), s.Size(), s.Shape)
		}
	}
	return out, nil
}

// upload copies one fp32 value per parameter, tensor by tensor, into the
// flat buffer dst (nil tensors: zeros).
func (b *Backend) upload(dst *cuda.Buffer, ts [][]float32) error {
	flat := make([]float32, b.n)
	b.flatten(flat, ts)
	return b.dev.CopyHtoD(dst, cuda.Bytes(flat))
}

// downTransposed reports whether tensor i is a layer's down projection,
// which every device buffer holds transposed, [f][h] (Wdᵀ): the sparse MLP
// then reads and adds whole rows per unit, and the dense path's GEMMs take
// either layout.
func (b *Backend) downTransposed(i int) bool {
	per := b.layerBase(1) - b.layerBase(0)
	return i >= b.layerBase(0) && i < b.normIndex() && (i-b.layerBase(0))%per == per-1
}

// flatten copies host tensors (train.Tensors order and shapes; nil:
// left as it is) into the flat device layout.
func (b *Backend) flatten(flat []float32, ts [][]float32) {
	for i, t := range ts {
		if t == nil {
			continue
		}
		if b.downTransposed(i) {
			s := b.specs[i].Shape
			train.Transpose(flat[b.off[i]:b.off[i]+len(t)], t, s[0], s[1])
			continue
		}
		copy(flat[b.off[i]:], t)
	}
}

// download copies the flat buffer src to host tensors in train.Tensors
// order and shapes (sharing one allocation, but for the down projections).
func (b *Backend) download(src *cuda.Buffer) ([][]float32, error) {
	if err := b.s.Synchronize(); err != nil {
		return nil, err
	}
	flat := make([]float32, b.n)
	if err := b.dev.CopyDtoH(cuda.Bytes(flat), src); err != nil {
		return nil, err
	}
	return b.unflatten(flat), nil
}

// unflatten cuts the flat device layout into host tensors, flatten's
// inverse.
func (b *Backend) unflatten(flat []float32) [][]float32 {
	out := make([][]float32, len(b.specs))
	for i, s := range b.specs {
		end := b.n
		if i+1 < len(b.off) {
			end = b.off[i+1]
		}
		out[i] = flat[b.off[i]:end:end]
		if b.downTransposed(i) {
			t := make([]float32, len(out[i]))
			train.Transpose(t, out[i], s.Shape[1], s.Shape[0])
			out[i] = t
		}
	}
	return out
}

// Load replaces the parameters and the optimizer state (nil: fresh moments,
// step 0). w's memory is copied, not kept.
func (b *Backend) Load(w *model.Weights, opt *train.OptimizerState) error {
	ts, err := b.hostTensors(w)
	if err != nil {
		return err
	}
	if opt != nil {
		if len(opt.M) != len(b.specs) || len(opt.V) != len(b.specs) {
			return fmt.Errorf("trainer: optimizer state of %d and %d moments for %d tensors", len(opt.M), len(opt.V), len(b.specs))
		}
		for i, s := range b.specs {
			if len(opt.M[i]) != s.Size() || len(opt.V[i]) != s.Size() {
				return fmt.Errorf("trainer: optimizer moments of %s have %d and %d values, want %d", s.Name, len(opt.M[i]), len(opt.V[i]), s.Size())
			}
		}
	}
	if err := b.s.Synchronize(); err != nil {
		return err
	}
	if err := b.upload(b.w, ts); err != nil {
		return err
	}
	if opt != nil {
		if err := b.uploadShard(b.m, opt.M); err != nil {
			return err
		}
		if err := b.uploadShard(b.v, opt.V); err != nil {
			return err
		}
		b.optStep = opt.Step
	} else {
		if err := b.dev.Memset8(b.m, 0, b.s); err != nil {
			return err
		}
		if err := b.dev.Memset8(b.v, 0, b.s); err != nil {
			return err
		}
		b.optStep = 0
	}
	b.inStep = false
	if err := b.run.toBF16(b.wb, b.w, b.n); err != nil {
		return err
	}
	return b.s.Synchronize()
}

// Weights copies the parameters to host model weights (fresh memory).
func (b *Backend) Weights() (*model.Weights, error) {
	ts, err := b.download(b.w)
	if err != nil {
		return nil, err
	}
	w := &model.Weights{Embed: ts[0], Norm: ts[b.normIndex()]}
	if !b.c.TieWordEmbeddings {
		w.LMHead = ts[b.headIndex()]
	}
	for l := 0; l < b.c.NumHiddenLayers; l++ {
		t := ts[b.layerBase(l):]
		lw := model.LayerWeights{AttnNorm: t[tAttnNorm], Q: t[tQ], K: t[tK], V: t[tV], O: t[tO], MLPNorm: t[tMLPNorm]}
		if b.c.MLPGated {
			lw.Gate, lw.Up, lw.Down = t[6], t[7], t[8]
		} else {
			lw.Up, lw.Down = t[6], t[7]
		}
		w.Layers = append(w.Layers, lw)
	}
	return w, nil
}

// OptimizerState copies the AdamW state to host memory.
func (b *Backend) OptimizerState() (*train.OptimizerState, error) {
	load := b.download
	if b.opts.Comm != nil { // every rank must call it: the moments are gathered
		load = b.gatherMoment
	}
	m, err := load(b.m)
	if err != nil {
		return nil, err
	}
	v, err := load(b.v)
	if err != nil {
		return nil, err
	}
	return &train.OptimizerState{Step: b.optStep, M: m, V: v}, nil
}

// Close waits for queued work and frees everything the backend holds.
func (b *Backend) Close() error {
	return b.close(b.freeAll)
}

// freeAll frees the backend's buffers (the device is idle).
func (b *Backend) freeAll() error {
	var errs []error
	for _, a := range b.attn {
		errs = append(errs, a.close())
	}
	b.attn = nil
	for _, r := range b.ropes {
		errs = append(errs, r[0].Free(), r[1].Free())
	}
	b.ropes = nil
	errs = append(errs, b.prof.free())
	b.prof = nil
	if b.acts != nil {
		errs = append(errs, b.acts.free())
		b.acts = nil
	}
	for _, p := range []**cuda.Buffer{&b.w, &b.g, &b.m, &b.v, &b.wb, &b.stats, &b.active, &b.evalStats, &b.evalActive, &b.norm2, &b.flag} {
		if *p != nil {
			errs = append(errs, (*p).Free())
			*p = nil
		}
	}
	return errors.Join(errs...)
}

// ropeTables returns the fp32 cos and sin tables for sequences of seq
// tokens (model.RoPEAngles, as the CPU reference), uploaded once.
func (b *Backend) ropeTables(seq int) (cos, sin *cuda.Buffer, err error) {
	if t, ok := b.ropes[seq]; ok {
		return t[0], t[1], nil
	}
	c64, s64 := model.RoPEAngles(b.c, seq)
	var bufs [2]*cuda.Buffer
	for i, src := range [][]float64{c64, s64} {
		v := make([]float32, len(src))
		for j, x := range src {
			v[j] = float32(x)
		}
		if bufs[i], err = b.dev.Alloc(4 * len(v)); err != nil {
			return nil, nil, err
		}
		if err = b.dev.CopyHtoD(bufs[i], cuda.Bytes(v)); err != nil {
			return nil, nil, err
		}
	}
	b.ropes[seq] = bufs
	return bufs[0], bufs[1], nil
}

// attention returns the attention of micro-batches of batch x seq tokens.
func (b *Backend) attentionFor(batch, seq int) (*attention, error) {
	if a, ok := b.attn[[2]int{batch, seq}]; ok {
		return a, nil
	}
	c := b.c
	a, err := newAttention(b.dev, b.blas, batch, seq, c.NumAttentionHeads, c.NumKeyValueHeads, c.HeadDim)
	if err != nil {
		return nil, fmt.Errorf("trainer: attention for %d x %d tokens: %w", batch, seq, err)
	}
	b.attn[[2]int{batch, seq}] = a
	return a, nil
}

// adamWArgsFor returns the AdamW operands of the next step for a tensor
// that decays or not, exactly as train's CPU AdamW computes them.
func adamWArgsFor(h train.AdamW, lr float64, step int64, decays bool) adamWArgs {
	b1c := 1 - math.Pow(h.Beta1, float64(step))
	b2c := 1 - math.Pow(h.Beta2, float64(step))
	a := adamWArgs{gradScale: 1, b1: float32(h.Beta1), b2: float32(h.Beta2), stepSize: float32(lr / b1c),
		invB2c: float32(1 / math.Sqrt(b2c)), eps: float32(h.Eps)}
	if decays {
		a.wd = float32(lr * h.WeightDecay)
	}
	return a
}
