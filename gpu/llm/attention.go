package llm

import (
	"fmt"
	"math"

	"github.com/twell-ai/twell/cuda"
)

// wgMinTokens is the pass size above which auto runs the wgmma attention
// kernel (where it fits): prefill passes; decode steps keep mma.sync.
const wgMinTokens = 64

// attnKernel is an attention kernel and how to launch it.
type attnKernel struct {
	fn   *cuda.Function
	smem int  // dynamic shared memory
	ref  bool // attn_ref, whose launch also takes head_dim
}

// attnArgs are the operands of the attention kernels (attn.cu,
// attn_wgmma.cu) for one layer of a pass: the q/k/v rows (qkvW bf16 each),
// the output rows (nq hd bf16), the nItems work items (sequence, first
// query), the per-sequence metadata and the page size.
type attnArgs struct {
	qkv, out, items, seqQ0, seqN, seqPast, pt *cuda.Buffer
	nItems, page, layer, nq, nkv, hd, qkvW    int
}

// launch queues the kernel: one 256-thread block per (work item, head).
func (k attnKernel) launch(s *cuda.Stream, a attnArgs) error {
	grid, block := cuda.Dim3{uint32(a.nItems * a.nq), 1, 1}, cuda.Dim3{256, 1, 1}
	scaleLog2 := float32(math.Log2E / math.Sqrt(float64(a.hd)))
	if k.ref {
		return k.fn.Launch(grid, block, 0, s, a.qkv, a.out, a.items, a.seqQ0, a.seqN, a.seqPast, a.pt, int32(a.page),
			int32(a.layer), int32(a.nq), int32(a.nkv), int32(a.hd), int32(a.qkvW), scaleLog2)
	}
	return k.fn.Launch(grid, block, k.smem, s, a.qkv, a.out, a.items, a.seqQ0, a.seqN, a.seqPast, a.pt, int32(a.page),
		int32(a.layer), int32(a.nq), int32(a.nkv), int32(a.qkvW), scaleLog2)
}

// attentionKernel returns the attention kernel Engine.Attention picks for a
// pass of T tokens.
func (e *Engine) attentionKernel(T int) (attnKernel, error) {
	hd := e.cfg.HeadDim
	mma := func() (attnKernel, error) {
		fn := e.k.attnFA64
		if hd == 128 {
			fn = e.k.attnFA128
		}
		return attnKernel{fn: fn, smem: 2 * 2 * 64 * (hd + 8) * 2}, nil // two stages of a K and a V block
	}
	ref := attnKernel{fn: e.k.attnRef, ref: true}
	switch a := e.Attention; a {
	case "ref":
		return ref, nil
	case "mma":
		if hd != 64 && hd != 128 {
			return attnKernel{}, fmt.Errorf("llm: the mma attention kernel takes head_dim 64 or 128, not %d", hd)
		}
		return mma()
	case "wgmma3":
		if hd != 64 {
			return attnKernel{}, fmt.Errorf("llm: the wgmma attention kernel takes head_dim 64, not %d", hd)
		}
		fn, err := e.k.wgmma()
		return attnKernel{fn: fn, smem: wgSmem}, err
	case "", "auto":
		if hd == 64 && T > wgMinTokens && e.dev.Properties().Arch == "sm_90a" {
			if fn, err := e.k.wgmma(); err == nil {
				return attnKernel{fn: fn, smem: wgSmem}, nil
			}
		}
		if hd == 64 || hd == 128 {
			return mma()
		}
		return ref, nil
	default:
		return attnKernel{}, fmt.Errorf("llm: attention kernel %q: want auto, wgmma3, mma or ref", a)
	}
}

// AttentionKernel names the attention kernel that prefill passes (over
// wgMinTokens tokens) run, e.g. "attn_fa64" or "attn_wg64<3>" (see
// Attention); decode steps under auto run the mma.sync kernel.
func (e *Engine) AttentionKernel() (string, error) {
	k, err := e.attentionKernel(wgMinTokens + 1)
	if err != nil {
		return "", err
	}
	return k.fn.Name(), nil
}

// wgStages is the cp.async pipeline depth of the one build of attn_wg64
// (attn_wgmma.cu): on an H200, 3 stages took 14.3 ms at 4 layers of the
// SparseLM shape where 2 took 14.4 and mma.sync (attn_fa64) 21.3.
const wgStages = 3

// wgName is the name expression of the wgmma attention kernel.
var wgName = fmt.Sprintf("attn_wg64<%d>", wgStages)

// wgSmem is its dynamic shared memory: the 128 query rows and the stages'
// 64-key K and V blocks, 128 bytes a row, plus 1024 bytes for aligning the
// base.
const wgSmem = (attnBQ+wgStages*2*64)*128 + 1024

// wgmma returns attn_wg64, compiling attn_wgmma.cu on first use.
func (k *kernels) wgmma() (*cuda.Function, error) {
	k.wgOnce.Do(func() { k.attnWG, k.wgErr = compileWGMMA(k.dev, headers()) })
	return k.attnWG, k.wgErr
}

// compileWGMMA builds attn_wgmma.cu, which needs sm_90a (Hopper).
func compileWGMMA(dev *cuda.Device, hdrs []cuda.CompileOption) (*cuda.Function, error) {
	if a := dev.Properties().Arch; a != "sm_90a" {
		return nil, fmt.Errorf("llm: the wgmma attention kernel needs sm_90a (Hopper); %v is %s", dev, a)
	}
	mod, err := dev.Compile("attn_wgmma.cu", attnWGMMASrc, append(hdrs, cuda.WithNameExpressions(wgName))...)
	if err != nil {
		return nil, fmt.Errorf("llm: compiling attn_wgmma.cu: %w", err)
	}
	fn, err := mod.Function(wgName)
	if err != nil {
		return nil, fmt.Errorf("llm: kernel %s: %w", wgName, err)
	}
	return fn, nil
}
