// dense.cu: elementwise kernels of the dense MLP (DenseMLP: the cuBLASLt
// baseline, the automatic path's dense branch, and the model layers the
// TwELL kernels do not take). The ReLU ones also count the active gate
// units, so that the automatic path sees the density of every batch.
#include "common.cuh"

// block_count adds the block's counts to *nnz with one atomic per block
// (one address: per-warp atomics would queue up at its L2 slice).
__device__ __forceinline__ void block_count(u32 cnt, u64* nnz) {
  __shared__ u32 part[8];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = cnt;
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 t = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t += part[w];
    if (t) atomicAdd(nnz, (u64)t);
  }
}

// relu_mul: h = bf16(relu(g) * u), 8 bf16 per thread per step; n % 8 == 0.
// h may alias g or u (each element is read and written by one thread).
// Adds the number of g > 0 to *nnz.
__global__ void __launch_bounds__(256)
    relu_mul(const u16* g, const u16* u, u16* h, long long n,
             u64* __restrict__ nnz) {
  u32 cnt = 0;
  for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < n;
       i += (long long)gridDim.x * blockDim.x * 8) {
    uint4 gv = *(const uint4*)(g + i), uv = *(const uint4*)(u + i);
    u32 gw[4] = {gv.x, gv.y, gv.z, gv.w}, uw[4] = {uv.x, uv.y, uv.z, uv.w}, o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float g0 = bf_lo(gw[k]), g1 = bf_hi(gw[k]);
      cnt += (g0 > 0.f) + (g1 > 0.f);
      o[k] = pack_bf2(fmaxf(g0, 0.f) * bf_lo(uw[k]), fmaxf(g1, 0.f) * bf_hi(uw[k]));
    }
    uint4 ov;
    ov.x = o[0];
    ov.y = o[1];
    ov.z = o[2];
    ov.w = o[3];
    *(uint4*)(h + i) = ov;
  }
  block_count(cnt, nnz);
}

// relu_inplace: h = relu(h) for the non-gated MLP; counts h > 0.
__global__ void __launch_bounds__(256) relu_inplace(u16* __restrict__ h, long long n, u64* __restrict__ nnz) {
  u32 cnt = 0;
  for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < n;
       i += (long long)gridDim.x * blockDim.x * 8) {
    uint4 hv = *(uint4*)(h + i);
    u32 w[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float a = bf_lo(w[k]), b = bf_hi(w[k]);
      cnt += (a > 0.f) + (b > 0.f);
      w[k] = pack_bf2(fmaxf(a, 0.f), fmaxf(b, 0.f));
    }
    hv.x = w[0];
    hv.y = w[1];
    hv.z = w[2];
    hv.w = w[3];
    *(uint4*)(h + i) = hv;
  }
  block_count(cnt, nnz);
}

// ---------------------------------------------------------------------------
// Gathered dense pass over the rows D2T flagged (MLP.gatheredDense).

// gather_rows copies row ovf[1+i] of src into row i of dst for the block's
// i < min(ovf[0], R); d bf16 per row, d % 8 == 0.
__global__ void gather_rows(const u16* __restrict__ src, u16* __restrict__ dst, const int* __restrict__ ovf, int R,
                            int d) {
  const int i = blockIdx.x;
  if (i >= min(ovf[0], R)) return;
  const uint4* s = (const uint4*)(src + (size_t)ovf[1 + i] * d);
  uint4* o = (uint4*)(dst + (size_t)i * d);
  for (int k = threadIdx.x; k < d / 8; k += blockDim.x) o[k] = s[k];
}

// scatter_rows copies row i of src into row ovf[1+i] of dst (the inverse of
// gather_rows).
__global__ void scatter_rows(const u16* __restrict__ src, u16* __restrict__ dst, const int* __restrict__ ovf, int R,
                             int d) {
  const int i = blockIdx.x;
  if (i >= min(ovf[0], R)) return;
  const uint4* s = (const uint4*)(src + (size_t)i * d);
  uint4* o = (uint4*)(dst + (size_t)ovf[1 + i] * d);
  for (int k = threadIdx.x; k < d / 8; k += blockDim.x) o[k] = s[k];
}

// act_exact: h = g * u (gated) or g where g is active (> 0 or NaN, as in
// row_fallback), else 0; n % 8 == 0. h may alias g.
template <bool GATED>
__global__ void __launch_bounds__(256) act_exact(const u16* g, const u16* u, u16* h, long long n) {
  for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < n;
       i += (long long)gridDim.x * blockDim.x * 8) {
    uint4 gv = *(const uint4*)(g + i), uv = gv;
    if (GATED) uv = *(const uint4*)(u + i);
    u32 gw[4] = {gv.x, gv.y, gv.z, gv.w}, uw[4] = {uv.x, uv.y, uv.z, uv.w}, o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float g0 = bf_lo(gw[k]), g1 = bf_hi(gw[k]);
      float h0 = (g0 > 0.f || g0 != g0) ? (GATED ? g0 * bf_lo(uw[k]) : g0) : 0.f;
      float h1 = (g1 > 0.f || g1 != g1) ? (GATED ? g1 * bf_hi(uw[k]) : g1) : 0.f;
      o[k] = pack_bf2(h0, h1);
    }
    uint4 ov;
    ov.x = o[0];
    ov.y = o[1];
    ov.z = o[2];
    ov.w = o[3];
    *(uint4*)(h + i) = ov;
  }
}

// act_mul: the DenseMLP's elementwise step where relu_mul does not apply
// (SiLU gates, or F not a multiple of 8), one value per thread per step.
// act 0: relu, 1: silu. gated: g = act(g) * u; else g = act(g) (u unused).
// Counts nothing.
__device__ __forceinline__ float act_f(float x, int act) {
  if (act == 0) return fmaxf(x, 0.f);
  return x / (1.f + __expf(-x));
}

__global__ void act_mul(u16* __restrict__ g, const u16* __restrict__ u, long long n, int act, int gated) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    float v = act_f(bf_to_f(g[i]), act);
    if (gated) v *= bf_to_f(u[i]);
    g[i] = (u16)f_to_bf(v);
  }
}
