// d2t_wgmma.cu: D2T for Hopper (sm_90a): the gate GEMM C = x W^T with TMA
// loads, a 4-stage mbarrier pipeline, wgmma m64n256k16 tensor-core math,
// and ReLU + TwELL packing in the epilogue. Persistent: one CTA per SM,
// CTAs paired in clusters of 2 along M that share (multicast) the weight
// tile. Two consumer warpgroups each own 64 of the CTA tile's 128 rows and
// all 256 columns. The TMA producer is, by the template parameter PW:
//   PW = 0: a fourth warpgroup (384 threads) that gives its registers to the
//           consumers with setmaxnreg 40/232. Measured on an H200: ptxas kept
//           the 168-register budget of 384 threads and serialized the
//           wgmmas (warning C7511): 367 TFLOP/s.
//   PW = 1: one producer warp (288 threads). Measured: still 168 registers
//           (three warps share an SM sub-partition's 16K registers).
// The C7511 serialization came from the epilogue keeping all 128 fp32
// accumulators live while packing; it now converts them to 64 bf16 pairs
// first.
#include "common.cuh"
#include "wgmma.cuh"

// Build-time variants, for timing experiments (see TestD2TVariants):
// TW_EPI 0 skips the packing (mainloop cost alone; the output is wrong),
// TW_WAIT is how many wgmma groups stay in flight across k steps,
// TW_GROUP is how many M-tile pairs sweep the N tiles together.
#ifndef TW_EPI
#define TW_EPI 1
#endif
#ifndef TW_WAIT
#define TW_WAIT 1
#endif
#ifndef TW_NNZ
#define TW_NNZ 1  // 0: no active-unit counter (its atomics' cost)
#endif
#ifndef TW_GROUP
#define TW_GROUP 4
#endif

#define WG_BK 64
#define A_BYTES (128 * WG_BK * 2)  // 16 KiB
#define B_BYTES (256 * WG_BK * 2)  // 32 KiB

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// mbar_arrive_cta arrives on the barrier at the same offset in CTA cta of
// the cluster (possibly this one).
__device__ __forceinline__ void mbar_arrive_cta(u32 bar, u32 cta) {
  asm volatile(
      "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
      "r"(cta)
      : "memory");
}
__device__ __forceinline__ void tma_load(u32 dst, const TmaDesc* tm, int c0, int c1, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(tm), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_mc(u32 dst, const TmaDesc* tm, int c0, int c1, u32 bar, u16 mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
      "{%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(tm), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
      : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Shared memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups
// 1024 bytes apart.
__device__ __forceinline__ u64 smem_desc(u32 addr) {
  u64 d = (u64)((addr & 0x3FFFFu) >> 4);
  d |= (u64)1 << 16;             // leading byte offset (unused for swizzled K-major)
  d |= (u64)(1024 >> 4) << 32;  // stride byte offset
  d |= (u64)1 << 62;             // 128B swizzle
  return d;
}
__device__ __forceinline__ void fence_acc(float* acc) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// Work item w of a cluster: (pair of M tiles, N tile), in groups of G M-tile
// pairs that sweep the N tiles (L2 reuse of x rows and weights).
__device__ __forceinline__ void work_coords(int w, int m_pairs, int n_tiles, int& mp, int& nt) {
  const int G = TW_GROUP;
  int group = w / (G * n_tiles);
  int gm = min(G, m_pairs - group * G);
  int within = w - group * G * n_tiles;
  mp = group * G + within % gm;
  nt = within / gm;
}

template <int S, int STAGES, int PW>
__global__ void __launch_bounds__(PW ? 288 : 384, 1)
    d2t_wgmma(const __grid_constant__ TmaDesc tmA, const __grid_constant__ TmaDesc tmB, u32* __restrict__ packed,
              int* __restrict__ flags, int* __restrict__ ovf, u64* __restrict__ nnz, int m_pairs, int n_tiles,
              int k_iters, int row_words, int m_valid) {
  extern __shared__ unsigned char smem_raw[];
  // Align to 1024 bytes (128B swizzle atoms).
  u32 raw = smem_addr(smem_raw);
  u32 base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const u32 sA = base, sB = base + STAGES * A_BYTES;
  u32* stage_out = (u32*)(smem + STAGES * (A_BYTES + B_BYTES));
  const u32 bars = base + STAGES * (A_BYTES + B_BYTES) + 128 * S * 4;  // full[STAGES], empty[STAGES]
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (STAGES + s); };

  const int tid = threadIdx.x;
  const int wg = PW ? tid / 128 : (tid / 128 + 2) % 3;  // 0, 1: consumers; 2: the producer
  const int ctid = PW ? tid : tid - 128;                 // thread index among the 256 consumers
  const int nthreads = PW ? 288 : 384;
  const u32 rank = cluster_rank();
  const int cluster = blockIdx.x / 2, nclusters = gridDim.x / 2;
  const int total = m_pairs * n_tiles;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 4);  // 2 consumer warpgroups x 2 CTAs
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int i = tid; i < 128 * S; i += nthreads) stage_out[i] = 0;
  __syncthreads();
  cluster_sync();

  if (wg == 2) {
    if (!PW) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == (PW ? 256 : 0)) {
      int s = 0;
      u32 phase = 0;
      for (int w = cluster; w < total; w += nclusters) {
        int mp, nt;
        work_coords(w, m_pairs, n_tiles, mp, nt);
        int m0 = (mp * 2 + (int)rank) * 128, n0 = nt * 256;
        for (int k = 0; k < k_iters; ++k) {
          mbar_wait(empty(s), phase ^ 1u);
          mbar_expect_tx(full(s), A_BYTES + B_BYTES);
          tma_load(sA + s * A_BYTES, &tmA, k * WG_BK, m0, full(s));
          tma_load_mc(sB + s * B_BYTES + rank * (B_BYTES / 2), &tmB, k * WG_BK, n0 + (int)rank * 128, full(s),
                      (u16)0x3);
          if (++s == STAGES) {
            s = 0;
            phase ^= 1u;
          }
        }
      }
    }
  } else {
    if (!PW) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int cw = wg;  // rows cw*64 .. cw*64+63 of the CTA tile
    const int lane = tid & 31, wq = (tid >> 5) & 3;
    float acc[128];
    int s = 0;
    u32 phase = 0;
    for (int w = cluster; w < total; w += nclusters) {
      int mp, nt;
      work_coords(w, m_pairs, n_tiles, mp, nt);
      int m0 = (mp * 2 + (int)rank) * 128, n0 = nt * 256;
      int prev = -1;
      for (int k = 0; k < k_iters; ++k) {
        mbar_wait(full(s), phase);
        fence_acc(acc);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        u64 da = smem_desc(sA + s * A_BYTES + cw * 64 * 128);
        u64 db = smem_desc(sB + s * B_BYTES);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16(acc, da + 2 * kk, db + 2 * kk, (k > 0 || kk > 0) ? 1 : 0);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(TW_WAIT) : "memory");
        fence_acc(acc);
        if (prev >= 0 && (tid & 127) == 0) {
          mbar_arrive_cta(empty(prev), 0);
          mbar_arrive_cta(empty(prev), 1);
        }
        prev = s;
        if (++s == STAGES) {
          s = 0;
          phase ^= 1u;
        }
      }
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      fence_acc(acc);
      if (prev >= 0 && (tid & 127) == 0) {
        mbar_arrive_cta(empty(prev), 0);
        mbar_arrive_cta(empty(prev), 1);
      }

      // Epilogue: ReLU + pack into the staging tile, then copy it out.
      u32 hb[64];
      u64 mask[2];
      acc_to_bf(acc, hb, mask);
      int tot = 0;
#pragma unroll
      for (int h = 0; h < 2 * TW_EPI; ++h) {
        int r = cw * 64 + wq * 16 + (lane >> 2) + 8 * h;
        int row = m0 + r;
        auto bits = [&](int i, int e) { return (hb[32 * h + i] >> (16 * e)) & 0xffffu; };
        int n = pack_row_epilogue<S>(mask[h], bits, stage_out + r * S, n0, row, row < m_valid, flags, ovf);
        tot += ((lane & 3) == 0 && row < m_valid) ? n : 0;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
      if (TW_NNZ && lane == 0 && tot) atomicAdd(nnz, (u64)tot);
      asm volatile("bar.sync 1, 256;" ::: "memory");
      const int v4 = S / 4;
      for (int i = ctid; i < 128 * v4; i += 256) {
        int r = i / v4, c = i - r * v4;
        uint4* src = (uint4*)(stage_out + r * S) + c;
        uint4 val = *src;
        uint4 z;
        z.x = z.y = z.z = z.w = 0u;
        *src = z;
        *(uint4*)(packed + (size_t)(m0 + r) * row_words + nt * S + c * 4) = val;
      }
      asm volatile("bar.sync 1, 256;" ::: "memory");
    }
  }
  __syncwarp();
  cluster_sync();
}
