// gemv_wide.cu: the sparse MLP of a gated layer for decode steps of 9 to 64
// tokens (sm_90a; an experiment, Options.Wide). At these batches the
// small-batch kernels (gemv.cu) would hold too many accumulators, D2T's
// 128-row tiles compute mostly padding, and the dense path's three M = 64
// cuBLASLt products ran at about 1.7 TB/s (40 us a layer of the SparseLM
// shape). Two kernels:
//
//   gemv_act_wide   the gate and up rows of every unit once (46 MB at d
//                   2048, f 5632: sorting out the up rows that no token
//                   needs would cost a second pass over x), on tensor
//                   cores: a CTA takes WIDE_UNITS units, whose 32 gate and
//                   32 up rows are the N = 64 of wgmma m64n64k16 with the
//                   64 tokens (rows past m zero-filled by TMA) as M, the x
//                   and weight tiles of each 64-column step loaded by TMA
//                   through a WIDE_STAGES-deep mbarrier pipeline (the
//                   weights of the first steps before grid_wait). A unit's
//                   gate and up columns sit in the same thread's
//                   accumulators, so h = bf16(g) u is formed there; it is
//                   stored unit-major (ht [f][64] fp32, only where the unit
//                   is active: g > 0 or NaN), with a token mask a unit (tm),
//                   a record a unit of its first WIDE_INLINE active tokens
//                   and their h (meta, rh: most units fire in one or two of
//                   64 tokens at 0.5%), the CTA's 32-unit activity word
//                   (mask) and active-pair count (cnt). The active units'
//                   down rows are requested into the L2 for the next kernel.
//   gemv_down_wide  y = sum over the active (token, unit) pairs of h down[j]:
//                   CTA (c, s) takes output columns [16 c, 16 c + 16) and
//                   the s-th of WIDE_SPLIT ranges of units; its 16 half-warps
//                   walk the range's active units in ascending order (a lane
//                   a column; a unit's record and its down columns read in
//                   one round trip, WIDE_BATCH units at once; a unit with
//                   more active tokens than its record holds reads its token
//                   mask and h row whole, one round trip more), each adding
//                   into its own shared partial sums of the 64 tokens; the
//                   half-warps' sums are added in order into part, and the
//                   last CTA of a column block (a counter that wraps back to
//                   zero) adds the WIDE_SPLIT ranges in order into y. The
//                   summation order is fixed: the results repeat bit for bit.
//
// x and y are bf16 [m][d], the weights bf16 [f][d] (down = Wd^T). d is a
// multiple of 64, f of 32. Both kernels may start early: they read what
// earlier kernels wrote (x by TMA, ht, tm, mask, cnt) after grid_wait.
#include "common.cuh"
#include "wgmma.cuh"

#define WIDE_TOKENS 64  // most tokens a call (the wgmma's M)
#define WIDE_UNITS 32   // units a gemv_act_wide CTA takes (their gate and up rows: the wgmma's N)
#define WIDE_STAGES 6   // 64-column steps in flight
#define WIDE_TILE 8192  // bytes of a 64 x 64 bf16 tile: x's, or the 32 gate and 32 up rows'
#define WIDE_SPLIT 3    // unit ranges of gemv_down_wide (3 CTAs an SM: at d 2048 all 384 in one wave)
#define WIDE_COLS 16    // output columns of a gemv_down_wide CTA
#define WIDE_INLINE 4   // active tokens a unit's record holds
#define WIDE_BATCH 8    // units a gemv_down_wide half-warp reads at once

// gemv_act_wide: grid f / WIDE_UNITS CTAs of 128 threads (one warpgroup);
// dynamic shared memory 2 WIDE_STAGES WIDE_TILE + 1024 bytes. tmX maps x
// ([m][d] bf16, box 64 x 64), tmG and tmU the gate and up weights ([f][d],
// box 64 columns x 32 rows), all with the 128-byte swizzle.
extern "C" __global__ void __launch_bounds__(128)
    gemv_act_wide(const __grid_constant__ TmaDesc tmX, const __grid_constant__ TmaDesc tmG,
                  const __grid_constant__ TmaDesc tmU, const u16* __restrict__ down, float* __restrict__ ht,
                  u64* __restrict__ tm, u32* __restrict__ meta, float4* __restrict__ rh, u32* __restrict__ mask,
                  u32* __restrict__ cnt, int m, int d) {
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) u64 bars[WIDE_STAGES];
  __shared__ u64 tms[WIDE_UNITS];
  __shared__ u32 pairs;
  const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int j0 = blockIdx.x * WIDE_UNITS, steps = d / 64, first = min(WIDE_STAGES, steps);
  const u32 bar0 = smem_addr(bars);
  // Stage s: x's tile, then the weights' (gate rows 0-31, up rows 32-63).
  auto xs = [&](int s) { return base + (u32)(2 * s) * WIDE_TILE; };
  auto ws = [&](int s) { return xs(s) + WIDE_TILE; };
  if (tid < WIDE_UNITS) tms[tid] = 0ull;
  if (tid == 0) {
    pairs = 0;
    for (int s = 0; s < WIDE_STAGES; ++s) mbar_init(bar0 + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (tid == 0)
    for (int k = 0; k < first; ++k) {  // weights: before grid_wait
      mbar_expect_tx(bar0 + 8 * k, 2 * WIDE_TILE);
      tma_load(ws(k), &tmG, 64 * k, j0, bar0 + 8 * k);
      tma_load(ws(k) + WIDE_TILE / 2, &tmU, 64 * k, j0, bar0 + 8 * k);
    }
  grid_wait();
  grid_release();
  if (tid == 0)
    for (int k = 0; k < first; ++k) tma_load(xs(k), &tmX, 64 * k, 0, bar0 + 8 * k);
  float acc[8][4];
  zero(acc);
  keep_live(acc);  // zeros the wgmma reads, not constants ptxas folds (which serialized the wgmmas, C7511)
  for (int k = 0; k < steps; ++k) {
    const int s = k % WIDE_STAGES;
    mbar_wait(bar0 + 8 * s, (u32)(k / WIDE_STAGES) & 1u);
    keep_live(acc);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    const u64 da = sw128_desc(xs(s)), db = sw128_desc(ws(s));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wg_ss64(acc, da + 2 * kk, db + 2 * kk, 1);  // +32 bytes per k step
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    wg_wait<0>();
    keep_live(acc);
    // Every warp is done with stage s before thread 0 refills it.
    __syncthreads();
    if (tid == 0 && k + WIDE_STAGES < steps) {
      const int kn = k + WIDE_STAGES;
      const u32 bar = bar0 + 8 * s;
      mbar_expect_tx(bar, 2 * WIDE_TILE);
      tma_load(ws(s), &tmG, 64 * kn, j0, bar);
      tma_load(ws(s) + WIDE_TILE / 2, &tmU, 64 * kn, j0, bar);
      tma_load(xs(s), &tmX, 64 * kn, 0, bar);
    }
  }
  // acc[i][e]: token 16 warp + g + 8 (e >> 1), column 8 i + 2 tq + (e & 1):
  // for i < 4 the gate of unit j0 + that column, in acc[i + 4][e] its up.
  float hv[4][4];
  u32 on = 0, n = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = warp * 16 + g + 8 * (e >> 1), jl = 8 * i + 2 * tq + (e & 1);
      const float gv = __uint_as_float(f_to_bf(acc[i][e]) << 16);  // rounded as a GEMM's output would be
      hv[i][e] = gv * acc[i + 4][e];
      if (t < m && (gv > 0.f || gv != gv)) {
        on |= 1u << (4 * i + e);
        ht[(size_t)(j0 + jl) * WIDE_TOKENS + t] = hv[i][e];
        atomicOr(&tms[jl], 1ull << t);
        ++n;
      }
    }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
  if (lane == 0 && n) atomicAdd(&pairs, n);
  __syncthreads();
  // A unit's first WIDE_INLINE active tokens (ascending) also go into its
  // record: meta (count | token r at bits 8 + 6 r) and rh (their h), read
  // by gemv_down_wide in one round trip with the down row.
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (on >> (4 * i + e) & 1) {
        const int t = warp * 16 + g + 8 * (e >> 1), jl = 8 * i + 2 * tq + (e & 1);
        const int r = __popcll(tms[jl] & ((1ull << t) - 1ull));
        if (r < WIDE_INLINE) reinterpret_cast<float*>(rh)[(size_t)(j0 + jl) * 4 + r] = hv[i][e];
      }
  if (warp == 0) {
    const u64 bits = tms[lane];
    tm[j0 + lane] = bits;
    u32 mt = (u32)__popcll(bits);
    u64 b = bits;
#pragma unroll
    for (int r = 0; r < WIDE_INLINE; ++r) {
      if (b) mt |= (u32)(__ffsll((long long)b) - 1) << (8 + 6 * r);
      b &= b - 1ull;
    }
    meta[j0 + lane] = mt;
    const u32 live = __ballot_sync(0xffffffffu, bits != 0ull);
    if (lane == 0) mask[blockIdx.x] = live, cnt[blockIdx.x] = pairs;
    if (bits)  // for gemv_down_wide, next
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(down + (size_t)(j0 + lane) * d), "r"(d * 2)
                   : "memory");
  }
}

// gemv_down_wide: grid (d / WIDE_COLS, WIDE_SPLIT) CTAs of 256 threads;
// dynamic shared memory 16 WIDE_TOKENS WIDE_COLS floats (the half-warps'
// partial sums) and ceil(f / 32 / WIDE_SPLIT) 32 ints (the range's active
// units). part holds WIDE_SPLIT x WIDE_TOKENS x d floats, done d /
// WIDE_COLS counters (back at zero after each call). CTA (0, 0) sums the
// f / 32 counts of gemv_act_wide into *nnz.
extern "C" __global__ void __launch_bounds__(256)
    gemv_down_wide(const float* __restrict__ ht, const u64* __restrict__ tm, const u32* __restrict__ meta,
                   const float4* __restrict__ rh, const u32* __restrict__ mask, const u16* __restrict__ down,
                   float* __restrict__ part, int* __restrict__ done, u16* __restrict__ y, const u32* __restrict__ cnt,
                   u64* __restrict__ nnz, int m, int d, int f) {
  extern __shared__ float sums[];  // [16][WIDE_TOKENS][WIDE_COLS], then the list
  __shared__ int len;
  __shared__ int last;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int hw = tid >> 4, col = tid & 15, c0 = blockIdx.x * WIDE_COLS, sp = blockIdx.y;
  const int words = f / 32, w0 = sp * words / WIDE_SPLIT, w1 = (sp + 1) * words / WIDE_SPLIT;
  int* list = (int*)(sums + 16 * WIDE_TOKENS * WIDE_COLS);
  for (int i = tid; i < 16 * WIDE_TOKENS * WIDE_COLS; i += 256) sums[i] = 0.f;
  grid_wait();
  grid_release();
  if (warp == 0) {  // the range's active units, ascending
    const int n = list_units(mask, w0, w1, list);
    if (lane == 0) len = n;
  }
  if (sp == 0 && blockIdx.x == 0 && warp == 1) {
    u64 c = 0;
    for (int i = lane; i < words; i += 32) c += __ldcg(cnt + i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    if (lane == 0) *nnz = c;
  }
  __syncthreads();
  // Half-warp hw takes the list's units hw, hw + 16, ..., WIDE_BATCH at a
  // time: their records and down columns in one round trip; the tokens past
  // a record's WIDE_INLINE (units firing in many tokens) from tm and ht.
  float* mine = sums + hw * WIDE_TOKENS * WIDE_COLS + col;
  const u32 half_mask = 0xffffu << (lane & 16);  // this half-warp's lanes
  for (int i0 = hw; i0 < len; i0 += 16 * WIDE_BATCH) {
    u32 mt[WIDE_BATCH];
    float4 hr[WIDE_BATCH];
    float dv[WIDE_BATCH];
    int js[WIDE_BATCH];
#pragma unroll
    for (int q = 0; q < WIDE_BATCH; ++q) {
      const int i = i0 + 16 * q;
      js[q] = i < len ? list[i] : -1;
      mt[q] = 0u, hr[q] = make_float4(0.f, 0.f, 0.f, 0.f), dv[q] = 0.f;
      if (js[q] >= 0) {
        mt[q] = __ldcg(meta + js[q]);
        hr[q] = __ldcg(rh + js[q]);
        dv[q] = bf_to_f(down[(size_t)js[q] * d + c0 + col]);
      }
    }
#pragma unroll
    for (int q = 0; q < WIDE_BATCH; ++q) {
      const int cnt_q = (int)(mt[q] & 0xffu);
      const float h4[WIDE_INLINE] = {hr[q].x, hr[q].y, hr[q].z, hr[q].w};
#pragma unroll
      for (int r = 0; r < WIDE_INLINE; ++r)
        if (r < cnt_q) mine[((mt[q] >> (8 + 6 * r)) & 63u) * WIDE_COLS] += h4[r] * dv[q];
      if (cnt_q > WIDE_INLINE) {
        // The unit's token mask and its whole h row (lane l: tokens 4 l ..
        // 4 l + 3) in one round trip; each token's h from its lane.
        u64 b = __ldcg(tm + js[q]);
        const float4 row = __ldcg(reinterpret_cast<const float4*>(ht + (size_t)js[q] * WIDE_TOKENS) + col);
#pragma unroll
        for (int r = 0; r < WIDE_INLINE; ++r) b &= b - 1ull;
        for (; b; b &= b - 1ull) {
          const int t = __ffsll((long long)b) - 1;
          const float v = (t & 3) == 0 ? row.x : (t & 3) == 1 ? row.y : (t & 3) == 2 ? row.z : row.w;
          mine[t * WIDE_COLS] += __shfl_sync(half_mask, v, t >> 2, 16) * dv[q];
        }
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < m * WIDE_COLS; i += 256) {
    const int t = i / WIDE_COLS, c = i % WIDE_COLS;
    float s = 0.f;
    for (int h = 0; h < 16; ++h) s += sums[(h * WIDE_TOKENS + t) * WIDE_COLS + c];
    part[((size_t)sp * WIDE_TOKENS + t) * d + c0 + c] = s;
  }
  // The last range of this column block to finish adds them all.
  __threadfence();
  __syncthreads();
  // atomicInc wraps the counter back to 0 as the last range arrives (a
  // stray value is gone after one call).
  if (tid == 0) last = atomicInc((unsigned*)&done[blockIdx.x], WIDE_SPLIT - 1) == WIDE_SPLIT - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = tid; i < m * WIDE_COLS; i += 256) {
    const int t = i / WIDE_COLS, c = i % WIDE_COLS;
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < WIDE_SPLIT; ++r) s += __ldcg(part + ((size_t)r * WIDE_TOKENS + t) * d + c0 + c);
    y[(size_t)t * d + c0 + c] = (u16)f_to_bf(s);
  }
}
