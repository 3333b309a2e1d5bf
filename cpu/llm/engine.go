// Package llm is the CPU engine: a whole Llama-style model run in float32 on
// the kernels of package cpu (AVX-512 GEMMs, TwELL MLPs, flash-style
// attention). It implements engine.Engine and is the reference every GPU
// result is checked against.
package llm

import (
	"errors"
	"fmt"
	"math"
	"sync"

	"github.com/twell-ai/twell/cpu"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/twell"
)

// Options are the CPU engine's settings.
type Options struct {
	// MLPPath is how the MLPs run (auto: TwELL D2T, then the sparse or the
	// dense finish by measured density).
	MLPPath mlp.Path
	// DecodeBF16 makes forward passes of at most 16 tokens (decode steps of
	// up to 16 sequences, short prompts) read bfloat16 copies of the
	// projection and MLP weights: such passes are bound by memory
	// bandwidth, and bf16 halves the bytes. Their logits then carry bf16
	// rounding of the weights, and the copies cost memory.
	DecodeBF16 bool
	// KVPageSize is the number of positions in one page of the KV caches
	// (0: DefaultPageSize of the model). See KVPages.
	KVPageSize int
	// KVMemory is the budget of the KV caches in bytes, counted in whole
	// pages: a Forward whose new tokens would take the caches past it
	// fails with engine.ErrOutOfPages. 0: no budget.
	KVMemory int64
}

// Engine runs a model on the CPU. The kernels' packed copies of the weights
// are made at the first Forward, so an engine that is never run costs
// nothing beyond the model.
type Engine struct {
	model  *model.Model
	opts   Options
	layout twell.Layout
	act    cpu.Activation
	rope   *model.RoPETables
	pool   *pagePool // KV cache pages

	packMu sync.Mutex   // guards the first packing
	layers []cpuLayer   // nil until packed
	head   *cpu.PackedB // LM head (the embedding when tied)

	// ObserveMLPInput, when set, sees each layer's normalised MLP input (T
	// rows of HiddenSize values) before the MLP runs. It may change the
	// layer's weights in the model, then call RepackLayer: gate
	// calibration and activation analysis use it.
	ObserveMLPInput func(layer int, x []float32, tokens int) error
}

var _ engine.Engine = (*Engine)(nil)

type cpuLayer struct {
	qkv, o *cpu.PackedB
	mlp    *cpu.MLP
}

// New returns a CPU engine for m with options o.
func New(m *model.Model, o Options) (*Engine, error) {
	if m == nil || m.Weights == nil {
		return nil, errors.New("cpu/llm: nil model")
	}
	c := m.Config
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if len(m.Weights.Layers) != c.NumHiddenLayers {
		return nil, fmt.Errorf("cpu/llm: model has %d layers of weights, config says %d", len(m.Weights.Layers), c.NumHiddenLayers)
	}
	act, _ := c.GateActivation()
	var mact cpu.Activation
	switch act {
	case model.ActReLU:
		mact = cpu.ReLU
	case model.ActSiLU:
		mact = cpu.SiLU
	default:
		return nil, fmt.Errorf("cpu/llm: MLP activation %q not supported (want relu or silu)", act)
	}
	if o.MLPPath > mlp.Dense {
		return nil, fmt.Errorf("cpu/llm: %v", o.MLPPath)
	}
	if o.KVPageSize < 0 || o.KVMemory < 0 {
		return nil, fmt.Errorf("cpu/llm: KV page size %d and budget %d bytes: must be >= 0", o.KVPageSize, o.KVMemory)
	}
	size := o.KVPageSize
	if size == 0 {
		size = DefaultPageSize(c)
	}
	if bytes := float64(size) * float64(c.NumKeyValueHeads*c.HeadDim) * 8 * float64(c.NumHiddenLayers); bytes > 1<<50 {
		return nil, fmt.Errorf("cpu/llm: a KV page of %d positions would take %s", size, memcheck.Format(bytes))
	}
	total := 0
	if o.KVMemory > 0 {
		pageBytes := PageBytes(c, size)
		if total = int(min(o.KVMemory/pageBytes, math.MaxInt32)); total < 1 {
			return nil, fmt.Errorf("cpu/llm: a KV budget of %s holds no page of %d positions (%s)",
				memcheck.Format(float64(o.KVMemory)), size, memcheck.Format(float64(pageBytes)))
		}
	}
	return &Engine{model: m, opts: o, layout: twell.DefaultLayout, act: mact, rope: model.NewRoPETables(c), pool: newPagePool(c, size, total)}, nil
}

// Config returns the model's configuration.
func (e *Engine) Config() model.Config { return e.model.Config }

// Model returns the model the engine runs.
func (e *Engine) Model() *model.Model { return e.model }

// Close releases the packed copies of the weights and the KV memory kept
// for reuse.
func (e *Engine) Close() error {
	e.packMu.Lock()
	defer e.packMu.Unlock()
	e.layers, e.head = nil, nil
	e.pool.close()
	return nil
}

// Pack makes the packed copies of the weights the CPU kernels read, which
// the first Forward otherwise makes, so that a caller timing its first
// pass (generate's prefill) times the pass alone.
func (e *Engine) Pack() error { return e.pack() }

// pack makes the packed copies of the weights unless they exist.
func (e *Engine) pack() error {
	e.packMu.Lock()
	defer e.packMu.Unlock()
	if e.layers != nil {
		return nil
	}
	c, w := e.model.Config, e.model.Weights
	if err := memcheck.Fits("packing the weights for the CPU kernels", e.PackedBytes(), ""); err != nil {
		return fmt.Errorf("cpu/llm: %w", err)
	}
	layers := make([]cpuLayer, len(w.Layers))
	for i := range layers {
		var err error
		if layers[i], err = e.packLayer(i); err != nil {
			return err
		}
	}
	head := w.LMHead
	if c.TieWordEmbeddings {
		head = w.Embed
	}
	var err error
	if e.head, err = cpu.PackB(head, c.VocabSize, c.HiddenSize); err != nil {
		return fmt.Errorf("cpu/llm: LM head: %w", err)
	}
	if e.opts.DecodeBF16 {
		e.head.UseBF16ForSmallM()
	}
	e.layers = layers
	return nil
}

// PackedBytes estimates the memory the packed copies of the weights take
// (made at the first Forward): GEMM panels of every projection, the MLP's
// unit rows, and with DecodeBF16 their bf16 copies. Measured: a model then
// takes about 2.7 times its float32 size in all.
func (e *Engine) PackedBytes() float64 {
	f := 1.2
	if e.opts.DecodeBF16 {
		f = 1.7
	}
	return f * e.model.Config.WeightBytes()
}

// RepackLayer packs layer i's weights again after a change to them (from
// ObserveMLPInput); later layers of the running pass see the change.
func (e *Engine) RepackLayer(i int) error {
	if i < 0 || i >= len(e.layers) {
		return fmt.Errorf("cpu/llm: layer %d of %d is not packed", i, len(e.layers))
	}
	l, err := e.packLayer(i)
	if err != nil {
		return err
	}
	e.layers[i] = l
	return nil
}

// packLayer packs layer i's weights.
func (e *Engine) packLayer(i int) (cpuLayer, error) {
	c, lw := e.model.Config, e.model.Weights.Layers[i]
	h, hd := c.HiddenSize, c.HeadDim
	qkvRows := (c.NumAttentionHeads + 2*c.NumKeyValueHeads) * hd
	qkv := make([]float32, 0, qkvRows*h)
	qkv = append(append(append(qkv, lw.Q...), lw.K...), lw.V...)
	var l cpuLayer
	var err error
	if l.qkv, err = cpu.PackB(qkv, qkvRows, h); err != nil {
		return l, fmt.Errorf("cpu/llm: layer %d attention: %w", i, err)
	}
	if l.o, err = cpu.PackB(lw.O, h, c.NumAttentionHeads*hd); err != nil {
		return l, fmt.Errorf("cpu/llm: layer %d output projection: %w", i, err)
	}
	if l.mlp, err = cpu.NewMLP(lw.Gate, lw.Up, lw.Down, h, c.IntermediateSize); err != nil {
		return l, fmt.Errorf("cpu/llm: layer %d MLP: %w", i, err)
	}
	l.mlp.Act = e.act
	l.mlp.Path = e.opts.MLPPath
	if e.opts.DecodeBF16 {
		l.qkv.UseBF16ForSmallM()
		l.o.UseBF16ForSmallM()
		l.mlp.UseBF16ForSmallM()
	}
	return l, nil
}

// SetMLPPath chooses how the MLPs run from the next Forward on.
func (e *Engine) SetMLPPath(p mlp.Path) error {
	if p > mlp.Dense {
		return fmt.Errorf("cpu/llm: %v", p)
	}
	e.packMu.Lock()
	defer e.packMu.Unlock()
	e.opts.MLPPath = p
	for _, l := range e.layers {
		l.mlp.Path = p
	}
	return nil
}
