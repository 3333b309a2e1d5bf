// optim.cu: the optimizer kernels of GPU training (package gpu/trainer):
// the gradient's sum of squares, scaling, the fused AdamW update (fp32
// master weights and moments, bf16 copy for the GEMMs) and the
// re-initialisation of MLP units. No CUDA headers: common.cuh comes from
// the launcher.

#include "common.cuh"

// sumsq: part[b] = block b's sum of x[i]^2 over its grid-stride share of n
// values; sum_f64 adds the blocks' sums in order (no atomics: the
// gradient norm, and so the clipping, repeats bit for bit).
extern "C" __global__ void sumsq(const float* __restrict__ x, long long n, double* __restrict__ part) {
  float s = 0.f;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    s += x[i] * x[i];
  s = block_sum(s);
  if (threadIdx.x == 0) part[blockIdx.x] = (double)s;
}

// scale: x *= s over n values.
extern "C" __global__ void scale(float* __restrict__ x, long long n, float s) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    x[i] *= s;
}

// adamw: one AdamW step over n values, in the CPU reference's float32
// arithmetic and order:
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   w -= wd w;  w -= step_size m / (sqrt(v) inv_b2c + eps)
// and wb = bf16(w).
extern "C" __global__ void adamw(float* __restrict__ w, u16* __restrict__ wb, const float* __restrict__ g,
                                 float* __restrict__ m, float* __restrict__ v, long long n, float b1, float b2,
                                 float wd, float step_size, float inv_b2c, float eps) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    float gv = g[i];
    float mv = b1 * m[i] + (1.f - b1) * gv;
    float vv = b2 * v[i] + (1.f - b2) * gv * gv;
    float wv = w[i];
    wv -= wd * wv;
    wv -= step_size * mv / (sqrtf(vv) * inv_b2c + eps);
    m[i] = mv;
    v[i] = vv;
    w[i] = wv;
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
