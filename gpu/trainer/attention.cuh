// attention.cuh: what the dK/dV kernels of attention.cu (mma.sync) and
// attention_wgmma.cu (wgmma) share: where a lane's rows of a dS^T tile
// lie, storing them, and storing dK and dV. Both keep, per warp, 16 keys
// as rows in the mma.m16n8k16 C layout (lane = 4 g + tq: rows g and g + 8,
// columns 2 tq and 2 tq + 1 of each 8-column tile).
#pragma once
#include "common.cuh"

// ds_lane_row returns where lane (g, tq) of warp w writes row 16 w + g of
// the dS^T tile (query block qb, key block kb) of query head head of
// sequence z (gridDim.x blocks of 64 keys a sequence), from column q_off
// on; row 16 w + g + 8 is 8 x 64 elements further.
__device__ __forceinline__ u16* ds_lane_row(u16* ds, int z, int nq, int head, int qb, int kb, int w, int g, int tq,
                                            int q_off) {
  const size_t ntile = (size_t)gridDim.x * (gridDim.x + 1) / 2;  // causal tiles per (sequence, head)
  return ds + (((size_t)z * nq + head) * ntile + (size_t)qb * (qb + 1) / 2 + kb) * 4096 + (16 * w + g) * 64 +
         q_off + tq * 2;
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

// store_dkdv writes the lane's rows of dK (scaled by scale) and dV, keys
// key0 and key0 + 8 of sequence tok0 / seq, into their fp32 dqkv columns
// (kv head kh); keys past the sequence are left out.
template <int HD>
__device__ __forceinline__ void store_dkdv(float* __restrict__ dqkv, const float (&dk)[HD / 8][4],
                                           const float (&dv)[HD / 8][4], size_t tok0, int key0, int seq, size_t W,
                                           int nq, int nkv, int kh, int tq, float scale) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key0 + 8 * h;
    if (key >= seq) continue;
    float* rk = dqkv + (tok0 + key) * W + (nq + kh) * HD + tq * 2;
    float* rv = rk + (size_t)nkv * HD;
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) {
      float2 k2, v2;
      k2.x = dk[j][2 * h] * scale, k2.y = dk[j][2 * h + 1] * scale;
      v2.x = dv[j][2 * h], v2.y = dv[j][2 * h + 1];
      *(float2*)(rk + j * 8) = k2;
      *(float2*)(rv + j * 8) = v2;
    }
  }
}
