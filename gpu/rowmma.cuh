// rowmma.cuh: products of 16 weight rows with up to 8 tokens on tensor
// cores, for the kernels of decode-sized batches that are bound by reading
// the weights once (gemv_act_mma and gemv_mlp_mma in gemv.cu, gpu/llm's
// gemv_rows_mma). A block of 256 threads copies its 16 rows into shared
// memory (slab_load: bulk asynchronous copies on sm_90, issued before
// grid_wait so that they overlap the kernel before), in chunks of ACT_COLS
// columns, each row padded by 8 elements so that row r + 1 starts 16 bytes
// of banks after row r; its 8 warps split a chunk's columns, each adding
// its share of the 16 x 8 products with mma.sync m16n8k16 (the tokens as
// the 8 columns, their fragments read from the L2: act_x), and mma_sum
// adds the warps' shares in warp order. Within each 32 columns, lane (g, q)
// feeds the MMA columns 8q .. 8q+7 of rows g and g + 8 as whole 16-byte
// loads: the k order of a product is permuted the same way for both
// operands, so the sums are the dot products. Include after common.cuh and
// mma.cuh.
#pragma once

#define ACT_COLS 2048                // columns of a row chunk in shared memory
#define ACT_STEPS (ACT_COLS / 32 / 8)  // 32-column steps of a warp per chunk

// bulk_rows (warp 0, all lanes) copies columns [c0, c0 + cw) of the rows
// j0 + r of w with bit r set in rows into row r of slab (row stride ld
// elements), completing on bar, which expects their bytes (sm_90).
__device__ __forceinline__ void bulk_rows(u32 slab, int ld, const u16* __restrict__ w, int j0, u32 rows, int d,
                                          int c0, int cw, u32 bar, u64 pol) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) mbar_expect_tx(bar, (u32)__popc(rows) * (u32)cw * 2u);
  __syncwarp();
  if (lane < 16 && (rows >> lane & 1))
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
        "%4;" ::"r"(slab + (u32)(lane * ld * 2)),
        "l"(w + (size_t)(j0 + lane) * d + c0), "r"(cw * 2), "r"(bar), "l"(pol)
        : "memory");
}

// slab_init (all threads) prepares bar for slab_load: on sm_90 thread 0
// initializes it, and the block waits for that.
__device__ __forceinline__ void slab_init(u32 bar) {
#if __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0) {
    mbar_init(bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
#endif
}

// slab_load (all threads) requests columns [c0, c0 + cw) of the rows j0 + r
// of w with bit r set in rows into row r of slab, once every thread is
// done reading what it overwrites (a __syncthreads before it, or none
// yet): on sm_90 warp 0 issues bulk copies completing on bar (after a
// proxy fence, which orders the block's earlier reads of slab before
// them); before sm_90 every thread issues 16-byte cp.async copies.
__device__ __forceinline__ void slab_load(u32 slab, int ld, const u16* __restrict__ w, int j0, u32 rows, int d,
                                          int c0, int cw, u32 bar, u64 pol) {
#if __CUDA_ARCH__ >= 900
  if (threadIdx.x < 32) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    bulk_rows(slab, ld, w, j0, rows, d, c0, cw, bar, pol);
  }
#else
  const int per = cw / 8;  // 16-byte pieces a row
  for (int i = threadIdx.x; i < 16 * per; i += blockDim.x) {
    const int r = i / per, c = i - r * per;
    if (rows >> r & 1) cp_async16(slab + (u32)((r * ld + 8 * c) * 2), w + (size_t)(j0 + r) * d + c0 + 8 * c, true);
  }
  cp_async_commit();
#endif
}

// slab_wait (all threads) waits for the last slab_load; phase counts bar's
// phases (sm_90).
__device__ __forceinline__ void slab_wait(u32 bar, u32& phase) {
#if __CUDA_ARCH__ >= 900
  mbar_wait(bar, phase);
  phase ^= 1;
#else
  cp_async_wait<0>();
  __syncthreads();
#endif
}

// act_steps sets this warp's share [s0, s1) of the 32-column steps of the
// chunk at column c0 (chunks of kc columns).
__device__ __forceinline__ void act_steps(int d, int c0, int kc, int& s0, int& s1) {
  const int steps = min(kc, d - c0) / 32, per = (steps + 7) / 8;
  s0 = min(steps, (int)(threadIdx.x >> 5) * per);
  s1 = min(steps, s0 + per);
}

// act_x loads this warp's x fragments of steps [s0, s1) of the chunk at
// column c0: token g's 16 bytes at column 32 s + 8 q (zero past m).
__device__ __forceinline__ void act_x(uint4 (&xv)[ACT_STEPS], const u16* __restrict__ x, int m, int d, int c0,
                                      int s0, int s1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int i = 0; i < ACT_STEPS; ++i)
    xv[i] = s0 + i < s1 && g < m ? ldg_cg(x + (size_t)g * d + c0 + 32 * (s0 + i) + 8 * q) : make_uint4(0, 0, 0, 0);
}

// act_mma adds this warp's share, steps [s0, s1) of 32 columns of a chunk,
// of the 16 x 8 products of the rows in slab (row stride ld; rows whose bit
// is clear in live count as zeros) with the x fragments xv into c.
__device__ __forceinline__ void act_mma(const u16* slab, int ld, u32 live, const uint4 (&xv)[ACT_STEPS], int s0,
                                        int s1, float (&c)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const bool la = live >> g & 1, lb = live >> (g + 8) & 1;
  const u16* ra = slab + g * ld + 8 * q;
  const u16* rb = ra + 8 * ld;
#pragma unroll
  for (int i = 0; i < ACT_STEPS; ++i) {
    if (s0 + i >= s1) break;
    const int col = 32 * (s0 + i);
    const uint4 wa = la ? *(const uint4*)(ra + col) : make_uint4(0, 0, 0, 0);
    const uint4 wb = lb ? *(const uint4*)(rb + col) : make_uint4(0, 0, 0, 0);
    const u32 a0[4] = {wa.x, wb.x, wa.y, wb.y}, a1[4] = {wa.z, wb.z, wa.w, wb.w};
    mma16816(c, a0, xv[i].x, xv[i].y);
    mma16816(c, a1, xv[i].z, xv[i].w);
  }
}

// mma_sum adds the warps' products c in warp order into warp 0's c; red is
// shared, 4 floats per thread.
__device__ __forceinline__ void mma_sum(float (&c)[4], float4* red) {
  __syncthreads();  // red's previous contents have been read
  red[threadIdx.x] = make_float4(c[0], c[1], c[2], c[3]);
  __syncthreads();
  if (threadIdx.x >= 32) return;
  for (int wi = 1; wi < (int)(blockDim.x >> 5); ++wi) {
    const float4 v = red[wi * 32 + threadIdx.x];
    c[0] += v.x, c[1] += v.y, c[2] += v.z, c[3] += v.w;
  }
}

// rows_mma (all threads) adds the products of the rows j0 + r of w with bit
// r set in rows with the m tokens of x (d columns) into this warp's c,
// chunk by chunk of kc columns. The first chunk's copy must have been
// requested (slab_load of columns [0, kc)); each later one is requested
// here once every warp is done with the chunk before. xv ends holding the
// last chunk's x fragments. phase counts bar's phases (slab_wait).
__device__ __forceinline__ void rows_mma(u32 sl, const u16* slab, int ld, const u16* __restrict__ w, int j0, u32 rows,
                                         const u16* __restrict__ x, int m, int d, int kc, u32 bar, u32& phase,
                                         u64 pol, uint4 (&xv)[ACT_STEPS], float (&c)[4]) {
  for (int c0 = 0; c0 < d; c0 += kc) {
    int s0, s1;
    act_steps(d, c0, kc, s0, s1);
    act_x(xv, x, m, d, c0, s0, s1);
    slab_wait(bar, phase);
    act_mma(slab, ld, rows, xv, s0, s1, c);
    if (c0 + kc < d) {
      __syncthreads();  // every warp is done with the chunk
      slab_load(sl, ld, w, j0, rows, d, c0 + kc, min(kc, d - c0 - kc), bar, pol);
    }
  }
}
