// rope.cu: rotary position embedding and the KV-cache write after the
// q/k/v GEMM of prefill passes (package gpu/llm).
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
#include "kvpage.cuh"
#include "rope.cuh"

// rope_kv: for flat token t (one block each), rotate its query heads in
// place in qkv (rows of qkv_w bf16: nq query heads, nkv key heads, nkv value
// heads; with rot_q = 0 the queries are left as they are, for an attention
// kernel that rotates them as it loads them) and write its rotated keys and
// its values into its sequence's KV cache at its position. Hugging Face's
// rotate_half: pairs (i, i + hd/2) by rope_rotate (rope.cuh). cos and sin
// are fp32 [position][hd/2].
extern "C" __global__ void rope_kv(u16* __restrict__ qkv, const float* __restrict__ cosT,
                                   const float* __restrict__ sinT, const int* __restrict__ tok_seq,
                                   const int* __restrict__ tok_pos, const u64* __restrict__ seq_pt, int page,
                                   int layer, int nq, int nkv, int hd, int qkv_w, int rot_q) {
  int t = blockIdx.x;
  int s = tok_seq[t], p = tok_pos[t];
  int half = hd / 2, h0 = rot_q ? 0 : nq;  // the first head rotated here
  u16* row = qkv + (size_t)t * qkv_w;
  u16* pg = (u16*)kv_table(seq_pt, s)[p / page];  // the page of position p, row pp of it
  int pp = p % page;
  const float* c = cosT + (size_t)p * half;
  const float* sn = sinT + (size_t)p * half;
  if (hd % 16 == 0) {
    // 8 pairs per thread and 16-byte copies: 2-byte accesses ran at half
    // the memory bandwidth (1.55 ms per layer for 131072 tokens on an
    // H200, where 3.2 GB move).
    int q8 = half / 8, groups = (nq + nkv - h0) * q8;
    for (int i = threadIdx.x; i < groups; i += blockDim.x) {
      int h = h0 + i / q8, j = (i % q8) * 8;
      u16* v = row + h * hd;
      uint4 A = *(const uint4*)(v + j), B = *(const uint4*)(v + j + half);
      rope_rotate8(A, B, c + j, sn + j);
      u16* dst = h < nq ? v : pg + kv_off(page, layer, 0, nkv, h - nq, pp, hd);
      *(uint4*)(dst + j) = A;
      *(uint4*)(dst + j + half) = B;
    }
    int nv8 = nkv * hd / 8;
    const uint4* vals = (const uint4*)(row + (nq + nkv) * hd);
    for (int i = threadIdx.x; i < nv8; i += blockDim.x) {
      int kh = i * 8 / hd, j = i * 8 - kh * hd;
      *(uint4*)(pg + kv_off(page, layer, 1, nkv, kh, pp, hd) + j) = vals[i];
    }
    return;
  }
  int pairs = (nq + nkv - h0) * half;
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    int h = h0 + i / half, j = i % half;
    u16* v = row + h * hd;
    float ra, rb;
    rope_rotate(bf_to_f(v[j]), bf_to_f(v[j + half]), c[j], sn[j], ra, rb);
    u16 oa = (u16)f_to_bf(ra), ob = (u16)f_to_bf(rb);
    if (h < nq) {
      v[j] = oa;
      v[j + half] = ob;
    } else {
      int kh = h - nq;
      u16* dst = pg + kv_off(page, layer, 0, nkv, kh, pp, hd);
      dst[j] = oa;
      dst[j + half] = ob;
    }
  }
  int nv = nkv * hd;
  for (int i = threadIdx.x; i < nv; i += blockDim.x) {
    int kh = i / hd, j = i % hd;
    u16* dst = pg + kv_off(page, layer, 1, nkv, kh, pp, hd);
    dst[j] = row[(nq + nkv) * hd + i];
  }
}
