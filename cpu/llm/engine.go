// Package llm is the CPU engine: a whole Llama-style model run in float32 on
// the kernels of package cpu (AVX-512 GEMMs, TwELL MLPs, flash-style
// attention). It implements engine.Engine and is the reference every GPU
// result is checked against.
package llm

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"

	"github.com/twell-ai/twell/bf16"
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
	// projection and MLP weights that bfloat16 cannot hold exactly: such
	// passes are bound by memory bandwidth, and bf16 halves the bytes.
	// Their logits then carry bf16 rounding of the weights, and the copies
	// cost memory. Weights that are all bfloat16 values (a bfloat16
	// checkpoint's) are kept in bf16 alone whatever this says, with the
	// same results as in float32 (see cpu.PackedB.Compact).
	DecodeBF16 bool
	// ReleaseWeights makes the engine let go of the model's float32
	// projection and MLP matrices as it packs each layer (then of an untied
	// LM head, and of the embeddings where bf16 holds them exactly: it keeps
	// a bf16 copy), and hand that memory back to the system, so that once packed
	// the process holds the packed copies (for a bfloat16 checkpoint, bf16
	// ones) but not the float32 model besides. The model can then not be
	// packed again (RepackLayer, a second engine), run on a GPU or saved:
	// for commands that only run it (generate, serve, eval).
	ReleaseWeights bool
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

	packMu   sync.Mutex   // guards the first packing
	released bool         // the model's matrices were let go (ReleaseWeights)
	layers   []cpuLayer   // nil until packed
	head     *cpu.PackedB // LM head (the embedding when tied)
	embed16  []uint16     // the embeddings in bf16 once ReleaseWeights dropped the model's; nil otherwise

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
// for reuse, and hands the memory back to the system.
func (e *Engine) Close() error {
	e.packMu.Lock()
	defer e.packMu.Unlock()
	e.layers, e.head, e.embed16 = nil, nil, nil
	e.pool.close()
	debug.FreeOSMemory()
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
	if e.released {
		return errReleased
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
		// Packing left garbage: the layer's float32 panels where it was
		// compacted, and its float32 matrices when released. Collected
		// now, it is reused by the next layer; left to the collector's
		// pace (a collection once the heap doubles) it would add up to
		// several times a layer's size over a large model.
		if e.opts.ReleaseWeights {
			e.released = true
			lw := &w.Layers[i]
			lw.Q, lw.K, lw.V, lw.O, lw.Gate, lw.Up, lw.Down = nil, nil, nil, nil, nil, nil, nil
			debug.FreeOSMemory()
		} else {
			runtime.GC()
		}
	}
	head := w.LMHead
	if c.TieWordEmbeddings {
		head = w.Embed
	}
	var err error
	if e.head, err = cpu.PackBCompact(head, c.VocabSize, c.HiddenSize); err != nil {
		return fmt.Errorf("cpu/llm: LM head: %w", err)
	}
	if e.opts.DecodeBF16 { // only matters for panels PackBCompact left in float32
		e.head.UseBF16ForSmallM()
	}
	if e.opts.ReleaseWeights {
		if !c.TieWordEmbeddings {
			w.LMHead = nil
		}
		if bf16.Exact(w.Embed) { // the lookups read a bf16 copy, exactly
			e.embed16 = make([]uint16, len(w.Embed))
			bf16.Truncate(e.embed16, w.Embed)
			w.Embed = nil
		}
		debug.FreeOSMemory()
	}
	e.layers = layers
	return nil
}

// errReleased is what packing again says once ReleaseWeights let go of the
// model's matrices.
var errReleased = errors.New("cpu/llm: the model's weights were released once packed (Options.ReleaseWeights): they cannot be packed again")

// PackedBytes estimates the memory the packed copies of the weights take
// (made at the first Forward): GEMM panels of every projection and the
// MLP's unit rows, in bfloat16 alone where the weights are all bfloat16
// values, else in float32 (plus bf16 copies with DecodeBF16). It does not
// count on cpu.MLP.Trim's saving: the dense finish may bring the panels
// back.
func (e *Engine) PackedBytes() float64 {
	c := e.model.Config
	f := 1.2
	switch {
	case e.weightsExact():
		f = 0.6
	case e.opts.DecodeBF16:
		f = 1.7
	}
	switch {
	case e.opts.ReleaseWeights:
		f = max(0, f-1) // each layer's float32 matrices go as its copies come
	case e.model.Deferred():
		f++ // the layers are read into float32 and kept
	}
	// Packing a layer makes float32 panels before compacting them.
	perLayer := c.WeightBytes() / float64(max(1, c.NumHiddenLayers)) // an upper bound
	return f*c.WeightBytes() + 1.2*perLayer
}

// PackedSize returns the bytes the packed copies of the weights take now,
// the bf16 embeddings of ReleaseWeights included (0 before the first
// Forward or Pack).
func (e *Engine) PackedSize() int64 {
	e.packMu.Lock()
	defer e.packMu.Unlock()
	var n int64
	for _, l := range e.layers {
		n += int64(l.qkv.Bytes() + l.o.Bytes() + l.mlp.Bytes())
	}
	if e.head != nil {
		n += int64(e.head.Bytes())
	}
	return n + 2*int64(len(e.embed16))
}

// weightsExact reports whether every projection, MLP and LM-head weight of
// the model is a bfloat16 value, so that packing keeps them in bf16 alone.
// Layers still in a checkpoint (model.LoadDeferred) count by their stored
// type.
func (e *Engine) weightsExact() bool {
	if !e.model.DeferredBF16() {
		return false
	}
	w := e.model.Weights
	var ms [][]float32
	for i := range w.Layers {
		l := &w.Layers[i]
		ms = append(ms, l.Q, l.K, l.V, l.O, l.Gate, l.Up, l.Down) // nil while deferred
	}
	if e.model.Config.TieWordEmbeddings {
		ms = append(ms, w.Embed)
	} else {
		ms = append(ms, w.LMHead)
	}
	var inexact atomic.Bool
	cpu.ParallelFor(len(ms), func(i int) {
		if !inexact.Load() && !bf16.Exact(ms[i]) {
			inexact.Store(true)
		}
	})
	return !inexact.Load()
}

// RepackLayer packs layer i's weights again after a change to them (from
// ObserveMLPInput); later layers of the running pass see the change.
func (e *Engine) RepackLayer(i int) error {
	if e.released {
		return errReleased
	}
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
	c := e.model.Config
	lw, err := e.model.Layer(i)
	if err != nil {
		return cpuLayer{}, fmt.Errorf("cpu/llm: %w", err)
	}
	if lw.Q == nil {
		return cpuLayer{}, fmt.Errorf("cpu/llm: layer %d of the model holds no weights (an engine with ReleaseWeights let go of them)", i)
	}
	h, hd := c.HiddenSize, c.HeadDim
	qkvRows := (c.NumAttentionHeads + 2*c.NumKeyValueHeads) * hd
	qkv := make([]float32, 0, qkvRows*h)
	qkv = append(append(append(qkv, lw.Q...), lw.K...), lw.V...)
	var l cpuLayer
	if l.qkv, err = cpu.PackBCompact(qkv, qkvRows, h); err != nil {
		return l, fmt.Errorf("cpu/llm: layer %d attention: %w", i, err)
	}
	if l.o, err = cpu.PackBCompact(lw.O, h, c.NumAttentionHeads*hd); err != nil {
		return l, fmt.Errorf("cpu/llm: layer %d output projection: %w", i, err)
	}
	if l.mlp, err = cpu.NewMLP(lw.Gate, lw.Up, lw.Down, h, c.IntermediateSize); err != nil {
		return l, fmt.Errorf("cpu/llm: layer %d MLP: %w", i, err)
	}
	l.mlp.Act = e.act
	l.mlp.Path = e.opts.MLPPath
	if e.opts.DecodeBF16 { // only matters for panels PackBCompact left in float32
		l.qkv.UseBF16ForSmallM()
		l.o.UseBF16ForSmallM()
	}
	if !l.mlp.Compact() && e.opts.DecodeBF16 {
		l.mlp.UseBF16ForSmallM()
	}
	if e.layout.Check(c.IntermediateSize) == nil { // else every pass runs dense
		l.mlp.Trim() // the sparse finish reads the unit rows; dense panels come back when needed
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
