// rowdot.cuh: dot products of a few tokens with whole weight rows, for the
// kernels of decode-sized batches that are bound by reading the weights
// once (gemv.cu here, and the decode projections in gpu/llm's proj.cu).
// One warp handles U rows: each lane reads 16 bytes of each row per 256 columns,
// 4 U loads in flight (a warp with one row in flight leaves the memory
// system idle between its round trips). Include after common.cuh.
#pragma once

// rows_load issues the loads of columns [base, base + 1024) of the U rows
// (d bf16 each).
template <int U>
__device__ __forceinline__ void rows_load(uint4 (&wv)[U][4], const u16* const (&rows)[U], int base, int d, int lane) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      int c = base + j * 256 + lane * 8;
      if (c < d) wv[u][j] = ldg_nc(rows[u] + c);
    }
}

// rows_dot sets acc[u][t] = xs[t] . rows[u] (t < m <= MB) in every lane of
// the warp; xs holds the m x d tokens in shared memory, and wv the loads of
// columns [0, 1024) that the caller issued with rows_load (before staging
// xs, so that the two overlap). d % 8 == 0.
template <int MB, int U>
__device__ __forceinline__ void rows_dot(uint4 (&wv)[U][4], const u16* const (&rows)[U], const u16* xs, int m, int d,
                                         int lane, float (&acc)[U][MB]) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int t = 0; t < MB; ++t) acc[u][t] = 0.f;
  for (int base = 0;;) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      int c = base + j * 256 + lane * 8;
      if (c >= d) continue;
#pragma unroll
      for (int t = 0; t < MB; ++t) {
        if (t >= m) continue;
        uint4 xv = *(const uint4*)(xs + t * d + c);
#pragma unroll
        for (int u = 0; u < U; ++u) acc[u][t] = dot8(wv[u][j], xv, acc[u][t]);
      }
    }
    base += 1024;
    if (base >= d) break;
    rows_load<U>(wv, rows, base, d, lane);
  }
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int t = 0; t < MB; ++t) acc[u][t] = warp_sum(acc[u][t]);
}

// rows_prefetch asks the L2 for columns [base, d) of the U rows, a
// 128-byte line per lane and step (for the columns past rows_load's first
// 1024, before an early-start kernel's grid_wait).
template <int U>
__device__ __forceinline__ void rows_prefetch(const u16* const (&rows)[U], int base, int d, int lane) {
#pragma unroll
  for (int u = 0; u < U; ++u)
    for (int c = base + lane * 64; c < d; c += 32 * 64) asm volatile("prefetch.global.L2 [%0];" ::"l"(rows[u] + c));
}

// stage_x copies the m x d tokens (what the kernel before wrote: read
// through the L2) into shared memory and waits for them.
__device__ __forceinline__ void stage_x(u16* xs, const u16* __restrict__ x, int m, int d) {
  for (int i = threadIdx.x; i < m * d / 8; i += blockDim.x) ((uint4*)xs)[i] = ldg_cg((const uint4*)x + i);
  __syncthreads();
}

// pick returns v[lane] for lane < MB (a register array indexed without
// local memory).
template <int MB>
__device__ __forceinline__ float pick(const float (&v)[MB], int lane) {
  float r = 0.f;
#pragma unroll
  for (int t = 0; t < MB; ++t)
    if (t == lane) r = v[t];
  return r;
}
