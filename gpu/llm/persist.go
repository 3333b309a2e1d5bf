package llm

import (
	_ "embed"
	"errors"
	"fmt"
	"math"
	"unsafe"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/mlp"
)

//go:embed persist.cu
var persistSrc []byte

// The persistent decode kernel (persist.cu, Engine.Persistent) runs every
// decoder layer of a graph-replayed decode step of 1 to persistMaxSeqs
// sequences in one cooperative launch, one block an SM.
const (
	persistMaxSeqs = 8  // the instances take one token, or up to 8 (MB)
	persistRows    = 4  // weight rows a ring slot holds (P_ROWS)
	persistMaxSlot = 16 // P_MAXSLOT
	persistMinSlot = 4  // fewer slots than this and the weights cannot stream ahead
	persistMaxRuns = 32 // P_MAXRUNS
	persistWarps   = 7  // consumer warps a block (P_NC)
)

// persistExprs are the kernel's instances, by head_dim and MB.
var persistExprs = []string{"persist_decode<64,1>", "persist_decode<64,8>", "persist_decode<128,1>", "persist_decode<128,8>"}

// persistExpr names the instance for head_dim hd and m tokens.
func persistExpr(hd, m int) string {
	mb := 1
	if m > 1 {
		mb = persistMaxSeqs
	}
	return fmt.Sprintf("persist_decode<%d,%d>", hd, mb)
}

// persistKernels compiles persist.cu on first use: sm_90 and later only.
func (k *kernels) persistKernels() (map[string]*cuda.Function, error) {
	k.persistOnce.Do(func() {
		if p := k.dev.Properties(); p.Major < 9 {
			k.persistErr = fmt.Errorf("llm: the persistent decode kernel needs compute capability 9.0 or later; %v has %s", k.dev, p.ComputeCapability())
			return
		}
		mod, err := k.dev.Compile("persist.cu", persistSrc, append(headers(), cuda.WithNameExpressions(persistExprs...))...)
		if err != nil {
			k.persistErr = fmt.Errorf("llm: compiling persist.cu: %w", err)
			return
		}
		k.persist = map[string]*cuda.Function{}
		for _, e := range persistExprs {
			if k.persist[e], err = mod.Function(e); err != nil {
				k.persistErr = fmt.Errorf("llm: kernel %s: %w", e, err)
				return
			}
		}
	})
	return k.persist, k.persistErr
}

// persistState is the persistent kernel's device memory, made before a
// graph is recorded (never inside a capture) and kept.
type persistState struct {
	table *cuda.Buffer // the layers' PLayer records
	resB  *cuda.Buffer // fp32 [8][d]: the other residual buffer
	h     *cuda.Buffer // fp32 [8][f]
	act   *cuda.Buffer // f/4 activity bytes
	runs  *cuda.Buffer // the attention runs: 8 nq P_MAXRUNS (hd + 2) floats
	cnt   *cuda.Buffer // 8 nq run counters (zero at rest)
	bar   *cuda.Buffer // the grid barrier's two words (zero at first)
	// stamps, with Engine.PersistentStamps, get each block's phase start
	// and end times: SMs x layers x 10 words
	stamps *cuda.Buffer
}

// persistLaunch is what one step's launch needs beyond the buffers.
type persistLaunch struct {
	fn                    *cuda.Function
	grid, threads, shared int
	nslot, slotBytes, cap int
	runs                  int
}

// persistUsable reports whether a decode step of T sequences whose layers
// run paths can take the persistent kernel: Engine.Persistent on and no
// earlier failure, 1 to 8 sequences, head_dim 64 or 128, every layer a
// gated TwELL MLP on the sparse path.
func (e *Engine) persistUsable(T int, paths []mlp.Path) bool {
	c := e.cfg
	if !e.Persistent || e.persistErr != nil || T < 1 || T > persistMaxSeqs || paths == nil || e.mlpPath == mlp.Dense {
		return false
	}
	if c.HeadDim != 64 && c.HeadDim != 128 {
		return false
	}
	for i, l := range e.layers {
		if l.mlp == nil || !l.mlp.Gated || paths[i] != mlp.Sparse {
			return false
		}
	}
	return true
}

// persistPlan returns the launch of the persistent kernel for a decode step
// of T sequences, or nil where the step cannot take it (persistUsable);
// it makes the kernel's buffers on first use. Call it outside a graph
// capture. A failure (no kernel for the device, not one block an SM with
// enough ring slots, memory) turns the kernel off for the engine and is
// kept in PersistentError; the steps run layer by layer.
func (e *Engine) persistPlan(T int, paths []mlp.Path) *persistLaunch {
	if !e.persistUsable(T, paths) {
		return nil
	}
	pl, err := e.persistSetup(T)
	if err != nil {
		e.persistErr = err
		return nil
	}
	return pl
}

// persistSetup compiles the kernel (first use), sizes its ring to the
// shared memory an SM gives one block (at most persistMaxSlot slots, or
// PersistentSlots), checks that a block fits an SM, makes its buffers and
// picks the attention runs a head: as many as fill the consumer warps of
// the grid once, at most persistMaxRuns.
func (e *Engine) persistSetup(T int) (*persistLaunch, error) {
	c := e.cfg
	d, f, hd, nq := c.HiddenSize, c.IntermediateSize, c.HeadDim, c.NumAttentionHeads
	p := e.dev.Properties()
	if !p.CooperativeLaunch {
		return nil, fmt.Errorf("llm: %v has no cooperative launches (the persistent decode kernel's grid barrier needs them)", e.dev)
	}
	fns, err := e.k.persistKernels()
	if err != nil {
		return nil, err
	}
	fn := fns[persistExpr(hd, T)]
	attr, err := fn.Attributes()
	if err != nil {
		return nil, err
	}
	nc := persistWarps
	mb := 1
	if T > 1 {
		mb = persistMaxSeqs
	}
	row := max(d, nq*hd)
	slot := 2 * persistRows * row
	words := f / 16
	cp := (words + nc - 1) / nc * 16 // list capacity of a warp
	scratch := max(2*mb*row, 4*nc*cp)
	nslot := min(persistMaxSlot, (p.SharedPerBlockOptin-attr.StaticShared-scratch)/slot)
	if e.PersistentSlots > 0 {
		nslot = min(nslot, max(persistMinSlot, e.PersistentSlots))
	}
	if nslot < persistMinSlot {
		return nil, fmt.Errorf("llm: the persistent decode kernel fits %d ring slots of %d bytes in %d bytes of shared memory; it needs %d",
			nslot, slot, p.SharedPerBlockOptin, persistMinSlot)
	}
	shared := nslot*slot + scratch
	threads := 32 * (nc + 1)
	if err := fn.SetMaxDynamicShared(shared); err != nil {
		return nil, err
	}
	if n, err := fn.MaxActiveBlocksPerSM(threads, shared); err != nil || n < 1 {
		return nil, fmt.Errorf("llm: the persistent decode kernel does not fit an SM (%d blocks, %v)", n, err)
	}
	if err := e.persistAlloc(); err != nil {
		return nil, err
	}
	if e.PersistentStamps && e.persist.stamps == nil {
		if e.persist.stamps, err = e.dev.Alloc(8 * persistPhases * 2 * p.SMs * len(e.layers)); err != nil {
			return nil, fmt.Errorf("llm: the persistent decode kernel's timeline: %w", err)
		}
	}
	runs := min(persistMaxRuns, max(1, p.SMs*nc/(T*nq)))
	return &persistLaunch{fn: fn, grid: p.SMs, threads: threads, shared: shared, nslot: nslot, slotBytes: slot, cap: cp, runs: runs}, nil
}

// persistAlloc makes the kernel's buffers (for 8 tokens) and its layer
// table, once.
func (e *Engine) persistAlloc() error {
	ps := &e.persist
	if ps.table != nil {
		return nil
	}
	c := e.cfg
	d, f, hd, nq := c.HiddenSize, c.IntermediateSize, c.HeadDim, c.NumAttentionHeads
	const m = persistMaxSeqs
	// PLayer: qkv, o, gate, up, down, attn_norm, mlp_norm.
	table := make([]uint64, 0, 7*len(e.layers))
	for _, l := range e.layers {
		gate, up, down := l.mlp.Rows()
		for _, b := range []*cuda.Buffer{l.qkv, l.o, gate, up, down, l.attnNorm, l.mlpNorm} {
			table = append(table, uint64(b.Ptr()))
		}
	}
	var err error
	for _, b := range []struct {
		p    **cuda.Buffer
		n    int
		zero bool
	}{
		{&ps.table, 8 * len(table), false}, {&ps.resB, 4 * m * d, false}, {&ps.h, 4 * m * f, false},
		{&ps.act, f / 4, false}, {&ps.runs, 4 * m * nq * persistMaxRuns * (hd + 2), false},
		{&ps.cnt, 4 * m * nq, true}, {&ps.bar, 8, true},
	} {
		if *b.p, err = e.dev.Alloc(b.n); err != nil {
			return errors.Join(fmt.Errorf("llm: the persistent decode kernel's buffers: %w", err), e.persistFree())
		}
		if b.zero {
			if err = e.dev.Memset8(*b.p, 0, e.stream); err != nil {
				return errors.Join(err, e.persistFree())
			}
		}
	}
	tb := unsafe.Slice((*byte)(unsafe.Pointer(&table[0])), 8*len(table))
	if err := e.dev.CopyHtoDAsync(ps.table, tb, e.stream); err != nil {
		return errors.Join(err, e.persistFree())
	}
	// The copy reads table (Go memory) asynchronously: wait for it.
	return e.stream.Synchronize()
}

// persistFree frees the kernel's buffers.
func (e *Engine) persistFree() error {
	ps := &e.persist
	var errs []error
	for _, b := range []**cuda.Buffer{&ps.table, &ps.resB, &ps.h, &ps.act, &ps.runs, &ps.cnt, &ps.bar, &ps.stamps} {
		if *b != nil {
			errs = append(errs, (*b).Free())
			*b = nil
		}
	}
	return errors.Join(errs...)
}

// launch queues the persistent kernel for b's decode step on the engine's
// stream: the layers read the embeddings in ws.resid and leave the
// residual stream there and the last MLP output in ws.proj.
func (pl *persistLaunch) launch(e *Engine, b *batch, tokSeq, tokPos, pt *cuda.Buffer) error {
	c := e.cfg
	ws, ps := &e.ws, &e.persist
	var stamps any = cuda.DevicePtr(0)
	if e.PersistentStamps && ps.stamps != nil {
		stamps = ps.stamps
	}
	scaleLog2 := float32(math.Log2E / math.Sqrt(float64(c.HeadDim)))
	return pl.fn.LaunchEx(cuda.LaunchConfig{Grid: cuda.Dim3{uint32(pl.grid), 1, 1}, Block: cuda.Dim3{uint32(pl.threads), 1, 1},
		SharedBytes: pl.shared, Stream: e.stream, Cooperative: true},
		ps.table, int32(len(e.layers)), ws.resid, ps.resB, ws.proj, ws.qkv, ws.hn, ps.h, ps.act, ps.runs, ps.cnt, ps.bar, stamps,
		e.cosB, e.sinB, tokSeq, tokPos, pt, int32(e.pool.size), int32(b.T), int32(c.HiddenSize), int32(c.IntermediateSize),
		int32(c.NumAttentionHeads), int32(c.NumKeyValueHeads), int32(pl.runs), int32(pl.nslot), int32(pl.slotBytes),
		int32(pl.cap), float32(c.RMSNormEps), scaleLog2)
}

// PersistentError returns why the persistent decode kernel
// (Engine.Persistent) is not used, after a failure to set it up or to
// record it into a graph; nil if it has not failed.
func (e *Engine) PersistentError() error { return e.persistErr }

// PersistentSteps returns how many decode steps ran the persistent decode
// kernel so far.
func (e *Engine) PersistentSteps() int { return e.persistSteps }

// persistPhases are the persistent kernel's phases a layer, in order.
const persistPhases = 5

// persistPhaseNames name them.
var persistPhaseNames = [persistPhases]string{"norm+qkv", "attention", "o_proj", "norm+gate", "down"}

// PersistentPhase is where the layers' time goes in the persistent decode
// kernel, by phase (PersistentPhases).
type PersistentPhase struct {
	Name string
	// SpanUS holds, per layer, the time from the first block starting the
	// phase to the last one finishing it (microseconds); BarrierUS the time
	// from then until the first block starts the next phase (the grid
	// barrier; none after the last layer's last phase).
	SpanUS, BarrierUS []float64
}

// PersistentPhases reads the timeline the last step that ran the
// persistent decode kernel recorded (Engine.PersistentStamps) and returns
// its phases. It synchronizes the engine's stream.
func (e *Engine) PersistentPhases() ([]PersistentPhase, error) {
	ps := &e.persist
	if !e.PersistentStamps || ps.stamps == nil || e.persistSteps == 0 {
		return nil, errors.New("llm: no persistent decode step recorded a timeline (PersistentStamps)")
	}
	nl, sms := len(e.layers), e.dev.Properties().SMs
	w := make([]uint64, persistPhases*2*sms*nl)
	if err := e.stream.Synchronize(); err != nil {
		return nil, err
	}
	if err := e.dev.CopyDtoH(unsafe.Slice((*byte)(unsafe.Pointer(&w[0])), 8*len(w)), ps.stamps); err != nil {
		return nil, err
	}
	return phaseTimes(w, sms, nl), nil
}

// phaseTimes reads stamps (block b, layer l, phase p, start 0 or end 1 at
// ((b nl + l) 5 + p) 2 + end, nanoseconds) by phase.
func phaseTimes(w []uint64, blocks, nl int) []PersistentPhase {
	at := func(b, l, p, end int) uint64 { return w[((b*nl+l)*persistPhases+p)*2+end] }
	out := make([]PersistentPhase, persistPhases)
	for p := range out {
		spans, gaps := make([]float64, 0, nl), make([]float64, 0, nl)
		for l := range nl {
			first, last, next := uint64(math.MaxUint64), uint64(0), uint64(math.MaxUint64)
			for b := range blocks {
				first, last = min(first, at(b, l, p, 0)), max(last, at(b, l, p, 1))
				if p+1 < persistPhases {
					next = min(next, at(b, l, p+1, 0))
				} else if l+1 < nl {
					next = min(next, at(b, l+1, 0, 0))
				}
			}
			spans = append(spans, float64(last-first)/1e3)
			if next != math.MaxUint64 {
				gaps = append(gaps, float64(next-last)/1e3)
			}
		}
		out[p] = PersistentPhase{Name: persistPhaseNames[p], SpanUS: spans, BarrierUS: gaps}
	}
	return out
}
