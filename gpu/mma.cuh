// mma.cuh: the bf16 tensor-core building blocks of the attention kernels
// (inference, gpu/llm, and training, gpu/trainer): mma.sync m16n8k16 with
// fp32 accumulation, ldmatrix loads, the packing of an fp32 tile into an A
// fragment, exp2, and the online softmax's step and output store. Score and
// output tiles are 16 query rows in the mma/wgmma accumulator layout: in a
// warp, lane = 4 g + tq holds x[j][2h + e] = row g + 8h, column
// 8j + 2tq + e.
#pragma once
#include "common.cuh"

#define NEG_INF __uint_as_float(0xff800000u)

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
__device__ __forceinline__ void ldsm4a(u32 addr, u32 (&a)[4]) { ldsm4(addr, a[0], a[1], a[2], a[3]); }

// ex2 is 2^x (flushing denormals; 2^-inf = 0).
__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// zero sets a tile of fp32 accumulators (C layout) to 0.
template <int NJ>
__device__ __forceinline__ void zero(float (&x)[NJ][4]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) x[j][0] = x[j][1] = x[j][2] = x[j][3] = 0.f;
}

// stsm4 stores four 8 x 8 bf16 matrices into shared memory (stmatrix
// .x4): a[i] is the lane's pair of matrix i in the mma C layout (row g,
// columns 2 tq and 2 tq + 1), and lane l gives the address of row l % 8 of
// matrix l / 8 (16 bytes).
__device__ __forceinline__ void stsm4(u32 addr, const u32 (&a)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a[0]), "r"(a[1]),
               "r"(a[2]), "r"(a[3])
               : "memory");
}

// p_frag packs columns 16kk .. 16kk+15 of a 16-row fp32 tile (C layout)
// into the bf16 A fragment of a product over those columns.
template <int NJ>
__device__ __forceinline__ void p_frag(const float (&sc)[NJ][4], int kk, u32 (&a)[4]) {
  a[0] = cvt_bf2(sc[2 * kk][0], sc[2 * kk][1]);
  a[1] = cvt_bf2(sc[2 * kk][2], sc[2 * kk][3]);
  a[2] = cvt_bf2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
  a[3] = cvt_bf2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
}

// softmax_probs is one block of the online softmax for a 16-row tile: it
// takes the raw scores sc of NJ x 8 keys, updates the running row maxima
// mrow (kept scaled, in log2 units) and sums lrow, leaves in sc the block's
// unnormalized probabilities, and returns in corr the factor by which the
// rows' earlier outputs must be scaled. The maxima stay finite because key
// 0 is in every row's first block.
template <int NJ>
__device__ __forceinline__ void softmax_probs(float (&sc)[NJ][4], float (&mrow)[2], float (&lrow)[2], float (&corr)[2],
                                              float scale_log2) {
  float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], sc[j][e]);
  float ms[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    float mn = fmaxf(mrow[h], mx[h] * scale_log2);
    corr[h] = ex2(mrow[h] - mn);
    mrow[h] = mn;
    ms[h] = mn;
  }
  float ls[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = ex2(fmaf(sc[j][e], scale_log2, -ms[e >> 1]));
      sc[j][e] = p;
      ls[e >> 1] += p;
    }
#pragma unroll
  for (int h = 0; h < 2; ++h) lrow[h] = lrow[h] * corr[h] + ls[h];
}

// rescale multiplies a 16-row output tile's rows by corr.
template <int NO>
__device__ __forceinline__ void rescale(float (&o)[NO][4], const float (&corr)[2]) {
#pragma unroll
  for (int j = 0; j < NO; ++j) {
    o[j][0] *= corr[0];
    o[j][1] *= corr[0];
    o[j][2] *= corr[1];
    o[j][3] *= corr[1];
  }
}

// softmax_step is softmax_probs followed by the rescaling of the output
// accumulators o.
template <int NJ, int NO>
__device__ __forceinline__ void softmax_step(float (&sc)[NJ][4], float (&mrow)[2], float (&lrow)[2], float (&o)[NO][4],
                                             float scale_log2) {
  float corr[2];
  softmax_probs(sc, mrow, lrow, corr, scale_log2);
  rescale(o, corr);
}

// store_rows writes a 16-row output tile, normalized by the row sums (summed
// over the quad here), for the rows below n; orow0 points at row g's first
// column of this lane (column 2tq).
template <int NO>
__device__ __forceinline__ void store_rows(const float (&o)[NO][4], const float (&lrow)[2], u16* orow0, size_t pitch,
                                           int row_g, int n) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = lrow[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (row_g + 8 * h >= n) continue;
    float il = 1.f / l;
    u16* orow = orow0 + (size_t)(8 * h) * pitch;
#pragma unroll
    for (int j = 0; j < NO; ++j) *(u32*)(orow + j * 8) = pack_bf2(o[j][2 * h] * il, o[j][2 * h + 1] * il);
  }
}
