// attention_wgmma.cu: the Hopper (sm_90a) kernels of the training
// attention for head size 64 (package gpu/trainer compiles it only for
// sm_90a): attn_fwd_wg, the forward, attn_bwd_dkdv_wg, the dK/dV kernel,
// and attn_bwd_dq_wg, the dQ kernel. Same interfaces, work and results as
// attn_fwd<64>, attn_bwd_dkdv<64, 64> and attn_bwd_dq<64> in attention.cu;
// the products run on wgmma instead of mma.sync.
//
// attn_bwd_dkdv_wg:
// One CTA of one warpgroup per (64-key block, kv head, sequence b0 + z), the
// longest first; warp w owns keys 16w .. 16w+15 (the m64 rows of every
// product), its dK and dV in fp32 registers. The CTA walks the query heads
// of its group and, for each, the 64-query blocks from its first key on, Q,
// dO, lse and D through a two-stage cp.async pipeline. Every tile is 64 rows
// of 64 bf16 with the 128-byte swizzle: K, V, Q and dO are K-major in
// S^T = K Q^T and dP^T = V dO^T (reduction over the head), and Q and dO are
// MN-major in dV += P^T dO and dK += dS^T Q (reduction over the queries),
// whose A operands, P^T and dS^T in bf16, come from registers (the
// accumulator layout of S^T is the A fragment layout). The lse and D rows
// come with the stage's cp.async group. dS^T goes to attn_bwd_dq_wg
// through a shared tile (stmatrix) that one thread copies out whole
// (cp.async.bulk): its rows in the 128-byte swizzle, so that the dQ kernel
// copies it back into a wgmma operand tile as it is, and the stores use
// every byte of their sectors (the lanes' 4-byte stores used 18 of 32).

#include "mma.cuh"
#include "wgmma.cuh"
#include "attention.cuh"

#define LOG2E_WG 1.4426950408889634f

// wg_load_tile queues cp.async copies of rows [r0, r0 + 64) of a [row][64]
// bf16 matrix (src, pitch elements a row) into the swizzled tile at dst,
// zero-filling rows at or past lim. All 128 threads take part.
__device__ __forceinline__ void wg_load_tile(u32 dst, const u16* __restrict__ src, size_t pitch, int r0, int lim) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int idx = i * 128 + threadIdx.x, r = idx >> 3, c = idx & 7;
    const bool ok = r0 + r < lim;
    cp_async16(dst + swz(r, c), src + (size_t)(ok ? r0 + r : 0) * pitch + c * 8, ok);
  }
}

// wg_probs turns the lane's scores and dP of 32 queries (columns qc0 on of
// the block from query q0; keys key0 and key0 + 8) into P and dS = P (dP -
// D) in place: p = exp2(s scale_log2 - lse log2 e), with l2 and dd the
// block's lse and D; where MASK, p = 0 for a key after the query or a query
// past the sequence.
template <bool MASK>
__device__ __forceinline__ void wg_probs(float (&s)[4][4], float (&dp)[4][4], const float* l2, const float* dd,
                                         int qc0, int key0, int q0, int seq, int tq, float scale_log2) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int qc = qc0 + j * 8 + tq * 2;
    const float2 lv = *(const float2*)(l2 + qc), dv = *(const float2*)(dd + qc);
    const float nl[2] = {-LOG2E_WG * lv.x, -LOG2E_WG * lv.y}, d[2] = {dv.x, dv.y};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key0 + (e >> 1) * 8, q = q0 + qc + (e & 1);
      const float p = !MASK || (key <= q && q < seq) ? ex2(fmaf(s[j][e], scale_log2, nl[e & 1])) : 0.f;
      s[j][e] = p;
      dp[j][e] = p * (dp[j][e] - d[e & 1]);
    }
  }
}

// attn_bwd_dkdv_wg: see the top of the file. Dynamic shared memory: 1024
// bytes of alignment, 7 tiles of 8 KB (K, V, Q and dO per stage, dS^T) and
// 2 stages x 2 x 64 floats (lse and D).
extern "C" __global__ void __launch_bounds__(128, 3)
    attn_bwd_dkdv_wg(const u16* __restrict__ qkv, const u16* __restrict__ dout, const float* __restrict__ lse,
                     const float* __restrict__ dsum, GRAD_OUT_ARGS, u16* __restrict__ ds, int seq,
                     int nq, int nkv, int b0, float scale_log2, float scale) {
  const GradOut dqkv{dqkv32, dqkvb, rope_cos, rope_sin};
  constexpr int HD = 64, BKK = 64, BQ = 64;
  constexpr u32 TILE = 64 * 128;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 raw = smem_addr(smem_raw), sK = (raw + 1023u) & ~1023u, sV = sK + TILE, sQ0 = sV + TILE;
  const u32 sDS = sQ0 + 4 * TILE;
  float* sL = (float*)(smem_raw + (sDS + TILE - raw));  // [stage][BQ] lse
  float* sD = sL + 2 * BQ;                              // [stage][BQ] D
  const size_t W = (size_t)(nq + 2 * nkv) * HD, OW = (size_t)nq * HD;
  const int G = nq / nkv, kh = blockIdx.y, b = b0 + blockIdx.z;
  const int k0 = (gridDim.x - 1 - blockIdx.x) * BKK;
  const size_t tok0 = (size_t)b * seq;
  const int nqb = (seq - k0 + BQ - 1) / BQ;  // query blocks from k0 on, per head
  const int nit = G * nqb;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;

  wg_load_tile(sK, qkv + tok0 * W + (nq + kh) * HD, W, k0, seq);
  wg_load_tile(sV, qkv + tok0 * W + (nq + nkv + kh) * HD, W, k0, seq);
  // Iteration it works on query block q0 of query head head: the blocks
  // from k0 on of each head of the group in turn (next steps them on).
  auto next = [&](int& head, int& q0) {
    q0 += BQ;
    if (q0 >= seq) q0 = k0, ++head;
  };
  auto load = [&](int st, int head, int q0) {
    const u32 q = sQ0 + (u32)st * 2 * TILE;
    wg_load_tile(q, qkv + tok0 * W + head * HD, W, q0, seq);
    wg_load_tile(q + TILE, dout + tok0 * OW + head * HD, OW, q0, seq);
    const size_t row = ((size_t)b * nq + head) * seq;
    const int i = tid % BQ;  // threads 0-63 copy lse, 64-127 D
    const bool ok = q0 + i < seq;
    cp_async4(smem_addr((tid < BQ ? sL : sD) + st * BQ + i), (tid < BQ ? lse : dsum) + row + (ok ? q0 + i : 0), ok);
    cp_async_commit();
  };
  int head = kh * G, q0 = k0, lhead = head, lq0 = q0;  // the block computed, and the block loaded last
  load(0, lhead, lq0);  // the same group as K and V

  const int key0 = k0 + 16 * warp + g;  // the lane's keys: key0 and key0 + 8
  float dk[HD / 8][4], dv[HD / 8][4];
  zero(dk);
  zero(dv);
  const u64 descK = sw128_desc(sK), descV = sw128_desc(sV);

  for (int it = 0; it < nit; ++it) {
    if (it + 1 < nit) {
      next(lhead, lq0);
      load((it + 1) & 1, lhead, lq0);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    // cp.async wrote through the generic proxy; wgmma reads through the async one.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    // The dS^T tile's last copy out must have read it before it is written again.
    if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    __syncthreads();
    const int st = it & 1;
    const u32 sq = sQ0 + (u32)st * 2 * TILE, sdo = sq + TILE;
    const float* l2 = sL + st * BQ;
    const float* dd = sD + st * BQ;
    // The block in two halves of 32 queries: the scores and dP of half 1
    // are computed while the warps work on half 0's probabilities, and
    // half 0's dV and dK products while they work on half 1's.
    float s[2][BQ / 16][4], dp[2][BQ / 16][4];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      zero(s[hf]);
      zero(dp[hf]);
    }
    keep_live(s[0]);
    keep_live(s[1]);
    keep_live(dp[0]);
    keep_live(dp[1]);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    const u64 descQ = sw128_desc(sq), descO = sw128_desc(sdo);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const u64 half = (u64)hf * (32 * 128 >> 4);  // query rows 32 hf on
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) wg_ss32(s[hf], descK + 2 * kk, descQ + half + 2 * kk, kk);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) wg_ss32(dp[hf], descV + 2 * kk, descO + half + 2 * kk, kk);
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      // Half 0: its scores and dP are done, half 1's may still run. Half 1:
      // its scores and dP are done, half 0's dV and dK products may still run.
      wg_wait<1>();
      keep_live(s[hf]);
      keep_live(dp[hf]);
      if (q0 >= k0 + BKK && q0 + BQ <= seq)  // every query of the block sees every key
        wg_probs<false>(s[hf], dp[hf], l2, dd, 32 * hf, key0, q0, seq, tq, scale_log2);
      else
        wg_probs<true>(s[hf], dp[hf], l2, dd, 32 * hf, key0, q0, seq, tq, scale_log2);
      u32 pf[2][4], df[2][4];
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        p_frag(s[hf], kk, pf[kk]);
        p_frag(dp[hf], kk, df[kk]);
        // The lane's rows of dS^T, as the dK product rounds them: queries
        // 32 hf + 16 kk on, chunk (8 columns) 4 hf + 2 kk + lane / 16.
        stsm4(sDS + swz(16 * warp + (lane & 7) + (lane & 8), 4 * hf + 2 * kk + (lane >> 4)), df[kk]);
      }
      keep_live(dv);
      keep_live(dk);
      keep_live(pf);
      keep_live(df);
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
        wg_rs64t(dv, pf[kk], descO + (2 * hf + kk) * (16 * 128 >> 4));  // 16 queries a k step
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) wg_rs64t(dk, df[kk], descQ + (2 * hf + kk) * (16 * 128 >> 4));
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      keep_live(pf);
      keep_live(df);
    }
    wg_wait<0>();
    keep_live(dv);
    keep_live(dk);
    // stmatrix wrote dS^T through the generic proxy; the bulk copy reads through the async one.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();  // the stage just read is the next load's target; dS^T is whole
    if (tid == 0) {
      // dS^T: tile (q0 / 64, k0 / 64) of (sequence z, head).
      const u16* dst = ds_tile(ds, blockIdx.z, nq, head, q0 / 64, k0 / 64);
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\ncp.async.bulk.commit_group;" ::"l"(dst),
                   "r"(sDS), "n"(TILE)
                   : "memory");
    }
    next(head, q0);
  }
  if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  store_dkdv<HD>(dqkv, dk, dv, tok0, key0, seq, W, nq, nkv, kh, tq, scale);
}

// attn_fwd_wg: out and lse. One CTA of two warpgroups per (128-query block,
// head, sequence), the longest blocks first; warpgroup w owns queries
// 64w .. 64w+63 of the block (warp i of it rows 16i .. 16i+15). The CTA's
// query rows and blocks of 64 keys and values stream into shared memory
// (128-byte swizzle) through a cp.async pipeline of WG_FWD_STAGES blocks.
// Per block: S = Q K^T by 4 wgmma m64n64k16 (both K-major), the causal
// mask, the online softmax as in attn_fwd (a warp's rows all before a
// block's keys get probabilities 0 and keep their finite maxima of block
// 0), then O += P V by 4 wgmma (P from registers, V MN-major).
// Dynamic shared memory: 1024 bytes of alignment, the 128-row Q tile and
// WG_FWD_STAGES x (K, V) tiles of 8 KB.
#define WG_FWD_STAGES 3
extern "C" __global__ void __launch_bounds__(256)
    attn_fwd_wg(const u16* __restrict__ qkv, u16* __restrict__ out, float* __restrict__ lse, int seq, int nq, int nkv,
                float scale_log2) {
  constexpr int HD = 64, BQ = 128, BK = 64, AHEAD = WG_FWD_STAGES - 1;
  constexpr u32 TILE = 64 * 128;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 sQ = (smem_addr(smem_raw) + 1023u) & ~1023u, sKV = sQ + 2 * TILE;
  const FwdHeads at(qkv, seq, nq, nkv, HD);
  const size_t W = at.W, tok0 = at.tok0;
  const int head = at.head, b = at.b, q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const u16 *Q = at.Q, *K = at.K, *V = at.V;
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int kend = min(q0 + BQ, seq);  // keys [0, kend) are needed by the CTA
  const int nblk = (kend + BK - 1) / BK;
  const int wrow0 = q0 + 64 * wg;                                // the warpgroup's first query
  const int wklast = wrow0 < seq ? min(wrow0 + 63, seq - 1) : -1;  // and the last key it needs
  const int row0 = wrow0 + 16 * warp;                            // the warp's first query

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int idx = i * 256 + tid, r = idx >> 3, c = idx & 7;
    const bool ok = q0 + r < seq;
    cp_async16(sQ + swz(r, c), Q + (size_t)(ok ? q0 + r : 0) * W + c * 8, ok);
  }
  auto stage = [&](int blk) { return sKV + (u32)(blk % WG_FWD_STAGES) * 2 * TILE; };  // K; V at + TILE
  // load queues block blk (if any) and commits a group either way, so that
  // every iteration waits for the same count.
  auto load = [&](int blk) {
    if (blk < nblk) {
      const u32 sk = stage(blk), sv = sk + TILE;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int idx = i * 256 + tid, r = idx >> 3, c = idx & 7, k = blk * BK + r;
        const bool ok = k < kend;
        const size_t off = (size_t)(ok ? k : 0) * W + c * 8;
        cp_async16(sk + swz(r, c), K + off, ok);
        cp_async16(sv + swz(r, c), V + off, ok);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < AHEAD; ++i) load(i);

  float o[HD / 8][4];
  zero(o);
  float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.f, 0.f};
  const u64 descQ = sw128_desc(sQ + (u32)wg * TILE);

  for (int kb = 0; kb < nblk; ++kb) {
    load(kb + AHEAD);
    cp_async_wait<AHEAD>();
    // cp.async wrote through the generic proxy; wgmma reads through the async one.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const int k0 = kb * BK;
    if (k0 <= wklast) {  // uniform over the warpgroup, as wgmma needs
      const u32 sk = stage(kb);
      const u64 descK = sw128_desc(sk), descV = sw128_desc(sk + TILE);
      float sc[BK / 8][4];
      wg_scores(sc, descQ, descK);
      wg_wait<0>();
      keep_live(sc);
      fwd_softmax_step<BK / 8, HD>(sc, o, mrow, lrow, k0, row0, g, tq, scale_log2);
      u32 pf[BK / 16][4];
      wg_pv_probs(o, sc, pf, descV);
    }
    __syncthreads();  // the stage just read is a later load's target
  }
  cp_async_wait<0>();
  fwd_store<HD>(out, lse, o, mrow, lrow, tok0, b, row0, g, tq, seq, nq, head);
}

// attn_bwd_dq_wg: dQ = dS K / sqrt(HD) from the dS^T tiles attn_bwd_dkdv
// (or attn_bwd_dkdv_wg) stored; the work and result of attn_bwd_dq<64>.
// One CTA of one warpgroup per (64-query block qb, head, sequence b0 + z),
// the longest first; warp w owns queries 16w .. 16w+15, its dQ rows in
// fp32 registers. The key blocks 0 .. qb stream K and the tile's dS^T
// (64 x 64 bf16 each, 128-byte swizzle) through a cp.async pipeline of
// WG_DQ_STAGES blocks; per block 4 wgmma m64n64k16 take both operands
// MN-major, dS from the [key][query] tile as stored and K as [key][head].
// Masked scores are stored as zeros, so the diagonal tile needs no mask;
// so are keys past the sequence, and their K rows load as zeros. The dS^T
// tiles are stored swizzled (attn_bwd_dkdv_wg) and copied in as they are.
// Dynamic shared memory: 1024 bytes of alignment and WG_DQ_STAGES x 2
// tiles of 8 KB.
#define WG_DQ_STAGES 3
extern "C" __global__ void __launch_bounds__(128)
    attn_bwd_dq_wg(const u16* __restrict__ qkv, const u16* __restrict__ ds, GRAD_OUT_ARGS, int seq, int nq, int nkv,
                   int b0, float scale) {
  const GradOut dqkv{dqkv32, dqkvb, rope_cos, rope_sin};
  constexpr int HD = 64, BK = 64, AHEAD = WG_DQ_STAGES - 1;
  constexpr u32 TILE = 64 * 128;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 s0 = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const size_t W = (size_t)(nq + 2 * nkv) * HD;
  const int head = blockIdx.y, b = b0 + blockIdx.z, kh = head / (nq / nkv);
  const int qb = gridDim.x - 1 - blockIdx.x, nblk = qb + 1;
  const size_t tok0 = (size_t)b * seq;
  const u16* K = qkv + tok0 * W + (nq + kh) * HD;
  const u16* T = ds + (((size_t)blockIdx.z * nq + head) * ((size_t)gridDim.x * (gridDim.x + 1) / 2) +
                       (size_t)qb * (qb + 1) / 2) * 4096;  // tile (qb, 0)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;

  auto stage = [&](int kb) { return s0 + (u32)(kb % WG_DQ_STAGES) * 2 * TILE; };  // K; dS^T at + TILE
  // load queues key block kb (if any) and commits a group either way, so
  // that every iteration waits for the same count.
  auto load = [&](int kb) {
    if (kb < nblk) {
      const u32 st = stage(kb);
      wg_load_tile(st, K, W, kb * BK, seq);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = i * 128 + threadIdx.x;  // 16-byte chunk
        cp_async16(st + TILE + c * 16, T + (size_t)kb * 4096 + c * 8, true);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < AHEAD; ++i) load(i);

  float dq[HD / 8][4];
  zero(dq);
  for (int kb = 0; kb < nblk; ++kb) {
    load(kb + AHEAD);
    cp_async_wait<AHEAD>();
    // cp.async wrote through the generic proxy; wgmma reads through the async one.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const u32 st = stage(kb);
    const u64 descK = sw128_desc(st), descS = sw128_desc(st + TILE);
    keep_live(dq);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk)  // 16 keys a k step
      wg_ss64<1, 1>(dq, descS + kk * (16 * 128 >> 4), descK + kk * (16 * 128 >> 4), 1);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    wg_wait<0>();
    keep_live(dq);
    __syncthreads();  // the stage just read is a later load's target
  }
  cp_async_wait<0>();
  const int row0 = qb * 64 + 16 * warp;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + g + 8 * h;
    if (row < seq) store_grad_row<HD>(dqkv, (tok0 + row) * W + (size_t)head * HD, row, true, dq, h, tq, scale);
  }
}
