// norm.cu: the embedding lookup and the fused residual add + RMSNorm of the
// GPU Llama forward (package gpu/llm).
// Storage is bf16 (weights, activations between GEMMs, the KV cache); the
// residual stream and the norm weights are fp32, and all arithmetic is fp32.
// No CUDA headers: package gpu's common.cuh (bf16 helpers, dot8, cp.async)
// and the headers named below come from the launcher (gpu.Headers).

#include "common.cuh"


// embed: resid[t] = table[ids[t]] (bf16 -> fp32). One block per token.
extern "C" __global__ void embed(const u16* __restrict__ table, const int* __restrict__ ids, float* __restrict__ resid,
                                 int d) {
  int t = blockIdx.x;
  const u16* row = table + (size_t)ids[t] * d;
  float* out = resid + (size_t)t * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = bf_to_f(row[i]);
}

// add_rmsnorm: for output row b (one block each), with r = rows ? rows[b] : b,
//   v = resid[r] + (delta ? delta[r] : 0)
//   out[b] = bf16(v / sqrt(mean(v^2) + eps) * w)
// and, when rows is null, resid[r] = v (the residual add). With rows set
// (the final norm of the rows whose logits are wanted) resid is not written.
// When d is a multiple of 4 and at most 16 per thread, each thread keeps
// its values in registers between the sum of squares and the output (one
// pass over memory, its loads issued together: decode steps run this at a
// few tokens, where latency is all that counts); else a plain two-pass loop.
//
// Launched with early start, it waits (grid_wait) before reading resid and
// delta, and reads them through the L2.
extern "C" __global__ void add_rmsnorm(float* __restrict__ resid, const u16* __restrict__ delta,
                                       const int* __restrict__ rows, const float* __restrict__ w, u16* __restrict__ out,
                                       int d, float eps) {
  grid_wait();
  grid_release();
  int b = blockIdx.x;
  int r = rows ? rows[b] : b;
  float* x = resid + (size_t)r * d;
  const u16* dl = delta ? delta + (size_t)r * d : nullptr;
  u16* o = out + (size_t)b * d;
  if (rms_fits(d)) {  // common.cuh
    float4 v[RMS_MAXV], wv[RMS_MAXV];
    rms_weights(wv, w, d);
    rms_load(v, x, dl, d);
    const int n4 = d / 4;
    if (dl && !rows)
#pragma unroll
      for (int k = 0; k < RMS_MAXV; ++k) {
        int i = threadIdx.x + k * blockDim.x;
        if (i < n4) ((float4*)x)[i] = v[k];
      }
    float inv = rms_inv(v, d, eps);
#pragma unroll
    for (int k = 0; k < RMS_MAXV; ++k) {
      int i = threadIdx.x + k * blockDim.x;
      if (i < n4) ((uint2*)o)[i] = rms_pack(v[k], inv, wv[k]);
    }
    return;
  }
  float ss = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float v = __ldcg(x + i);
    if (dl) {
      v += bf_to_f(__ldcg(dl + i));
      if (!rows) x[i] = v;
    }
    ss += v * v;
  }
  // Each thread re-reads only the elements it wrote, so no barrier is
  // needed between the write above and the read below.
  float inv = rsqrtf(block_sum(ss) / (float)d + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float v = x[i];
    if (dl && rows) v += bf_to_f(__ldcg(dl + i));
    o[i] = (u16)f_to_bf(v * inv * w[i]);
  }
}

