package trainer

import (
	_ "embed"
	"errors"
	"fmt"
	"math"
	"sync"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/gpu"
	"github.com/twell-ai/twell/internal/memcheck"
)

// attentionCU holds the attention kernels: attn_fwd, attn_bwd_dsum,
// attn_bwd_dkdv and attn_bwd_dq (flash-attention 2 style, mma.sync bf16
// tensor cores, fp32 accumulation; the forward stores no score matrix, the
// backward its bf16 dS once).
//
//go:embed attention.cu
var attentionCU []byte

// attentionWGMMACU holds attn_fwd_wg, attn_bwd_dkdv_wg and attn_bwd_dq_wg,
// the Hopper forward, dK/dV and dQ kernels for head size 64 (wgmma
// instead of mma.sync; compiled for sm_90a only).
//
//go:embed attention_wgmma.cu
var attentionWGMMACU []byte

// attentionCUH holds what the dK/dV kernels of both files share.
//
//go:embed attention.cuh
var attentionCUH []byte

// attentionHeaders are the headers the attention kernels include: package
// gpu's and attention.cuh.
func attentionHeaders() []cuda.CompileOption {
	return append(gpu.Headers(), cuda.WithHeader("attention.cuh", attentionCUH))
}

// attentionHeadDims are the head sizes the attention kernels are built for.
// The tiles take any multiple of 32 up to 128, but ptxas spills a few
// registers of attn_fwd<96>, so 96 is left out until that is fixed.
var attentionHeadDims = []int{32, 64, 128}

// Tile sizes of attention.cu: 64 queries per forward and dQ CTA, 64 keys
// per dK/dV CTA and per forward and dQ key block, 4 warps each.
const (
	attnBlockQ   = 64
	attnBlockK   = 64
	attnThreads  = 128
	attnDsumRows = 8 // warps (token-head rows) per attn_bwd_dsum block
)

// attnDKDVBlockQ is the query block of attn_bwd_dkdv<hd>: smaller for large
// heads, whose dK and dV accumulators take most of the registers (at 32,
// hd 128 spilled with CUDA 13's ptxas once the kernel also stored dS).
func attnDKDVBlockQ(hd int) int {
	if hd <= 64 {
		return 64
	}
	return 16
}

// attnScratchCap bounds the dS^T tiles the backward keeps at once: it runs
// in chunks of as many sequences as fit (at least one). At the 1.5B shape
// (8 x 2048 tokens, 32 heads) the whole micro-batch takes 1.1 GB.
var attnScratchCap int64 = 2 << 30

// attnSeqScratch is the size of one sequence's dS^T tiles: a bf16 64 x 64
// tile per causal (query block, key block) pair and query head.
func attnSeqScratch(seq, nq int) int64 {
	nt := int64(ceil(seq, attnBlockQ))
	return nt * (nt + 1) / 2 * attnBlockQ * attnBlockK * 2 * int64(nq)
}

// attnChunk returns the sequences of a backward launch for micro-batches of
// batch sequences.
func attnChunk(batch, seq, nq int) int {
	return int(max(1, min(int64(batch), attnScratchCap/attnSeqScratch(seq, nq))))
}

// attnWorkBytes is the device memory of an attention's work buffers: D
// (fp32 per query row and head) and the dS^T tiles of one chunk.
func attnWorkBytes(batch, seq, nq int) int64 {
	return 4*int64(batch)*int64(nq)*int64(seq) + int64(attnChunk(batch, seq, nq))*attnSeqScratch(seq, nq)
}

// attentionExprs are the name expressions of the kernels for head size hd.
func attentionExprs(hd int) (fwd, dkdv, dq string) {
	return fmt.Sprintf("attn_fwd<%d>", hd), fmt.Sprintf("attn_bwd_dkdv<%d, %d>", hd, attnDKDVBlockQ(hd)),
		fmt.Sprintf("attn_bwd_dq<%d>", hd)
}

// attentionKernels are the compiled attention kernels for one head size on
// one device.
type attentionKernels struct {
	fwd, dsum, dkdv, dq *cuda.Function
	// fwdWG, dkdvWG and dqWG are attn_fwd_wg, attn_bwd_dkdv_wg and
	// attn_bwd_dq_wg where they run (head size 64 on sm_90a), else nil.
	fwdWG, dkdvWG, dqWG *cuda.Function
}

type attentionKey struct {
	dev *cuda.Device
	hd  int
}

var (
	attnKernMu  sync.Mutex
	attnKernTab = map[attentionKey]*attentionKernels{}
)

// attentionKernelsFor compiles attention.cu for dev and head size hd (once
// per process; NVRTC's output is also cached on disk) and looks its kernels
// up.
func attentionKernelsFor(dev *cuda.Device, hd int) (*attentionKernels, error) {
	attnKernMu.Lock()
	defer attnKernMu.Unlock()
	key := attentionKey{dev, hd}
	if k := attnKernTab[key]; k != nil {
		return k, nil
	}
	fwd, dkdv, dq := attentionExprs(hd)
	mod, err := dev.Compile("attention.cu", attentionCU, append(attentionHeaders(), cuda.WithNameExpressions(fwd, dkdv, dq))...)
	if err != nil {
		return nil, fmt.Errorf("trainer: compiling attention.cu: %w", err)
	}
	k := &attentionKernels{}
	for _, f := range []struct {
		fn   **cuda.Function
		name string
	}{{&k.fwd, fwd}, {&k.dsum, "attn_bwd_dsum"}, {&k.dkdv, dkdv}, {&k.dq, dq}} {
		if *f.fn, err = mod.Function(f.name); err != nil {
			return nil, fmt.Errorf("trainer: attention kernel %s: %w", f.name, err)
		}
	}
	if hd == 64 && dev.Properties().Arch == "sm_90a" {
		wg, err := dev.Compile("attention_wgmma.cu", attentionWGMMACU, attentionHeaders()...)
		if err != nil {
			return nil, fmt.Errorf("trainer: compiling attention_wgmma.cu: %w", err)
		}
		for _, f := range []struct {
			fn   **cuda.Function
			name string
		}{{&k.fwdWG, "attn_fwd_wg"}, {&k.dkdvWG, "attn_bwd_dkdv_wg"}, {&k.dqWG, "attn_bwd_dq_wg"}} {
			if *f.fn, err = wg.Function(f.name); err != nil {
				return nil, fmt.Errorf("trainer: attention kernel %s: %w", f.name, err)
			}
		}
	}
	attnKernTab[key] = k
	return k, nil
}

// Launch shapes of attention_wgmma.cu. attn_fwd_wg: 128 queries and two
// warpgroups a CTA; dynamic shared memory 1024 bytes of alignment, the
// 128-row Q tile and 3 stages of K and V tiles (64 x 64 bf16 each).
// attn_bwd_dkdv_wg: 1024 bytes of alignment, seven 64 x 64 bf16 tiles and
// 2 x 2 x 64 floats. attn_bwd_dq_wg: 1024 bytes of alignment and 3 stages
// of K and dS^T tiles.
const (
	attnFwdWGBlockQ  = 128
	attnFwdWGThreads = 256
	attnFwdWGShared  = 1024 + 2*64*64*2 + 3*2*64*64*2
	attnDKDVWGShared = 1024 + 7*64*64*2 + 2*2*64*4
	attnDQWGShared   = 1024 + 3*2*64*64*2
)

// attention holds the work buffers of causal self-attention over batch
// independent sequences of seq tokens each (positions 0..seq-1), nq query
// heads and nkv key/value heads (grouped-query: query head h uses kv head
// h/(nq/nkv)) of size hd, scale 1/sqrt(hd).
//
// The kernels (attention.cu) are flash-attention 2 style: the forward pass
// computes out and the log-sum-exp of each query row block by block with an
// online softmax; the backward pass recomputes the probabilities from lse,
// with D = rowsum(dout * out) from a small kernel, one kernel for dK and dV
// (a CTA per 64 keys of a kv head, summing its query heads in registers)
// that also stores the score gradient dS (bf16, the causal 64 x 64 tiles),
// and one for dQ = dS K (a CTA per 64 queries of a head). Storing dS costs
// 2 bytes written and read per causal score; recomputing it for dQ cost two
// more products (scores and dP) over the same scores. Products run on
// mma.sync bf16 tensor cores (on Hopper at head size 64 all three are
// attention_wgmma.cu's, the same work on wgmma), probabilities and their
// gradients rounded to bf16, accumulation and softmax in fp32. Nothing is
// accumulated with atomics: every output element is written once, in a
// fixed order, so forward and backward are bitwise deterministic.
type attention struct {
	dev                     *cuda.Device
	k                       *attentionKernels
	batch, seq, nq, nkv, hd int
	// dsum is D = rowsum(dout * out), fp32 [batch][nq][seq], recomputed by
	// every backward call.
	dsum *cuda.Buffer
	// ds holds the dS^T tiles of chunk sequences (attention.cu's ds).
	ds    *cuda.Buffer
	chunk int
	// fwdWG, dkdvWG and dqWG are the wgmma forward, dK/dV and dQ kernels
	// the attention runs, nil for the mma.sync ones.
	fwdWG, dkdvWG, dqWG *cuda.Function
}

// newAttention compiles the kernels for hd (32, 64 or 128)
// and allocates the backward's work buffers (attnWorkBytes). blas is
// not used by this implementation; it is part of the constructor so that
// the caller need not know which products run where.
func newAttention(dev *cuda.Device, blas *cublas.Handle, batch, seq, nq, nkv, hd int) (*attention, error) {
	_ = blas
	if batch < 1 || seq < 1 || nq < 1 || nkv < 1 || hd < 1 {
		return nil, fmt.Errorf("trainer: attention batch %d, seq %d, %d query and %d kv heads of size %d: all must be positive",
			batch, seq, nq, nkv, hd)
	}
	if nq%nkv != 0 {
		return nil, fmt.Errorf("trainer: attention with %d query heads and %d kv heads: nq must be a multiple of nkv", nq, nkv)
	}
	ok := false
	for _, d := range attentionHeadDims {
		ok = ok || d == hd
	}
	if !ok {
		return nil, fmt.Errorf("trainer: attention head size %d: the kernels take %v", hd, attentionHeadDims)
	}
	if batch > 65535 || nq > 65535 {
		return nil, fmt.Errorf("trainer: attention batch %d with %d query heads: at most 65535 of each (CUDA grid)", batch, nq)
	}
	if tokens := int64(batch) * int64(seq); tokens*int64(nq) > math.MaxInt32 || tokens*int64(nq+2*nkv)*int64(hd) > 1<<40 {
		return nil, fmt.Errorf("trainer: attention batch %d x seq %d x %d heads is too large", batch, seq, nq+2*nkv)
	}
	k, err := attentionKernelsFor(dev, hd)
	if err != nil {
		return nil, err
	}
	a := &attention{dev: dev, k: k, batch: batch, seq: seq, nq: nq, nkv: nkv, hd: hd, chunk: attnChunk(batch, seq, nq),
		fwdWG: k.fwdWG, dkdvWG: k.dkdvWG, dqWG: k.dqWG}
	if a.dsum, err = dev.Alloc(4 * batch * nq * seq); err != nil {
		return nil, fmt.Errorf("trainer: attention work buffer (fp32 [%d][%d][%d]): %w", batch, nq, seq, err)
	}
	if a.ds, err = dev.Alloc(int(int64(a.chunk) * attnSeqScratch(seq, nq))); err != nil {
		a.close()
		return nil, fmt.Errorf("trainer: attention score gradient tiles (%d sequences of %d tokens, %d heads: %s): %w",
			a.chunk, seq, nq, memcheck.Format(float64(int64(a.chunk)*attnSeqScratch(seq, nq))), err)
	}
	return a, nil
}

// qkvWidth is the row width of qkv and dqkv in elements.
func (a *attention) qkvWidth() int { return (a.nq + 2*a.nkv) * a.hd }

// check returns an error naming the buffer and its expected shape when b is
// nil or holds fewer than rows x cols elements of esize bytes.
func (a *attention) check(op, name string, b *cuda.Buffer, rows, cols, esize int, dtype string) error {
	want := rows * cols * esize
	if b == nil {
		return fmt.Errorf("trainer: attention %s: %s is nil, want %s [%d][%d]", op, name, dtype, rows, cols)
	}
	if b.Len() < want {
		return fmt.Errorf("trainer: attention %s: %s holds %d bytes, want %s [%d][%d] (%d bytes)",
			op, name, b.Len(), dtype, rows, cols, want)
	}
	return nil
}

// scales returns log2(e)/sqrt(hd), the kernels' score factor for exp2, and
// 1/sqrt(hd).
func (a *attention) scales() (scaleLog2, scale float32) {
	s := 1 / math.Sqrt(float64(a.hd))
	return float32(s * math.Log2E), float32(s)
}

// grid returns the launch grid of the per-block kernels: a CTA per block of
// 64 rows, per head and per sequence.
func (a *attention) grid(heads int) cuda.Dim3 {
	return cuda.Dim3{uint32((a.seq + attnBlockQ - 1) / attnBlockQ), uint32(heads), uint32(a.batch)}
}

// forward reads qkv, bf16 [batch*seq][(nq+2*nkv)*hd] (per token: the nq query
// heads, then the nkv key heads, then the nkv value heads; RoPE already
// applied) and writes out, bf16 [batch*seq][nq*hd], and lse, fp32
// [batch][nq][seq] (log-sum-exp of each query row's scaled, masked
// scores). The caller keeps one lse per layer: forward runs for every
// layer, later backward for each layer in reverse order with the same qkv,
// out and lse buffers, so nothing per layer may live only in the
// attention's own buffers.
func (a *attention) forward(s *cuda.Stream, out, qkv, lse *cuda.Buffer) error {
	T := a.batch * a.seq
	if err := a.check("forward", "qkv", qkv, T, a.qkvWidth(), 2, "bf16"); err != nil {
		return err
	}
	if err := a.check("forward", "out", out, T, a.nq*a.hd, 2, "bf16"); err != nil {
		return err
	}
	if err := a.check("forward", "lse", lse, a.batch*a.nq, a.seq, 4, "fp32"); err != nil {
		return err
	}
	scaleLog2, _ := a.scales()
	fn, g, block, smem := a.k.fwd, a.grid(a.nq), cuda.Dim3{attnThreads, 1, 1}, 2*2*attnBlockK*(a.hd+8)*2
	if a.fwdWG != nil {
		fn, block, smem = a.fwdWG, cuda.Dim3{attnFwdWGThreads, 1, 1}, attnFwdWGShared
		g[0] = uint32(ceil(a.seq, attnFwdWGBlockQ))
	}
	if err := fn.Launch(g, block, smem, s, qkv, out, lse,
		int32(a.seq), int32(a.nq), int32(a.nkv), scaleLog2); err != nil {
		return fmt.Errorf("trainer: attention forward: %w", err)
	}
	return nil
}

// attnGrad is where the attention backward writes dqkv (same layout as
// qkv; the k and v parts summed over the query heads of their group):
// fp32 into f32, or, when bf16 is set, bf16 into bf16 with the q and k heads
// turned back by RoPE's rotation (cos and sin, fp32 [seq][hd/2], the
// tables the forward's rope_bf16 rotated them by), which is the gradient
// of the q/k/v product rope_bf16 rotated.
type attnGrad struct{ f32, bf16, cos, sin *cuda.Buffer }

// backward writes the gradient of qkv into g (overwritten) from dout, bf16
// [batch*seq][nq*hd], and the forward's qkv, out and lse.
func (a *attention) backward(s *cuda.Stream, g attnGrad, dout, qkv, out, lse *cuda.Buffer) error {
	T := a.batch * a.seq
	type operand struct {
		name       string
		b          *cuda.Buffer
		rows, cols int
		esize      int
		dtype      string
	}
	ops := []operand{
		{"dout", dout, T, a.nq * a.hd, 2, "bf16"},
		{"qkv", qkv, T, a.qkvWidth(), 2, "bf16"},
		{"out", out, T, a.nq * a.hd, 2, "bf16"},
		{"lse", lse, a.batch * a.nq, a.seq, 4, "fp32"},
	}
	if g.bf16 != nil {
		g.f32 = nil
		ops = append(ops, operand{"dqkv", g.bf16, T, a.qkvWidth(), 2, "bf16"},
			operand{"rope cos", g.cos, a.seq, a.hd / 2, 4, "fp32"}, operand{"rope sin", g.sin, a.seq, a.hd / 2, 4, "fp32"})
	} else {
		ops = append(ops, operand{"dqkv", g.f32, T, a.qkvWidth(), 4, "fp32"})
		g.cos, g.sin = nil, nil
	}
	for _, c := range ops {
		if err := a.check("backward", c.name, c.b, c.rows, c.cols, c.esize, c.dtype); err != nil {
			return err
		}
	}
	gradArgs := []any{optional(g.f32), optional(g.bf16), optional(g.cos), optional(g.sin)}
	scaleLog2, scale := a.scales()
	block := cuda.Dim3{attnThreads, 1, 1}
	rows := T * a.nq
	if err := a.k.dsum.Launch(cuda.Dim3{uint32((rows + attnDsumRows - 1) / attnDsumRows), 1, 1}, cuda.Dim3{32 * attnDsumRows, 1, 1},
		0, s, dout, out, a.dsum, int32(rows), int32(a.seq), int32(a.nq), int32(a.hd)); err != nil {
		return fmt.Errorf("trainer: attention backward (D): %w", err)
	}
	bq, p := attnDKDVBlockQ(a.hd), a.hd+8
	smemKV := (2*attnBlockK+4*bq)*p*2 + 4*bq*4
	for b0 := 0; b0 < a.batch; b0 += a.chunk {
		n := uint32(min(a.chunk, a.batch-b0))
		grid := a.grid(a.nkv)
		grid[2] = n
		fn, smem := a.k.dkdv, smemKV
		if a.dkdvWG != nil {
			fn, smem = a.dkdvWG, attnDKDVWGShared
		}
		args := append(append([]any{qkv, dout, lse, a.dsum}, gradArgs...), a.ds,
			int32(a.seq), int32(a.nq), int32(a.nkv), int32(b0), scaleLog2, scale)
		if err := fn.Launch(grid, block, smem, s, args...); err != nil {
			return fmt.Errorf("trainer: attention backward (dK, dV): %w", err)
		}
		if err := a.launchDQ(s, gradArgs, qkv, b0, n); err != nil {
			return err
		}
	}
	return nil
}

// launchDQ queues attn_bwd_dq for the n sequences from b0, whose dS^T tiles
// the dK/dV kernel left in ds; gradArgs are the kernel's GradOut fields.
func (a *attention) launchDQ(s *cuda.Stream, gradArgs []any, qkv *cuda.Buffer, b0 int, n uint32) error {
	_, scale := a.scales()
	grid := a.grid(a.nq)
	grid[2] = n
	fn, smem := a.k.dq, 2*attnBlockK*(a.hd+8+attnBlockQ+8)*2 // two stages of K and dS^T
	if a.dqWG != nil {
		fn, smem = a.dqWG, attnDQWGShared
	}
	args := append(append([]any{qkv, a.ds}, gradArgs...), int32(a.seq), int32(a.nq), int32(a.nkv), int32(b0), scale)
	if err := fn.Launch(grid, cuda.Dim3{attnThreads, 1, 1}, smem, s, args...); err != nil {
		return fmt.Errorf("trainer: attention backward (dQ): %w", err)
	}
	return nil
}

// close frees the work buffers. Call it when no queued work still uses the
// attention.
func (a *attention) close() error {
	var err error
	for _, b := range []**cuda.Buffer{&a.dsum, &a.ds} {
		if *b != nil {
			err = errors.Join(err, (*b).Free())
			*b = nil
		}
	}
	return err
}
