// attention.cu: causal self-attention for training (package gpu/trainer),
// forward and backward, flash-attention 2 style with mma.sync bf16 tensor
// cores and fp32 accumulation: no score matrix is ever stored.
// No CUDA headers: package gpu's common.cuh (bf16 helpers, cp.async) comes
// from the launcher (gpu.Headers).
//
// Shapes (all row-major, token t = b * seq + position):
//   qkv   bf16 [batch*seq][W], W = (nq + 2 nkv) HD: per token the nq query
//         heads, then the nkv key heads, then the nkv value heads
//   out   bf16 [batch*seq][nq HD]
//   lse   fp32 [batch][nq][seq]: natural log-sum-exp of a query row's
//         scaled, masked scores
//   dqkv  fp32 [batch*seq][W], or bf16 with the q and k heads turned back
//         by RoPE's rotation (GradOut in attention.cuh)
//   dsum  fp32 [batch][nq][seq]: D = rowsum(dO * O)
//   ds    bf16 [z][nq][tile][64][64]: dS^T = (P (dP - D))^T of the causal
//         64 x 64 tiles of sequence b0 + z (tile qb (qb + 1) / 2 + kb for
//         query block qb, key block kb <= qb; keys as rows), written by
//         attn_bwd_dkdv and read by attn_bwd_dq (the wgmma pair of
//         attention_wgmma.cu keeps each tile's rows in the 128-byte
//         swizzle: 16-byte chunk c of row r at chunk c ^ (r mod 8))
// Query head h reads kv head h / (nq / nkv). Query q sees keys 0..q.
//
// Every kernel writes each of its outputs exactly once, with a fixed order
// of summation and no atomics: results are bitwise deterministic.
//
// Fragment layouts are PTX's for mma.m16n8k16 (lane = 4 g + tq):
//   A (16x16, row): a0 (row g, cols 2tq, 2tq+1), a1 (row g+8, same cols),
//                   a2 (row g, cols 2tq+8, +9), a3 (row g+8, cols 2tq+8, +9)
//   B (16x8, col):  b0 (k 2tq, 2tq+1; n g), b1 (k 2tq+8, +9; n g)
//   C (16x8):       c0, c1 (row g, cols 2tq, 2tq+1), c2, c3 (row g+8)
// A score tile of 16 rows x 8 NJ columns is float[NJ][4] in the C layout.
// Shared tiles are [row][HD] with a pitch of HD + 8 bf16 (ldmatrix without
// bank conflicts); rows past the sequence are zero-filled, so that masked
// (zero) probabilities never meet garbage.

#include "mma.cuh"
#include "attention.cuh"

#define LOG2E 1.4426950408889634f



// Per-lane ldmatrix offsets (bf16 elements from a tile's first row) for a
// shared tile of pitch P, with mi = lane / 8, mr = lane % 8:
//   a_off: an A fragment of rows 0..15, k 0..15 of a [row][k] tile
//          (matrix mi: rows +8 for odd mi, k +8 for mi >= 2);
//   b_off: B fragments of two k slices (16 each) for n 0..7 of an [n][k]
//          tile (matrix mi: k +8 for odd mi, next k slice for mi >= 2):
//          registers 0, 1 are slice kk, 2, 3 slice kk+1;
//   t_off: with ldsm4t, B fragments of two n tiles (8 each) for k 0..15 of
//          a [k][n] tile (matrix mi: k +8 for odd mi, n +8 for mi >= 2):
//          registers 0, 1 are n tile j, 2, 3 n tile j+1.
struct LdOff {
  int a, b, t;
  __device__ __forceinline__ LdOff(int lane, int P) {
    int mi = lane >> 3, mr = lane & 7;
    a = (mr + (mi & 1) * 8) * P + (mi >> 1) * 8;
    b = mr * P + (mi & 1) * 8 + (mi >> 1) * 16;
    t = ((mi & 1) * 8 + mr) * P + (mi >> 1) * 8;
  }
};


// tile_mma adds to acc (16 rows x 8 NJ columns) the product of the 16 rows
// of the [row][HD] tile at sa (shared address of the warp's first row) and
// the transpose of the NJ*8 rows of the [col][HD] tile at sb: acc += A B^T
// over HD.
template <int HD, int NJ>
__device__ __forceinline__ void tile_mma(float (&acc)[NJ][4], u32 sa, u32 sb, const LdOff& off) {
  constexpr int P = HD + 8;
#pragma unroll
  for (int kk = 0; kk < HD / 16; kk += 2) {
    u32 a0[4], a1[4];
    ldsm4a(sa + 2 * (kk * 16 + off.a), a0);
    ldsm4a(sa + 2 * ((kk + 1) * 16 + off.a), a1);
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      u32 b0, b1, b2, b3;
      ldsm4(sb + 2 * (j * 8 * P + kk * 16 + off.b), b0, b1, b2, b3);
      mma16816(acc[j], a0, b0, b1);
      mma16816(acc[j], a1, b2, b3);
    }
  }
}

// tile_mma_pv adds to acc (16 rows x HD) the product of the 16-row fp32
// tile x (16 x 16 NK, rounded to bf16) and the 16 NK rows of the [k][HD]
// tile at sb: acc += X B.
template <int HD, int NK>
__device__ __forceinline__ void tile_mma_pv(float (&acc)[HD / 8][4], const float (&x)[2 * NK][4], u32 sb,
                                            const LdOff& off) {
  constexpr int P = HD + 8;
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    u32 a[4];
    p_frag(x, kk, a);
#pragma unroll
    for (int j = 0; j < HD / 8; j += 2) {
      u32 b0, b1, b2, b3;
      ldsm4t(sb + 2 * (kk * 16 * P + j * 8 + off.t), b0, b1, b2, b3);
      mma16816(acc[j], a, b0, b1);
      mma16816(acc[j + 1], a, b2, b3);
    }
  }
}

// load_rows queues cp.async copies of rows [r0, r0 + N) of a [row][HD] bf16
// matrix (src, pitch elements a row) into the shared tile dst (pitch HD + 8),
// zero-filling rows at or past lim. All NT threads of the CTA take part.
template <int HD, int NT, int N>
__device__ __forceinline__ void load_rows(u16* dst, const u16* __restrict__ src, size_t pitch, int r0, int lim) {
  constexpr int CH = HD / 8;
  static_assert(N * CH % NT == 0, "whole rounds of 16-byte copies");
#pragma unroll
  for (int i = 0; i < N * CH / NT; ++i) {
    const int idx = i * NT + threadIdx.x, r = idx / CH, c = (idx % CH) * 8;
    bool ok = r0 + r < lim;
    cp_async16(smem_addr(dst + r * (HD + 8) + c), src + (size_t)(ok ? r0 + r : 0) * pitch + c, ok);
  }
}

// attn_fwd: out and lse. One CTA of 4 warps per (64-query block, head,
// sequence), the longest blocks first (blockIdx.x reversed); warp w owns
// queries 16w .. 16w+15 of the block, its Q fragments in registers. Blocks
// of 64 keys and values stream through a two-stage cp.async pipeline. Per
// block each warp computes its scores, masks the causal triangle, updates
// its running row maxima (log2 units) and sums, rescales its output
// accumulators and adds P V (P rounded to bf16).
// Dynamic shared memory: 2 stages x (K, V) x 64 x (HD + 8) bf16.
template <int HD>
__global__ void __launch_bounds__(128) attn_fwd(const u16* __restrict__ qkv, u16* __restrict__ out,
                                                float* __restrict__ lse, int seq, int nq, int nkv, float scale_log2) {
  constexpr int NW = 4, BQ = 16 * NW, BK = 64, P = HD + 8, TILE = BK * P;
  extern __shared__ __align__(16) u16 smem[];  // [stage][K | V][BK][P]
  const FwdHeads at(qkv, seq, nq, nkv, HD);
  const size_t W = at.W, tok0 = at.tok0;
  const int head = at.head, b = at.b, q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const u16 *Q = at.Q, *K = at.K, *V = at.V;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int kend = min(q0 + BQ, seq);  // keys [0, kend) are needed by the CTA
  const int nblk = (kend + BK - 1) / BK;
  const LdOff off(lane, P);

  auto load = [&](int blk) {
    u16* sk = smem + (blk & 1) * 2 * TILE;
    load_rows<HD, NW * 32, BK>(sk, K, W, blk * BK, kend);
    load_rows<HD, NW * 32, BK>(sk + TILE, V, W, blk * BK, kend);
    cp_async_commit();
  };
  load(0);

  const int row0 = q0 + warp * 16;
  const int wlast = row0 < seq ? min(row0 + 15, seq - 1) : -1;  // the warp's last key
  u32 qf[HD / 16][4];  // Q fragments, rows past seq zero
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      int row = row0 + g + (r & 1) * 8, col = kk * 16 + tq * 2 + (r >> 1) * 8;
      qf[kk][r] = row < seq ? *(const u32*)(Q + (size_t)row * W + col) : 0u;
    }
  float o[HD / 8][4];
  zero(o);
  float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.f, 0.f};

  for (int kb = 0; kb < nblk; ++kb) {
    if (kb + 1 < nblk) {
      load(kb + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int k0 = kb * BK;
    if (k0 <= wlast) {
      u32 sk = smem_addr(smem + (kb & 1) * 2 * TILE), sv = sk + 2 * TILE;
      float sc[BK / 8][4];
      zero(sc);
#pragma unroll
      for (int j = 0; j < BK / 8; ++j)
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk += 2) {
          u32 b0, b1, b2, b3;
          ldsm4(sk + 2 * (j * 8 * P + kk * 16 + off.b), b0, b1, b2, b3);
          mma16816(sc[j], qf[kk], b0, b1);
          mma16816(sc[j], qf[kk + 1], b2, b3);
        }
      fwd_softmax_step<BK / 8, HD>(sc, o, mrow, lrow, k0, row0, g, tq, scale_log2);
      tile_mma_pv<HD, BK / 16>(o, sc, sv, off);
    }
    __syncthreads();  // the stage just read is the next load's target
  }
  fwd_store<HD>(out, lse, o, mrow, lrow, tok0, b, row0, g, tq, seq, nq, head);
}

// attn_bwd_dsum: dsum = rowsum(dO * O) per (token, head); one warp each,
// blockIdx.x * 8 + warp = token * nq + head.
extern "C" __global__ void __launch_bounds__(256)
    attn_bwd_dsum(const u16* __restrict__ dout, const u16* __restrict__ out, float* __restrict__ dsum, int rows,
                  int seq, int nq, int hd) {
  const int w = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (w >= rows) return;
  const size_t base = (size_t)w * hd;  // token * nq * hd + head * hd
  float s = 0.f;
  for (int j = 2 * lane; j < hd; j += 64) {
    u32 x = *(const u32*)(dout + base + j), y = *(const u32*)(out + base + j);
    s = fmaf(bf_lo(x), bf_lo(y), s);
    s = fmaf(bf_hi(x), bf_hi(y), s);
  }
  s = warp_sum(s);
  if (lane == 0) {
    const int tok = w / nq, head = w % nq, b = tok / seq, q = tok % seq;
    dsum[((size_t)b * nq + head) * seq + q] = s;
  }
}

// attn_bwd_dkdv: dK and dV, and dS^T stored for attn_bwd_dq (ds, in bf16,
// as the dK product rounds it). One CTA of 4 warps per (64-key block, kv
// head, sequence b0 + z), the longest first; warp w owns keys 16w .. 16w+15 and keeps
// their dK and dV in fp32 registers. The CTA walks the G = nq / nkv query
// heads of its group and, for each, the BQ-query blocks from its first key
// to the end of the sequence (Q, dO, lse and D through a two-stage
// pipeline), so that the group sum stays in registers: no atomics. Per
// block, with keys as rows:
//   S^T = K Q^T, P^T = exp2(S^T scale_log2 - lse log2 e) (causal: key <= query),
//   dP^T = V dO^T, dS^T = P^T (dP^T - D), dV += P^T dO, dK += dS^T Q,
// and dK is scaled by 1/sqrt(HD) at the end.
// Dynamic shared memory: (2 x 64 + 2 stages x 2 x BQ) x (HD + 8) bf16 and
// 2 stages x 2 x BQ floats.
template <int HD, int BQ>
__global__ void __launch_bounds__(128)
    attn_bwd_dkdv(const u16* __restrict__ qkv, const u16* __restrict__ dout, const float* __restrict__ lse,
                  const float* __restrict__ dsum, GRAD_OUT_ARGS, u16* __restrict__ ds, int seq, int nq, int nkv,
                  int b0, float scale_log2, float scale) {
  const GradOut dqkv{dqkv32, dqkvb, rope_cos, rope_sin};
  constexpr int NW = 4, BKK = 16 * NW, P = HD + 8;
  extern __shared__ __align__(16) u16 smem[];
  u16* sK = smem;                       // [BKK][P]
  u16* sV = sK + BKK * P;               // [BKK][P]
  u16* sQ = sV + BKK * P;               // [stage][Q | dO][BQ][P]
  float* sL = (float*)(sQ + 4 * BQ * P);  // [stage][BQ] lse log2 e
  float* sD = sL + 2 * BQ;                // [stage][BQ] D
  const size_t W = (size_t)(nq + 2 * nkv) * HD, OW = (size_t)nq * HD;
  const int G = nq / nkv, kh = blockIdx.y, b = b0 + blockIdx.z;
  const int k0 = (gridDim.x - 1 - blockIdx.x) * BKK;
  const size_t tok0 = (size_t)b * seq;
  const int nqb = (seq - k0 + BQ - 1) / BQ;  // query blocks from k0 on, per head
  const int nit = G * nqb;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const LdOff off(lane, P);

  load_rows<HD, NW * 32, BKK>(sK, qkv + tok0 * W + (nq + kh) * HD, W, k0, seq);
  load_rows<HD, NW * 32, BKK>(sV, qkv + tok0 * W + (nq + nkv + kh) * HD, W, k0, seq);
  auto load = [&](int it) {
    const int st = it & 1, head = kh * G + it / nqb, q0 = k0 + (it % nqb) * BQ;
    u16* q = sQ + st * 2 * BQ * P;
    load_rows<HD, NW * 32, BQ>(q, qkv + tok0 * W + head * HD, W, q0, seq);
    load_rows<HD, NW * 32, BQ>(q + BQ * P, dout + tok0 * OW + head * HD, OW, q0, seq);
    const size_t row = ((size_t)b * nq + head) * seq;
    for (int r = threadIdx.x; r < BQ; r += NW * 32) {
      bool ok = q0 + r < seq;
      sL[st * BQ + r] = ok ? lse[row + q0 + r] * LOG2E : 0.f;
      sD[st * BQ + r] = ok ? dsum[row + q0 + r] : 0.f;
    }
    cp_async_commit();
  };
  load(0);  // the same group as K and V

  const int kw0 = k0 + 16 * warp;  // the warp's first key
  float dk[HD / 8][4], dv[HD / 8][4];
  zero(dk);
  zero(dv);
  const u32 skw = smem_addr(sK + 16 * warp * P), svw = smem_addr(sV + 16 * warp * P);

  for (int it = 0; it < nit; ++it) {
    if (it + 1 < nit) {
      load(it + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int st = it & 1, head = kh * G + it / nqb, q0 = k0 + (it % nqb) * BQ;
    // The warp's 16 rows of dS^T in this block: tile (q0 / 64, k0 / 64),
    // columns from q0 % 64.
    const int qb = q0 / 64;
    u16* dst = ds_lane_row(ds, blockIdx.z, nq, head, qb, k0 / 64, warp, g, tq, q0 % 64);
    // Skip blocks where every query is before the warp's keys (their dS^T
    // is zero, and stored so for attn_bwd_dq).
    if (kw0 < seq && q0 + BQ - 1 < kw0) {
#pragma unroll
      for (int j = 0; j < BQ / 8; ++j) *(u32*)(dst + j * 8) = *(u32*)(dst + 8 * 64 + j * 8) = 0u;
    } else if (kw0 < seq) {
      const u32 sq = smem_addr(sQ + st * 2 * BQ * P), sdo = sq + 2 * BQ * P;
      const float* l2 = sL + st * BQ;
      const float* dd = sD + st * BQ;
      float s[BQ / 8][4], dp[BQ / 8][4];
      zero(s);
      zero(dp);
      tile_mma<HD, BQ / 8>(s, skw, sq, off);
      tile_mma<HD, BQ / 8>(dp, svw, sdo, off);
#pragma unroll
      for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = kw0 + g + (e >> 1) * 8, ql = j * 8 + tq * 2 + (e & 1), q = q0 + ql;
          const float p = (key <= q && q < seq) ? ex2(fmaf(s[j][e], scale_log2, -l2[ql])) : 0.f;
          s[j][e] = p;
          dp[j][e] = p * (dp[j][e] - dd[ql]);
        }
      store_ds(dst, dp);
      tile_mma_pv<HD, BQ / 16>(dv, s, sdo, off);
      tile_mma_pv<HD, BQ / 16>(dk, dp, sq, off);
    }
    __syncthreads();  // the stage just read is the next load's target
  }
  store_dkdv<HD>(dqkv, dk, dv, tok0, kw0 + g, seq, W, nq, nkv, kh, tq, scale);
}

// attn_bwd_dq: dQ = dS K / sqrt(HD) from the dS^T tiles attn_bwd_dkdv
// stored. One CTA of 4 warps per (64-query block qb, head, sequence b0 + z),
// the longest first; warp w owns queries 16w .. 16w+15. The key blocks
// 0 .. qb stream K (64 x HD) and the tile's dS^T (64 x 64) through a
// two-stage pipeline; the A fragments of dS come from the transposed tile
// with ldmatrix.trans. Keys past the sequence load as zeros, so that
// whatever their tile rows hold never counts.
// Dynamic shared memory: 2 stages x 64 x (HD + 8 + 72) bf16.
template <int HD>
__global__ void __launch_bounds__(128)
    attn_bwd_dq(const u16* __restrict__ qkv, const u16* __restrict__ ds, GRAD_OUT_ARGS, int seq, int nq, int nkv,
                int b0, float scale) {
  const GradOut dqkv{dqkv32, dqkvb, rope_cos, rope_sin};
  constexpr int NW = 4, BQ = 16 * NW, BK = 64, P = HD + 8, PS = BK + 8;
  constexpr int STAGE = BK * P + BK * PS;
  extern __shared__ __align__(16) u16 smem[];  // [stage][K [BK][P] | dS^T [BK][PS]]
  const size_t W = (size_t)(nq + 2 * nkv) * HD;
  const int head = blockIdx.y, b = b0 + blockIdx.z, kh = head / (nq / nkv);
  const int qb = gridDim.x - 1 - blockIdx.x, q0 = qb * BQ;
  const size_t tok0 = (size_t)b * seq;
  const u16* K = qkv + tok0 * W + (nq + kh) * HD;
  const u16* T = ds + (((size_t)blockIdx.z * nq + head) * ((size_t)gridDim.x * (gridDim.x + 1) / 2) +
                       (size_t)qb * (qb + 1) / 2) * 4096;  // tile (qb, 0)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const LdOff off(lane, P);
  // ldmatrix.trans offsets of an A fragment (16 queries x 16 keys) in a
  // [key][query] tile of pitch PS: matrix mi holds keys +8 for mi >= 2 and
  // queries +8 for odd mi.
  const int mi = lane >> 3, mr = lane & 7;
  const int aoff = (mr + (mi >> 1) * 8) * PS + (mi & 1) * 8 + 16 * warp;

  auto load = [&](int kb) {
    u16* st = smem + (kb & 1) * STAGE;
    load_rows<HD, NW * 32, BK>(st, K, W, kb * BK, seq);
    load_rows<BK, NW * 32, BK>(st + BK * P, T + (size_t)kb * 4096, BK, 0, seq - kb * BK);
    cp_async_commit();
  };
  load(0);

  float dq[HD / 8][4];
  zero(dq);
  for (int kb = 0; kb <= qb; ++kb) {
    if (kb < qb) {
      load(kb + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const u32 sk = smem_addr(smem + (kb & 1) * STAGE), sd = sk + 2 * BK * P;
    // In the diagonal tile the warp's queries see keys up to 16 warp + 15.
    const int kks = kb < qb ? BK / 16 : warp + 1;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      if (kk < kks) {
        u32 a[4];
        ldsm4t(sd + 2 * (kk * 16 * PS + aoff), a[0], a[1], a[2], a[3]);
#pragma unroll
        for (int j = 0; j < HD / 8; j += 2) {
          u32 b0_, b1, b2, b3;
          ldsm4t(sk + 2 * (kk * 16 * P + j * 8 + off.t), b0_, b1, b2, b3);
          mma16816(dq[j], a, b0_, b1);
          mma16816(dq[j + 1], a, b2, b3);
        }
      }
    }
    __syncthreads();  // the stage just read is the next load's target
  }
  const int row0 = q0 + 16 * warp;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + g + 8 * h;
    if (row < seq) store_grad_row<HD>(dqkv, (tok0 + row) * W + (size_t)head * HD, row, true, dq, h, tq, scale);
  }
}
