package llm

import (
	_ "embed"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/mlp"
)

//go:embed step.cu
var stepSrc []byte

// The launch shape of step_b1 (step.cu): one block per SM of 8 consumer
// warps and a producer warp, a ring of stepSlots slots of 8 rows of at
// most 2048 bf16 columns, and the attention's runs per head.
const (
	stepThreads = 288
	stepSlots   = 6
	stepSlot    = 8 * 2048 * 2
	stepRuns    = 4
	stepPart    = 64 + 2
)

// stepKernel is an engine's whole-step decode kernel and what it keeps on
// the device: the layers' weight table and the kernel's scratch.
type stepKernel struct {
	fn                   *cuda.Function
	grid, smem           int
	table                *cuda.Buffer // a StepLayer (step.cu) per layer
	q, part, h, act, cnt *cuda.Buffer
}

// stepFits reports why the engine's one-token decode steps cannot run on
// step_b1, or nil.
func (e *Engine) stepFits() error {
	c := e.cfg
	d, f, nq, nkv := c.HiddenSize, c.IntermediateSize, c.NumAttentionHeads, c.NumKeyValueHeads
	switch {
	case e.dev.Properties().Major < 9:
		return errors.New("needs compute capability 9.0 (bulk copies)")
	case c.HeadDim != 64:
		return fmt.Errorf("head_dim %d (want 64)", c.HeadDim)
	case d%256 != 0 || d > 2048 || (nq*64)%256 != 0 || nq*64 > 2048:
		return fmt.Errorf("hidden size %d and %d heads of 64 (want multiples of 256, at most 2048)", d, nq)
	case f%32 != 0 || f > 8192:
		return fmt.Errorf("MLP width %d (want a multiple of 32, at most 8192)", f)
	case nq%nkv != 0:
		return fmt.Errorf("%d heads over %d key/value heads", nq, nkv)
	}
	for i, l := range e.layers {
		if l.mlp == nil || !l.mlp.Gated {
			return fmt.Errorf("layer %d has no gated TwELL MLP", i)
		}
	}
	return nil
}

// stepReady makes the engine's stepKernel at first use: compiles step.cu,
// checks that a block fits on every SM at once (the launch is
// cooperative), and uploads the weight table.
func (e *Engine) stepReady() error {
	if e.step != nil {
		return nil
	}
	if err := e.stepFits(); err != nil {
		return fmt.Errorf("llm: %s=1: %w", EnvStepKernel, err)
	}
	mod, err := e.dev.Compile("step.cu", stepSrc, headers()...)
	if err != nil {
		return fmt.Errorf("llm: compiling step.cu: %w", err)
	}
	fn, err := mod.Function("step_b1")
	if err != nil {
		return err
	}
	c := e.cfg
	sk := &stepKernel{fn: fn, grid: e.dev.Properties().SMs, smem: stepSlots*stepSlot + 2*max(c.HiddenSize, 64*c.NumAttentionHeads)}
	if err := fn.SetMaxDynamicShared(sk.smem); err != nil {
		return fmt.Errorf("llm: step_b1: %w", err)
	}
	if n, err := fn.MaxActiveBlocksPerSM(stepThreads, sk.smem); err != nil || n < 1 {
		return fmt.Errorf("llm: step_b1: %d blocks an SM fit (%v)", n, err)
	}
	table := make([]byte, 0, 56*len(e.layers))
	for _, l := range e.layers {
		gate, up, down := l.mlp.Rows()
		for _, b := range []*cuda.Buffer{l.qkv, l.o, gate, up, down, l.attnNorm, l.mlpNorm} {
			table = binary.LittleEndian.AppendUint64(table, uint64(b.Ptr()))
		}
	}
	sizes := []int{len(table), 2 * c.NumAttentionHeads * 64, 4 * c.NumAttentionHeads * stepRuns * stepPart,
		4 * c.IntermediateSize, c.IntermediateSize, 8}
	bufs := make([]*cuda.Buffer, len(sizes))
	for i, n := range sizes {
		if bufs[i], err = e.dev.Alloc(n); err != nil {
			for _, b := range bufs[:i] {
				b.Free()
			}
			return fmt.Errorf("llm: step_b1 buffers: %w", err)
		}
	}
	sk.table, sk.q, sk.part, sk.h, sk.act, sk.cnt = bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], bufs[5]
	e.step = sk // Close frees the buffers from here on
	if err := e.dev.CopyHtoD(sk.table, table); err != nil {
		return err
	}
	return e.dev.Memset8(sk.cnt, 0, e.stream)
}

// stepQueue queues step_b1 for a one-token pass: the layers of the token
// whose embedding is in resid, leaving the residual stream there.
func (e *Engine) stepQueue(s *cuda.Stream, resid, tokPos, pt *cuda.Buffer) error {
	c, sk := e.cfg, e.step
	return sk.fn.LaunchEx(cuda.LaunchConfig{Grid: cuda.Dim3{uint32(sk.grid), 1, 1},
		Block: cuda.Dim3{stepThreads, 1, 1}, SharedBytes: sk.smem, Stream: s, Cooperative: true},
		sk.table, int32(len(e.layers)), int32(c.HiddenSize), int32(c.IntermediateSize), int32(c.NumAttentionHeads),
		int32(c.NumKeyValueHeads), int32(e.pool.size), resid, e.cosB, e.sinB, tokPos, pt, float32(c.RMSNormEps),
		sk.q, sk.part, sk.h, sk.act, sk.cnt)
}

// useStep reports whether a pass of T tokens with MLP paths paths (nil:
// not being recorded into a graph) runs on step_b1: StepKernel set, a
// graph-recorded one-token step, every layer on the sparse path.
func (e *Engine) useStep(T int, paths []mlp.Path) bool {
	if !e.StepKernel || T != 1 || paths == nil || e.step == nil {
		return false
	}
	for _, p := range paths {
		if p != mlp.Sparse {
			return false
		}
	}
	return true
}

// closeStep frees the step kernel's buffers.
func (e *Engine) closeStep() error {
	if e.step == nil {
		return nil
	}
	var err error
	for _, b := range []*cuda.Buffer{e.step.table, e.step.q, e.step.part, e.step.h, e.step.act, e.step.cnt} {
		err = errors.Join(err, b.Free())
	}
	e.step = nil
	return err
}
