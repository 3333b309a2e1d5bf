// kvpage.cuh: how the kernels of package gpu/llm address the KV cache.
//
// A sequence's cache is a list of pages of `page` positions each, anywhere
// in device memory; a page is bf16 [layer][k|v][kv_head][page][head_dim].
// The per-forward metadata gives sequence s its page table, seq_pt[s]: the
// address of an array of its pages' addresses, page i holding positions
// i * page .. i * page + page - 1. page is a multiple of ATT_BK (attn.cuh),
// so that a block of keys of the attention kernels lies in one page, and
// the engine keeps a page under 2 GiB, so offsets inside one fit an int.
#pragma once

// kv_table returns sequence s's page table.
__device__ __forceinline__ const u64* kv_table(const u64* __restrict__ seq_pt, int s) {
  return (const u64*)seq_pt[s];
}

// kv_off returns the offset (bf16 elements) from a page's start of row pp
// (a position's index in its page) of layer's keys (kv = 0) or values
// (kv = 1) of kv head kh.
__device__ __forceinline__ int kv_off(int page, int layer, int kv, int nkv, int kh, int pp, int hd) {
  return (((layer * 2 + kv) * nkv + kh) * page + pp) * hd;
}
