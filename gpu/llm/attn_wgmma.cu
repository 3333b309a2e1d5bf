// attn_wgmma.cu: the Hopper (sm_90a) attention kernel for head_dim 64
// (package gpu/llm compiles it only for sm_90a). Same interface, work items
// and results as attn_fa64 in attn.cu; the products run on wgmma instead of
// mma.sync.
//
// One CTA per (work item, head), blockIdx.x = item * nq + head; two
// warpgroups, warpgroup w owning the item's queries 64w .. 64w+63 (warp i of
// it rows 16i .. 16i+15). The CTA's 128 query rows and blocks of 64 keys and
// values stream into shared memory through a cp.async pipeline of STAGES
// blocks, every row of 64 bf16 (128 bytes) stored with the 128-byte swizzle
// (16-byte chunk c of row r at r * 128 + ((c ^ (r % 8)) * 16), 1024-byte
// aligned): K-major for Q and K in S = Q K^T, and MN-major for V (keys are
// the reduction) in O += P V, whose A operand, P in bf16, comes from
// registers (the accumulator layout of S is the A fragment layout). Rows and
// keys past the sequence are zero-filled. Per block: S by 4 wgmma
// m64n64k16, the causal mask on diagonal blocks, the online softmax of
// attn.cuh, then P V by 4 wgmma m64n64k16.

#include "common.cuh"
#include "wgmma.cuh"
#include "attn.cuh"
#include "rope.cuh"

#define WG_BK 64  // keys per block

// attn_wg64<STAGES>: see the top of the file. Dynamic shared memory:
// (128 + STAGES * 2 * 64) * 128 bytes, plus 1024 for alignment. The engine
// instantiates STAGES = 3: on an H200, 3 stages beat 2 and a build that
// overlapped each block's P V with the next block's scores. Blocks are
// loaded AHEAD = min(STAGES - 1, 2) ahead; with 3 stages a block's stage is
// loaded again in the next iteration, so every iteration ends at a barrier.
// Measured and dropped (H200, 2026-12-05, whole-model prefill within the
// defaults' spread): 4 stages with one barrier an iteration, each block's
// softmax overlapped with the block before's P V (as flash-attention 3
// does), and the queries held in registers as wgmma A fragments.
template <int STAGES>
__global__ void __launch_bounds__(256, 2)
    attn_wg64(const u16* __restrict__ qkv, u16* __restrict__ out, const int* __restrict__ items,
              const int* __restrict__ seq_q0, const int* __restrict__ seq_n, const int* __restrict__ seq_past,
              const u64* __restrict__ seq_pt, int page, int layer, int nq, int nkv, int qkv_w, float scale_log2,
              const float* __restrict__ cosT, const float* __restrict__ sinT) {
  constexpr int HD = 64, BK = WG_BK;
  static_assert(BK == ATT_BK, "the blocks of keys are the ones a page holds whole");
  constexpr int AHEAD = STAGES - 1 < 2 ? STAGES - 1 : 2;  // blocks loaded ahead of the one computed
  constexpr bool END_SYNC = STAGES < AHEAD + 2;  // whether a stage is reloaded right after its use
  constexpr u32 QBYTES = ATT_BQ * 128, BLK = BK * 128;  // Q tile; one K or V block
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 sQ = (smem_addr(smem_raw) + 1023u) & ~1023u, sKV = sQ + QBYTES;

  const AttnItem a = attn_item(items, seq_q0, seq_n, seq_past, seq_pt, page, layer, nq, nkv, HD);
  const int head = a.head, q0 = a.q0, n = a.n, past = a.past, qs = a.qs;
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, tq = lane & 3;
  const int kend = past + min(q0 + ATT_BQ, n);  // keys [0, kend) are needed by the CTA
  const int nblk = (kend + BK - 1) / BK;
  const int wrow0 = q0 + wg * 64;                                      // the warpgroup's first query
  const int wklast = wrow0 < n ? past + min(wrow0 + 63, n - 1) : -1;  // and the last key it needs
  const int trow0 = wrow0 + warp * 16;                                 // the warp's first query

  if (cosT == nullptr) {  // the queries were rotated by rope_kv
    for (int idx = tid; idx < ATT_BQ * 8; idx += 256) {
      int r = idx >> 3, c = idx & 7, row = q0 + r;
      bool ok = row < n;
      cp_async16(sQ + swz(r, c), qkv + (size_t)(qs + (ok ? row : 0)) * qkv_w + head * HD + c * 8, ok);
    }
  }
  auto stage = [&](int blk) { return sKV + (u32)(blk % STAGES) * 2 * BLK; };  // K block; V at + BLK
  // load_next queues the next block of keys and values (if any) and
  // commits a group either way, so that every iteration waits for the same
  // count. The blocks go in order, each thread copying the same two 16-byte
  // chunks of every block (rows lr and lr + 32, chunk lc); the block's page
  // and stage are tracked from one block to the next, not divided out (the
  // loads with their divisions by the blocks a page holds were a quarter of
  // the kernel's instructions), and the next block's page is read as this
  // one is queued, an iteration before it is needed.
  const int lr = tid >> 3, lc = tid & 7;
  const u32 soff = swz(lr, lc);  // row lr + 32 is 4096 bytes further
  const int goff = lr * HD + lc * 8;
  int lblk = 0, lpb = 0, lst = 0;  // next block to load, its block in its page, its stage
  const u64* lpt = a.pt;           // its page table entry
  u64 lpg = 0;                     // its page
  if (nblk > 0) lpg = *lpt;
  auto load_next = [&]() {
    if (lblk < nblk) {
      const int k0 = lblk * BK;
      const u16* K = (const u16*)lpg + a.koff + lpb * BK * HD;
      const u16* V = K + a.vstep;
      const u32 sk = sKV + (u32)lst * 2 * BLK + soff, sv = sk + BLK;
      const bool ok0 = k0 + lr < kend, ok1 = k0 + lr + 32 < kend;
      const int o0 = ok0 ? goff : lc * 8, o1 = ok1 ? goff + 32 * HD : lc * 8;
      cp_async16(sk, K + o0, ok0);
      cp_async16(sv, V + o0, ok0);
      cp_async16(sk + 4096, K + o1, ok1);
      cp_async16(sv + 4096, V + o1, ok1);
      ++lblk;
      lst = lst + 1 == STAGES ? 0 : lst + 1;
      if (++lpb == a.bpp) {
        lpb = 0;
        ++lpt;
        if (lblk < nblk) lpg = *lpt;
      }
    }
    cp_async_commit();
  };
  static_assert(BK * 8 == 2 * 256, "a block is two 16-byte chunks a thread");
#pragma unroll
  for (int i = 0; i < AHEAD; ++i) load_next();
  if (cosT != nullptr) {
    // Rotate the queries here, while the first blocks' copies are in
    // flight: 8 pairs (a 16-byte chunk of each half of the row) per step,
    // as rope_kv would have (rope_rotate8, the same bits), stored into the
    // swizzled tile. The first iteration's proxy fence and barrier publish
    // them to wgmma.
    for (int idx = tid; idx < ATT_BQ * 4; idx += 256) {
      int r = idx >> 2, c = idx & 3, row = q0 + r;
      uint4 A = make_uint4(0, 0, 0, 0), B = A;
      if (row < n) {
        const u16* src = qkv + (size_t)(qs + row) * qkv_w + head * HD + c * 8;
        const size_t cs = (size_t)(past + row) * (HD / 2) + c * 8;  // the query's position's cos and sin
        A = *(const uint4*)src;
        B = *(const uint4*)(src + HD / 2);
        rope_rotate8(A, B, cosT + cs, sinT + cs);
      }
      st_shared16(sQ + swz(r, c), A);
      st_shared16(sQ + swz(r, c + 4), B);
    }
  }

  float o[HD / 8][4];
  zero(o);
  float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.f, 0.f};
  u32 p[BK / 16][4];  // the block's probabilities, bf16 A fragments
  const u64 dq = sw128_desc(sQ + (u32)wg * 64 * 128);
  // scores computes block blk's scores S = Q K^T, waiting for them.
  auto scores = [&](float (&sc)[BK / 8][4], int blk) {
    wg_scores(sc, dq, sw128_desc(stage(blk)));
    wg_wait<0>();
    keep_live(sc);
  };
  auto mask = [&](float (&sc)[BK / 8][4], int k0) {
    if (k0 + BK - 1 > past + trow0) mask_after(sc, k0, past + trow0 + g, tq);
  };

  for (int kb = 0; kb < nblk; ++kb) {
    load_next();
    // Groups 0 .. kb + AHEAD are committed.
    cp_async_wait<AHEAD>();
    // cp.async wrote through the generic proxy; wgmma reads through the async one.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const int k0 = kb * BK;
    if (k0 <= wklast) {  // uniform over the warpgroup, as wgmma needs
      const u64 dv = sw128_desc(stage(kb) + BLK);
      float sc[BK / 8][4];
      scores(sc, kb);
      mask(sc, k0);
      // o *= corr only in warps where a row's maximum moved: a rescale by
      // exactly 1 would leave the same bits.
      float corr[2];
      softmax_probs(sc, mrow, lrow, corr, scale_log2);
      if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) rescale(o, corr);
      wg_pv_probs(o, sc, p, dv);
    }
    if (END_SYNC) __syncthreads();  // the stage just read is the next iteration's load target
  }
  cp_async_wait<0>();
  if (trow0 < n) {
    int row = trow0 + g;
    store_rows(o, lrow, out + (size_t)(qs + row) * nq * HD + head * HD + tq * 2, (size_t)nq * HD, row, n);
  }
}

// attn_wg64_probe checks the two products of attn_wg64 in isolation (tests
// only; one CTA of one warpgroup): with q, k, v each 64 x 64 bf16 row-major
// in global memory, it writes s = q k^T (fp32, 64 x 64, row-major) through
// the same shared memory layout and descriptors as attn_wg64, then
// o = bf16(s) v, with P taken from s's accumulators as attn_wg64 takes it.
extern "C" __global__ void __launch_bounds__(128)
    attn_wg64_probe(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                    float* __restrict__ s_out, float* __restrict__ o_out) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 sQ = (smem_addr(smem_raw) + 1023u) & ~1023u, sK = sQ + 8192, sV = sK + 8192;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  for (int idx = tid; idx < 64 * 8; idx += 128) {
    int r = idx >> 3, c = idx & 7;
    cp_async16(sQ + swz(r, c), q + r * 64 + c * 8, true);
    cp_async16(sK + swz(r, c), k + r * 64 + c * 8, true);
    cp_async16(sV + swz(r, c), v + r * 64 + c * 8, true);
  }
  cp_async_commit();
  cp_async_wait<0>();
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  float sc[8][4], o[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
  wg_scores(sc, sw128_desc(sQ), sw128_desc(sK));
  wg_wait<0>();
  keep_live(sc);
  u32 p[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) p_frag(sc, kk, p[kk]);
  wg_pv(o, p, sw128_desc(sV));
  wg_wait<0>();
  keep_live(o);
  keep_live(p);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int row = warp * 16 + g + (e >> 1) * 8, col = j * 8 + tq * 2 + (e & 1);
      s_out[row * 64 + col] = sc[j][e];
      o_out[row * 64 + col] = o[j][e];
    }
}
