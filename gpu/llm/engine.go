package llm

import (
	"errors"
	"fmt"
	"runtime/debug"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/gpu"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/twell"
)

var _ engine.Paged = (*Engine)(nil)

// DefaultMLPChunk is the default for Engine.MLPChunk.
const DefaultMLPChunk = 1 << 17

// Engine is a model's weights on one GPU, bf16, ready to run forward
// passes. Its methods queue work on the engine's own stream and keep
// workspace between calls, so an Engine must not be used by several
// goroutines at once.
type Engine struct {
	cfg model.Config // the model's configuration
	// MLPChunk is the most tokens one MLP call takes: a forward pass over
	// more tokens runs each MLP in chunks. It bounds the MLP workspace,
	// which the layers share (about 2 x chunk x width bf16 for the dense
	// path). Zero means DefaultMLPChunk.
	MLPChunk int
	// Attention picks the attention kernel: "" or "auto" (for head_dim 64
	// on Hopper, sm_90a, the wgmma kernel with a 3-stage pipeline in passes
	// of more than 64 tokens; else the mma.sync kernel for head_dim 64 and
	// 128, and the plain one for other head dims; decode steps, each
	// sequence with one new token, run the decode kernel for head_dim 64
	// and 128, which splits the keys of few sequences across CTAs);
	// "wgmma3" (head_dim 64, sm_90a), "mma" (head_dim 64 or 128) or "ref"
	// (the plain kernel, any head_dim) for every pass, to compare them.
	Attention string
	// Profile makes Forward time each kind of step with CUDA events and
	// report it in Stats.StepMS (for diagnosis: it adds an event record
	// per step, and steps replayed from a CUDA graph are not timed).
	Profile bool
	// NoGraphs turns off replaying decode steps from CUDA graphs
	// (graphs.go); every step then queues its kernels one by one. NewEngine
	// sets it when the environment variable TWELL_GRAPHS is "0".
	NoGraphs bool
	// NoGEMV makes the q/k/v and output projections of passes of at most 4
	// tokens run through cuBLASLt instead of the engine's own gemv_rows
	// kernel (to compare them). NewEngine sets it when the environment
	// variable TWELL_GEMV is "0".
	NoGEMV bool
	// Serial launches the kernels of decode steps without early start: each
	// then begins only when the kernel before it has finished. By default
	// (compute capability 9.0 and later) the norm, projection, attention
	// and small-batch MLP kernels start while the kernel before them runs,
	// issuing their weight loads, and wait for its results on the device
	// (cuda.LaunchConfig.EarlyStart). NewEngine sets it, and the TwELL MLPs'
	// Serial, when the environment variable TWELL_EARLY_START is "0".
	Serial bool
	// FuseNorms fuses the residual add and RMSNorm of one-token passes
	// (decode steps of one sequence) into the kernel after it: the
	// attention norm into qkv_rope1n, and, on a graph-replayed step whose
	// TwELL layer runs sparse, the MLP norm into gpu.MLP.QueueNormed. The
	// fused kernels norm the token bit for bit as add_rmsnorm does, and
	// write the residual sum to the other of two residual buffers. NewEngine
	// sets it unless the environment variable TWELL_LLM_FUSE_NORMS is "0".
	FuseNorms bool
	// AttnRope makes prefill passes on the wgmma attention kernel (attn_wg64)
	// rotate the queries as the attention loads them, so that rope_kv reads
	// and writes only the keys and values: about two thirds of its traffic
	// (queries 4 KB of a token's 6 KB of q/k/v rows at the SparseLM shape)
	// are not read and written back. Both rotate with rope_rotate
	// (rope.cuh), so the logits are the same bits. NewEngine sets it unless
	// the environment variable TWELL_LLM_ATTN_ROPE is "0".
	AttnRope bool
	// DecRope makes decode steps whose q/k/v projection runs on cuBLASLt
	// (more sequences than the engine's own projection kernels take) skip
	// rope_kv: the decode attention kernel rotates the query and the new key
	// as it loads them, with rope_rotate8 as rope_kv (the same bits), and
	// writes the new key and value into the cache. NewEngine sets it unless
	// the environment variable TWELL_LLM_DEC_ROPE is "0".
	DecRope bool
	// HotUnits makes the first pass of at least gpu.CalibrationTokens
	// tokens calibrate each TwELL layer on its input (gpu.MLP.Calibrate),
	// after which the layers compute their most frequently firing units
	// densely. A failed calibration turns it off and is reported by
	// CalibrationError; the pass goes on without hot units. NewEngine sets
	// it unless the environment variable TWELL_HOT_UNITS is "0".
	HotUnits bool
	// ReuseLogits makes Forward return its logits in host memory that the
	// engine owns (page-locked, so the copy from the GPU is one fast DMA)
	// and overwrites at the next Forward call or frees at Close, instead
	// of a fresh slice per call. A decode step of 64 sequences returns
	// 12.6 MB of logits (vocabulary 49152): allocating and filling that
	// anew each step costs milliseconds on the host. Callers that keep
	// logits past the next call must copy them.
	ReuseLogits bool

	dev    *cuda.Device
	blas   *cublas.Handle
	stream *cuda.Stream
	k      *kernels

	embed, head, norm *cuda.Buffer // bf16 [vocab][d] (head is embed when tied), fp32 [d]
	layers            []layer
	act               gpu.Activation // MLP activation
	mlpPath           mlp.Path

	rope         *model.RoPETables
	cosB, sinB   *cuda.Buffer
	ropePtr      *float32
	ropeLen      int
	ws           workspace
	pool         *kvPool // the KV caches' pages
	closed       bool
	sparseLayers int
	weightBytes  int64

	hostLogits *cuda.HostBuffer // ReuseLogits' buffer

	// decGlobalMerge merges the decode kernel's runs through global memory
	// where clusters would merge them (tests compare both).
	decGlobalMerge bool
	// decRunsFixed, when positive, is the number of runs the decode
	// attention cuts each query's keys into at every batch instead of
	// decRuns' choice: for the tests. (Fixing 4 or 8 runs at every batch
	// lost to the choice at every batch size on an H200.)
	decRunsFixed int

	prof   stepProfile // Profile's events
	profOn bool        // the pass being queued is profiled: Profile set, not replayed from a graph

	gen      uint64 // reallocations of engine buffers (a recorded graph uses their addresses)
	graphs   map[int]*stepGraph
	graphErr error
	hotErr   error // why a calibration failed (HotUnits)
	replays  int   // decode steps replayed from graphs
	records  int   // decode-step graphs recorded
	// decoders are the open Decoders; inflight says that steps they
	// queued may still run (settle).
	decoders map[*Decoder]bool
	inflight bool
	picks    passPicks // ForwardSample's buffers
}

// layer is one decoder layer's weights on the device.
type layer struct {
	attnNorm, mlpNorm *cuda.Buffer // fp32 [d]
	qkv, o            *cuda.Buffer // bf16 [(nq+2nkv)hd][d], [d][nq hd]
	// mlp is the TwELL MLP (ReLU gate, shapes its kernels take); dense the
	// cuBLASLt MLP of the other layers (exactly one is set).
	mlp   *gpu.MLP
	dense *gpu.DenseMLP
}

// workspace is per-forward device memory, grown as needed and kept.
type workspace struct {
	tokens int          // tokens the token-sized buffers hold
	resid  *cuda.Buffer // fp32 [T][d], the residual stream
	resid2 *cuda.Buffer // fp32 [d]: the other residual buffer of fused norms (FuseNorms)
	hn     *cuda.Buffer // bf16 [T][max(d, nq hd)]: normed input, then attention output
	qkv    *cuda.Buffer // bf16 [T][(nq+2nkv) hd]
	proj   *cuda.Buffer // bf16 [T][d]: attention projection, then MLP output
	mlpTok int          // tokens the dense MLP layers' workspace holds
	meta   *cuda.Buffer // per-forward metadata (see rope.cu)
	rows   int          // rows the head buffers hold
	decSeq int          // sequences the decode attention's buffer holds
	dec    *cuda.Buffer // the decode attention's runs and counters (decBytes)
	sel    *cuda.Buffer // bf16 [rows][d]: final-normed rows whose logits are wanted
	logits *cuda.Buffer // fp32 [rows][vocab]
}

// headChunk is the most rows one LM-head GEMM takes (bounds the fp32 logits
// buffer when every token's logits are wanted).
const headChunk = 2048

// Supported reports why a model with config c cannot run on the GPU
// engine, or nil if it can.
func Supported(c model.Config) error {
	if err := c.Validate(); err != nil {
		return err
	}
	act, _ := c.GateActivation()
	if act != model.ActReLU && act != model.ActSiLU {
		return fmt.Errorf("llm: MLP activation %q not supported (want relu or silu)", act)
	}
	if c.HeadDim%2 != 0 || c.HeadDim > 256 {
		return fmt.Errorf("llm: head_dim %d not supported (want an even size up to 256)", c.HeadDim)
	}
	return nil
}

// twellShape reports whether package gpu's TwELL MLP takes an MLP of hidden
// size d and width f.
func twellShape(d, f int) bool {
	return d >= 64 && d%64 == 0 && d <= gpu.MaxD && f%256 == 0
}

// NewEngine uploads the weights of m to dev: bf16 projections (q, k and v
// fused), fp32 norm weights, the embedding table (also the LM head when
// tied), and one gpu.MLP per layer where the gate is ReLU and the shape
// suits the TwELL kernels (a cuBLASLt dense MLP otherwise). It compiles the
// kernels on first use. Close frees the device memory. Its settings come
// from the environment (OptionsFromEnv).
func NewEngine(dev *cuda.Device, m *model.Model) (*Engine, error) {
	opts, err := OptionsFromEnv()
	if err != nil {
		return nil, err
	}
	return NewEngineWith(dev, m, opts)
}

// NewEngineWith is NewEngine with the given settings instead of the
// environment's.
func NewEngineWith(dev *cuda.Device, m *model.Model, opts Options) (*Engine, error) {
	if dev == nil {
		return nil, errors.New("llm: nil device")
	}
	if m == nil || m.Weights == nil {
		return nil, errors.New("llm: nil model")
	}
	c := m.Config
	if err := Supported(c); err != nil {
		return nil, err
	}
	// The bf16 weights (half the float32 size) must fit in what the device
	// has free, with room to spare for workspaces and KV caches.
	if free, err := dev.Available(); err == nil && c.WeightBytes()/2 > float64(free) {
		return nil, fmt.Errorf("llm: the model's bf16 weights need about %s of device memory, but %s is free on %v",
			memcheck.Format(c.WeightBytes()/2), memcheck.Format(float64(free)), dev)
	}
	w := m.Weights
	if len(w.Layers) != c.NumHiddenLayers {
		return nil, fmt.Errorf("llm: model has %d layers of weights, config says %d", len(w.Layers), c.NumHiddenLayers)
	}
	k, err := kernelsFor(dev)
	if err != nil {
		return nil, err
	}
	e := &Engine{cfg: c, dev: dev, k: k, mlpPath: mlp.Auto, rope: model.NewRoPETables(c), Attention: opts.Attention,
		NoGraphs: opts.NoGraphs, NoGEMV: opts.NoGEMV, Serial: opts.MLP.Serial, FuseNorms: opts.FuseNorms, AttnRope: opts.AttnRope, DecRope: opts.DecRope, HotUnits: !opts.MLP.NoHotUnits, pool: &kvPool{dev: dev, cfg: c}}
	if act, _ := c.GateActivation(); act == model.ActSiLU {
		e.act = gpu.ActSiLU
	}
	ok := false
	defer func() {
		if !ok {
			e.Close()
		}
	}()
	if err := e.pool.configure(opts.KVPageSize, opts.KVMemory); err != nil {
		return nil, err
	}
	if e.blas, err = cublas.New(dev); err != nil {
		return nil, err
	}
	if opts.GEMMTune {
		e.blas.TuneFlops = cublas.DefaultTuneFlops
	}
	if e.stream, err = dev.NewStream(); err != nil {
		return nil, err
	}
	h, hd, nq, nkv, f := c.HiddenSize, c.HeadDim, c.NumAttentionHeads, c.NumKeyValueHeads, c.IntermediateSize
	if e.embed, err = e.upBF16(w.Embed, c.VocabSize*h, "embed_tokens"); err != nil {
		return nil, err
	}
	e.head = e.embed
	if !c.TieWordEmbeddings {
		if e.head, err = e.upBF16(w.LMHead, c.VocabSize*h, "lm_head"); err != nil {
			return nil, err
		}
	}
	if e.norm, err = e.upF32(w.Norm, h, "norm"); err != nil {
		return nil, err
	}
	qkvRows := (nq + 2*nkv) * hd
	for i := range w.Layers {
		lw, err := m.Layer(i) // from the checkpoint, for a deferred model
		if err != nil {
			return nil, fmt.Errorf("llm: %w", err)
		}
		var l layer
		name := func(s string) string { return fmt.Sprintf("layer %d %s", i, s) }
		if l.attnNorm, err = e.upF32(lw.AttnNorm, h, name("input_layernorm")); err != nil {
			return nil, err
		}
		if l.mlpNorm, err = e.upF32(lw.MLPNorm, h, name("post_attention_layernorm")); err != nil {
			return nil, err
		}
		if len(lw.Q) != nq*hd*h || len(lw.K) != nkv*hd*h || len(lw.V) != nkv*hd*h {
			return nil, fmt.Errorf("llm: layer %d: q/k/v projections hold %d, %d, %d values, want %d, %d, %d",
				i, len(lw.Q), len(lw.K), len(lw.V), nq*hd*h, nkv*hd*h, nkv*hd*h)
		}
		qkv := make([]float32, 0, qkvRows*h)
		qkv = append(append(append(qkv, lw.Q...), lw.K...), lw.V...)
		if l.qkv, err = e.upBF16(qkv, qkvRows*h, name("qkv")); err != nil {
			return nil, err
		}
		if l.o, err = e.upBF16(lw.O, h*nq*hd, name("o_proj")); err != nil {
			return nil, err
		}
		if e.act == gpu.ActReLU && twellShape(h, f) && twell.DefaultLayout.Tile == 256 {
			if l.mlp, err = gpu.NewMLP(dev, e.blas, lw.Gate, lw.Up, lw.Down, h, f, twell.DefaultLayout); err != nil {
				return nil, fmt.Errorf("llm: layer %d MLP: %w", i, err)
			}
			l.mlp.Apply(opts.MLP)
			// The layers run one after another on the engine's stream:
			// one activation workspace serves them all.
			if first := e.firstMLP(); first != nil {
				if err := l.mlp.ShareWorkspace(first); err != nil {
					return nil, fmt.Errorf("llm: layer %d MLP: %w", i, err)
				}
			}
			e.sparseLayers++
			e.weightBytes += l.mlp.WeightBytes()
		} else {
			gate := lw.Gate
			if !c.MLPGated {
				gate = nil
			}
			if l.dense, err = gpu.NewDenseMLP(dev, e.blas, gate, lw.Up, lw.Down, h, f, e.act); err != nil {
				return nil, fmt.Errorf("llm: layer %d MLP: %w", i, err)
			}
			if first := e.firstDense(); first != nil {
				if err := l.dense.ShareWorkspace(first); err != nil {
					return nil, fmt.Errorf("llm: layer %d MLP: %w", i, err)
				}
			}
			e.weightBytes += l.dense.WeightBytes()
		}
		e.layers = append(e.layers, l)
		if opts.ReleaseWeights {
			lw.Q, lw.K, lw.V, lw.O, lw.Gate, lw.Up, lw.Down = nil, nil, nil, nil, nil, nil, nil
			debug.FreeOSMemory()
		}
	}
	if opts.ReleaseWeights {
		m.Weights = nil // everything the engine reads is on the device
		debug.FreeOSMemory()
	}
	ok = true
	return e, nil
}

// upBF16 uploads n float32 values as bf16, counting them as weights.
func (e *Engine) upBF16(v []float32, n int, what string) (*cuda.Buffer, error) {
	if len(v) != n {
		return nil, fmt.Errorf("llm: %s holds %d values, want %d", what, len(v), n)
	}
	b, err := gpu.Upload(e.dev, v)
	if err != nil {
		return nil, fmt.Errorf("llm: uploading %s: %w", what, err)
	}
	e.weightBytes += int64(2 * n)
	return b, nil
}

// upF32 uploads n float32 values as they are.
func (e *Engine) upF32(v []float32, n int, what string) (*cuda.Buffer, error) {
	if len(v) != n {
		return nil, fmt.Errorf("llm: %s holds %d values, want %d", what, len(v), n)
	}
	b, err := e.dev.Alloc(4 * n)
	if err != nil {
		return nil, fmt.Errorf("llm: uploading %s: %w", what, err)
	}
	if err := e.dev.CopyHtoD(b, cuda.Bytes(v)); err != nil {
		b.Free()
		return nil, fmt.Errorf("llm: uploading %s: %w", what, err)
	}
	e.weightBytes += int64(4 * n)
	return b, nil
}

// Device returns the GPU the engine runs on.
func (e *Engine) Device() *cuda.Device { return e.dev }

// Stream returns the stream every forward pass is queued on (for timing
// with events).
func (e *Engine) Stream() *cuda.Stream { return e.stream }

// WeightBytes returns the device memory the weights take.
func (e *Engine) WeightBytes() int64 { return e.weightBytes }

// TwELLLayers returns how many layers run their MLP through package gpu's
// TwELL MLP (the others run a plain dense MLP).
func (e *Engine) TwELLLayers() int { return e.sparseLayers }

// Config returns the model's configuration.
func (e *Engine) Config() model.Config { return e.cfg }

// SetMLPPath chooses how the TwELL layers' MLPs run: mlp.Auto (sparse or
// dense per call by measured density, gpu.MLP.Forward), mlp.Sparse (always
// the TwELL path) or mlp.Dense (always cuBLASLt: the baseline). Layers
// without a TwELL MLP always run dense.
func (e *Engine) SetMLPPath(path mlp.Path) error {
	switch path {
	case mlp.Auto, mlp.Sparse, mlp.Dense:
	default:
		return fmt.Errorf("llm: %v", path)
	}
	for _, l := range e.layers {
		if l.mlp != nil {
			l.mlp.Path = path
		}
	}
	e.mlpPath = path
	return nil
}

// MLPPath returns the path SetMLPPath chose (mlp.Auto at first).
func (e *Engine) MLPPath() mlp.Path { return e.mlpPath }

// Close frees the engine's device memory (the KV caches' pages too), stream
// and cuBLAS handle. Caches made by NewCache must not be used after it.
func (e *Engine) Close() error {
	if e.closed {
		return nil
	}
	var errs []error
	for d := range e.decoders {
		errs = append(errs, d.Close())
	}
	e.closed = true
	free := func(bs ...*cuda.Buffer) {
		for _, b := range bs {
			if b != nil {
				errs = append(errs, b.Free())
			}
		}
	}
	if e.stream != nil {
		errs = append(errs, e.stream.Synchronize())
	}
	errs = append(errs, e.dropGraphs(), e.pool.close())
	if e.head != e.embed {
		free(e.head)
	}
	free(e.embed, e.norm, e.cosB, e.sinB)
	for _, l := range e.layers {
		free(l.attnNorm, l.mlpNorm, l.qkv, l.o)
		if l.mlp != nil {
			errs = append(errs, l.mlp.Close())
		}
		if l.dense != nil {
			errs = append(errs, l.dense.Close())
		}
	}
	ws := &e.ws
	free(ws.resid, ws.resid2, ws.hn, ws.qkv, ws.proj, ws.meta, ws.dec, ws.sel, ws.logits)
	if e.hostLogits != nil {
		errs = append(errs, e.hostLogits.Free())
		e.hostLogits = nil
	}
	errs = append(errs, e.picks.free())
	errs = append(errs, e.prof.close())
	e.layers, e.ws = nil, workspace{}
	if e.stream != nil {
		errs = append(errs, e.stream.Destroy())
	}
	if e.blas != nil {
		errs = append(errs, e.blas.Close())
	}
	return errors.Join(errs...)
}

// firstDense returns the dense MLP of the first layer that has one, or nil.
func (e *Engine) firstDense() *gpu.DenseMLP {
	for _, l := range e.layers {
		if l.dense != nil {
			return l.dense
		}
	}
	return nil
}

// firstMLP returns the first layer's TwELL MLP, or nil.
func (e *Engine) firstMLP() *gpu.MLP {
	for _, l := range e.layers {
		if l.mlp != nil {
			return l.mlp
		}
	}
	return nil
}

// GEMVTimeline reports whether the TwELL layers run the measuring build of
// the small-batch kernels that GEMVStamps reads.
func (e *Engine) GEMVTimeline() bool {
	l := e.firstMLP()
	return l != nil && l.GEMVTimeline
}

// GEMVStamps returns the timer stamps that the last one-token sparse MLP
// kernel (gemv_mlp) left when the TwELL layers run the GEMV_TIMELINE build
// (Options.MLP.GEMVTimeline; see gpu.MLP.GEMVStamps), and the SM of each
// block: after a decode step of one sequence, the last sparse layer's. Call
// it after Forward.
func (e *Engine) GEMVStamps() (stamps [][]uint64, sms []int, err error) {
	l := e.firstMLP()
	if l == nil {
		return nil, nil, errors.New("llm: GEMVStamps: the engine has no TwELL layers")
	}
	return l.GEMVStamps()
}
