// mma.cuh: the bf16 tensor-core building blocks of the attention kernels
// (inference, gpu/llm, and training, gpu/trainer): mma.sync m16n8k16 with
// fp32 accumulation, ldmatrix loads, the packing of an fp32 tile into an A
// fragment, and exp2 for the online softmax.
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

// p_frag packs columns 16kk .. 16kk+15 of a 16-row fp32 tile (C layout)
// into the bf16 A fragment of a product over those columns.
template <int NJ>
__device__ __forceinline__ void p_frag(const float (&sc)[NJ][4], int kk, u32 (&a)[4]) {
  a[0] = cvt_bf2(sc[2 * kk][0], sc[2 * kk][1]);
  a[1] = cvt_bf2(sc[2 * kk][2], sc[2 * kk][3]);
  a[2] = cvt_bf2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
  a[3] = cvt_bf2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
}
