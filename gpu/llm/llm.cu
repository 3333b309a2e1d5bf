// llm.cu: the non-MLP kernels of the GPU Llama forward (package gpu/llm).
//
// Storage is bf16 (weights, activations between GEMMs, the KV cache); the
// residual stream and the norm weights are fp32, and all arithmetic is fp32.
// It needs no CUDA headers (bf16 conversions are bit operations, the
// tensor-core instructions inline PTX); it includes package gpu's
// common.cuh (bf16 helpers, dot8, cp.async) and rowdot.cuh (the weight-row
// dot products of the decode projections), which the launcher supplies.
//
// Per-forward metadata (written by the launcher, one upload per call):
//   tok_seq[t], tok_pos[t]   sequence and absolute position of flat token t
//   seq_q0[s]                flat index of sequence s's first new token
//   seq_n[s], seq_past[s]    new tokens of s, and positions already cached
//   seq_base[s], seq_cap[s]  s's KV cache: base address and capacity
//   items[2i], items[2i+1]   attention work item i: sequence, first query
//
// KV cache of one sequence: bf16 [layer][k|v][kv_head][capacity][head_dim].

#include "common.cuh"
#include "rowdot.cuh"
#include "attn.cuh"

// block_sum returns the sum of v over the block (blockDim.x a multiple of
// 32, at most 1024) to every thread.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
  __shared__ float total;
  v = warp_sum(v);
  int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) part[w] = v;
  __syncthreads();
  if (w == 0) {
    float s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// embed: resid[t] = table[ids[t]] (bf16 -> fp32). One block per token.
extern "C" __global__ void embed(const u16* __restrict__ table, const int* __restrict__ ids, float* __restrict__ resid,
                                 int d) {
  int t = blockIdx.x;
  const u16* row = table + (size_t)ids[t] * d;
  float* out = resid + (size_t)t * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = bf_to_f(row[i]);
}

// add_rmsnorm: for output row b (one block each), with r = rows ? rows[b] : b,
//   v = resid[r] + (delta ? delta[r] : 0)
//   out[b] = bf16(v / sqrt(mean(v^2) + eps) * w)
// and, when rows is null, resid[r] = v (the residual add). With rows set
// (the final norm of the rows whose logits are wanted) resid is not written.
// When d is a multiple of 4 and at most 16 per thread, each thread keeps
// its values in registers between the sum of squares and the output (one
// pass over memory, its loads issued together: decode steps run this at a
// few tokens, where latency is all that counts); else a plain two-pass loop.
extern "C" __global__ void add_rmsnorm(float* __restrict__ resid, const u16* __restrict__ delta,
                                       const int* __restrict__ rows, const float* __restrict__ w,
                                       u16* __restrict__ out, int d, float eps) {
  constexpr int MAXV = 4;  // float4 per thread
  int b = blockIdx.x;
  int r = rows ? rows[b] : b;
  float* x = resid + (size_t)r * d;
  const u16* dl = delta ? delta + (size_t)r * d : nullptr;
  u16* o = out + (size_t)b * d;
  int n4 = d / 4;
  if (d % 4 == 0 && n4 <= MAXV * (int)blockDim.x) {
    float4 v[MAXV], wv[MAXV];
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
      int i = threadIdx.x + k * blockDim.x;
      if (i >= n4) continue;
      v[k] = ((const float4*)x)[i];
      wv[k] = ((const float4*)w)[i];
      if (dl) {
        uint2 dd = ((const uint2*)dl)[i];
        v[k].x += bf_lo(dd.x);
        v[k].y += bf_hi(dd.x);
        v[k].z += bf_lo(dd.y);
        v[k].w += bf_hi(dd.y);
      }
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
      int i = threadIdx.x + k * blockDim.x;
      if (i >= n4) continue;
      ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
      if (dl && !rows) ((float4*)x)[i] = v[k];
    }
    float inv = rsqrtf(block_sum(ss) / (float)d + eps);
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
      int i = threadIdx.x + k * blockDim.x;
      if (i >= n4) continue;
      uint2 ov;
      ov.x = pack_bf2(v[k].x * inv * wv[k].x, v[k].y * inv * wv[k].y);
      ov.y = pack_bf2(v[k].z * inv * wv[k].z, v[k].w * inv * wv[k].w);
      ((uint2*)o)[i] = ov;
    }
    return;
  }
  float ss = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float v = x[i];
    if (dl) {
      v += bf_to_f(dl[i]);
      if (!rows) x[i] = v;
    }
    ss += v * v;
  }
  // Each thread re-reads only the elements it wrote, so no barrier is
  // needed between the write above and the read below.
  float inv = rsqrtf(block_sum(ss) / (float)d + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float v = x[i];
    if (dl && rows) v += bf_to_f(dl[i]);
    o[i] = (u16)f_to_bf(v * inv * w[i]);
  }
}

// The projections of decode steps (passes of at most 4 tokens) are bound by
// reading the weights once; cuBLASLt's kernels for a handful of rows reach
// about half the memory bandwidth. They use rowdot.cuh: the first weight
// loads are issued before x is staged in shared memory. k % 8 == 0.

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
template <int MB>
__device__ __forceinline__ void qkv_rope_body(const u16* __restrict__ x, const u16* __restrict__ w,
                                              u16* __restrict__ qkv, const float* __restrict__ cosT,
                                              const float* __restrict__ sinT, const int* __restrict__ tok_seq,
                                              const int* __restrict__ tok_pos, const u64* __restrict__ seq_base,
                                              const int* __restrict__ seq_cap, int m, int k, int layer, int nq,
                                              int nkv, int hd, int qkv_w) {
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
  u16* dst = (u16*)seq_base[s] + (((size_t)(layer * 2 + kv) * nkv + h2) * seq_cap[s] + p) * hd;
  dst[j] = (u16)f_to_bf(a);
  dst[j + half] = (u16)f_to_bf(b);
}

extern "C" __global__ void __launch_bounds__(256)
    qkv_rope1(const u16* x, const u16* w, u16* qkv, const float* cosT, const float* sinT, const int* tok_seq,
              const int* tok_pos, const u64* seq_base, const int* seq_cap, int m, int k, int layer, int nq, int nkv,
              int hd, int qkv_w) {
  qkv_rope_body<1>(x, w, qkv, cosT, sinT, tok_seq, tok_pos, seq_base, seq_cap, m, k, layer, nq, nkv, hd, qkv_w);
}
extern "C" __global__ void __launch_bounds__(256)
    qkv_rope4(const u16* x, const u16* w, u16* qkv, const float* cosT, const float* sinT, const int* tok_seq,
              const int* tok_pos, const u64* seq_base, const int* seq_cap, int m, int k, int layer, int nq, int nkv,
              int hd, int qkv_w) {
  qkv_rope_body<4>(x, w, qkv, cosT, sinT, tok_seq, tok_pos, seq_base, seq_cap, m, k, layer, nq, nkv, hd, qkv_w);
}

// rope_kv: for flat token t (one block each), rotate its query heads in
// place in qkv (rows of qkv_w bf16: nq query heads, nkv key heads, nkv value
// heads) and write its rotated keys and its values into its sequence's KV
// cache at its position. Hugging Face's rotate_half: pairs (i, i + hd/2),
//   a' = a cos - b sin,  b' = b cos + a sin.
// cos and sin are fp32 [position][hd/2].
extern "C" __global__ void rope_kv(u16* __restrict__ qkv, const float* __restrict__ cosT,
                                   const float* __restrict__ sinT, const int* __restrict__ tok_seq,
                                   const int* __restrict__ tok_pos, const u64* __restrict__ seq_base,
                                   const int* __restrict__ seq_cap, int layer, int nq, int nkv, int hd, int qkv_w) {
  int t = blockIdx.x;
  int s = tok_seq[t], p = tok_pos[t], cap = seq_cap[s];
  int half = hd / 2;
  u16* row = qkv + (size_t)t * qkv_w;
  u16* cache = (u16*)seq_base[s];
  const float* c = cosT + (size_t)p * half;
  const float* sn = sinT + (size_t)p * half;
  if (hd % 8 == 0) {
    // 4 pairs per thread and 16-byte copies of the values: the 2-byte
    // accesses below ran at half the memory bandwidth (1.55 ms per layer
    // for 131072 tokens on an H200, where 3.2 GB move).
    int q4 = half / 4, groups = (nq + nkv) * q4;
    for (int i = threadIdx.x; i < groups; i += blockDim.x) {
      int h = i / q4, j = (i - h * q4) * 4;
      u16* v = row + h * hd;
      uint2 A = *(const uint2*)(v + j), B = *(const uint2*)(v + j + half);
      float4 C = *(const float4*)(c + j), S = *(const float4*)(sn + j);
      float a[4] = {bf_lo(A.x), bf_hi(A.x), bf_lo(A.y), bf_hi(A.y)};
      float b[4] = {bf_lo(B.x), bf_hi(B.x), bf_lo(B.y), bf_hi(B.y)};
      float cc[4] = {C.x, C.y, C.z, C.w}, ss[4] = {S.x, S.y, S.z, S.w};
      float ra[4], rb[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        ra[k] = a[k] * cc[k] - b[k] * ss[k];
        rb[k] = b[k] * cc[k] + a[k] * ss[k];
      }
      u16* dst = h < nq ? v : cache + (((size_t)(layer * 2) * nkv + (h - nq)) * cap + p) * hd;
      *(uint2*)(dst + j) = make_uint2(pack_bf2(ra[0], ra[1]), pack_bf2(ra[2], ra[3]));
      *(uint2*)(dst + j + half) = make_uint2(pack_bf2(rb[0], rb[1]), pack_bf2(rb[2], rb[3]));
    }
    int nv8 = nkv * hd / 8;
    const uint4* vals = (const uint4*)(row + (nq + nkv) * hd);
    for (int i = threadIdx.x; i < nv8; i += blockDim.x) {
      int kh = i * 8 / hd, j = i * 8 - kh * hd;
      *(uint4*)(cache + (((size_t)(layer * 2 + 1) * nkv + kh) * cap + p) * hd + j) = vals[i];
    }
    return;
  }
  int pairs = (nq + nkv) * half;
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    int h = i / half, j = i % half;
    u16* v = row + h * hd;
    float a = bf_to_f(v[j]), b = bf_to_f(v[j + half]);
    float ra = a * c[j] - b * sn[j], rb = b * c[j] + a * sn[j];
    u16 oa = (u16)f_to_bf(ra), ob = (u16)f_to_bf(rb);
    if (h < nq) {
      v[j] = oa;
      v[j + half] = ob;
    } else {
      int kh = h - nq;
      u16* dst = cache + (((size_t)(layer * 2) * nkv + kh) * cap + p) * hd;
      dst[j] = oa;
      dst[j + half] = ob;
    }
  }
  int nv = nkv * hd;
  for (int i = threadIdx.x; i < nv; i += blockDim.x) {
    int kh = i / hd, j = i % hd;
    u16* dst = cache + (((size_t)(layer * 2 + 1) * nkv + kh) * cap + p) * hd;
    dst[j] = row[(nq + nkv) * hd + i];
  }
}

// ---------------------------------------------------------------------------
// Attention. out[t][head*hd + j] = sum_p softmax_p(q . k_p / sqrt(hd)) v_p[j]
// over the positions p <= pos(t) of t's sequence (causal), keys and values
// read from the KV cache (GQA: query head h reads kv head h / (nq/nkv)).
// Both kernels use an online softmax over the keys: no score matrix.

// attn_ref: the plain kernel (any even hd <= 256). One CTA per (work item,
// head), blockIdx.x = item * nq + head as in attn_fa; 8 warps;
// each warp takes queries of the item one at a time, each lane holding hd/32
// dimensions, and walks the keys one by one.
extern "C" __global__ void __launch_bounds__(256)
    attn_ref(const u16* __restrict__ qkv, u16* __restrict__ out, const int* __restrict__ items,
             const int* __restrict__ seq_q0, const int* __restrict__ seq_n, const int* __restrict__ seq_past,
             const u64* __restrict__ seq_base, const int* __restrict__ seq_cap, int layer, int nq, int nkv, int hd,
             int qkv_w, float scale_log2) {
  const int MAXD = 8;  // dims per lane: hd <= 256
  const AttnItem a = attn_item(items, seq_q0, seq_n, seq_past, seq_base, seq_cap, layer, nq, nkv, hd);
  const int head = a.head, q0 = a.q0, n = a.n, past = a.past, qs = a.qs;
  const u16 *K = a.K, *V = a.V;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int qend = min(q0 + ATT_BQ, n);
  for (int qi = q0 + warp; qi < qend; qi += blockDim.x >> 5) {
    const u16* q = qkv + (size_t)(qs + qi) * qkv_w + head * hd;
    float qv[MAXD], acc[MAXD];
#pragma unroll
    for (int k = 0; k < MAXD; ++k) {
      int j = lane + 32 * k;
      qv[k] = j < hd ? bf_to_f(q[j]) * scale_log2 : 0.f;
      acc[k] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    int last = past + qi;  // keys 0..last
    for (int p = 0; p <= last; ++p) {
      const u16* kp = K + (size_t)p * hd;
      float dot = 0.f;
#pragma unroll
      for (int k = 0; k < MAXD; ++k) {
        int j = lane + 32 * k;
        if (j < hd) dot += qv[k] * bf_to_f(kp[j]);
      }
      dot = warp_sum(dot);
      float mn = fmaxf(m, dot);
      float corr = exp2f(m - mn), e = exp2f(dot - mn);
      l = l * corr + e;
      const u16* vp = V + (size_t)p * hd;
#pragma unroll
      for (int k = 0; k < MAXD; ++k) {
        int j = lane + 32 * k;
        if (j < hd) acc[k] = acc[k] * corr + e * bf_to_f(vp[j]);
      }
      m = mn;
    }
    u16* o = out + (size_t)(qs + qi) * nq * hd + head * hd;
    float il = 1.f / l;
#pragma unroll
    for (int k = 0; k < MAXD; ++k) {
      int j = lane + 32 * k;
      if (j < hd) o[j] = (u16)f_to_bf(acc[k] * il);
    }
  }
}

// mma16816: d += a (16x16 bf16, row) * b (16x8 bf16, col), fp32 accumulate.
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldsm4 / ldsm4t: four 8x8 bf16 matrices from shared memory (lanes 8i..8i+7
// give the row addresses of matrix i); the .trans form hands each lane a
// column pair instead of a row pair.
__device__ __forceinline__ void ldsm4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm4t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// attn_fa: the tensor-core kernel for hd = 64 or 128 (flash-attention 2
// style). One CTA per (work item, head), blockIdx.x = item * nq + head, so
// the launcher's item order (longest first) is the order CTAs start in.
// NW warps; warp w owns WM tiles of 16 queries, tile i holding the item's
// queries (i NW + w) 16 .. +15 (interleaved, so that the causal triangle
// gives every warp the same work). Blocks of 64 keys and values stream
// through a two-stage cp.async pipeline into shared memory, rows [key][dim]
// with a pitch of hd + 8 (ldmatrix without bank conflicts); keys past the
// CTA's last needed one are zero-filled, so unwritten cache memory never
// reaches the arithmetic. Per block each warp computes its scores with
// mma.sync (K fragments by ldmatrix, shared by the warp's tiles), masks the
// causal triangle on the diagonal blocks, updates its running row maxima
// and sums, and adds P V (P rounded to bf16; V fragments by ldmatrix.trans)
// into its fp32 accumulators. Fragment layouts are PTX's for m16n8k16:
// lane = 4 g + tq holds rows g and g+8, columns 2tq, 2tq+1 (+8).

template <int HD, int NW, int WM>
__device__ __forceinline__ void attn_fa_body(const u16* __restrict__ qkv, u16* __restrict__ out,
                                             const int* __restrict__ items, const int* __restrict__ seq_q0,
                                             const int* __restrict__ seq_n, const int* __restrict__ seq_past,
                                             const u64* __restrict__ seq_base, const int* __restrict__ seq_cap,
                                             int layer, int nq, int nkv, int qkv_w, float scale_log2) {
  static_assert(NW * WM * 16 == ATT_BQ, "a CTA covers one work item");
  constexpr int BK = 64;
  constexpr int P = HD + 8;      // shared row pitch (bf16)
  constexpr int TILE = BK * P;   // one K or V block
  constexpr int CH = HD / 8;     // 16-byte chunks per row
  extern __shared__ __align__(16) u16 smem[];  // [stage][K | V][BK][P]

  const AttnItem a = attn_item(items, seq_q0, seq_n, seq_past, seq_base, seq_cap, layer, nq, nkv, HD);
  const int head = a.head, q0 = a.q0, n = a.n, past = a.past, qs = a.qs;
  const u16 *K = a.K, *V = a.V;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int g = lane >> 2, tq = lane & 3;
  int kend = past + min(q0 + ATT_BQ, n);  // keys [0, kend) are needed by the CTA
  int nblk = (kend + BK - 1) / BK;

  auto load = [&](int blk) {
    int k0 = blk * BK;
    u16* sk = smem + (blk & 1) * 2 * TILE;
    u16* sv = sk + TILE;
    for (int idx = threadIdx.x; idx < BK * CH; idx += NW * 32) {
      int r = idx / CH, c = (idx % CH) * 8;
      int key = k0 + r;
      bool ok = key < kend;
      size_t off = (size_t)(ok ? key : 0) * HD + c;
      cp_async16(smem_addr(sk + r * P + c), K + off, ok);
      cp_async16(smem_addr(sv + r * P + c), V + off, ok);
    }
    cp_async_commit();
  };
  load(0);

  // The warp's query tiles: first row (index among the sequence's new
  // tokens), and the last key each needs (-1: the tile has no valid row).
  int row0[WM], klast[WM];
  int wklast = -1;
#pragma unroll
  for (int i = 0; i < WM; ++i) {
    row0[i] = q0 + (i * NW + warp) * 16;
    klast[i] = row0[i] < n ? past + min(row0[i] + 15, n - 1) : -1;
    wklast = max(wklast, klast[i]);
  }
  // Q fragments, straight from global memory (rows past n are zero).
  u32 qf[WM][HD / 16][4];
#pragma unroll
  for (int i = 0; i < WM; ++i)
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        int row = row0[i] + g + (r & 1) * 8;
        int col = kk * 16 + tq * 2 + (r >> 1) * 8;
        qf[i][kk][r] = row < n ? *(const u32*)(qkv + (size_t)(qs + row) * qkv_w + head * HD + col) : 0u;
      }
  float o[WM][HD / 8][4];
  float mrow[WM][2], lrow[WM][2];
#pragma unroll
  for (int i = 0; i < WM; ++i) {
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.f;
    mrow[i][0] = mrow[i][1] = NEG_INF;
    lrow[i][0] = lrow[i][1] = 0.f;
  }
  // Per-lane ldmatrix offsets (bf16 elements) within a block: K, matrix
  // lane/8 = (dims +8 for odd, next 16-dim slice for >= 2); V (trans),
  // matrix lane/8 = (keys +8 for odd, next 8-dim tile for >= 2).
  int mi = lane >> 3, mr = lane & 7;
  int koff = mr * P + (mi & 1) * 8 + (mi >> 1) * 16;
  int voff = ((mi & 1) * 8 + mr) * P + (mi >> 1) * 8;

  for (int kb = 0; kb < nblk; ++kb) {
    if (kb + 1 < nblk) {
      load(kb + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    int k0 = kb * BK;
    if (k0 <= wklast) {
      u32 sk = smem_addr(smem + (kb & 1) * 2 * TILE);
      u32 sv = sk + TILE * 2;
      // S = Q K^T, 16 rows x 64 keys per tile. Every tile takes part (a
      // tile past its last key sees only masked scores: no change).
      float sc[WM][BK / 8][4];
#pragma unroll
      for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) sc[i][j][0] = sc[i][j][1] = sc[i][j][2] = sc[i][j][3] = 0.f;
#pragma unroll
      for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk += 2) {
          u32 b0, b1, b2, b3;
          ldsm4(sk + 2 * (j * 8 * P + kk * 16 + koff), b0, b1, b2, b3);
#pragma unroll
          for (int i = 0; i < WM; ++i) {
            mma16816(sc[i][j], qf[i][kk], b0, b1);
            mma16816(sc[i][j], qf[i][kk + 1], b2, b3);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < WM; ++i) {
        // Mask keys past each row's position on the diagonal blocks.
        if (k0 + BK - 1 > past + row0[i]) mask_after(sc[i], k0, past + row0[i] + g, tq);
        softmax_step(sc[i], mrow[i], lrow[i], o[i], scale_log2);
      }
      // O += P V: the score fragments of key tiles 2kk and 2kk+1 are the A
      // fragment of key slice kk.
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        u32 a[WM][4];
#pragma unroll
        for (int i = 0; i < WM; ++i) p_frag(sc[i], kk, a[i]);
#pragma unroll
        for (int j = 0; j < HD / 8; j += 2) {
          u32 b0, b1, b2, b3;
          ldsm4t(sv + 2 * (kk * 16 * P + j * 8 + voff), b0, b1, b2, b3);
#pragma unroll
          for (int i = 0; i < WM; ++i) {
            mma16816(o[i][j], a[i], b0, b1);
            mma16816(o[i][j + 1], a[i], b2, b3);
          }
        }
      }
    }
    __syncthreads();  // the stage just read is the next load's target
  }
#pragma unroll
  for (int i = 0; i < WM; ++i) {
    if (klast[i] < 0) continue;
    int row = row0[i] + g;
    store_rows(o[i], lrow[i], out + (size_t)(qs + row) * nq * HD + head * HD + tq * 2, (size_t)nq * HD, row, n);
  }
}

// attn_fa64, attn_fa128: 8 warps of one query tile each (two tiles per
// warp, which halve the shared-memory reads of K and V, spilled registers).
// Dynamic shared memory: 2 * 2 * 64 * (hd + 8) * 2 bytes.
extern "C" __global__ void __launch_bounds__(256, 2)
    attn_fa64(const u16* __restrict__ qkv, u16* __restrict__ out, const int* __restrict__ items,
              const int* __restrict__ seq_q0, const int* __restrict__ seq_n, const int* __restrict__ seq_past,
              const u64* __restrict__ seq_base, const int* __restrict__ seq_cap, int layer, int nq, int nkv,
              int qkv_w, float scale_log2) {
  attn_fa_body<64, 8, 1>(qkv, out, items, seq_q0, seq_n, seq_past, seq_base, seq_cap, layer, nq, nkv, qkv_w,
                         scale_log2);
}

extern "C" __global__ void __launch_bounds__(256)
    attn_fa128(const u16* __restrict__ qkv, u16* __restrict__ out, const int* __restrict__ items,
               const int* __restrict__ seq_q0, const int* __restrict__ seq_n, const int* __restrict__ seq_past,
               const u64* __restrict__ seq_base, const int* __restrict__ seq_cap, int layer, int nq, int nkv,
               int qkv_w, float scale_log2) {
  attn_fa_body<128, 8, 1>(qkv, out, items, seq_q0, seq_n, seq_past, seq_base, seq_cap, layer, nq, nkv, qkv_w,
                          scale_log2);
}

// ---------------------------------------------------------------------------
// The dense MLP's elementwise step, for layers that do not run on package
// gpu's TwELL MLP (SiLU gates, or shapes its kernels do not take).
// act 0: relu, 1: silu. gated: h = act(g) * u (h may alias g); else
// g = act(g) in place (u unused).

__device__ __forceinline__ float act_f(float x, int act) {
  if (act == 0) return fmaxf(x, 0.f);
  return x / (1.f + __expf(-x));
}

extern "C" __global__ void act_mul(u16* __restrict__ g, const u16* __restrict__ u, long long n, int act, int gated) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    float v = act_f(bf_to_f(g[i]), act);
    if (gated) v *= bf_to_f(u[i]);
    g[i] = (u16)f_to_bf(v);
  }
}
