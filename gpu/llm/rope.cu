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

// rope_kv: for flat token t (one block each), rotate its query heads in
// place in qkv (rows of qkv_w bf16: nq query heads, nkv key heads, nkv value
// heads) and write its rotated keys and its values into its sequence's KV
// cache at its position. Hugging Face's rotate_half: pairs (i, i + hd/2),
//   a' = a cos - b sin,  b' = b cos + a sin.
// cos and sin are fp32 [position][hd/2].
extern "C" __global__ void rope_kv(u16* __restrict__ qkv, const float* __restrict__ cosT,
                                   const float* __restrict__ sinT, const int* __restrict__ tok_seq,
                                   const int* __restrict__ tok_pos, const u64* __restrict__ seq_pt, int page,
                                   int layer, int nq, int nkv, int hd, int qkv_w) {
  int t = blockIdx.x;
  int s = tok_seq[t], p = tok_pos[t];
  int half = hd / 2;
  u16* row = qkv + (size_t)t * qkv_w;
  u16* pg = (u16*)kv_table(seq_pt, s)[p / page];  // the page of position p, row pp of it
  int pp = p % page;
  const float* c = cosT + (size_t)p * half;
  const float* sn = sinT + (size_t)p * half;
  if (hd % 8 == 0) {
    // 4 pairs per thread and 16-byte copies of the values: the 2-byte
    // accesses below ran at half the memory bandwidth (1.55 ms per layer
    // for 131072 tokens on an H200, where 3.2 GB move).
    int q4 = half / 4, groups = (nq + nkv) * q4;
    for (int i = threadIdx.x; i < groups; i += blockDim.x) {
      int h = i / q4, j = (i - h * q4) * 4;
      u16* v = row + h * hd;
      uint2 A = *(const uint2*)(v + j), B = *(const uint2*)(v + j + half);
      float4 C = *(const float4*)(c + j), S = *(const float4*)(sn + j);
      float a[4] = {bf_lo(A.x), bf_hi(A.x), bf_lo(A.y), bf_hi(A.y)};
      float b[4] = {bf_lo(B.x), bf_hi(B.x), bf_lo(B.y), bf_hi(B.y)};
      float cc[4] = {C.x, C.y, C.z, C.w}, ss[4] = {S.x, S.y, S.z, S.w};
      float ra[4], rb[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        ra[k] = a[k] * cc[k] - b[k] * ss[k];
        rb[k] = b[k] * cc[k] + a[k] * ss[k];
      }
      u16* dst = h < nq ? v : pg + kv_off(page, layer, 0, nkv, h - nq, pp, hd);
      *(uint2*)(dst + j) = make_uint2(pack_bf2(ra[0], ra[1]), pack_bf2(ra[2], ra[3]));
      *(uint2*)(dst + j + half) = make_uint2(pack_bf2(rb[0], rb[1]), pack_bf2(rb[2], rb[3]));
    }
    int nv8 = nkv * hd / 8;
    const uint4* vals = (const uint4*)(row + (nq + nkv) * hd);
    for (int i = threadIdx.x; i < nv8; i += blockDim.x) {
      int kh = i * 8 / hd, j = i * 8 - kh * hd;
      *(uint4*)(pg + kv_off(page, layer, 1, nkv, kh, pp, hd) + j) = vals[i];
    }
    return;
  }
  int pairs = (nq + nkv) * half;
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    int h = i / half, j = i % half;
    u16* v = row + h * hd;
    float a = bf_to_f(v[j]), b = bf_to_f(v[j + half]);
    float ra = a * c[j] - b * sn[j], rb = b * c[j] + a * sn[j];
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

