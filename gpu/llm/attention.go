package llm

import (
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/model"
)

// wgMinTokens is the pass size above which auto runs the wgmma attention
// kernel (where it fits): prefill passes; decode steps keep mma.sync.
const wgMinTokens = 64

// attnKernel is an attention kernel and how to launch it.
type attnKernel struct {
	fn   *cuda.Function
	smem int  // dynamic shared memory
	ref  bool // attn_ref, whose launch also takes head_dim
	wg   bool // attn_wg64, whose launch also takes the RoPE tables (attnArgs.cos)
}

// attnArgs are the operands of the attention kernels (attn.cu,
// attn_wgmma.cu) for one layer of a pass: the q/k/v rows (qkvW bf16 each),
// the output rows (nq hd bf16), the nItems work items (sequence, first
// query), the per-sequence metadata and the page size. cos and sin, for
// attn_wg64 only, are the RoPE tables when the queries are still to be
// rotated (Engine.AttnRope), nil when rope_kv rotated them.
type attnArgs struct {
	qkv, out, items, seqQ0, seqN, seqPast, pt *cuda.Buffer
	cos, sin                                  *cuda.Buffer
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
	if k.wg {
		return k.fn.Launch(grid, block, k.smem, s, a.qkv, a.out, a.items, a.seqQ0, a.seqN, a.seqPast, a.pt, int32(a.page),
			int32(a.layer), int32(a.nq), int32(a.nkv), int32(a.qkvW), scaleLog2, optional(a.cos), optional(a.sin))
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
	a := e.Attention
	switch a {
	case "ref":
		return ref, nil
	case "mma":
		if hd != 64 && hd != 128 {
			return attnKernel{}, fmt.Errorf("llm: the mma attention kernel takes head_dim 64 or 128, not %d", hd)
		}
		return mma()
	case "", "auto":
		if hd == 64 && T > wgMinTokens && e.dev.Properties().Arch == "sm_90a" {
			if k, err := e.k.wgmma("wgmma3"); err == nil {
				return k, nil
			}
		}
		if hd == 64 || hd == 128 {
			return mma()
		}
		return ref, nil
	}
	if _, ok := wgBuilds[a]; !ok {
		return attnKernel{}, fmt.Errorf("llm: attention kernel %q: want %s", a, attentionChoices())
	}
	if hd != 64 {
		return attnKernel{}, fmt.Errorf("llm: the wgmma attention kernel takes head_dim 64, not %d", hd)
	}
	return e.k.wgmma(a)
}

// attentionChoices lists the values Engine.Attention takes, for messages.
func attentionChoices() string {
	return strings.Join(append([]string{"auto", "mma", "ref"}, wgNames()...), ", ")
}

// wgNames returns the names of the wgmma attention builds (wgBuilds),
// sorted.
func wgNames() []string {
	names := slices.Collect(maps.Keys(wgBuilds))
	slices.Sort(names)
	return names
}

// decSplits is the most runs a decode step's keys are cut into, per
// sequence and head (decRuns), decThreads is ATT_DEC_THREADS (attn.cu), the
// threads of the CTA that takes one run, and decStages is ATT_DEC_STAGES,
// the key blocks (keys and values) a CTA holds in shared memory at once.
const (
	decSplits  = 16
	decThreads = 128
	decStages  = 2
)

// decSmem is the decode kernel's dynamic shared memory for head_dim hd:
// decStages blocks of keys (ATT_BK, PageMultiple) and their values, bf16.
func decSmem(hd int) int { return decStages * 2 * PageMultiple * hd * 2 }

// decRuns is the number of runs a decode step on kernel k cuts each
// query's keys into, where the step has pairs (sequence, head) pairs:
// decSplits, halved (down to 1) while the CTAs would not all be resident
// at once (k's slots): a second wave of CTAs costs more than longer runs,
// and only the first wave's copies overlap the kernel before.
func (e *Engine) decRuns(pairs int, k decKernel) int {
	if e.decRunsFixed > 0 {
		return min(e.decRunsFixed, decSplits)
	}
	return decRunsFor(pairs, k.slots)
}

// decRunsFor is decRuns for pairs (sequence, head) pairs and room for
// slots resident CTAs.
func decRunsFor(pairs, slots int) int {
	runs := decSplits
	for runs > 1 && pairs*runs > slots {
		runs /= 2
	}
	return runs
}

// decBytes is the size of the decode attention's buffer for S sequences of
// model c: per sequence and head, up to decSplits runs of head_dim outputs, a
// maximum and a sum (fp32), and a counter (0 when c's head_dim has no
// decode kernel).
func decBytes(c model.Config, S int) int {
	if c.HeadDim != 64 && c.HeadDim != 128 {
		return 0
	}
	return S * c.NumAttentionHeads * (4*decSplits*(c.HeadDim+2) + 4)
}

// decAttention is the decode attention kernel, its buffer's views and the
// runs per (sequence, head).
type decAttention struct {
	fn                *cuda.Function
	po, pm, pl, count *cuda.Buffer
	runs              int
	// cos and sin, when set, make the kernel rotate the query and the new
	// key and write the new key and value into the cache (Engine.DecRope):
	// rope_kv does not run.
	cos, sin *cuda.Buffer
	early    bool // launch with early start
	cluster  bool // launch the runs of a (work item, head) as a cluster
	// releaseFirst lets the next kernel start before this one's grid_wait
	// (attn.cu, grid_enter in common.cuh): in one-token steps, as the other
	// one-token kernels do. (At b=8, where cuBLASLt's GEMM comes next, the
	// attention releasing first ran 3868-3910 tokens/s against 3920-4032,
	// H100.)
	releaseFirst bool
}

// decodeSplit reports whether decode steps (one new token per sequence)
// run the decode kernel: under auto, for head_dim 64 and 128. On an H200 at
// 512 cached tokens (SparseLM-1.5B preset, 32 heads, TwELL MLPs; two runs
// in one process, the kernel before it in the same runs) it took decode
// from 905-924 to 924-982 tokens/s at batch 1, 4135-4429 to 4357-4587 at
// batch 8, and, where the prefill kernel (attn_fa64) ran before, from
// 5977-6464 to 6213-6820 at 16, 9190-9338 to 9843-10375 at 32 and
// 12442-12621 to 15477-15852 at 64.
func (e *Engine) decodeSplit() bool {
	return (e.Attention == "" || e.Attention == "auto") && decBytes(e.cfg, 1) > 0
}

// decRope reports whether a decode step of T sequences leaves RoPE and the
// cache write to the decode attention kernel (DecRope): where its q/k/v
// projection is cuBLASLt's, not qkv_rope.
func (e *Engine) decRope(T int) bool { return e.DecRope && !e.gemv(T, e.cfg.HiddenSize) }

// decodeAttention returns the decode kernel for pass b, and whether b runs
// it: when b is a decode step and decodeSplit holds.
func (e *Engine) decodeAttention(b *batch) (decAttention, bool) {
	c := e.cfg
	if b.T != b.S || !e.decodeSplit() || e.ws.decSeq < b.S {
		return decAttention{}, false
	}
	k := e.k.dec[c.HeadDim]
	l := decLayout(c, b.S)
	v := func(i int) *cuda.Buffer { return view(e.ws.dec, l[i][0], l[i][1]) }
	d := decAttention{fn: k.fn, po: v(0), pm: v(1), pl: v(2), count: v(3), runs: e.decRuns(b.S*c.NumAttentionHeads, k),
		early: e.early(), cluster: k.cluster && !e.decGlobalMerge,
		releaseFirst: b.T == 1 && e.gemv(1, c.NumAttentionHeads*c.HeadDim)}
	if e.decRope(b.T) {
		d.cos, d.sin = e.cosB, e.sinB
	}
	return d, true
}

// decLayout returns where the decode attention's buffer for S sequences of
// model c keeps the runs' outputs, maxima and sums and the counters:
// {offset, size} in bytes, in that order, within decBytes(c, S).
func decLayout(c model.Config, S int) [4][2]int {
	pairs := S * c.NumAttentionHeads
	runs := pairs * decSplits
	return [4][2]int{{0, 4 * runs * c.HeadDim}, {4 * runs * c.HeadDim, 4 * runs}, {4 * runs * (c.HeadDim + 1), 4 * runs},
		{4 * runs * (c.HeadDim + 2), 4 * pairs}}
}

// launch queues the decode kernel: a CTA per (work item, head, run); the
// runs of a (work item, head) form a cluster where the device has them,
// merging through distributed shared memory.
func (d decAttention) launch(s *cuda.Stream, a attnArgs) error {
	grid := cuda.Dim3{uint32(a.nItems * a.nq), uint32(d.runs), 1}
	cfg := cuda.LaunchConfig{Grid: grid, Block: cuda.Dim3{decThreads, 1, 1}, SharedBytes: decSmem(a.hd), Stream: s,
		EarlyStart: d.early}
	if d.runs > 1 && d.cluster {
		cfg.Cluster = cuda.Dim3{1, uint32(d.runs), 1}
	}
	scaleLog2 := float32(math.Log2E / math.Sqrt(float64(a.hd)))
	return d.fn.LaunchEx(cfg, a.qkv, a.out, a.items, a.seqQ0, a.seqN, a.seqPast, a.pt,
		int32(a.page), int32(a.layer), int32(a.nq), int32(a.nkv), int32(a.qkvW), scaleLog2, d.po, d.pm, d.pl, d.count, releaseArg(d.releaseFirst),
		optional(d.cos), optional(d.sin))
}

// releaseArg is attn_dec's release_first argument.
func releaseArg(first bool) int32 {
	if first {
		return 1
	}
	return 0
}

// AttentionKernel names the attention kernel that prefill passes (over
// wgMinTokens tokens) run, e.g. "attn_fa64" or "attn_wg64<3>" (see
// Attention); decode steps of few sequences under auto run attn_dec64 or
// attn_dec128 (decodeAttention).
func (e *Engine) AttentionKernel() (string, error) {
	k, err := e.attentionKernel(wgMinTokens + 1)
	if err != nil {
		return "", err
	}
	return k.fn.Name(), nil
}

// wgBuild is a build of the wgmma attention kernel (attn_wgmma.cu): its
// name expression and the key and value blocks its shared memory holds.
type wgBuild struct {
	expr   string
	stages int
}

// wgBuilds are the builds by Engine.Attention name; auto runs wgmma3: on
// an H200, 3 stages took 14.3 ms at 4 layers of the SparseLM shape where 2
// took 14.4 and mma.sync (attn_fa64) 21.3. Builds with 4 stages, with each
// block's softmax overlapped with the block before's P V, and with the
// queries in registers were within the defaults' spread in whole-model
// prefill (H200, 2026-12-05) and are gone.
var wgBuilds = map[string]wgBuild{"wgmma3": {"attn_wg64<3>", 3}}

// wgExprs returns the name expressions of every build, sorted.
func wgExprs() []string {
	var exprs []string
	for _, b := range wgBuilds {
		exprs = append(exprs, b.expr)
	}
	slices.Sort(exprs)
	return exprs
}

// wgSmem is the dynamic shared memory of a build of stages stages: the 128
// query rows and the stages' 64-key K and V blocks, 128 bytes a row, plus
// 1024 bytes for aligning the base.
func wgSmem(stages int) int { return (attnBQ+stages*2*64)*128 + 1024 }

// wgmma returns the wgmma attention build of Engine.Attention name name
// (a key of wgBuilds), compiling attn_wgmma.cu on first use.
func (k *kernels) wgmma(name string) (attnKernel, error) {
	k.wgOnce.Do(func() { k.attnWG, k.wgErr = compileWGMMA(k.dev, headers()) })
	if k.wgErr != nil {
		return attnKernel{}, k.wgErr
	}
	b, ok := wgBuilds[name]
	if !ok {
		return attnKernel{}, fmt.Errorf("llm: no wgmma attention build %q", name)
	}
	return attnKernel{fn: k.attnWG[b.expr], smem: wgSmem(b.stages), wg: true}, nil
}

// compileWGMMA builds attn_wgmma.cu, which needs sm_90a (Hopper): a kernel
// for each of wgBuilds, by name expression.
func compileWGMMA(dev *cuda.Device, hdrs []cuda.CompileOption) (map[string]*cuda.Function, error) {
	if a := dev.Properties().Arch; a != "sm_90a" {
		return nil, fmt.Errorf("llm: the wgmma attention kernel needs sm_90a (Hopper); %v is %s", dev, a)
	}
	exprs := wgExprs()
	mod, err := dev.Compile("attn_wgmma.cu", attnWGMMASrc, append(hdrs, cuda.WithNameExpressions(exprs...))...)
	if err != nil {
		return nil, fmt.Errorf("llm: compiling attn_wgmma.cu: %w", err)
	}
	fns := map[string]*cuda.Function{}
	for _, e := range exprs {
		if fns[e], err = mod.Function(e); err != nil {
			return nil, fmt.Errorf("llm: kernel %s: %w", e, err)
		}
	}
	return fns, nil
}
