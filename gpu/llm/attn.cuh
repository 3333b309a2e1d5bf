// attn.cuh: what the attention kernels of attn.cu (mma.sync) and
// attn_wgmma.cu (Hopper wgmma) share: the work-item size, where a block of
// keys is in the cache's pages, and the per-tile online-softmax step
// (cp.async helpers are in common.cuh).
//
// Score and output tiles are 16 query rows in the mma/wgmma accumulator
// layout: in a warp, lane = 4 g + tq holds x[j][2h + e] = row g + 8h,
// column 8j + 2tq + e.
#pragma once
#include "mma.cuh"
#include "kvpage.cuh"

#define ATT_BQ 128  // queries per work item (one CTA of an attention kernel)
#define ATT_BK 64   // keys per block of the tensor-core kernels; a page holds whole blocks

// AttnItem is what every attention kernel's CTA reads first: its work item
// (blockIdx.x = item * nq + head), the item's sequence, and where the
// sequence's keys and values for the head's kv head (GQA: head / (nq /
// nkv)) are in its pages.
struct AttnItem {
  int head, q0;     // the head, and the item's first query among the sequence's new tokens
  int n, past, qs;  // new tokens of the sequence, positions already cached, first flat token
  const u64* pt;    // the sequence's page table
  int koff, vstep;  // from a page's start to the head's keys; from keys to values (elements)
  int bpp;          // blocks of ATT_BK keys per page
};

__device__ __forceinline__ AttnItem attn_item(const int* __restrict__ items, const int* __restrict__ seq_q0,
                                              const int* __restrict__ seq_n, const int* __restrict__ seq_past,
                                              const u64* __restrict__ seq_pt, int page, int layer, int nq,
                                              int nkv, int hd) {
  AttnItem a;
  const int item = blockIdx.x / nq;
  a.head = blockIdx.x % nq;
  const int s = items[2 * item];
  a.q0 = items[2 * item + 1];
  a.n = seq_n[s], a.past = seq_past[s], a.qs = seq_q0[s];
  a.pt = kv_table(seq_pt, s);
  a.koff = kv_off(page, layer, 0, nkv, a.head / (nq / nkv), 0, hd);
  a.vstep = nkv * page * hd;
  a.bpp = page / ATT_BK;
  return a;
}

// block_page returns the address of the page that holds key block blk
// (keys blk * ATT_BK ..): the one load from the page table per block.
__device__ __forceinline__ u64 block_page(const AttnItem& a, int blk) { return a.pt[blk / a.bpp]; }

// block_keys returns the address of key block blk's keys in its page pg
// (from block_page); its values are a.vstep elements further.
__device__ __forceinline__ const u16* block_keys(const AttnItem& a, u64 pg, int blk, int hd) {
  return (const u16*)pg + a.koff + (blk % a.bpp) * ATT_BK * hd;
}

// mask_after sets to -inf the scores of keys k0 + column past each row's
// last key: last0 for row g, last0 + 8 for row g + 8.
template <int NJ>
__device__ __forceinline__ void mask_after(float (&sc)[NJ][4], int k0, int last0, int tq) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (k0 + j * 8 + tq * 2 + (e & 1) > last0 + (e >> 1) * 8) sc[j][e] = NEG_INF;
}

// softmax_probs is one block of the online softmax for a 16-row tile: it
// takes the raw scores sc of NJ x 8 keys, updates the running row maxima
// mrow (kept scaled, in log2 units) and sums lrow, leaves in sc the block's
// unnormalized probabilities, and returns in corr the factor by which the
// rows' earlier outputs must be scaled. The maxima stay finite because key
// 0 is in every row's first block.
template <int NJ>
__device__ __forceinline__ void softmax_probs(float (&sc)[NJ][4], float (&mrow)[2], float (&lrow)[2], float (&corr)[2],
                                              float scale_log2) {
  float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], sc[j][e]);
  float ms[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    float mn = fmaxf(mrow[h], mx[h] * scale_log2);
    corr[h] = ex2(mrow[h] - mn);
    mrow[h] = mn;
    ms[h] = mn;
  }
  float ls[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = ex2(fmaf(sc[j][e], scale_log2, -ms[e >> 1]));
      sc[j][e] = p;
      ls[e >> 1] += p;
    }
#pragma unroll
  for (int h = 0; h < 2; ++h) lrow[h] = lrow[h] * corr[h] + ls[h];
}

// rescale multiplies a 16-row output tile's rows by corr.
template <int NO>
__device__ __forceinline__ void rescale(float (&o)[NO][4], const float (&corr)[2]) {
#pragma unroll
  for (int j = 0; j < NO; ++j) {
    o[j][0] *= corr[0];
    o[j][1] *= corr[0];
    o[j][2] *= corr[1];
    o[j][3] *= corr[1];
  }
}

// softmax_step is softmax_probs followed by the rescaling of the output
// accumulators o.
template <int NJ, int NO>
__device__ __forceinline__ void softmax_step(float (&sc)[NJ][4], float (&mrow)[2], float (&lrow)[2], float (&o)[NO][4],
                                             float scale_log2) {
  float corr[2];
  softmax_probs(sc, mrow, lrow, corr, scale_log2);
  rescale(o, corr);
}


// store_rows writes a 16-row output tile, normalized by the row sums (summed
// over the quad here), for the rows below n; orow0 points at row g's first
// column of this lane (column 2tq).
template <int NO>
__device__ __forceinline__ void store_rows(const float (&o)[NO][4], const float (&lrow)[2], u16* orow0, size_t pitch,
                                           int row_g, int n) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = lrow[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (row_g + 8 * h >= n) continue;
    float il = 1.f / l;
    u16* orow = orow0 + (size_t)(8 * h) * pitch;
#pragma unroll
    for (int j = 0; j < NO; ++j) *(u32*)(orow + j * 8) = pack_bf2(o[j][2 * h] * il, o[j][2 * h + 1] * il);
  }
}
