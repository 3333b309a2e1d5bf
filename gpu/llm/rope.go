package llm

import "github.com/twell-ai/twell/cuda"

// ropeArgs are the operands of rope_kv (rope.cu) and qkv_rope (proj.cu) for
// a pass of T tokens of one layer: the q/k/v rows (qkvW = (nq + 2 nkv) hd
// bf16 each), the fp32 cos and sin tables, and the pass's metadata (each
// token's sequence and position, each sequence's page table; page
// positions a page). early launches qkv_rope with early start; keepQ makes
// rope_kv leave the queries unrotated, for an attention kernel that rotates
// them as it loads them (Engine.AttnRope).
type ropeArgs struct {
	qkv, cos, sin, tokSeq, tokPos, pt *cuda.Buffer
	T, page, layer, nq, nkv, hd, qkvW int
	early, keepQ                      bool
}

// ropeKV queues rope_kv: one block per token rotates its query heads in
// place (unless keepQ) and writes its rotated keys and its values into the
// cache. Without the queries a block rotates the key heads only (8 of 40
// heads at the SparseLM shape), hence the smaller block.
func (a ropeArgs) ropeKV(fn *cuda.Function, s *cuda.Stream) error {
	threads, rotQ := 256, int32(1)
	if a.keepQ {
		threads, rotQ = 128, 0
	}
	return fn.Launch(cuda.Dim3{uint32(a.T), 1, 1}, cuda.Dim3{uint32(threads), 1, 1}, 0, s, a.qkv, a.cos, a.sin, a.tokSeq, a.tokPos,
		a.pt, int32(a.page), int32(a.layer), int32(a.nq), int32(a.nkv), int32(a.hd), int32(a.qkvW), rotQ)
}

// qkvRopeNormed queues qkv_rope1n for one token: the residual add and
// RMSNorm of norm (resid + delta into residOut, normed with w; see
// normArgs) fused before the projection by w (qkvW x h) with RoPE and the
// cache write.
func (a ropeArgs) qkvRopeNormed(fn *cuda.Function, s *cuda.Stream, norm normArgs, residOut, w *cuda.Buffer, h int) error {
	return fn.LaunchEx(cuda.LaunchConfig{Grid: cuda.Dim3{uint32((a.qkvW/2 + 7) / 8), 1, 1}, Block: cuda.Dim3{256, 1, 1}, SharedBytes: 2 * h,
		Stream: s, EarlyStart: a.early}, norm.resid, optional(norm.delta), residOut, norm.w, norm.eps, w, a.qkv,
		a.cos, a.sin, a.tokSeq, a.tokPos, a.pt, int32(a.page), int32(h), int32(a.layer), int32(a.nq), int32(a.nkv),
		int32(a.hd), int32(a.qkvW))
}

// qkvRope queues qkv_rope1 or qkv_rope4: the projection of x (T x h bf16)
// by w (qkvW x h) with RoPE and the cache write fused in; one warp per
// pair of rotated columns, x staged in shared memory.
func (a ropeArgs) qkvRope(fn *cuda.Function, s *cuda.Stream, x, w *cuda.Buffer, h int) error {
	return fn.LaunchEx(cuda.LaunchConfig{Grid: cuda.Dim3{uint32((a.qkvW/2 + 7) / 8), 1, 1}, Block: cuda.Dim3{256, 1, 1}, SharedBytes: 2 * a.T * h,
		Stream: s, EarlyStart: a.early}, x, w, a.qkv,
		a.cos, a.sin, a.tokSeq, a.tokPos, a.pt, int32(a.page), int32(a.T), int32(h), int32(a.layer), int32(a.nq), int32(a.nkv),
		int32(a.hd), int32(a.qkvW))
}
