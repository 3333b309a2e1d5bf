// gemv.cu: the sparse MLP for batches of at most 8 tokens (decode steps).
//
// D2T works on 128-row tiles: for one token it computes 128 rows of the
// gate GEMM, compute-bound, and its tail kernels give one CTA per 8 tokens.
// For a handful of tokens the MLP is bound by reading the weights, and the
// sparse activation saves exactly the reads of the up and down rows of the
// inactive units. Two kernels:
//
//   gemv_act   every gate row once (all SMs, 4 units per warp, their loads
//              in flight together; gemv_act_mma for more than 4 tokens,
//              on tensor cores): g = x . Wg_j
//              for each token; for a unit active in some token (g > 0 or
//              NaN, g rounded to bf16 as the GEMM output would be) it reads
//              the up row and writes h[t][j] = g * (x_t . Wu_j) where active,
//              else 0 (non-gated: h = g where active). Each CTA writes the
//              bit mask of its 32 (gemv_act_mma: 16) units' activity and its
//              count of active (token, unit) pairs: plain stores, no memset,
//              no atomics.
//   gemv_down  y[t][c] = sum over the active units j of h[t][j] down[j][c]:
//              each CTA owns DOWN_COLS columns; warp w lists the active
//              units of its share of the mask (every eighth word, from
//              word w) and reads only those down rows; the warps' partial
//              sums are added in warp order.
//              The summation order is fixed: results are deterministic.
//              Block 0 also sums gemv_act's counts into *nnz.
//
// Both may be launched with early start (cuda.LaunchConfig.EarlyStart): the
// act kernels request their gate rows before grid_wait (gemv_act its first
// loads and the rest into the L2, gemv_act_mma all of them into shared
// memory), and every kernel reads what earlier kernels wrote (x, h, the
// mask and counts) after it, through the L2. The one-token kernels built on
// act_group (gemv_act<1>, gemv_act_norm, gemv_mlp) release the next kernel
// before their wait (grid_enter, common.cuh).
//
// Rows are bf16 [F][D] (gate or up, and down = Wd^T); x and y are bf16
// [m][D]; h is fp32 [m][F]. D is a multiple of 64, F of 32.
//
// With LIST, the same kernels recompute the rows that D2T flagged (a tile
// over capacity, NaN or Inf) exactly, for the sparse path of large batches:
// the rows are entries first.. of the overflow list (list[0] = count,
// list[1..] = row indices), at most cap of them, taken MB at a time; group
// i's h and mask live at h + i MB F and mask + i F/32, and gemv_down writes
// each group's outputs to the listed rows of y. One row then costs a read
// of the weights spread over all SMs, not one CTA's walk over every unit.
#include "common.cuh"
#include "rowdot.cuh"
#include "mma.cuh"

// With GEMV_TIMELINE defined (a separate build, Options.GEMVTimeline),
// thread 0 of each block of the one-token kernels built on act_group
// (gemv_mlp above all) stamps the GPU's global timer (ns) at the points
// TL_ENTRY .. TL_END into gemv_timeline[block][point], for a timeline of
// where the kernel's time goes inside a graph-replayed decode step. Each
// launch overwrites the stamps of the one before. Without it TL_MARK is
// nothing.
#define TL_BLOCKS 1024
#define TL_POINTS 8
#define TL_ENTRY 0   // the block starts
#define TL_WAITED 1  // grid_enter returned: the kernels before are done
#define TL_STAGED 2  // x (normed) is in shared memory
#define TL_GATE 3    // warp 0's gate dot products are summed
#define TL_ACT 4     // the block's h and mask are written
#define TL_SYNCED 5  // past gemv_mlp's grid barrier
#define TL_END 6     // the block's down columns are written
#define TL_SM 7      // not a time: the SM the block ran on
#ifdef GEMV_TIMELINE
__device__ unsigned long long gemv_timeline[TL_BLOCKS * TL_POINTS];
__device__ __forceinline__ void tl_mark(int point) {
  if (threadIdx.x == 0 && blockIdx.x < TL_BLOCKS) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    gemv_timeline[blockIdx.x * TL_POINTS + point] = t;
    if (point == TL_ENTRY) {
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      gemv_timeline[blockIdx.x * TL_POINTS + TL_SM] = sm;
    }
  }
}
#define TL_MARK(point) tl_mark(point)
#define TL_MARK_ALL(point) (__syncthreads(), tl_mark(point))  // once every warp is there
#else
#define TL_MARK(point)
#define TL_MARK_ALL(point)
#endif

// stage_rows copies the m token rows rows[0..m) of x into shared memory
// and waits for them.
__device__ __forceinline__ void stage_rows(u16* xs, const u16* __restrict__ x, const int* __restrict__ rows, int m,
                                           int d) {
  int per = d / 8;
  for (int i = threadIdx.x; i < m * per; i += blockDim.x) {
    int t = i / per, c = i - t * per;
    ((uint4*)xs)[i] = ldg_nc((const uint4*)(x + (size_t)rows[t] * d) + c);
  }
  __syncthreads();
}

// listed returns how many overflow-list entries from first on a LIST
// kernel takes (at most cap).
__device__ __forceinline__ int listed(const int* __restrict__ list, int first, int cap) {
  return min(max(list[0] - first, 0), cap);
}

// NormIn is the input of gemv_act_norm: one token's residual stream resid
// (fp32, d), the delta added to it (bf16, may be null), where the sum goes
// (resid_out) and the RMSNorm's weights and epsilon (see stage_norm_x).
struct NormIn {
  const float* resid;
  const u16* delta;
  float* resid_out;
  const float* w;
  float eps;
};

// gate_rows_issue points rows at a warp's 4 gate rows j0 .. j0+3 of w
// and issues the loads of their first 1024 columns into wv, the rest of
// them asked of the L2 (before grid_wait: weights).
__device__ __forceinline__ void gate_rows_issue(const u16* (&rows)[4], uint4 (&wv)[4][4], const u16* __restrict__ w,
                                                int j0, int d, int lane) {
#pragma unroll
  for (int k = 0; k < 4; ++k) rows[k] = w + (size_t)(j0 + k) * d;
  rows_load<4>(wv, rows, 0, d, lane);
  rows_prefetch<4>(rows, 1024, d, lane);
}

// act_group computes gemv_act's h and mask for the mg <= MB tokens of one
// group: x itself (rows == nullptr), the listed rows of x, or with NORM the
// token that nin norms. The group's h is at h and its mask at mask. With
// down set, the down rows of the units active in some token are requested
// into the L2 as they are found (for gemv_mlp's down phase).
template <int MB, bool GATED, bool NORM>
__device__ __forceinline__ void act_group(const u16* __restrict__ x, const int* __restrict__ rows_of_x,
                                          const u16* __restrict__ w, const u16* __restrict__ up, float* __restrict__ h,
                                          u32* __restrict__ mask, u32* __restrict__ cnt, int mg, int d, int f, u16* xs,
                                          u32* wmask, u32* wcnt, NormIn nin, const u16* __restrict__ down = nullptr) {
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int j0 = blockIdx.x * 32 + warp * 4;
  const u16* rows[4];
  uint4 wv[4][4];
  TL_MARK(TL_ENTRY);
  gate_rows_issue(rows, wv, w, j0, d, lane);
  float4 nw[RMS_MAXV];
  if (NORM) rms_weights(nw, nin.w, d);
  grid_enter(MB == 1);
  TL_MARK(TL_WAITED);
  if (NORM)
    stage_norm_x(xs, nin.resid, nin.delta, nin.resid_out, nw, d, nin.eps);
  else if (rows_of_x)
    stage_rows(xs, x, rows_of_x, mg, d);
  else
    stage_x(xs, x, mg, d);
  TL_MARK(TL_STAGED);
  float g[4][MB];
  rows_dot<MB, 4>(wv, rows, xs, mg, d, lane, g);
  TL_MARK(TL_GATE);
  u32 bits = 0, n = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    int j = j0 + k;
    bool on[MB], any = false;
#pragma unroll
    for (int t = 0; t < MB; ++t) {
      g[k][t] = __uint_as_float(f_to_bf(g[k][t]) << 16);
      on[t] = t < mg && (g[k][t] > 0.f || g[k][t] != g[k][t]);
      any |= on[t];
    }
    if (down && any) {
      const u16* drow[1] = {down + (size_t)j * d};
      rows_prefetch<1>(drow, 0, d, lane);
    }
    float u[1][MB];
#pragma unroll
    for (int t = 0; t < MB; ++t) u[0][t] = 1.f;
    if (GATED && any) {
      const u16* urow[1] = {up + (size_t)j * d};
      uint4 uv[1][4];
      rows_load<1>(uv, urow, 0, d, lane);
      rows_dot<MB, 1>(uv, urow, xs, mg, d, lane, u);
    }
    if (lane == 0) {
#pragma unroll
      for (int t = 0; t < MB; ++t) {
        if (t >= mg) continue;
        h[(size_t)t * f + j] = on[t] ? g[k][t] * u[0][t] : 0.f;
        n += on[t];
      }
    }
    bits |= (u32)any << (warp * 4 + k);
  }
  if (lane == 0) {
    wmask[warp] = bits;
    wcnt[warp] = n;
  }
  // Also keeps a next group from restaging xs while a warp still reads it.
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 b = 0, c = 0;
    for (int i = 0; i < 8; ++i) {
      b |= wmask[i];
      c += wcnt[i];
    }
    mask[blockIdx.x] = b;
    if (cnt) cnt[blockIdx.x] = c;
  }
  TL_MARK(TL_ACT);
}

// gemv_act: grid F/32 blocks of 256 threads, warp w taking units 4w..4w+3
// of the block's 32; dynamic shared memory MB*d*2 (LIST) or m*d*2. MB is
// at most 4 (more tokens run gemv_act_mma).
template <int MB, bool GATED, bool LIST>
__global__ void __launch_bounds__(256)
    gemv_act(const u16* __restrict__ x, const u16* __restrict__ w, const u16* __restrict__ up, float* __restrict__ h,
             u32* __restrict__ mask, u32* __restrict__ cnt, int m, int d, int f, const int* __restrict__ list,
             int first, int cap) {
  extern __shared__ __align__(16) u16 xs[];
  __shared__ u32 wmask[8], wcnt[8];
  const NormIn none = {};
  if (!LIST) {
    act_group<MB, GATED, false>(x, nullptr, w, up, h, mask, cnt, m, d, f, xs, wmask, wcnt, none);
    return;
  }
  grid_wait();  // the list is the kernel before's
  grid_release();
  const int total = listed(list, first, cap);
  for (int g0 = 0; g0 < total; g0 += MB)
    act_group<MB, GATED, false>(x, list + 1 + first + g0, w, up, h + (size_t)g0 * f,
                                mask + (size_t)(g0 / MB) * gridDim.x, nullptr, min(MB, total - g0), d, f, xs, wmask,
                                wcnt, none);
}

// gemv_act_norm: gemv_act for one token, with the residual add and RMSNorm
// before it fused in: every block norms the token into its shared memory
// (stage_norm_x, common.cuh: bit for bit gpu/llm's add_rmsnorm), block 0
// writes resid + delta to resid_out. d a multiple of 4, at most 4096;
// dynamic shared memory d * 2 bytes.
template <bool GATED>
__global__ void __launch_bounds__(256)
    gemv_act_norm(const float* resid, const u16* delta, float* resid_out, const float* normw, float eps,
                  const u16* __restrict__ w, const u16* __restrict__ up, float* __restrict__ h, u32* __restrict__ mask,
                  u32* __restrict__ cnt, int d, int f) {
  extern __shared__ __align__(16) u16 xs[];
  __shared__ u32 wmask[8], wcnt[8];
  const NormIn nin = {resid, delta, resid_out, normw, eps};
  act_group<1, GATED, true>(nullptr, nullptr, w, up, h, mask, cnt, 1, d, f, xs, wmask, wcnt, nin);
}

// gemv_act_mma: gemv_act (not LIST) for up to 8 tokens on tensor cores.
// Block b takes units 16b .. 16b+15. Warp 0 copies their gate rows into
// shared memory with bulk asynchronous copies (cp.async.bulk, completing on
// an mbarrier) before grid_wait, so that every block's whole share of the
// gate weights is requested at once, while the kernel before still runs:
// the kernel is bound by the latency of those reads, not by their bytes.
// (Before sm_90, which has neither, every thread copies with cp.async.)
// The eight warps then split the columns, each computing its share of the
// 16 units x 8 tokens with mma.sync m16n8k16 (bf16 in, fp32 accumulate;
// tokens past m are zero), its x fragments read from the L2, and warp 0
// adds the shares in warp order. Within each 32 columns, lane (g, q) feeds
// the MMA columns 8q .. 8q+7 of rows g and g + 8 as whole 16-byte loads:
// the k order of a product is permuted the same way for both operands, so
// the sums are the dot products. The up rows of the units active in some
// token follow into the same shared memory (gated), and the down rows of
// those units are requested into the L2 for gemv_down. The mask and the
// per-block count (of 16 units) are stored as halves: mask as u16 [f/16]
// within gemv_down's words, cnt as u32 [f/16]. Rows are copied in chunks of
// ACT_COLS columns (one chunk for d <= ACT_COLS); dynamic shared memory
// 16 (min(d, ACT_COLS) + 8) * 2 bytes: the 8-element pad puts row r + 1
// 16 bytes of banks after row r, so the A loads are free of bank
// conflicts. Three blocks an SM (all 352 blocks of f 5632 in one wave).
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

template <bool GATED>
__global__ void __launch_bounds__(256, 3)
    gemv_act_mma(const u16* __restrict__ x, const u16* __restrict__ w, const u16* __restrict__ up,
                 const u16* __restrict__ down, float* __restrict__ h, u32* __restrict__ mask, u32* __restrict__ cnt,
                 int m, int d, int f) {
  extern __shared__ __align__(128) u16 slab[];
  __shared__ float4 red[256], gsave[32];
  __shared__ u32 live_up;
  __shared__ __align__(8) u64 bar_mem;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int j0 = blockIdx.x * 16, kc = min(d, ACT_COLS), ld = kc + 8;
  const u32 sl = smem_addr(slab), bar = smem_addr(&bar_mem);
  const u64 pol = policy_evict_first();  // weights stream through once a step
  slab_init(bar);
  slab_load(sl, ld, w, j0, 0xffffu, d, 0, kc, bar, pol);
  grid_wait();
  grid_release();
  u32 phase = 0;
  float gc[4] = {0.f, 0.f, 0.f, 0.f};
  uint4 xv[ACT_STEPS];
  for (int c0 = 0; c0 < d; c0 += kc) {
    int s0, s1;
    act_steps(d, c0, kc, s0, s1);
    act_x(xv, x, m, d, c0, s0, s1);
    slab_wait(bar, phase);
    act_mma(slab, ld, 0xffffu, xv, s0, s1, gc);
    if (c0 + kc < d) {
      __syncthreads();  // every warp is done with the chunk
      slab_load(sl, ld, w, j0, 0xffffu, d, c0 + kc, min(kc, d - c0 - kc), bar, pol);
    }
  }
  mma_sum(gc, red);
  // Warp 0 holds the gate values of units j0 + g (gc[0], gc[1]) and
  // j0 + g + 8 (gc[2], gc[3]) for tokens 2q, 2q + 1. It rounds them to bf16
  // as a GEMM's output would be and parks them (0 where inactive) in gsave
  // while the up rows are read: registers are short there.
  if (warp == 0) {
    u32 any = 0;
    float gv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float v = __uint_as_float(f_to_bf(gc[e]) << 16);
      const bool on = 2 * q + (e & 1) < m && (v > 0.f || v != v);
      gv[e] = on ? v : 0.f;
      if (on) any |= 1u << (g + 8 * (e >> 1));
    }
    gsave[lane] = make_float4(gv[0], gv[1], gv[2], gv[3]);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) any |= __shfl_xor_sync(0xffffffffu, any, o);
    if (lane == 0) live_up = any;
#if __CUDA_ARCH__ >= 900
    if (lane < 16 && (any >> lane & 1))  // for gemv_down, next
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(down + (size_t)(j0 + lane) * d), "r"(d * 2)
                   : "memory");
#endif
  }
  __syncthreads();
  const u32 live = live_up;
  float uc[4] = {1.f, 1.f, 1.f, 1.f};
  if (GATED && live) {
    // mma_sum's barriers come after every warp's last read of the gate rows.
    uc[0] = uc[1] = uc[2] = uc[3] = 0.f;
    for (int c0 = 0; c0 < d; c0 += kc) {
      int s0, s1;
      act_steps(d, c0, kc, s0, s1);
      slab_load(sl, ld, up, j0, live, d, c0, min(kc, d - c0), bar, pol);
      if (d > kc) act_x(xv, x, m, d, c0, s0, s1);  // one chunk: the gate pass's are still here
      slab_wait(bar, phase);
      act_mma(slab, ld, live, xv, s0, s1, uc);
      if (c0 + kc < d) __syncthreads();  // every warp is done with the chunk
    }
    mma_sum(uc, red);
  }
  if (warp != 0) return;
  const float4 gs = gsave[lane];
  const float gv[4] = {gs.x, gs.y, gs.z, gs.w};
  u32 n = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int t = 2 * q + (e & 1), j = j0 + g + 8 * (e >> 1);
    const bool on = live >> (g + 8 * (e >> 1)) & 1 && t < m && gv[e] != 0.f;
    if (t < m) h[(size_t)t * f + j] = on ? gv[e] * uc[e] : 0.f;
    n += on;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
  if (lane == 0) {
    reinterpret_cast<unsigned short*>(mask)[blockIdx.x] = (unsigned short)live;
    cnt[blockIdx.x] = n;
  }
}

// DOWN_COLS is the number of output columns of a gemv_down block (16: four
// times the blocks of 64-column ones, which left 100 of 132 SMs idle at d
// 2048).
#define DOWN_COLS 16

// down_group computes gemv_down's outputs in the DOWN_COLS columns of slice
// blk for the mg <= MB tokens of one group, whose h and mask gemv_act
// wrote, into rows ylist[0..mg) of y (rows 0..mg without a list). lists
// holds a list of 8 ceil(f/256) 32 ints per warp (8 warps).
template <int MB>
__device__ __forceinline__ void down_group(const float* __restrict__ h, const u32* __restrict__ mask,
                                           const u16* __restrict__ down, u16* __restrict__ y,
                                           const int* __restrict__ ylist, int mg, int d, int f, int* lists,
                                           float (*red)[MB][DOWN_COLS], int blk) {
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Warp w takes mask words w, w + 8, w + 16, ...: interleaved, so that
  // units that fire together (a calibrated MLP's hot units are its last
  // ones, hot.go) are spread over the warps rather than all left to one.
  const int words = f / 32;
  int* list = lists + warp * ((words + 7) / 8) * 32;
  // Lane l takes column c0 + l % 16 of the units at odd (l >= 16) or even
  // places of the warp's list: each row's 16 columns are one 32-byte sector.
  int c0 = blk * DOWN_COLS, col = c0 + (lane & 15), half = lane >> 4;
  const int len = list_units(mask, warp, words, 8, list);
  __syncwarp();
  float acc[MB];
#pragma unroll
  for (int t = 0; t < MB; ++t) acc[t] = 0.f;
  for (int i0 = half; i0 < len; i0 += 16) {
    int js[8];
    u16 dv[8];
    float hv[8][MB];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      js[k] = i0 + 2 * k < len ? list[i0 + 2 * k] : -1;
      if (js[k] < 0) continue;
      dv[k] = down[(size_t)js[k] * d + col];
#pragma unroll
      for (int t = 0; t < MB; ++t) hv[k][t] = t < mg ? __ldcg(h + (size_t)t * f + js[k]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if (js[k] < 0) continue;
#pragma unroll
      for (int t = 0; t < MB; ++t) acc[t] = fmaf(hv[k][t], bf_to_f(dv[k]), acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < MB; ++t) {
    float other = __shfl_down_sync(0xffffffffu, acc[t], 16);
    if (half == 0) red[warp][t][lane] = acc[t] + other;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < mg * DOWN_COLS; i += blockDim.x) {
    int t = i / DOWN_COLS, c = i % DOWN_COLS;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) s += red[w][t][c];
    size_t row = ylist ? (size_t)ylist[t] : (size_t)t;
    y[row * d + c0 + c] = (u16)f_to_bf(s);
  }
}

// sum_counts (block 0, every thread) sums the act kernel's n per-block
// counts into *nnz; all threads load them (one round trip for f <= 8192).
__device__ __forceinline__ void sum_counts(const u32* __restrict__ cnt, int n, u64* __restrict__ nnz) {
  __shared__ u32 part[8];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  u32 c = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) c += __ldcg(cnt + i);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if (lane == 0) part[warp] = c;
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 s = 0;
    for (int w = 0; w < 8; ++w) s += part[w];
    *nnz = s;
  }
}

// gemv_down: grid d/DOWN_COLS blocks of 256 threads. Warp w first lists
// the active units of its share of the mask (every eighth word) in shared
// memory (ascending; dynamic shared memory 8 * ceil(f/256) * 32 ints),
// then reads their down rows and h values eight units a half-warp at a
// time, so that a token's few dozen units cost a round trip or two rather
// than one per unit. Block 0 sums the ncnt per-block counts of the act
// kernel into *nnz.
template <int MB, bool LIST>
__global__ void __launch_bounds__(256)
    gemv_down(const float* __restrict__ h, const u32* __restrict__ mask, const u16* __restrict__ down,
              u16* __restrict__ y, const u32* __restrict__ cnt, u64* __restrict__ nnz, int m, int d, int f,
              int ncnt, const int* __restrict__ ylist, int first, int cap) {
  __shared__ float red[8][MB][DOWN_COLS];
  extern __shared__ int lists[];
  grid_wait();
  grid_release();
  if (LIST) {
    const int words = f / 32, total = listed(ylist, first, cap);
    for (int g0 = 0; g0 < total; g0 += MB) {
      if (g0 > 0) __syncthreads();  // the previous group's red has been read
      down_group<MB>(h + (size_t)g0 * f, mask + (size_t)(g0 / MB) * words, down, y, ylist + 1 + first + g0,
                     min(MB, total - g0), d, f, lists, red, blockIdx.x);
    }
    return;
  }
  down_group<MB>(h, mask, down, y, nullptr, m, d, f, lists, red, blockIdx.x);
  if (blockIdx.x == 0) sum_counts(cnt, ncnt, nnz);
}

// gemv_mlp: gemv_act (with NORM: gemv_act_norm) and gemv_down for one
// token in one kernel, the phases met at a grid_sync instead of a kernel
// boundary: grid F/32 blocks of 256 threads, launched cooperatively (every
// one resident at once; the launcher checks that they fit). The act phase
// requests the live units' down rows into the L2; after the barrier block
// b computes the down columns of slices b, b + grid, ... . The same sums in
// the same order as the two kernels: the same bits. Dynamic shared memory
// the larger of the act phase's d 2 bytes and the down phase's lists; bar
// is grid_sync's counter. y may be delta (written after the barrier,
// when every block has read it). (For 2 to 4 tokens the two kernels are
// faster: see docs/gpu-twell.md.)
template <bool GATED, bool NORM>
__global__ void __launch_bounds__(256)
    gemv_mlp(const u16* x, const float* resid, const u16* delta, float* resid_out, const float* normw, float eps,
             const u16* __restrict__ w, const u16* __restrict__ up, const u16* __restrict__ down, float* h, u32* mask,
             u32* cnt, u16* y, u64* nnz, u64* bar, int d, int f) {
  extern __shared__ __align__(16) u16 xs[];
  __shared__ u32 wmask[8], wcnt[8];
  __shared__ float red[8][1][DOWN_COLS];
  const NormIn nin = {resid, delta, resid_out, normw, eps};
  act_group<1, GATED, NORM>(x, nullptr, w, up, h, mask, cnt, 1, d, f, xs, wmask, wcnt, nin, down);
  grid_sync(bar);
  TL_MARK(TL_SYNCED);
  for (int b = blockIdx.x; b < d / DOWN_COLS; b += gridDim.x) {
    if (b != (int)blockIdx.x) __syncthreads();  // the previous slice's red has been read
    down_group<1>(h, mask, down, y, nullptr, 1, d, f, reinterpret_cast<int*>(xs), red, b);
  }
  TL_MARK_ALL(TL_END);
  if (blockIdx.x == 0) sum_counts(cnt, gridDim.x, nnz);
}
