// optim.cu: the optimizer kernels of GPU training (package gpu/trainer):
// the gradient's sum of squares, the fused AdamW update with the clipping
// factor applied to the gradient as it is read (fp32
// master weights and moments, bf16 copy for the GEMMs) and the
// re-initialisation of MLP units. No CUDA headers: common.cuh comes from
// the launcher.

#include "common.cuh"

// aligned16 reports whether p is 16-byte aligned (float4 loads).
__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

// sumsq: part[b] = block b's sum of x[i]^2 over its grid-stride share of n
// values (float4 at a time when x is 16-byte aligned, the last n % 4 by
// block 0's first threads); sum_f64 adds the blocks' sums in order (no
// atomics: the gradient norm, and so the clipping, repeats bit for bit).
// Grid: flatBlocks(n) blocks of 256 threads (at most 1024, whatever the
// device, so the order of the sum depends on n alone).
extern "C" __global__ void sumsq(const float* __restrict__ x, long long n, double* __restrict__ part) {
  float s = 0.f;
  const long long n4 = aligned16(x) ? n / 4 : 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += stride) {
    const float4 v = ((const float4*)x)[i];
    s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  for (long long i = 4 * n4 + blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) s += x[i] * x[i];
  s = block_sum(s);
  if (threadIdx.x == 0) part[blockIdx.x] = (double)s;
}

// adamw_one is one AdamW step of one value, in the CPU reference's float32
// arithmetic and order, with the gradient first scaled by gs (the clipping
// factor, 1 without clipping; g * gs is the product the clipped gradient
// would hold):
//   g = g gs;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   w -= wd w;  w -= step_size m / (sqrt(v) inv_b2c + eps)
__device__ __forceinline__ void adamw_one(float& w, float& m, float& v, float g, float gs, float b1, float b2, float wd,
                                          float step_size, float inv_b2c, float eps) {
  g = g * gs;
  m = b1 * m + (1.f - b1) * g;
  v = b2 * v + (1.f - b2) * g * g;
  w -= wd * w;
  w -= step_size * m / (sqrtf(v) * inv_b2c + eps);
}

// adamw: one AdamW step (adamw_one) over n values, and wb = bf16(w): four
// values a thread at a time (16-byte loads of w, g, m, v, an 8-byte store
// of wb) when every pointer allows, the rest one at a time. Grid-stride:
// flatBlocks(ceil(n / 4)) blocks of 256 threads, one launch per run of
// tensors of Update.
extern "C" __global__ void adamw(float* __restrict__ w, u16* __restrict__ wb, const float* __restrict__ g,
                                 float* __restrict__ m, float* __restrict__ v, long long n, float gs, float b1,
                                 float b2, float wd, float step_size, float inv_b2c, float eps) {
  const bool vec = aligned16(w) && aligned16(g) && aligned16(m) && aligned16(v) && ((unsigned long long)wb & 7) == 0;
  const long long n4 = vec ? n / 4 : 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += stride) {
    float4 wv = ((float4*)w)[i], mv = ((float4*)m)[i], vv = ((float4*)v)[i];
    const float4 gv = ((const float4*)g)[i];
    adamw_one(wv.x, mv.x, vv.x, gv.x, gs, b1, b2, wd, step_size, inv_b2c, eps);
    adamw_one(wv.y, mv.y, vv.y, gv.y, gs, b1, b2, wd, step_size, inv_b2c, eps);
    adamw_one(wv.z, mv.z, vv.z, gv.z, gs, b1, b2, wd, step_size, inv_b2c, eps);
    adamw_one(wv.w, mv.w, vv.w, gv.w, gs, b1, b2, wd, step_size, inv_b2c, eps);
    ((float4*)w)[i] = wv;
    ((float4*)m)[i] = mv;
    ((float4*)v)[i] = vv;
    ((uint2*)wb)[i] = make_uint2(pack_bf2(wv.x, wv.y), pack_bf2(wv.z, wv.w));
  }
  for (long long i = 4 * n4 + blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
    float wv = w[i], mv = m[i], vv = v[i];
    adamw_one(wv, mv, vv, g[i], gs, b1, b2, wd, step_size, inv_b2c, eps);
    w[i] = wv;
    m[i] = mv;
    v[i] = vv;
    wb[i] = (u16)f_to_bf(wv);
  }
}

// to_bf16: wb = bf16(w) over n values (after an upload).
extern "C" __global__ void to_bf16(const float* __restrict__ w, u16* __restrict__ wb, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    wb[i] = (u16)f_to_bf(w[i]);
}

// reinit_rows: for each of n units (blockIdx.x), row units[k] of a tensor
// of rows of h values gets rows[k] (rows null: zeros), its bf16 copy too,
// and zero moments. m and v hold the moments of the tensor's values
// [mlo, mhi) only (a data-parallel rank's shard: m[0] is value mlo's).
extern "C" __global__ void reinit_rows(float* __restrict__ w, u16* __restrict__ wb, float* __restrict__ m,
                                       float* __restrict__ v, const float* __restrict__ rows,
                                       const int* __restrict__ units, int h, long long mlo, long long mhi) {
  int k = blockIdx.x;
  size_t base = (size_t)units[k] * h;
  for (int i = threadIdx.x; i < h; i += blockDim.x) {
    float x = rows ? rows[(size_t)k * h + i] : 0.f;
    long long e = (long long)(base + i);
    w[e] = x;
    wb[e] = (u16)f_to_bf(x);
    if (e >= mlo && e < mhi) {
      m[e - mlo] = 0.f;
      v[e - mlo] = 0.f;
    }
  }
}
