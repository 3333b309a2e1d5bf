// proj.cu: the q/k/v and output projections of decode steps (package
// gpu/llm), with RoPE and the KV-cache write fused into the q/k/v one.
// Storage is bf16 (weights, activations between GEMMs, the KV cache); the
// residual stream and the norm weights are fp32, and all arithmetic is fp32.
// No CUDA headers: package gpu's common.cuh (bf16 helpers, dot8, cp.async)
// and the headers named below come from the launcher (gpu.Headers).
//
// Per-forward metadata (written by the launcher, one upload per call):
//   tok_seq[t], tok_pos[t]   sequence and absolute position of flat token t
//   seq_q0[s]                flat index of sequence s's first new token
//   seq_n[s], seq_past[s]    new tokens of s, and positions already cached
//   seq_pt[s]                s's KV cache: the address of its page table
//   items[2i], items[2i+1]   attention work item i: sequence, first query
//
// KV cache of one sequence: pages of `page` positions (a kernel argument),
// each bf16 [layer][k|v][kv_head][page][head_dim]; see kvpage.cuh.

#include "common.cuh"
#include "rowdot.cuh"
#include "kvpage.cuh"

// The projections of decode steps (passes of at most 4 tokens) are bound by
// reading the weights once; cuBLASLt's kernels for a handful of rows reach
// about half the memory bandwidth. They use rowdot.cuh: the first weight
// loads are issued, and the rest of the rows prefetched into the L2, before
// grid_wait (launched with early start, that overlaps the kernel before)
// and before x is staged in shared memory; for one token the next kernel is
// released before the wait (grid_enter), so that its loads start early too.
// k % 8 == 0.

// gemv_rows: y[t][n] = bf16(sum_k x[t][k] w[n][k]) for t < m <= MB. One
// warp per output column (grid n/8 blocks of 256 threads, rounded up);
// dynamic shared memory m * k * 2 bytes.
template <int MB>
__device__ __forceinline__ void gemv_rows_body(const u16* __restrict__ x, const u16* __restrict__ w,
                                               u16* __restrict__ y, int m, int n, int k) {
  extern __shared__ __align__(16) u16 xs[];
  int lane = threadIdx.x & 31;
  int col = blockIdx.x * 8 + (threadIdx.x >> 5);
  const u16* rows[1] = {w + (size_t)min(col, n - 1) * k};
  uint4 wv[1][4];
  rows_load<1>(wv, rows, 0, k, lane);
  rows_prefetch<1>(rows, 1024, k, lane);
  grid_enter(MB == 1);
  stage_x(xs, x, m, k);
  if (col >= n) return;
  float acc[1][MB];
  rows_dot<MB, 1>(wv, rows, xs, m, k, lane, acc);
  if (lane < m) y[(size_t)lane * n + col] = (u16)f_to_bf(pick<MB>(acc[0], lane));
}

extern "C" __global__ void __launch_bounds__(256) gemv_rows1(const u16* x, const u16* w, u16* y, int m, int n, int k) {
  gemv_rows_body<1>(x, w, y, m, n, k);
}
extern "C" __global__ void __launch_bounds__(256) gemv_rows4(const u16* x, const u16* w, u16* y, int m, int n, int k) {
  gemv_rows_body<4>(x, w, y, m, n, k);
}

// qkv_rope: the q/k/v projection of a decode step with RoPE and the KV-cache
// write fused in (what rope_kv does after the GEMM). Warp i computes the
// pair of columns c and c + hd/2 of one head (c = head hd + j, j < hd/2),
// the two halves that RoPE rotates together; lane t < m then writes token
// t's results: rotated q into qkv, rotated k and plain v into its
// sequence's cache at its position. Grid (n/2)/8 blocks of 256 threads,
// rounded up (n = qkv_w = (nq + 2 nkv) hd); dynamic shared memory m k 2
// bytes. The rotation is applied to the fp32 dot products (rope_kv rotates
// their bf16 rounding).
//
// With NORM (qkv_rope1n, one token) the kernel also does the residual add
// and RMSNorm before it (add_rmsnorm's work): every block norms the token
// into its shared memory from resid + delta (stage_norm_x, common.cuh, bit
// for bit add_rmsnorm's values), and block 0 writes resid + delta to
// resid_out; x is not read. That saves a kernel of a decode step.
template <int MB, bool NORM>
__device__ __forceinline__ void qkv_rope_body(const u16* __restrict__ x, const u16* __restrict__ w,
                                              u16* __restrict__ qkv, const float* __restrict__ cosT,
                                              const float* __restrict__ sinT, const int* __restrict__ tok_seq,
                                              const int* __restrict__ tok_pos, const u64* __restrict__ seq_pt,
                                              int page, int m, int k, int layer, int nq, int nkv, int hd,
                                              int qkv_w, const float* __restrict__ resid,
                                              const u16* __restrict__ delta, float* __restrict__ resid_out,
                                              const float* __restrict__ normw, float eps) {
  extern __shared__ __align__(16) u16 xs[];
  int lane = threadIdx.x & 31;
  int half = hd / 2, pairs = qkv_w / 2;
  int pi = min(blockIdx.x * 8 + (threadIdx.x >> 5), pairs - 1);
  bool ok = blockIdx.x * 8 + (threadIdx.x >> 5) < pairs;
  int head = pi / half, j = pi % half;
  int c1 = head * hd + j, c2 = c1 + half;
  const u16* rows[2] = {w + (size_t)c1 * k, w + (size_t)c2 * k};
  uint4 wv[2][4];
  rows_load<2>(wv, rows, 0, k, lane);
  rows_prefetch<2>(rows, 1024, k, lane);
  float4 nw[RMS_MAXV];
  if (NORM) rms_weights(nw, normw, k);
  grid_enter(MB == 1);
  if (NORM)
    stage_norm_x(xs, resid, delta, resid_out, nw, k, eps);
  else
    stage_x(xs, x, m, k);
  if (!ok) return;
  float acc[2][MB];
  rows_dot<MB, 2>(wv, rows, xs, m, k, lane, acc);
  if (lane >= m) return;
  float a = pick<MB>(acc[0], lane), b = pick<MB>(acc[1], lane);
  int t = lane, s = tok_seq[t], p = tok_pos[t];
  if (head < nq + nkv) {
    float c = cosT[(size_t)p * half + j], sn = sinT[(size_t)p * half + j];
    float ra = a * c - b * sn, rb = b * c + a * sn;
    a = ra;
    b = rb;
  }
  if (head < nq) {
    qkv[(size_t)t * qkv_w + c1] = (u16)f_to_bf(a);
    qkv[(size_t)t * qkv_w + c2] = (u16)f_to_bf(b);
    return;
  }
  int kv = head < nq + nkv ? 0 : 1;
  int h2 = head - nq - kv * nkv;
  u16* dst = (u16*)kv_table(seq_pt, s)[p / page] + kv_off(page, layer, kv, nkv, h2, p % page, hd);
  dst[j] = (u16)f_to_bf(a);
  dst[j + half] = (u16)f_to_bf(b);
}

// QKV_ROPE(MB) defines qkv_rope<MB>, the entry point of qkv_rope_body<MB,
// false> for up to MB tokens: qkv_rope1 and qkv_rope4.
#define QKV_ROPE(MB)                                                                                                \
  extern "C" __global__ void __launch_bounds__(256)                                                                 \
      qkv_rope##MB(const u16* x, const u16* w, u16* qkv, const float* cosT, const float* sinT, const int* tok_seq,   \
                   const int* tok_pos, const u64* seq_pt, int page, int m, int k, int layer, int nq, int nkv, int hd, \
                   int qkv_w) {                                                                                     \
    qkv_rope_body<MB, false>(x, w, qkv, cosT, sinT, tok_seq, tok_pos, seq_pt, page, m, k, layer, nq, nkv, hd, qkv_w, \
                             nullptr, nullptr, nullptr, nullptr, 0.f);                                              \
  }
QKV_ROPE(1)
QKV_ROPE(4)

// qkv_rope1n: qkv_rope1 with the residual add and RMSNorm before it fused
// in (one token; k a multiple of 4, at most 4096, for 256 threads). Held to
// 80 registers, as qkv_rope1 is: three blocks an SM, so that the 384 blocks
// of the SparseLM shape run in one wave.
extern "C" __global__ void __launch_bounds__(256, 3)
    qkv_rope1n(const float* resid, const u16* delta, float* resid_out, const float* normw, float eps, const u16* w,
               u16* qkv, const float* cosT, const float* sinT, const int* tok_seq, const int* tok_pos,
               const u64* seq_pt, int page, int k, int layer, int nq, int nkv, int hd, int qkv_w) {
  qkv_rope_body<1, true>(nullptr, w, qkv, cosT, sinT, tok_seq, tok_pos, seq_pt, page, 1, k, layer, nq, nkv, hd, qkv_w,
                         resid, delta, resid_out, normw, eps);
}
