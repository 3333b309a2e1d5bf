// stepstream.cu: how fast one persistent kernel can stream a one-token
// decode step's weights (a model's layers in order) through shared memory
// while its blocks meet at grid barriers between the phases, as a kernel
// that runs a whole decode step (every layer) in one launch would.
//
// One block per SM: warp 8 (the producer) copies the block's share of each
// phase's rows, 4 rows (16 KB) at a time, into a ring of NS slots with bulk
// asynchronous copies, ahead of the consumers by up to NS slots and across
// the barriers (the rows do not depend on the activations); warps 0-7 (the
// consumers) take each slot's dot products with x and free the slot. Per
// layer four streamed phases (q/k/v rows, a KV cache's keys and values, the
// output projection's rows, the gate rows) and a fifth of scattered 32-byte
// reads (the down rows of a token's active units). The bits of mode pick
// what a real step's dependencies add: SS_SYNC ends each phase with a grid
// barrier of the consumers, SS_STAGE then has them read x again through the
// L2 (as a real step reads the phase before's results), SS_DOWN makes the
// scattered reads, SS_LAYER keeps only the barrier at each layer's end,
// SS_NOFENCE leaves out the barrier's __threadfence (the arrival's release
// still orders what the block wrote before it).
#include "common.cuh"

#define SS_D 2048
#define SS_ROWS 4
#define SS_CHUNK (SS_ROWS * SS_D * 2)
#define SS_CONS 8
#define SS_PHASES 4
#define SS_ACTIVE 28
#define SS_SYNC 1
#define SS_STAGE 2
#define SS_DOWN 4
#define SS_LAYER 8
#define SS_NOFENCE 16

// SSLayer is one layer's streamed rows: q/k/v, keys and values, output
// projection, gate; each nc[p] chunks of 4 rows of SS_D bf16.
struct SSLayer {
  const u16* base[SS_PHASES];
};

__device__ __forceinline__ void cons_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// cons_grid_sync is grid_sync among the consumer warps only (the producer
// runs ahead and never meets them); fence: with grid_sync's __threadfence.
__device__ __forceinline__ void cons_grid_sync(u64* cnt, bool fence) {
  cons_sync();
  if (threadIdx.x == 0) grid_arrive_wait(cnt, fence);
  cons_sync();
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void stage(u16* xs, const u16* __restrict__ x) {
  for (int i = threadIdx.x; i < SS_D / 8; i += SS_CONS * 32) ((uint4*)xs)[i] = __ldcg((const uint4*)x + i);
  cons_sync();
}

// step_stream: grid = one block per SM, 288 threads, dynamic shared memory
// NS * 16 KB + 4 KB. out[((l * total + poff[p] + c) * 8 + w] is consumer
// warp w's half-row dot product of chunk c of phase p of layer l (row w/2,
// columns (w%2)*1024 ..); sink[block * 56 + t] keeps thread t's scattered reads alive.
template <int NS>
__global__ void __launch_bounds__(288, 1)
    step_stream(const SSLayer* __restrict__ layers, int nl, int n0, int n1, int n2, int n3, const u16* __restrict__ x,
                float* __restrict__ out, float* __restrict__ sink, u64* cnt, int mode) {
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) u64 bars[2 * NS];
  u16* ring = (u16*)sm;
  u16* xs = (u16*)(sm + NS * SS_CHUNK);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int G = gridDim.x, b = blockIdx.x;
  const int nc[SS_PHASES] = {n0, n1, n2, n3};
  const int total = n0 + n1 + n2 + n3;
  const u32 full0 = smem_addr(&bars[0]), empty0 = smem_addr(&bars[NS]);
  if (threadIdx.x == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, SS_CONS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == SS_CONS) {
    if (lane != 0) return;
    const u32 ring0 = smem_addr(ring);
    int i = 0;
    for (int l = 0; l < nl; ++l)
      for (int p = 0; p < SS_PHASES; ++p) {
        const u16* base = layers[l].base[p];
        for (int c = b; c < nc[p]; c += G, ++i) {
          const int s = i % NS, k = i / NS;
          if (k > 0) mbar_wait(empty0 + 8 * s, (k - 1) & 1);
          mbar_expect_tx(full0 + 8 * s, SS_CHUNK);
          asm volatile(
              "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                  ring0 + s * SS_CHUNK),
              "l"(base + (size_t)c * SS_ROWS * SS_D), "r"(SS_CHUNK), "r"(full0 + 8 * s)
              : "memory");
        }
      }
    return;
  }
  const int row = warp >> 1, half = warp & 1;
  float kept = 0.f;
  int i = 0;
  stage(xs, x);
  for (int l = 0; l < nl; ++l) {
    int poff = 0;
    for (int p = 0; p < SS_PHASES; ++p) {
      if ((mode & SS_STAGE) && (l > 0 || p > 0)) stage(xs, x);
      for (int c = b; c < nc[p]; c += G, ++i) {
        const int s = i % NS, k = i / NS;
        mbar_wait(full0 + 8 * s, k & 1);
        const u16* r = ring + s * (SS_ROWS * SS_D) + row * SS_D + half * (SS_D / 2);
        const u16* xv = xs + half * (SS_D / 2);
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < SS_D / 2 / 256; ++j)
          acc = dot8(*(const uint4*)(r + j * 256 + lane * 8), *(const uint4*)(xv + j * 256 + lane * 8), acc);
        acc = warp_sum(acc);
        __syncwarp();
        if (lane == 0) {
          out[((size_t)l * total + poff + c) * 8 + warp] = acc;
          mbar_arrive(empty0 + 8 * s);
        }
      }
      poff += nc[p];
      if ((mode & SS_SYNC) && !(mode & SS_LAYER)) cons_grid_sync(cnt, !(mode & SS_NOFENCE));
    }
    // The down phase: SS_ACTIVE scattered 32-byte reads of the gate rows.
    if ((mode & SS_DOWN) && threadIdx.x < SS_ACTIVE * 2) {
      const u32 h = (u32)(l * 977 + (threadIdx.x >> 1) * 7919 + b * 131) * 2654435761u;
      const int rowsTotal = nc[3] * SS_ROWS;
      const u16* src = layers[l].base[3] + (size_t)(h % (u32)max(rowsTotal, 1)) * SS_D + (b * 16 % SS_D) +
                       (threadIdx.x & 1) * 8;
      uint4 v = __ldcg((const uint4*)src);
      kept += bf_lo(v.x) + bf_hi(v.w);
    }
    if (mode & SS_SYNC) cons_grid_sync(cnt, !(mode & SS_NOFENCE));
  }
  if (threadIdx.x < SS_ACTIVE * 2) sink[b * SS_ACTIVE * 2 + threadIdx.x] = kept;
}

// ss_fill writes n bf16 values in [-1, 1) from a hash of (seed, index).
extern "C" __global__ void ss_fill(u16* p, size_t n, u32 seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    u32 h = (u32)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = (u16)(__float_as_uint((float)(h >> 8) * (2.f / 16777216.f) - 1.f) >> 16);
  }
}
