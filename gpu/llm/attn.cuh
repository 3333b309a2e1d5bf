// attn.cuh: what the attention kernels of attn.cu (mma.sync) and
// attn_wgmma.cu (Hopper wgmma) share: the work-item size, where a block of
// keys is in the cache's pages, and the causal mask (the online-softmax
// step is mma.cuh's, cp.async helpers are in common.cuh).
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

