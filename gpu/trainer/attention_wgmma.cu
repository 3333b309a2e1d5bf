// attention_wgmma.cu: the Hopper (sm_90a) dK/dV kernel of the training
// attention for head size 64 (package gpu/trainer compiles it only for
// sm_90a). Same interface, work and results as attn_bwd_dkdv<64, 64> in
// attention.cu; the four products run on wgmma instead of mma.sync.
//
// One CTA of one warpgroup per (64-key block, kv head, sequence b0 + z), the
// longest first; warp w owns keys 16w .. 16w+15 (the m64 rows of every
// product), its dK and dV in fp32 registers. The CTA walks the query heads
// of its group and, for each, the 64-query blocks from its first key on, Q,
// dO, lse and D through a two-stage cp.async pipeline. Every tile is 64 rows
// of 64 bf16 with the 128-byte swizzle: K, V, Q and dO are K-major in
// S^T = K Q^T and dP^T = V dO^T (reduction over the head), and Q and dO are
// MN-major in dV += P^T dO and dK += dS^T Q (reduction over the queries),
// whose A operands, P^T and dS^T in bf16, come from registers (the
// accumulator layout of S^T is the A fragment layout). dS^T is stored for
// attn_bwd_dq as attn_bwd_dkdv stores it.

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

// attn_bwd_dkdv_wg: see the top of the file. Dynamic shared memory: 1024
// bytes of alignment, 6 tiles of 8 KB (K, V, and Q and dO per stage) and 2
// stages x 2 x 64 floats (lse log2 e and D).
extern "C" __global__ void __launch_bounds__(128)
    attn_bwd_dkdv_wg(const u16* __restrict__ qkv, const u16* __restrict__ dout, const float* __restrict__ lse,
                     const float* __restrict__ dsum, float* __restrict__ dqkv, u16* __restrict__ ds, int seq,
                     int nq, int nkv, int b0, float scale_log2, float scale) {
  constexpr int HD = 64, BKK = 64, BQ = 64;
  constexpr u32 TILE = 64 * 128;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 raw = smem_addr(smem_raw), sK = (raw + 1023u) & ~1023u, sV = sK + TILE, sQ0 = sV + TILE;
  float* sL = (float*)(smem_raw + (sQ0 + 4 * TILE - raw));  // [stage][BQ] lse log2 e
  float* sD = sL + 2 * BQ;                                   // [stage][BQ] D
  const size_t W = (size_t)(nq + 2 * nkv) * HD, OW = (size_t)nq * HD;
  const int G = nq / nkv, kh = blockIdx.y, b = b0 + blockIdx.z;
  const int k0 = (gridDim.x - 1 - blockIdx.x) * BKK;
  const size_t tok0 = (size_t)b * seq;
  const int nqb = (seq - k0 + BQ - 1) / BQ;  // query blocks from k0 on, per head
  const int nit = G * nqb;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;

  wg_load_tile(sK, qkv + tok0 * W + (nq + kh) * HD, W, k0, seq);
  wg_load_tile(sV, qkv + tok0 * W + (nq + nkv + kh) * HD, W, k0, seq);
  auto load = [&](int it) {
    const int st = it & 1, head = kh * G + it / nqb, q0 = k0 + (it % nqb) * BQ;
    const u32 q = sQ0 + (u32)st * 2 * TILE;
    wg_load_tile(q, qkv + tok0 * W + head * HD, W, q0, seq);
    wg_load_tile(q + TILE, dout + tok0 * OW + head * HD, OW, q0, seq);
    const size_t row = ((size_t)b * nq + head) * seq;
    if (tid < BQ) {
      const bool ok = q0 + tid < seq;
      sL[st * BQ + tid] = ok ? lse[row + q0 + tid] * LOG2E_WG : 0.f;
      sD[st * BQ + tid] = ok ? dsum[row + q0 + tid] : 0.f;
    }
    cp_async_commit();
  };
  load(0);  // the same group as K and V

  const int key0 = k0 + 16 * warp + g;  // the lane's keys: key0 and key0 + 8
  float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) dk[j][0] = dk[j][1] = dk[j][2] = dk[j][3] = dv[j][0] = dv[j][1] = dv[j][2] = dv[j][3] = 0.f;
  const u64 descK = sw128_desc(sK), descV = sw128_desc(sV);

  for (int it = 0; it < nit; ++it) {
    if (it + 1 < nit) {
      load(it + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    // cp.async wrote through the generic proxy; wgmma reads through the async one.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const int st = it & 1, head = kh * G + it / nqb, q0 = k0 + (it % nqb) * BQ;
    const u32 sq = sQ0 + (u32)st * 2 * TILE, sdo = sq + TILE;
    const float* l2 = sL + st * BQ;
    const float* dd = sD + st * BQ;
    float s[BQ / 8][4], dp[BQ / 8][4];
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.f;
    keep_live(s);
    keep_live(dp);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    const u64 descQ = sw128_desc(sq), descO = sw128_desc(sdo);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) wg_ss64(s, descK + 2 * kk, descQ + 2 * kk, kk);  // +32 bytes a k step
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) wg_ss64(dp, descV + 2 * kk, descO + 2 * kk, kk);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    wg_wait<0>();
    keep_live(s);
    keep_live(dp);
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + (e >> 1) * 8, ql = j * 8 + tq * 2 + (e & 1), q = q0 + ql;
        const float p = (key <= q && q < seq) ? ex2(fmaf(s[j][e], scale_log2, -l2[ql])) : 0.f;
        s[j][e] = p;
        dp[j][e] = p * (dp[j][e] - dd[ql]);
      }
    // dS^T rows of the lane: tile (q0 / 64, k0 / 64) of (sequence z, head).
    store_ds(ds_lane_row(ds, blockIdx.z, nq, head, q0 / 64, k0 / 64, warp, g, tq, 0), dp);
    u32 pf[BQ / 16][4], df[BQ / 16][4];
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) {
      p_frag(s, kk, pf[kk]);
      p_frag(dp, kk, df[kk]);
    }
    keep_live(dv);
    keep_live(dk);
    keep_live(pf);
    keep_live(df);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) wg_rs64t(dv, pf[kk], descO + kk * (16 * 128 >> 4));  // 16 queries a k step
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) wg_rs64t(dk, df[kk], descQ + kk * (16 * 128 >> 4));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    wg_wait<0>();
    keep_live(dv);
    keep_live(dk);
    keep_live(pf);
    keep_live(df);
    __syncthreads();  // the stage just read is the next load's target
  }
  store_dkdv<HD>(dqkv, dk, dv, tok0, key0, seq, W, nq, nkv, kh, tq, scale);
}
