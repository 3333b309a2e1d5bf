// d2t_wgmma.cu: D2T for Hopper (sm_90a): the gate GEMM C = x W^T with TMA
// loads, a 3-stage mbarrier pipeline, wgmma m64n256k16 tensor-core math,
// and ReLU + TwELL packing in the epilogue. Persistent: one CTA per SM,
// CTAs paired in clusters of 2 along M that share (multicast) the weight
// tile. Two consumer warpgroups each own 64 of the CTA tile's 128 rows and
// all 256 columns; a third warpgroup holds the TMA producer (one thread)
// and three packer warps. After each tile's mainloop the consumers store
// only each row's activity masks and the bf16 pairs that hold an active
// value into shared memory; the packer warps rank the active units from
// the masks and write the packed words while the consumers run the next
// tile's mainloop. Work items past the packed N tiles are the hot units'
// dense products (hot.go), from which the consumers store h = relu(g) u
// (gated: each item's weight tile is 128 gate rows and the same units' 128
// up rows) as bf16 instead. On an H100 at m = 65536 (d 2048, f 5632, 0.5%)
// it takes 2.17 ms (skewed firing rates, 256 hot units left out) and 2.14
// ms (uniform, all 22 tiles); the reference's D2T took 2.16 and 2.20 ms in
// the same run (scripts/race-reference.sh, 2026-12-06). Findings built in: with all 128 fp32 accumulators live into
// the next tile's mainloop, ptxas ran out of registers and serialized the
// wgmmas (warning C7511, 4.12 ms), so the epilogue finishes before it;
// releasing each stage with a cluster-scope arrive from one thread cost
// 27% (see release_stage); the first k step is peeled (see mainloop).
// Storing the whole tile as bf16 for the packers to scan (during the next
// tile's first k steps) took 2.38 and 2.48 ms on the same H100: the mask
// epilogue replaced it.
// Starting the second consumer warpgroup a k step behind the first, so that
// each one's epilogue overlaps the other's wgmmas, changed nothing (2.041
// against 2.045-2.061 ms skewed, 2.298 against 2.272-2.319 uniform, same
// H100 run).
// Storing each row's active values compactly (S - 1 bf16 slots a row, 8 KiB
// a tile) made the D2T slower (2.602 against 2.054 ms skewed, 3.087 against
// 2.282 uniform, H100; the running slot counters spilled 32 bytes), and the
// fourth stage that the freed memory held gained nothing over it (2.651 and
// 3.104 ms). Nor did the consumers writing the packed words themselves (each
// value at its rank from the quad's masks, shared by shuffles), with no
// packer warps, no tile buffer and 4 stages: the same words, but the D2T took
// 2.421-2.433 against 2.133-2.138 ms skewed and 2.405-2.435 against
// 2.385-2.400 uniform (H100), though the consumers of this kernel spend about
// 6% of their time waiting for the packers (tile_empty) and about 30% for
// stages to fill (ncu's warp-state samples). Each CTA of a pair loading the
// whole weight tile itself, so that no CTA waits for the other's consumers
// to free a stage, did not help either (D2T 2.106-2.107 against 2.066-2.068
// ms skewed, 2.330-2.338 against 2.326-2.345 uniform, H100).
// The consumers pack each cluster's last tile with the packers (8 of every
// 11 rows): nothing overlaps that tile's packing, which took the packer
// warps about 850 cycles a row (D2T at m = 4096 0.185 -> 0.178-0.180 ms
// uniform, 0.173 -> 0.165-0.166 skewed, H100). Measured and dropped in the
// same runs: six stages of 32 columns in the same memory (level at 4096,
// 2.448 against 2.338 ms at 65536 uniform) and each lane storing its own
// packed entries and zeros without a scratch row (0.192 against 0.178 ms
// at 4096 uniform, 2.667 against 2.385 at 65536). Storing each active
// value at its column-order rank (from the quad's masks, S slots a row)
// with a fourth stage in the freed memory lost too: 0.226 against 0.180
// ms at 4096 uniform, 2.86-2.90 against 2.39 at 65536 (H100), its
// epilogue about 4,100 instructions longer.
// Two changes that shortened the work a tile won together (H100, one
// process a build in turns, two rounds): each packer warp packs two rows at
// a time (pack_two_rows, the two rows' loads and ballots interleaved), and
// the consumers store each active pair as max(bf16 pair, 1) with one
// max.u16x2 instead of testing each half for a positive value under bf16's
// smallest subnormal (machine code 97.5 -> 86.5 KB; 95.7 KB with the
// two-row packer, whose code the packer warps run). D2T 0.162 against
// 0.181-0.182 ms at 4096 uniform, 2.197-2.214 against 2.306-2.343 at 65536
// skewed, 2.100-2.106 against 2.404-2.419 uniform; the store alone gave
// 0.172, 2.204-2.208 and 2.285-2.303. The two-row packer first hung, its
// setmaxnreg counts past the CTA's registers (see REG_PRODUCERS).
#include "common.cuh"
#include "wgmma.cuh"

#define WG_WAIT 1    // wgmma groups in flight across k steps
#define WG_GROUP 16  // M-tile pairs that sweep the N tiles together (4: 1.5% slower mainloop on an H200)

#define WG_BK 64
#define A_BYTES (128 * WG_BK * 2)  // 16 KiB
#define B_BYTES (256 * WG_BK * 2)  // 32 KiB

// mbar_arrive_cta arrives on the barrier at the same offset in CTA cta of
// the cluster (possibly this one), with .cta scope (a .release.cluster
// arrive from one thread for both CTAs cost 27%: see release_stage).
__device__ __forceinline__ void mbar_arrive_cta(u32 bar, u32 cta) {
  asm volatile(
      "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
      "r"(cta)
      : "memory");
}
// release_stage tells both CTAs of the pair that this warpgroup is done
// with stage bar: warps 0 and 1 of the warpgroup signal one CTA each, in
// parallel.
__device__ __forceinline__ void release_stage(u32 bar, int tid) {
  const int t = tid & 127;
  if (t == 0 || t == 32) mbar_arrive_cta(bar, (u32)(t >> 5));
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
__device__ __forceinline__ void fence_acc(float* acc) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// Work item w of a cluster: (pair of M tiles, N tile), in groups of G M-tile
// pairs that sweep the N tiles (L2 reuse of x rows and weights).
__device__ __forceinline__ void work_coords(int w, int m_pairs, int n_tiles, int& mp, int& nt) {
  const int G = WG_GROUP;
  int group = w / (G * n_tiles);
  int gm = min(G, m_pairs - group * G);
  int within = w - group * G * n_tiles;
  mp = group * G + within % gm;
  nt = within / gm;
}

// produce runs the TMA producer (one thread): for every work item of the
// cluster and k step, it waits for the stage to be free, then loads the
// CTA's 128 x 64 slice of x and its half of the 256 x 64 weight slice,
// multicast to both CTAs of the pair. A gated hot item h (nt = n_sparse +
// h) takes the 128 units from n_sparse * 256 + 128 h: rank 0 loads their
// gate rows, rank 1 their up rows.
template <int STAGES>
__device__ __forceinline__ void produce(const TmaDesc* tmA, const TmaDesc* tmB, const TmaDesc* tmU, u32 sA, u32 sB,
                                        u32 bars, u32 rank, int cluster, int nclusters, int m_pairs, int n_tiles,
                                        int n_sparse, bool hot_gated, int k_iters) {
  int s = 0;
  u32 phase = 0;
  for (int w = cluster; w < m_pairs * n_tiles; w += nclusters) {
    int mp, nt;
    work_coords(w, m_pairs, n_tiles, mp, nt);
    const bool pair = hot_gated && nt >= n_sparse;
    const TmaDesc* tw = pair && rank ? tmU : tmB;
    const int m0 = (mp * 2 + (int)rank) * 128;
    const int w0 = pair ? n_sparse * 256 + (nt - n_sparse) * 128 : nt * 256 + (int)rank * 128;
    for (int k = 0; k < k_iters; ++k) {
      const u32 full = bars + 8u * s, empty = bars + 8u * (STAGES + s);
      mbar_wait(empty, phase ^ 1u);
      mbar_expect_tx(full, A_BYTES + B_BYTES);
      tma_load(sA + s * A_BYTES, tmA, k * WG_BK, m0, full);
      tma_load_mc(sB + s * B_BYTES + rank * (B_BYTES / 2), tw, k * WG_BK, w0, full, (u16)0x3);
      if (++s == STAGES) {
        s = 0;
        phase ^= 1u;
      }
    }
  }
}

// mainloop accumulates one work item's 64 x 256 slice (rows cw*64..) over
// all k steps: wgmma on each stage as it fills, WG_WAIT groups in flight,
// each stage released to both CTAs of the pair once its wgmmas are done.
// The first k step is peeled: its first wgmma writes the accumulators without
// reading them (wgmma_m64n256k16_set). Without the peel, ptxas 12.4 kept
// the 128 accumulators live through the epilogue, spilled there, and
// serialized every wgmma (C7515); with it the four HGMMAs of a k step issue
// back to back with one group in flight, without spills (4.66 ms against
// 4.82 for the whole MLP at m = 65536, 0.5%, on an H200).
template <int STAGES>
__device__ __forceinline__ void mainloop(float (&acc)[128], u32 sA, u32 sB, u32 bars, int cw, int tid, int k_iters,
                                         int& s, u32& phase) {
  int prev = -1;
  auto step = [&](bool first) {
    mbar_wait(bars + 8u * s, phase);
    if (!first) fence_acc(acc);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    u64 da = sw128_desc(sA + s * A_BYTES + cw * 64 * 128);
    u64 db = sw128_desc(sB + s * B_BYTES);
    if (first)
      wgmma_m64n256k16_set(acc, da, db);
    else
      wgmma_m64n256k16(acc, da, db, 1);
#pragma unroll
    for (int kk = 1; kk < 4; ++kk) wgmma_m64n256k16(acc, da + 2 * kk, db + 2 * kk, 1);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(WG_WAIT) : "memory");
    fence_acc(acc);
    if (prev >= 0) release_stage(bars + 8u * (STAGES + prev), tid);
    prev = s;
    if (++s == STAGES) {
      s = 0;
      phase ^= 1u;
    }
  };
  step(true);
  for (int k = 1; k < k_iters; ++k) step(false);
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  fence_acc(acc);
  if (prev >= 0) release_stage(bars + 8u * (STAGES + prev), tid);
}

// Epilogue buffers in shared memory: the tile's active values as bf16
// pairs, 128 rows of 256 values, rows PIPE_LD words apart (padded by 4
// words: the quad-wise stores of a warp hit 32 distinct banks); two S-word
// scratch rows for each warp that packs (PIPE_LAST: the packer warps, and
// the consumer warps on a cluster's last tile); the rows' activity masks,
// 8 words a row.
#define PIPE_LD 132
#define PIPE_TILE (128 * PIPE_LD * 4)
#define PIPE_PACKERS 3
#define PIPE_LAST (PIPE_PACKERS + 8)  // warps that pack the cluster's last tile: the packers and the consumers
#define PIPE_MASKS (128 * 8 * 4)

// Registers a thread after setmaxnreg: the producer's warpgroup (producer
// and packer warps) gives some to the two consumer warpgroups. Together
// they must stay within the CTA's pool, 384 threads at the 168 registers
// __launch_bounds__(384, 1) leaves; a setmaxnreg.inc past the pool waits
// for registers that never come, and the kernel hangs.
#define REG_PRODUCERS 72
#define REG_CONSUMERS 216
static_assert(128 * REG_PRODUCERS + 256 * REG_CONSUMERS <= 384 * 168, "setmaxnreg past the CTA's registers");

// pack_two_rows packs rows ra and rb of the tile (one warp; they may be the
// same row) into outa and outb, S words each: masks holds each row's
// activity as 8 words, quad lane q's 64-bit mask in words 2q and 2q + 1
// (bit 2i + e: column 8i + 2q + e, as in acc_to_bf), and tile only the bf16
// pairs that hold an active value (word 4i + q of a row: columns 8i + 2q
// and 8i + 2q + 1). Lane l takes columns 8l..8l+7; ranks come from ballots
// of the lanes' counts, not a shuffle scan. The entries go through erow
// (2S words, zero on entry and on return), the two rows' work interleaved
// so that their loads and ballots overlap. Sets the true counts and
// whether an active value is NaN or Inf.
template <int S>
__device__ __forceinline__ void pack_two_rows(const u32* masks, const u32* tile, u32* erow, u32* outa, u32* outb,
                                              int ra, int rb, int n0, int& na, int& nb, bool& bada, bool& badb) {
  const int lane = threadIdx.x & 31, w = lane >> 4, sh = (2 * lane) & 31;
  u32 ma = 0, mb = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    ma |= ((masks[ra * 8 + 2 * q + w] >> sh) & 3u) << (2 * q);
    mb |= ((masks[rb * 8 + 2 * q + w] >> sh) & 3u) << (2 * q);
  }
  const u32 ca = __popc(ma), cb = __popc(mb);
  const u32 a0 = __ballot_sync(0xffffffffu, ca & 1u), a1 = __ballot_sync(0xffffffffu, ca & 2u),
            a2 = __ballot_sync(0xffffffffu, ca & 4u), a3 = __ballot_sync(0xffffffffu, ca & 8u);
  const u32 b0 = __ballot_sync(0xffffffffu, cb & 1u), b1 = __ballot_sync(0xffffffffu, cb & 2u),
            b2 = __ballot_sync(0xffffffffu, cb & 4u), b3 = __ballot_sync(0xffffffffu, cb & 8u);
  na = __popc(a0) + 2 * __popc(a1) + 4 * __popc(a2) + 8 * __popc(a3);
  nb = __popc(b0) + 2 * __popc(b1) + 4 * __popc(b2) + 8 * __popc(b3);
  const u32 lt = (1u << lane) - 1u;
  int rka = __popc(a0 & lt) + 2 * __popc(a1 & lt) + 4 * __popc(a2 & lt) + 8 * __popc(a3 & lt);
  int rkb = __popc(b0 & lt) + 2 * __popc(b1 & lt) + 4 * __popc(b2 & lt) + 8 * __popc(b3 & lt);
  bool bla = false, blb = false;
  const u32* ta = tile + ra * PIPE_LD + 4 * lane;
  const u32* tb = tile + rb * PIPE_LD + 4 * lane;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if ((ma >> k) & 1u) {
      const u32 v = (ta[k >> 1] >> (16 * (k & 1))) & 0xffffu;
      bla |= (v & 0x7fffu) >= 0x7f80u;
      if (rka < S - 1) erow[1 + rka] = (v << 16) | (u32)(n0 + 8 * lane + k);
      ++rka;
    }
    if ((mb >> k) & 1u) {
      const u32 v = (tb[k >> 1] >> (16 * (k & 1))) & 0xffffu;
      blb |= (v & 0x7fffu) >= 0x7f80u;
      if (rkb < S - 1) erow[S + 1 + rkb] = (v << 16) | (u32)(n0 + 8 * lane + k);
      ++rkb;
    }
  }
  bada = __any_sync(0xffffffffu, bla);
  badb = __any_sync(0xffffffffu, blb);
  __syncwarp();
#pragma unroll
  for (int i = lane; i < S; i += 32) {
    outa[i] = (i == 0) ? (u32)na : erow[i];
    outb[i] = (i == 0) ? (u32)nb : erow[S + i];
  }
  __syncwarp();
#pragma unroll
  for (int i = lane; i < 2 * S; i += 32) erow[i] = 0u;
  __syncwarp();
}

// pack_rows packs rows r0, r0 + stride, ... of the tile at rows m0.. and N
// tile nt (one warp; erow its 2S-word scratch), two at a time, flags the
// rows that overflow or hold NaN or Inf, and returns the active values of
// the valid rows (the same count on every lane).
template <int S>
__device__ __forceinline__ u64 pack_rows(const u32* masks, const u32* tile, u32* erow, u32* __restrict__ packed,
                                         int* __restrict__ flags, int* __restrict__ ovf, int m0, int nt,
                                         int row_words, int m_valid, int r0, int stride) {
  const int lane = threadIdx.x & 31;
  u64 sum = 0;
  for (int r = r0; r < 128; r += 2 * stride) {
    const int r2 = r + stride < 128 ? r + stride : r;  // past the rows: row r again, the same words
    int na, nb;
    bool bada, badb;
    pack_two_rows<S>(masks, tile, erow, packed + (size_t)(m0 + r) * row_words + nt * S,
                     packed + (size_t)(m0 + r2) * row_words + nt * S, r, r2, nt * 256, na, nb, bada, badb);
    if (m0 + r < m_valid) {
      sum += (u64)na;
      if (lane == 0 && (bada || na > S - 1)) flag_row(flags, ovf, m0 + r);
    }
    if (r2 != r && m0 + r2 < m_valid) {
      sum += (u64)nb;
      if (lane == 0 && (badb || nb > S - 1)) flag_row(flags, ovf, m0 + r2);
    }
  }
  return sum;
}

// store_hot writes the hot units' h of a hot item as bf16, computed as the
// dense path computes it from cuBLASLt's bf16 products (gate and up
// rounded to bf16 first, then relu_mul's or relu_inplace's arithmetic: the
// same bits from the same rounded products), and returns how many of the thread's units fired (gate >
// 0), as those kernels count. The thread's rows are row0 and row0 + 8 of
// out (ld values a row; rows from m_valid on are neither stored nor
// counted), its columns 8i + 2tq and 8i + 2tq + 1 from acc[4i + 2h] and
// acc[4i + 2h + 1] (h: the row). Gated, columns 0..127 of the accumulator
// are the gate's and 128..255 the same units' up products, so each thread
// holds both factors of its 32 values of h (i < 16); otherwise all 256 are
// the up products, h = relu(u).
template <bool GATED>
__device__ __forceinline__ u32 store_hot(const float (&acc)[128], u16* __restrict__ out, int ld, int row0, int tq,
                                         int m_valid) {
  u32 fired = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    if (row >= m_valid) continue;
    u32* dst = (u32*)(out + (size_t)row * ld) + tq;
#pragma unroll
    for (int i = 0; i < (GATED ? 16 : 32); ++i) {
      const u32 g = cvt_bf2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]);
      const float g0 = bf_lo(g), g1 = bf_hi(g);
      fired += (g0 > 0.f) + (g1 > 0.f);
      u32 v;
      if (GATED) {
        const u32 u = cvt_bf2(acc[4 * (i + 16) + 2 * h], acc[4 * (i + 16) + 2 * h + 1]);
        v = pack_bf2(fmaxf(g0, 0.f) * bf_lo(u), fmaxf(g1, 0.f) * bf_hi(u));
      } else {
        v = pack_bf2(fmaxf(g0, 0.f), fmaxf(g1, 0.f));
      }
      dst[4 * i] = v;
    }
  }
  return fired;
}

// d2t_wgmma: see the top of the file. Work items of N tiles from n_sparse
// on are the n_hot hot units' (the rows of the weights after the packed
// ones; hot.go): with SeparateHot cuBLASLt computes their products instead,
// and n_hot is 0. Gated (hot_gated), n_hot / 128 items of 128 units each,
// whose weight tiles are their gate rows (tmB) and their up rows (tmU);
// else n_hot / 256 items of the up rows' tiles (tmB). Their epilogue
// writes h (store_hot) to hot_h (m_valid rows of n_hot values) in place of
// packing it, and counts the hot units that fired into nnz. n_tiles
// counts every item's tile.
template <int S, int STAGES>
__global__ void __launch_bounds__(384, 1)
    d2t_wgmma(const __grid_constant__ TmaDesc tmA, const __grid_constant__ TmaDesc tmB,
              const __grid_constant__ TmaDesc tmU, u32* __restrict__ packed, int* __restrict__ flags,
              int* __restrict__ ovf, u64* __restrict__ nnz, u16* __restrict__ hot_h, int hot_gated, int m_pairs,
              int n_tiles, int n_sparse, int n_hot, int k_iters, int row_words, int m_valid) {
  extern __shared__ unsigned char smem_raw[];
  u32 raw = smem_addr(smem_raw);
  u32 base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const u32 sA = base, sB = base + STAGES * A_BYTES;
  u32* tile = (u32*)(smem + STAGES * (A_BYTES + B_BYTES));
  u32* erows = tile + 128 * PIPE_LD;  // 2 x PIPE_LAST x S words
  u32* masks = erows + 2 * PIPE_LAST * S;  // 128 rows x 8 words
  // full[STAGES], empty[STAGES], tile_full, tile_empty
  const u32 bars = base + STAGES * (A_BYTES + B_BYTES) + PIPE_TILE + 2 * PIPE_LAST * S * 4 + PIPE_MASKS;
  const u32 tile_full = bars + 8u * (2 * STAGES), tile_empty = tile_full + 8u;

  const int tid = threadIdx.x;
  const int wg = (tid / 128 + 2) % 3;  // 0, 1: consumers; 2: producer warp + packer warps
  const u32 rank = cluster_rank();
  const int cluster = blockIdx.x / 2, nclusters = gridDim.x / 2;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars + 8u * s, 1);
      mbar_init(bars + 8u * (STAGES + s), 4);  // 2 consumer warpgroups x 2 CTAs
    }
    mbar_init(tile_full, 256);
    mbar_init(tile_empty, PIPE_PACKERS);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int i = tid; i < 2 * PIPE_LAST * S; i += 384) erows[i] = 0;
  __syncthreads();
  cluster_sync();

  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REG_PRODUCERS));
    const int warp = (tid >> 5) & 3, lane = tid & 31;
    if (warp == 0) {
      if (lane == 0)
        produce<STAGES>(&tmA, &tmB, &tmU, sA, sB, bars, rank, cluster, nclusters, m_pairs, n_tiles, n_sparse,
                        hot_gated != 0, k_iters);
    } else {
      const int pw = warp - 1;
      u32* erow = erows + 2 * pw * S;
      u64 sum = 0;
      u32 tphase = 0;
      for (int w = cluster; w < m_pairs * n_tiles; w += nclusters) {
        int mp, nt;
        work_coords(w, m_pairs, n_tiles, mp, nt);
        if (nt >= n_sparse) continue;  // a hot tile: its consumers store it
        mbar_wait(tile_full, tphase);
        // The consumers help with the cluster's last tile (pack_rows).
        const bool last = w + nclusters >= m_pairs * n_tiles;
        sum += pack_rows<S>(masks, tile, erow, packed, flags, ovf, (mp * 2 + (int)rank) * 128, nt, row_words, m_valid,
                            pw, last ? PIPE_LAST : PIPE_PACKERS);
        __syncwarp();
        if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(tile_empty) : "memory");
        tphase ^= 1u;
      }
      if (lane == 0 && sum) atomicAdd(nnz, sum);
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REG_CONSUMERS));
    const int cw = wg;
    const int lane = tid & 31, wq = (tid >> 5) & 3;
    float acc[128];
    int s = 0;
    u32 phase = 0, tphase = 0, fired = 0;
    // The thread's two tile rows (word 4i of each: its bf16 pair i) and
    // their mask words (u64 q of the row: quad lane q's 64 bits).
    u32* trow0 = tile + (cw * 64 + wq * 16 + (lane >> 2)) * PIPE_LD + (lane & 3);
    u32* trow1 = trow0 + 8 * PIPE_LD;
    u64* mrow0 = (u64*)(masks + (cw * 64 + wq * 16 + (lane >> 2)) * 8) + (lane & 3);
    u64* mrow1 = mrow0 + 8 * 4;
    int last_mp = -1, last_nt = 0;  // the cluster's last item, when packed
    for (int w = cluster; w < m_pairs * n_tiles; w += nclusters) {
      mainloop<STAGES>(acc, sA, sB, bars, cw, tid, k_iters, s, phase);
      int mp, nt;
      work_coords(w, m_pairs, n_tiles, mp, nt);
      last_mp = -1;
      if (nt >= n_sparse) {
        const int row0 = (mp * 2 + (int)rank) * 128 + cw * 64 + wq * 16 + (lane >> 2), h = nt - n_sparse;
        if (hot_gated)
          fired += store_hot<true>(acc, hot_h + h * 128, n_hot, row0, lane & 3, m_valid);
        else
          fired += store_hot<false>(acc, hot_h + h * 256, n_hot, row0, lane & 3, m_valid);
        continue;
      }
      u64 mk[2] = {0ull, 0ull};
#pragma unroll
      for (int i = 0; i < 32; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (!(acc[4 * i + 2 * h + e] <= 0.f)) mk[h] |= 1ull << (2 * i + e);  // > 0, or NaN
      // The masks live in registers: only their stores wait for the packers
      // to be done with the tile before.
      mbar_wait(tile_empty, tphase ^ 1u);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if ((mk[h] >> (2 * i)) & 3ull) {
            // The packers read a half only where its value is active (> 0
            // or NaN), where a zero can only be a positive value under
            // bf16's smallest subnormal: max(half, 1) stores that one.
            u32 p = cvt_bf2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]);
            asm("max.u16x2 %0, %0, %1;" : "+r"(p) : "r"(0x00010001u));
            (h ? trow1 : trow0)[4 * i] = p;
          }
        }
      }
      *mrow0 = mk[0];
      *mrow1 = mk[1];
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(tile_full) : "memory");
      tphase ^= 1u;
      last_mp = mp;
      last_nt = nt;
    }
    fired = __reduce_add_sync(0xffffffffu, fired);
    u64 sum = fired;
    if (last_mp >= 0) {
      // No mainloop is left to overlap the packers' work on the last tile,
      // so the consumer warps take 8 of every PIPE_LAST rows of it.
      mbar_wait(tile_full, tphase ^ 1u);
      sum += pack_rows<S>(masks, tile, erows + 2 * (PIPE_PACKERS + cw * 4 + wq) * S, packed, flags, ovf,
                          (last_mp * 2 + (int)rank) * 128, last_nt, row_words, m_valid,
                          PIPE_PACKERS + cw * 4 + wq, PIPE_LAST);
    }
    if (lane == 0 && sum) atomicAdd(nnz, sum);
  }
  __syncwarp();
  cluster_sync();
}
