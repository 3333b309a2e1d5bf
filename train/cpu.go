package train

import (
	"errors"
	"fmt"
	"math"

	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/model"
)

// CPU is the float32 CPU Backend: the explicit forward and backward of
// every layer (lossAndGrad), blocked GEMMs from package cpu, and AdamW in
// float32. It is the reference the other backends are checked against.
type CPU struct {
	c      model.Config
	params *Params[float32]
	grads  *Params[float32]
	opt    *adamW
	ws     arena[float32] // lossAndGrad's buffers, kept across steps
	step   struct {
		n, done int
		stats   *StepStats
	}
}

// NewCPU returns a CPU backend training w, a model with config c. The
// backend works in w's memory (training changes w) and starts with fresh
// optimizer moments.
func NewCPU(c model.Config, w *model.Weights) (*CPU, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	// The weights are there already; gradients and the two AdamW moments
	// take three times as much again (activations come on top: CPUMemory).
	if err := memcheck.Fits("training on the CPU (gradients and AdamW moments)", 3*c.WeightBytes(), "train a smaller model, or use -device cuda"); err != nil {
		return nil, fmt.Errorf("train: %w", err)
	}
	b := &CPU{c: c}
	if err := b.Load(w, nil); err != nil {
		return nil, err
	}
	return b, nil
}

// CPUMemory estimates the host memory of training a model of config c on
// the CPU with micro-batches of batch sequences of seq tokens: weights,
// gradients and AdamW moments (four float32 copies), each layer's saved
// activations (about 14 hidden-sized and 4 MLP-sized float32 rows per
// token) and the float32 logits of a micro-batch.
func CPUMemory(c model.Config, batch, seq int) float64 {
	tokens := float64(batch) * float64(seq)
	perToken := float64(c.NumHiddenLayers)*(14*float64(c.HiddenSize)+4*float64(c.IntermediateSize)) + 2*float64(c.VocabSize)
	return 4*c.WeightBytes() + 4*tokens*perToken
}

// Config returns the configuration of the model being trained.
func (b *CPU) Config() model.Config { return b.c }

// Params returns the parameters being trained (they share memory with the
// weights the backend was given).
func (b *CPU) Params() *Params[float32] { return b.params }

// BeginStep clears the gradients and the statistics for a step of
// microBatches micro-batches.
func (b *CPU) BeginStep(microBatches int) error {
	if microBatches <= 0 {
		return fmt.Errorf("train: a step of %d micro-batches", microBatches)
	}
	for _, t := range b.grads.list() {
		clear(*t)
	}
	L, f := b.c.NumHiddenLayers, b.c.IntermediateSize
	st := &StepStats{Active: make([][]int32, L), L0: make([]float64, L)}
	for li := range st.Active {
		st.Active[li] = make([]int32, f)
	}
	b.step.n, b.step.done, b.step.stats = microBatches, 0, st
	return nil
}

// Accumulate adds one micro-batch's gradients and statistics to the step's.
func (b *CPU) Accumulate(tokens []int, batch, seq int, l1 float64) error {
	st := b.step.stats
	if st == nil || b.step.done >= b.step.n {
		return errors.New("train: Accumulate outside a step, or more micro-batches than BeginStep announced")
	}
	mb, err := lossAndGrad(b.c, b.params, b.grads, tokens, batch, seq, l1, &b.ws)
	if err != nil {
		return err
	}
	n := float64(b.step.n)
	st.Loss += mb.Loss / n
	st.L1 += mb.L1 / n
	for li := range st.L0 {
		st.L0[li] += mb.L0[li] / n
		for j, k := range mb.Active[li] {
			st.Active[li][j] += k
		}
	}
	b.step.done++
	return nil
}

// EndStep makes the gradient the mean over the step's micro-batches and
// returns the step's statistics.
func (b *CPU) EndStep() (*StepStats, error) {
	st := b.step.stats
	if st == nil || b.step.done != b.step.n {
		return nil, fmt.Errorf("train: EndStep after %d of %d micro-batches", b.step.done, b.step.n)
	}
	if b.step.n > 1 {
		s := float32(1 / float64(b.step.n))
		for _, t := range b.grads.list() {
			for j := range *t {
				(*t)[j] *= s
			}
		}
	}
	b.step.stats = nil
	return st, nil
}

// ClipGradients clips the gradient's global norm to maxNorm (0: no
// clipping) and returns the norm before clipping.
func (b *CPU) ClipGradients(maxNorm float64) (float64, error) {
	return clipGradients(b.grads, maxNorm), nil
}

// Update applies one AdamW step.
func (b *CPU) Update(h AdamW, lr float64) error {
	b.opt.update(b.params, b.grads, h, lr)
	return nil
}

// ReinitUnits gives MLP units fresh gate and up rows, a zero down column
// and zero moments.
func (b *CPU) ReinitUnits(units []UnitInit) error {
	h, f := b.c.HiddenSize, b.c.IntermediateSize
	for _, u := range units {
		if u.Layer < 0 || u.Layer >= len(b.params.Layers) || u.Unit < 0 || u.Unit >= f {
			return fmt.Errorf("train: re-initialise unit %d of layer %d: outside the model (%d layers of %d units)", u.Unit, u.Layer, len(b.params.Layers), f)
		}
		l := &b.params.Layers[u.Layer]
		if len(u.Up) != h || (l.Gate != nil) != (u.Gate != nil) || (u.Gate != nil && len(u.Gate) != h) {
			return fmt.Errorf("train: re-initialise unit %d of layer %d: rows of %d (gate) and %d (up) values, want %d", u.Unit, u.Layer, len(u.Gate), len(u.Up), h)
		}
	}
	for _, u := range units {
		l := &b.params.Layers[u.Layer]
		j := u.Unit
		if l.Gate != nil {
			copy(l.Gate[j*h:(j+1)*h], u.Gate)
		}
		copy(l.Up[j*h:(j+1)*h], u.Up)
		for k := 0; k < h; k++ {
			l.Down[k*f+j] = 0
		}
		for i, t := range b.params.list() {
			switch {
			case &(*t)[0] == &l.Up[0] || (l.Gate != nil && &(*t)[0] == &l.Gate[0]):
				b.opt.resetRange(i, j*h, (j+1)*h)
			case &(*t)[0] == &l.Down[0]:
				for k := 0; k < h; k++ {
					b.opt.resetRange(i, k*f+j, k*f+j+1)
				}
			}
		}
	}
	return nil
}

// Loss returns the mean cross-entropy of one batch.
func (b *CPU) Loss(tokens []int, batch, seq int) (float64, error) {
	st, err := lossAndGrad(b.c, b.params, nil, tokens, batch, seq, 0, &b.ws)
	if err != nil {
		return 0, err
	}
	return st.Loss, nil
}

// Weights returns the parameters as model weights, sharing memory.
func (b *CPU) Weights() (*model.Weights, error) { return b.params.weights(), nil }

// OptimizerState returns the AdamW state, sharing memory.
func (b *CPU) OptimizerState() (*OptimizerState, error) {
	return &OptimizerState{Step: b.opt.step, M: b.opt.m, V: b.opt.v}, nil
}

// Load replaces the parameters (sharing w's memory) and the optimizer state
// (copied; nil: fresh).
func (b *CPU) Load(w *model.Weights, opt *OptimizerState) error {
	if w == nil {
		return errors.New("train: Load: no weights")
	}
	if len(w.Layers) != b.c.NumHiddenLayers {
		return fmt.Errorf("train: weights of %d layers for a %d-layer model", len(w.Layers), b.c.NumHiddenLayers)
	}
	p := FromWeights(w)
	if !b.c.MLPGated {
		for i := range p.Layers {
			p.Layers[i].Gate = nil
		}
	}
	if b.c.TieWordEmbeddings {
		p.LMHead = nil
	}
	specs, list := Tensors(b.c), p.list()
	if len(specs) != len(list) {
		return fmt.Errorf("train: weights hold %d tensors, the model %d", len(list), len(specs))
	}
	for i, s := range specs {
		if len(*list[i]) != s.Size() {
			return fmt.Errorf("train: tensor %s has %d values, want %d (shape %v)", s.Name, len(*list[i]), s.Size(), s.Shape)
		}
	}
	o := newAdamW(p)
	if opt != nil {
		if len(opt.M) != len(specs) || len(opt.V) != len(specs) {
			return fmt.Errorf("train: optimizer state of %d and %d moments for %d tensors", len(opt.M), len(opt.V), len(specs))
		}
		for i, s := range specs {
			if len(opt.M[i]) != s.Size() || len(opt.V[i]) != s.Size() {
				return fmt.Errorf("train: optimizer moments of %s have %d and %d values, want %d", s.Name, len(opt.M[i]), len(opt.V[i]), s.Size())
			}
			copy(o.m[i], opt.M[i])
			copy(o.v[i], opt.V[i])
		}
		o.step = opt.Step
	}
	b.params, b.grads, b.opt = p, zerosLike[float32](p), o
	b.step.stats = nil
	return nil
}

// Close does nothing: the CPU backend holds only Go memory.
func (b *CPU) Close() error { return nil }

// clipGradients scales g so that its global L2 norm is at most maxNorm
// (0 disables) and returns the norm before clipping.
func clipGradients(g *Params[float32], maxNorm float64) float64 {
	ss := 0.0
	for _, t := range g.list() {
		for _, v := range *t {
			ss += float64(v) * float64(v)
		}
	}
	norm := math.Sqrt(ss)
	if maxNorm > 0 && norm > maxNorm {
		s := float32(maxNorm / norm)
		for _, t := range g.list() {
			for j := range *t {
				(*t)[j] *= s
			}
		}
	}
	return norm
}
