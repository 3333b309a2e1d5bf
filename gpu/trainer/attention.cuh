// attention.cuh: what the kernels of attention.cu (mma.sync) and
// attention_wgmma.cu (wgmma) share: where a forward CTA's heads lie, the
// forward's online softmax step and output store; where the dS^T tiles lie (and, for the mma.sync kernels,
// a lane's rows of one and storing them); and storing gradient rows (dQ,
// dK, dV). Both keep, per warp, 16 keys
// as rows in the mma.m16n8k16 C layout (lane = 4 g + tq: rows g and g + 8,
// columns 2 tq and 2 tq + 1 of each 8-column tile).
#pragma once
#include "mma.cuh"

// FwdHeads is where a forward CTA's heads lie in qkv (bf16 [batch*seq][W],
// W = (nq + 2 nkv) hd): query head blockIdx.y, its kv head kh, sequence b =
// blockIdx.z from token tok0, and that sequence's Q, K and V columns.
struct FwdHeads {
  int head, b;
  size_t W, tok0;
  const u16 *Q, *K, *V;
  __device__ __forceinline__ FwdHeads(const u16* qkv, int seq, int nq, int nkv, int hd)
      : head(blockIdx.y), b(blockIdx.z), W((size_t)(nq + 2 * nkv) * hd), tok0((size_t)b * seq) {
    const int kh = head / (nq / nkv);
    Q = qkv + tok0 * W + head * hd;
    K = qkv + tok0 * W + (nq + kh) * hd;
    V = qkv + tok0 * W + (nq + nkv + kh) * hd;
  }
};

// fwd_softmax_step is one key block of the forward's online softmax, for
// the lane's rows row0 + g and row0 + g + 8 and the block's keys from k0:
// the causal mask, then mma.cuh's softmax_step. Every processed block has
// k0 <= row0 (both multiples of 16), so each row keeps key k0 and its
// running maximum is finite from the first block on.
template <int NJ, int HD>
__device__ __forceinline__ void fwd_softmax_step(float (&sc)[NJ][4], float (&o)[HD / 8][4], float (&mrow)[2],
                                                 float (&lrow)[2], int k0, int row0, int g, int tq,
                                                 float scale_log2) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (k0 + j * 8 + tq * 2 + (e & 1) > row0 + g + (e >> 1) * 8) sc[j][e] = NEG_INF;
  softmax_step(sc, mrow, lrow, o, scale_log2);
}

// fwd_store writes the lane's rows of the forward's output (o / l, bf16,
// query head head of the sequence whose first token is tok0) and their
// natural log-sum-exp (lse of sequence b); rows past seq are left out.
// mma.cuh's store_rows writes the same output, but with a row pointer and
// pitch that cost the mma.sync forward up to 27 more registers.
template <int HD>
__device__ __forceinline__ void fwd_store(u16* __restrict__ out, float* __restrict__ lse, const float (&o)[HD / 8][4],
                                          const float (&mrow)[2], const float (&lrow)[2], size_t tok0, int b,
                                          int row0, int g, int tq, int seq, int nq, int head) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = lrow[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = row0 + g + 8 * h;
    if (row >= seq) continue;
    const float il = 1.f / l;
    u16* orow = out + (tok0 + row) * nq * HD + head * HD + tq * 2;
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) *(u32*)(orow + j * 8) = pack_bf2(o[j][2 * h] * il, o[j][2 * h + 1] * il);
    if (tq == 0) lse[((size_t)b * nq + head) * seq + row] = (mrow[h] + log2f(l)) * 0.6931471805599453f;
  }
}

// ds_tile returns the dS^T tile (query block qb, key block kb) of query
// head head of sequence z (gridDim.x blocks of 64 keys a sequence).
__device__ __forceinline__ u16* ds_tile(u16* ds, int z, int nq, int head, int qb, int kb) {
  const size_t ntile = (size_t)gridDim.x * (gridDim.x + 1) / 2;  // causal tiles per (sequence, head)
  return ds + (((size_t)z * nq + head) * ntile + (size_t)qb * (qb + 1) / 2 + kb) * 4096;
}

// ds_lane_row returns where lane (g, tq) of warp w writes row 16 w + g of
// that tile, from column q_off on; row 16 w + g + 8 is 8 x 64 elements
// further.
__device__ __forceinline__ u16* ds_lane_row(u16* ds, int z, int nq, int head, int qb, int kb, int w, int g, int tq,
                                            int q_off) {
  return ds_tile(ds, z, nq, head, qb, kb) + (16 * w + g) * 64 + q_off + tq * 2;
}

// store_ds writes the lane's two rows of NJ x 8 dS^T columns (C layout,
// rounded to bf16 as the dK product rounds them) at dst.
template <int NJ>
__device__ __forceinline__ void store_ds(u16* dst, const float (&dp)[NJ][4]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    *(u32*)(dst + j * 8) = cvt_bf2(dp[j][0], dp[j][1]);
    *(u32*)(dst + 8 * 64 + j * 8) = cvt_bf2(dp[j][2], dp[j][3]);
  }
}

// GradOut is where the backward kernels write dqkv: fp32 rows at f32
// when bf is null; else bf16 rows at bf, the q and k heads turned back by
// RoPE's rotation first (cos and sin: [position][HD/2], as rope_bf16 reads
// them), so that no separate pass converts them.
struct GradOut {
  float* __restrict__ f32;
  u16* __restrict__ bf;
  const float* __restrict__ cos;
  const float* __restrict__ sin;
};

// GRAD_OUT_ARGS are a GradOut's fields as kernel parameters.
#define GRAD_OUT_ARGS                                                                                    \
  float* __restrict__ dqkv32, u16* __restrict__ dqkvb, const float* __restrict__ rope_cos, \
      const float* __restrict__ rope_sin

// store_grad_row writes the lane's columns of one gradient row: columns
// 2 tq and 2 tq + 1 of each 8-column tile j hold acc[j][2 h] and
// acc[j][2 h + 1] times scale. off is the row's first element in dqkv,
// pos its token's position, rot whether the columns are a q or k head (a
// pair i, i + HD/2 turned back by angle (pos, i): a c + b s, b c - a s,
// rope_bf16's inverse rotation).
template <int HD>
__device__ __forceinline__ void store_grad_row(const GradOut& o, size_t off, int pos, bool rot,
                                               const float (&acc)[HD / 8][4], int h, int tq, float scale) {
  if (!o.bf) {
    float* r = o.f32 + off + tq * 2;
#pragma unroll
    for (int j = 0; j < HD / 8; ++j)
      *(float2*)(r + j * 8) = make_float2(acc[j][2 * h] * scale, acc[j][2 * h + 1] * scale);
    return;
  }
  u16* r = o.bf + off;
  if (!rot) {
#pragma unroll
    for (int j = 0; j < HD / 8; ++j)
      *(u32*)(r + j * 8 + tq * 2) = pack_bf2(acc[j][2 * h] * scale, acc[j][2 * h + 1] * scale);
    return;
  }
  const float* cs = o.cos + (size_t)pos * (HD / 2);
  const float* sn = o.sin + (size_t)pos * (HD / 2);
#pragma unroll
  for (int j = 0; j < HD / 16; ++j) {
    const int i = j * 8 + tq * 2;
    const float2 c = *(const float2*)(cs + i), s = *(const float2*)(sn + i);
    const float a0 = acc[j][2 * h] * scale, a1 = acc[j][2 * h + 1] * scale;
    const float b0 = acc[j + HD / 16][2 * h] * scale, b1 = acc[j + HD / 16][2 * h + 1] * scale;
    *(u32*)(r + i) = pack_bf2(a0 * c.x + b0 * s.x, a1 * c.y + b1 * s.y);
    *(u32*)(r + i + HD / 2) = pack_bf2(b0 * c.x - a0 * s.x, b1 * c.y - a1 * s.y);
  }
}

// store_dkdv writes the lane's rows of dK (scaled by scale) and dV, keys
// key0 and key0 + 8 of sequence tok0 / seq, into their dqkv columns (kv
// head kh); keys past the sequence are left out.
template <int HD>
__device__ __forceinline__ void store_dkdv(const GradOut& o, const float (&dk)[HD / 8][4],
                                           const float (&dv)[HD / 8][4], size_t tok0, int key0, int seq, size_t W,
                                           int nq, int nkv, int kh, int tq, float scale) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key0 + 8 * h;
    if (key >= seq) continue;
    const size_t off = (tok0 + key) * W + (size_t)(nq + kh) * HD;
    store_grad_row<HD>(o, off, key, true, dk, h, tq, scale);
    store_grad_row<HD>(o, off + (size_t)nkv * HD, key, false, dv, h, tq, 1.f);
  }
}
