// attn.cu: causal attention over the KV cache (package gpu/llm): the plain
// kernel (any even head_dim up to 256) and the mma.sync kernels (head_dim 64
// and 128). attn_wgmma.cu holds the Hopper kernel.
// Storage is bf16 (weights, activations between GEMMs, the KV cache); the
// residual stream and the norm weights are fp32, and all arithmetic is fp32.
// No CUDA headers: package gpu's common.cuh (bf16 helpers, dot8, cp.async)
// and the headers named below come from the launcher (gpu.Headers).
//
// Per-forward metadata (written by the launcher, one upload per call):
//   tok_seq[t], tok_pos[t]   sequence and absolute position of flat token t
//   seq_q0[s]                flat index of sequence s's first new token
//   seq_n[s], seq_past[s]    new tokens of s, and positions already cached
//   seq_pt[s]                s's KV cache: the address of its page table
//   items[2i], items[2i+1]   attention work item i: sequence, first query
//
// KV cache of one sequence: pages of `page` positions (a kernel argument),
// each bf16 [layer][k|v][kv_head][page][head_dim]; see kvpage.cuh.

#include "common.cuh"
#include "attn.cuh"
#include "rope.cuh"

// Attention. out[t][head*hd + j] = sum_p softmax_p(q . k_p / sqrt(hd)) v_p[j]
// over the positions p <= pos(t) of t's sequence (causal), keys and values
// read from the KV cache (GQA: query head h reads kv head h / (nq/nkv)).
// Both kernels use an online softmax over the keys: no score matrix.

// attn_ref: the plain kernel (any even hd <= 256). One CTA per (work item,
// head), blockIdx.x = item * nq + head as in attn_fa; 8 warps;
// each warp takes queries of the item one at a time, each lane holding hd/32
// dimensions, and walks the keys one by one.
extern "C" __global__ void __launch_bounds__(256)
    attn_ref(const u16* __restrict__ qkv, u16* __restrict__ out, const int* __restrict__ items,
             const int* __restrict__ seq_q0, const int* __restrict__ seq_n, const int* __restrict__ seq_past,
             const u64* __restrict__ seq_pt, int page, int layer, int nq, int nkv, int hd, int qkv_w,
             float scale_log2) {
  const int MAXD = 8;  // dims per lane: hd <= 256
  const AttnItem a = attn_item(items, seq_q0, seq_n, seq_past, seq_pt, page, layer, nq, nkv, hd);
  const int head = a.head, q0 = a.q0, n = a.n, past = a.past, qs = a.qs;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int qend = min(q0 + ATT_BQ, n);
  for (int qi = q0 + warp; qi < qend; qi += blockDim.x >> 5) {
    const u16* q = qkv + (size_t)(qs + qi) * qkv_w + head * hd;
    float qv[MAXD], acc[MAXD];
#pragma unroll
    for (int k = 0; k < MAXD; ++k) {
      int j = lane + 32 * k;
      qv[k] = j < hd ? bf_to_f(q[j]) * scale_log2 : 0.f;
      acc[k] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    int last = past + qi;  // keys 0..last, page by page
    for (int p0 = 0; p0 <= last; p0 += page) {
      const u16* K = (const u16*)a.pt[p0 / page] + a.koff;
      const u16* V = K + a.vstep;
      for (int p = 0, pn = min(page, last + 1 - p0); p < pn; ++p) {
        const u16* kp = K + p * hd;
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < MAXD; ++k) {
          int j = lane + 32 * k;
          if (j < hd) dot += qv[k] * bf_to_f(kp[j]);
        }
        dot = warp_sum(dot);
        float mn = fmaxf(m, dot);
        float corr = exp2f(m - mn), e = exp2f(dot - mn);
        l = l * corr + e;
        const u16* vp = V + p * hd;
#pragma unroll
        for (int k = 0; k < MAXD; ++k) {
          int j = lane + 32 * k;
          if (j < hd) acc[k] = acc[k] * corr + e * bf_to_f(vp[j]);
        }
        m = mn;
      }
    }
    u16* o = out + (size_t)(qs + qi) * nq * hd + head * hd;
    float il = 1.f / l;
#pragma unroll
    for (int k = 0; k < MAXD; ++k) {
      int j = lane + 32 * k;
      if (j < hd) o[j] = (u16)f_to_bf(acc[k] * il);
    }
  }
}


// attn_fa: the tensor-core kernel for hd = 64 or 128 (flash-attention 2
// style). One CTA per (work item, head), blockIdx.x = item * nq + head, so
// the launcher's item order (longest first) is the order CTAs start in.
// NW warps; warp w owns WM tiles of 16 queries, tile i holding the item's
// queries (i NW + w) 16 .. +15 (interleaved, so that the causal triangle
// gives every warp the same work). Blocks of 64 keys and values stream
// through a two-stage cp.async pipeline into shared memory, rows [key][dim]
// with a pitch of hd + 8 (ldmatrix without bank conflicts); keys past the
// CTA's last needed one are zero-filled, so unwritten cache memory never
// reaches the arithmetic. Per block each warp computes its scores with
// mma.sync (K fragments by ldmatrix, shared by the warp's tiles), masks the
// causal triangle on the diagonal blocks, updates its running row maxima
// and sums, and adds P V (P rounded to bf16; V fragments by ldmatrix.trans)
// into its fp32 accumulators. Fragment layouts are PTX's for m16n8k16:
// lane = 4 g + tq holds rows g and g+8, columns 2tq, 2tq+1 (+8).

template <int HD, int NW, int WM>
__device__ __forceinline__ void attn_fa_body(const u16* __restrict__ qkv, u16* __restrict__ out,
                                             const int* __restrict__ items, const int* __restrict__ seq_q0,
                                             const int* __restrict__ seq_n, const int* __restrict__ seq_past,
                                             const u64* __restrict__ seq_pt, int page, int layer, int nq,
                                             int nkv, int qkv_w, float scale_log2) {
  static_assert(NW * WM * 16 == ATT_BQ, "a CTA covers one work item");
  constexpr int BK = ATT_BK;
  constexpr int P = HD + 8;      // shared row pitch (bf16)
  constexpr int TILE = BK * P;   // one K or V block
  constexpr int CH = HD / 8;     // 16-byte chunks per row
  extern __shared__ __align__(16) u16 smem[];  // [stage][K | V][BK][P]

  const AttnItem a = attn_item(items, seq_q0, seq_n, seq_past, seq_pt, page, layer, nq, nkv, HD);
  const int head = a.head, q0 = a.q0, n = a.n, past = a.past, qs = a.qs;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int g = lane >> 2, tq = lane & 3;
  int kend = past + min(q0 + ATT_BQ, n);  // keys [0, kend) are needed by the CTA
  int nblk = (kend + BK - 1) / BK;

  // load queues block blk, whose page is pg.
  auto load = [&](int blk, u64 pg) {
    int k0 = blk * BK;
    const u16* K = block_keys(a, pg, blk, HD);
    const u16* V = K + a.vstep;
    u16* sk = smem + (blk & 1) * 2 * TILE;
    u16* sv = sk + TILE;
    for (int idx = threadIdx.x; idx < BK * CH; idx += NW * 32) {
      int r = idx / CH, c = (idx % CH) * 8;
      bool ok = k0 + r < kend;
      int off = (ok ? r : 0) * HD + c;
      cp_async16(smem_addr(sk + r * P + c), K + off, ok);
      cp_async16(smem_addr(sv + r * P + c), V + off, ok);
    }
    cp_async_commit();
  };
  load(0, block_page(a, 0));
  // The page of the next block to load, read from the page table an
  // iteration ahead so that queuing a block does not wait for it.
  u64 pg = nblk > 1 ? block_page(a, 1) : 0;

  // The warp's query tiles: first row (index among the sequence's new
  // tokens), and the last key each needs (-1: the tile has no valid row).
  int row0[WM], klast[WM];
  int wklast = -1;
#pragma unroll
  for (int i = 0; i < WM; ++i) {
    row0[i] = q0 + (i * NW + warp) * 16;
    klast[i] = row0[i] < n ? past + min(row0[i] + 15, n - 1) : -1;
    wklast = max(wklast, klast[i]);
  }
  // Q fragments, straight from global memory (rows past n are zero).
  u32 qf[WM][HD / 16][4];
#pragma unroll
  for (int i = 0; i < WM; ++i)
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        int row = row0[i] + g + (r & 1) * 8;
        int col = kk * 16 + tq * 2 + (r >> 1) * 8;
        qf[i][kk][r] = row < n ? *(const u32*)(qkv + (size_t)(qs + row) * qkv_w + head * HD + col) : 0u;
      }
  float o[WM][HD / 8][4];
  float mrow[WM][2], lrow[WM][2];
#pragma unroll
  for (int i = 0; i < WM; ++i) {
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.f;
    mrow[i][0] = mrow[i][1] = NEG_INF;
    lrow[i][0] = lrow[i][1] = 0.f;
  }
  // Per-lane ldmatrix offsets (bf16 elements) within a block: K, matrix
  // lane/8 = (dims +8 for odd, next 16-dim slice for >= 2); V (trans),
  // matrix lane/8 = (keys +8 for odd, next 8-dim tile for >= 2).
  int mi = lane >> 3, mr = lane & 7;
  int koff = mr * P + (mi & 1) * 8 + (mi >> 1) * 16;
  int voff = ((mi & 1) * 8 + mr) * P + (mi >> 1) * 8;

  for (int kb = 0; kb < nblk; ++kb) {
    if (kb + 1 < nblk) {
      load(kb + 1, pg);
      if (kb + 2 < nblk) pg = block_page(a, kb + 2);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    int k0 = kb * BK;
    if (k0 <= wklast) {
      u32 sk = smem_addr(smem + (kb & 1) * 2 * TILE);
      u32 sv = sk + TILE * 2;
      // S = Q K^T, 16 rows x 64 keys per tile. Every tile takes part (a
      // tile past its last key sees only masked scores: no change).
      float sc[WM][BK / 8][4];
#pragma unroll
      for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) sc[i][j][0] = sc[i][j][1] = sc[i][j][2] = sc[i][j][3] = 0.f;
#pragma unroll
      for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk += 2) {
          u32 b0, b1, b2, b3;
          ldsm4(sk + 2 * (j * 8 * P + kk * 16 + koff), b0, b1, b2, b3);
#pragma unroll
          for (int i = 0; i < WM; ++i) {
            mma16816(sc[i][j], qf[i][kk], b0, b1);
            mma16816(sc[i][j], qf[i][kk + 1], b2, b3);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < WM; ++i) {
        // Mask keys past each row's position on the diagonal blocks.
        if (k0 + BK - 1 > past + row0[i]) mask_after(sc[i], k0, past + row0[i] + g, tq);
        softmax_step(sc[i], mrow[i], lrow[i], o[i], scale_log2);
      }
      // O += P V: the score fragments of key tiles 2kk and 2kk+1 are the A
      // fragment of key slice kk.
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        u32 a[WM][4];
#pragma unroll
        for (int i = 0; i < WM; ++i) p_frag(sc[i], kk, a[i]);
#pragma unroll
        for (int j = 0; j < HD / 8; j += 2) {
          u32 b0, b1, b2, b3;
          ldsm4t(sv + 2 * (kk * 16 * P + j * 8 + voff), b0, b1, b2, b3);
#pragma unroll
          for (int i = 0; i < WM; ++i) {
            mma16816(o[i][j], a[i], b0, b1);
            mma16816(o[i][j + 1], a[i], b2, b3);
          }
        }
      }
    }
    __syncthreads();  // the stage just read is the next load's target
  }
#pragma unroll
  for (int i = 0; i < WM; ++i) {
    if (klast[i] < 0) continue;
    int row = row0[i] + g;
    store_rows(o[i], lrow[i], out + (size_t)(qs + row) * nq * HD + head * HD + tq * 2, (size_t)nq * HD, row, n);
  }
}

// attn_fa64, attn_fa128: 8 warps of one query tile each (two tiles per
// warp, which halve the shared-memory reads of K and V, spilled registers).
// Dynamic shared memory: 2 * 2 * 64 * (hd + 8) * 2 bytes.
extern "C" __global__ void __launch_bounds__(256, 2)
    attn_fa64(const u16* __restrict__ qkv, u16* __restrict__ out, const int* __restrict__ items,
              const int* __restrict__ seq_q0, const int* __restrict__ seq_n, const int* __restrict__ seq_past,
              const u64* __restrict__ seq_pt, int page, int layer, int nq, int nkv, int qkv_w,
              float scale_log2) {
  attn_fa_body<64, 8, 1>(qkv, out, items, seq_q0, seq_n, seq_past, seq_pt, page, layer, nq, nkv, qkv_w,
                         scale_log2);
}

extern "C" __global__ void __launch_bounds__(256)
    attn_fa128(const u16* __restrict__ qkv, u16* __restrict__ out, const int* __restrict__ items,
               const int* __restrict__ seq_q0, const int* __restrict__ seq_n, const int* __restrict__ seq_past,
               const u64* __restrict__ seq_pt, int page, int layer, int nq, int nkv, int qkv_w,
               float scale_log2) {
  attn_fa_body<128, 8, 1>(qkv, out, items, seq_q0, seq_n, seq_past, seq_pt, page, layer, nq, nkv, qkv_w,
                          scale_log2);
}

// attn_dec64, attn_dec128: attention of decode steps, where every sequence
// of the pass has one new token (flash-decoding). blockIdx.x = item * nq +
// head as above, blockIdx.y = split: the query's key blocks (past + 1 keys,
// blocks of ATT_BK) are cut into gridDim.y runs of whole blocks, as even as
// they go, one CTA each, so that a short batch still spreads over the SMs.
//
// A CTA streams its run's keys and values through ATT_DEC_STAGES slots of
// shared memory (a block's keys, then its values): on sm_90 thread 0 asks
// for each as two bulk asynchronous copies (cp.async.bulk) completing on
// the slot's mbarrier; before sm_90 every thread issues 16-byte cp.async
// copies. The first slots are requested before grid_wait, so that under
// early start the reads overlap the kernel before: every cached position
// but the new token's was written by earlier passes, and the page tables
// do not change within a pass. The new token's key and value (the kernel
// before's) are left out of the copies and read from the L2 after
// grid_wait by the lanes that use them. With release_first the kernel lets
// the next one start before its own wait (grid_enter): in one-token steps,
// whose output projection runs gemv_rows1, an early-start kernel.
//
// With cos and sin (fp32 [position][hd/2]; null: rope_kv has run) the
// kernel also does rope_kv's work for the step, which then does not run:
// each CTA rotates its query, and the new token's key, as it loads them
// (rope_rotate8, as rope_kv: the same bits), and the CTA of the run that
// holds the new position, for the first query head of its key head, writes
// the rotated key and the value into the cache. The copies never include
// that position, so no CTA reads what another writes.
//
// The page of every key block is read from the page table one block ahead
// of its copy (before the wait for the block in flight), so that a copy is
// one round trip, not two.
//
// In a CTA of ATT_DEC_THREADS threads, groups of hd / 8 lanes take one key
// at a time (a lane: 8 dimensions of q, k, v); per block a group scores all
// its keys first and rescales its running output once, an online softmax
// per group; the CTA then merges its groups. With one run the CTA writes
// the output. With several, each run's maximum, sum and unnormalized
// output are merged in split order: launched as a cluster of the runs
// (sm_90), through distributed shared memory, where rank 0 reads the other
// runs' results and writes the output while they wait; otherwise through
// global memory (pm, pl, po), by the last CTA of the (sequence, head) to
// finish (a counter in cnt, reset to 0 by it). Either way the result does
// not depend on the order the CTAs run in and repeats bit for bit. The split
// count depends on the batch only, so a CUDA graph of a decode step stays
// valid as the sequences grow.
#define ATT_DEC_THREADS 128
#define ATT_DEC_STAGES 2  // key blocks (keys and values) of a run in shared memory at once

// dec_bulk copies bytes from global src to shared dst, completing on bar (sm_90).
__device__ __forceinline__ void dec_bulk(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// dec_copy (all threads) requests the first rows of a key block whose keys
// start at K (values vstep elements on) into slot dst: keys at dst, values
// ATT_BK * HD elements on. sm_90: thread 0, completing on bar (also when
// rows is 0); before: the threads' cp.async copies, one commit group.
template <int HD>
__device__ __forceinline__ void dec_copy(u32 dst, const u16* K, int vstep, int rows, u32 bar) {
#if __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0) {
    const u32 bytes = (u32)rows * HD * 2;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the slot's earlier reads come first
    mbar_expect_tx(bar, 2 * bytes);
    if (bytes) {
      dec_bulk(dst, K, bytes, bar);
      dec_bulk(dst + ATT_BK * HD * 2, K + vstep, bytes, bar);
    }
  }
#else
  const int pieces = rows * HD / 8;  // 16-byte pieces of the keys, and of the values
  for (int i = threadIdx.x; i < 2 * pieces; i += ATT_DEC_THREADS) {
    const int v = i >= pieces, p = i - v * pieces;
    cp_async16(dst + (u32)(v * ATT_BK * HD * 2 + p * 16), K + (size_t)v * vstep + p * 8, true);
  }
  cp_async_commit();
#endif
}

// DEC_MERGE_BATCH is how many runs' values dec_merge has in flight at
// once.
#define DEC_MERGE_BATCH 4

// dec_merge merges n runs' maxima, sums and output column d (run s's read
// by load(s, k): k = 0 the maximum, 1 the sum, 2 the output) in run order,
// and returns the normalized output. The reads (distributed shared memory
// or the L2) are requested DEC_MERGE_BATCH runs at a time, a round trip
// per batch rather than per run.
template <typename Load>
__device__ __forceinline__ float dec_merge(int n, Load load) {
  float M = NEG_INF;
  for (int s0 = 0; s0 < n; s0 += DEC_MERGE_BATCH) {
    float m[DEC_MERGE_BATCH];
#pragma unroll
    for (int i = 0; i < DEC_MERGE_BATCH; ++i) m[i] = s0 + i < n ? load(s0 + i, 0) : NEG_INF;
#pragma unroll
    for (int i = 0; i < DEC_MERGE_BATCH; ++i) M = fmaxf(M, m[i]);
  }
  float L = 0.f, O = 0.f;
  for (int s0 = 0; s0 < n; s0 += DEC_MERGE_BATCH) {
    float m[DEC_MERGE_BATCH], l[DEC_MERGE_BATCH], o[DEC_MERGE_BATCH];
#pragma unroll
    for (int i = 0; i < DEC_MERGE_BATCH; ++i)
      if (s0 + i < n) m[i] = load(s0 + i, 0), l[i] = load(s0 + i, 1), o[i] = load(s0 + i, 2);
#pragma unroll
    for (int i = 0; i < DEC_MERGE_BATCH; ++i)
      if (s0 + i < n) {
        const float w = ex2(m[i] - M);  // 0 for a run that saw no key
        L = fmaf(l[i], w, L);
        O = fmaf(o[i], w, O);
      }
  }
  return O / L;
}

#if __CUDA_ARCH__ >= 900
// cluster_sync: every thread of the cluster arrives (release), then waits
// for the others (acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// ld_cluster reads the float at shared address a of cluster CTA rank.
__device__ __forceinline__ float ld_cluster(u32 a, u32 rank) {
  u32 ra;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(ra) : "memory");
  return v;
}
#endif

// dec_rope_lane returns lane sub's 8 elements (sub * 8 ..) of head row v
// (hd elements, bf16), rotated for position pos by rope_rotate8 as rope_kv
// rotates them: the lane loads its own 8 and those of the other half of the
// head they pair with.
template <int HD>
__device__ __forceinline__ uint4 dec_rope_lane(const u16* v, int sub, const float* __restrict__ cosT,
                                               const float* __restrict__ sinT, int pos) {
  constexpr int HALF = HD / 2, LH = HD / 16;  // lanes per half of the head
  const bool lo = sub < LH;
  const int j = (lo ? sub : sub - LH) * 8;  // the pair's column in the first half
  uint4 A = ldg_cg(v + j), B = ldg_cg(v + j + HALF);
  const size_t cs = (size_t)pos * HALF + j;  // the columns' cos and sin
  rope_rotate8(A, B, cosT + cs, sinT + cs);
  return lo ? A : B;
}

template <int HD>
__device__ __forceinline__ void attn_dec_body(const u16* __restrict__ qkv, u16* __restrict__ out,
                                              const int* __restrict__ items, const int* __restrict__ seq_q0,
                                              const int* __restrict__ seq_n, const int* __restrict__ seq_past,
                                              const u64* __restrict__ seq_pt, int page, int layer, int nq, int nkv,
                                              int qkv_w, float scale_log2, float* __restrict__ po,
                                              float* __restrict__ pm, float* __restrict__ pl, int* __restrict__ cnt,
                                              int release_first, const float* __restrict__ cosT,
                                              const float* __restrict__ sinT) {
  constexpr int LPK = HD / 8;                // lanes per key
  constexpr int NG = ATT_DEC_THREADS / LPK;  // key groups of the CTA
  constexpr int NP = ATT_BK / NG;            // keys of a block per group
  constexpr int SLOT = 2 * ATT_BK * HD;      // elements of a slot: keys, then values
  extern __shared__ __align__(128) u16 kv[];  // ATT_DEC_STAGES slots
  __shared__ float sm[NG], sl[NG];
  __shared__ float so[NG][HD];
  __shared__ float rm, rl, ro[HD];  // the run's maximum, sum and output (read by cluster rank 0)
  __shared__ __align__(8) u64 bars[ATT_DEC_STAGES];
  __shared__ int last;
  const AttnItem a = attn_item(items, seq_q0, seq_n, seq_past, seq_pt, page, layer, nq, nkv, HD);
  const int id = blockIdx.x, sp = blockIdx.y;
  const int grp = threadIdx.x / LPK, sub = threadIdx.x % LPK;
  const int keys = a.past + 1;  // positions 0 .. past: the cache, the new token's included
  const int splits = gridDim.y;
  const int nblk = (keys + ATT_BK - 1) / ATT_BK;
  const int b0 = (int)((long)sp * nblk / splits), b1 = (int)((long)(sp + 1) * nblk / splits);
  const u32 kv0 = smem_addr(kv), bar0 = smem_addr(bars);
#if __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0) {
    for (int s = 0; s < ATT_DEC_STAGES; ++s) mbar_init(bar0 + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
#endif
  // copy(i, pg) requests block b0 + i, in page pg, into slot i % ATT_DEC_STAGES
  // (the rows before the new token's).
  auto copy = [&](int i, u64 pg) {
    const int blk = b0 + i, s = i % ATT_DEC_STAGES;
    const int rows = min(ATT_BK, a.past - blk * ATT_BK);
    dec_copy<HD>(kv0 + (u32)(s * SLOT * 2), block_keys(a, pg, blk, HD), a.vstep, rows, bar0 + 8 * s);
  };
  {
    u64 pgs[ATT_DEC_STAGES];  // every page read before the first copy: one round trip
#pragma unroll
    for (int i = 0; i < ATT_DEC_STAGES; ++i) pgs[i] = b0 + i < b1 ? block_page(a, b0 + i) : 0;
#pragma unroll
    for (int i = 0; i < ATT_DEC_STAGES; ++i) {
      if (b0 + i < b1) {
        copy(i, pgs[i]);
      } else {
#if __CUDA_ARCH__ < 900
        cp_async_commit();  // an empty group keeps the count of groups per block
#endif
      }
    }
  }
  grid_enter(release_first);
  const u16* qrow = qkv + (size_t)a.qs * qkv_w;
  const int kh = a.head / (nq / nkv);
  // The new token's key and value, this lane's 8 elements, for the run
  // that holds its position: rotated here (cos) or from the cache, whose
  // row new_key addresses (its value a.vstep on).
  const bool has_new = b1 == nblk && b0 < b1;
  auto new_key = [&]() {
    return const_cast<u16*>(block_keys(a, block_page(a, nblk - 1), nblk - 1, HD)) +
           (a.past - (nblk - 1) * ATT_BK) * HD + sub * 8;
  };
  uint4 q, knew = make_uint4(0, 0, 0, 0), vnew = knew;
  if (cosT) {
    q = dec_rope_lane<HD>(qrow + a.head * HD, sub, cosT, sinT, a.past);
    if (has_new) {
      knew = dec_rope_lane<HD>(qrow + (nq + kh) * HD, sub, cosT, sinT, a.past);
      vnew = ldg_cg(qrow + (nq + nkv + kh) * HD + sub * 8);
      if (grp == 0 && a.head % (nq / nkv) == 0) {  // one CTA of the key head writes them
        u16* K = new_key();
        *(uint4*)K = knew;
        *(uint4*)(K + a.vstep) = vnew;
      }
    }
  } else {
    q = ldg_cg(qrow + a.head * HD + sub * 8);
    if (has_new) {
      const u16* K = new_key();
      knew = ldg_cg(K), vnew = ldg_cg(K + a.vstep);
    }
  }
  float m = NEG_INF, l = 0.f, acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  for (int blk = b0; blk < b1; ++blk) {
    const int i = blk - b0, s = i % ATT_DEC_STAGES;
    // The page of the block this slot takes next, read while the slot's
    // block is awaited and used.
    const u64 next_pg = i + ATT_DEC_STAGES < b1 - b0 ? block_page(a, blk + ATT_DEC_STAGES) : 0;
#if __CUDA_ARCH__ >= 900
    mbar_wait(bar0 + 8 * s, (u32)(i / ATT_DEC_STAGES) & 1u);
#else
    cp_async_wait<ATT_DEC_STAGES - 1>();
    __syncthreads();
#endif
    const u16* Ks = kv + s * SLOT;
    const u16* Vs = Ks + ATT_BK * HD;
    const int kn = min(ATT_BK, keys - blk * ATT_BK), fresh = a.past - blk * ATT_BK;  // fresh: the new token's row
    float d[NP];
    uint4 vr[NP];
    float mb = NEG_INF;
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      const int r = j * NG + grp;
      const int o = r * HD + sub * 8;
      uint4 kr;
      if (r == fresh) {
        kr = knew;
        vr[j] = vnew;
      } else {
        kr = *(const uint4*)(Ks + o);
        vr[j] = *(const uint4*)(Vs + o);
      }
      float x = dot8(q, kr, 0.f);
#pragma unroll
      for (int w = LPK / 2; w > 0; w >>= 1) x += __shfl_xor_sync(0xffffffffu, x, w);
      d[j] = r < kn ? x * scale_log2 : NEG_INF;  // rows past the last key hold stale data
      mb = fmaxf(mb, d[j]);
    }
    const float mn = fmaxf(m, mb);
    if (mn != NEG_INF) {
      const float corr = ex2(m - mn);
      l *= corr;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] *= corr;
#pragma unroll
      for (int j = 0; j < NP; ++j)
        if (j * NG + grp < kn) {
          const float p = ex2(d[j] - mn);
          l += p;
          axpy8(acc, p, vr[j]);
        }
      m = mn;
    }
    if (i + ATT_DEC_STAGES < b1 - b0) {
      __syncthreads();  // every thread is done with slot s
      copy(i + ATT_DEC_STAGES, next_pg);
    } else {
#if __CUDA_ARCH__ < 900
      cp_async_commit();
#endif
    }
  }
  if (sub == 0) sm[grp] = m, sl[grp] = l;
#pragma unroll
  for (int e = 0; e < 8; ++e) so[grp][sub * 8 + e] = acc[e];
  __syncthreads();
  // The run's result: its groups merged, column d by thread d.
  auto out_row = [&]() { return out + (size_t)a.qs * nq * HD + a.head * HD; };
  if (threadIdx.x < HD) {
    const int d = threadIdx.x;
    float M = NEG_INF;
    for (int g = 0; g < NG; ++g) M = fmaxf(M, sm[g]);
    float L = 0.f, O = 0.f;
    if (M != NEG_INF)
      for (int g = 0; g < NG; ++g) {
        const float w = ex2(sm[g] - M);  // 0 for a group that saw no key
        L = fmaf(sl[g], w, L);
        O = fmaf(so[g][d], w, O);
      }
    if (splits == 1) {  // the only run: the output (key 0 is in it, so L > 0)
      out_row()[d] = (u16)f_to_bf(O / L);
    } else {
      ro[d] = O;
      if (d == 0) rm = M, rl = L;
    }
  }
  if (splits == 1) return;
#if __CUDA_ARCH__ >= 900
  u32 cl;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(cl));
  if (cl == (u32)splits) {  // launched as a cluster of the runs: rank sp is run sp
    cluster_sync();  // every run's result is in its shared memory
    if (sp == 0 && threadIdx.x < HD) {
      const int d = threadIdx.x;
      const u32 am = smem_addr(&rm), al = smem_addr(&rl), ao = smem_addr(&ro[d]);
      out_row()[d] = (u16)f_to_bf(
          dec_merge(splits, [&](int s, int k) { return ld_cluster(k == 0 ? am : k == 1 ? al : ao, s); }));
    }
    cluster_sync();  // no CTA leaves while rank 0 reads its shared memory
    return;
  }
#endif
  // Through global memory: run sp of (sequence, head) pair id (item nq +
  // head) at pair splits + sp.
  const size_t pair = id;
  if (threadIdx.x < HD) {
    const size_t run = pair * splits + sp;
    po[run * HD + threadIdx.x] = ro[threadIdx.x];
    if (threadIdx.x == 0) pm[run] = rm, pl[run] = rl;
  }
  // The last run of this (sequence, head) merges them all.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&cnt[id], 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x < HD) {
    const int d = threadIdx.x;
    const size_t p0 = pair * splits;
    out_row()[d] = (u16)f_to_bf(dec_merge(splits, [&](int s, int k) {
      return __ldcg(k == 0 ? pm + p0 + s : k == 1 ? pl + p0 + s : po + (p0 + s) * HD + d);
    }));
  }
  if (threadIdx.x == 0) cnt[id] = 0;
}

// ATTN_DEC defines attn_dec<HD>, the entry point of attn_dec_body<HD>.
#define ATTN_DEC(HD)                                                                                                  \
  extern "C" __global__ void __launch_bounds__(ATT_DEC_THREADS)                                                       \
      attn_dec##HD(const u16* __restrict__ qkv, u16* __restrict__ out, const int* __restrict__ items,                 \
                   const int* __restrict__ seq_q0, const int* __restrict__ seq_n, const int* __restrict__ seq_past,   \
                   const u64* __restrict__ seq_pt, int page, int layer, int nq, int nkv, int qkv_w, float scale_log2, \
                   float* __restrict__ po, float* __restrict__ pm, float* __restrict__ pl, int* __restrict__ cnt,     \
                   int release_first, const float* __restrict__ cosT, const float* __restrict__ sinT) {              \
    attn_dec_body<HD>(qkv, out, items, seq_q0, seq_n, seq_past, seq_pt, page, layer, nq, nkv, qkv_w, scale_log2, po,  \
                      pm, pl, cnt, release_first, cosT, sinT);                                                        \
  }
ATTN_DEC(64)
ATTN_DEC(128)
