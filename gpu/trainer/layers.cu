// layers.cu: the per-layer kernels of GPU training (package gpu/trainer):
// embedding, RMSNorm, RoPE, casts, the ReLU MLP activation with its L1
// statistics, and the cross-entropy of a chunk of logits, each forward
// beside its backward. Master values are fp32; bf16 only feeds GEMMs.
// No CUDA headers: package gpu's common.cuh comes from the launcher.

#include "common.cuh"


__device__ __forceinline__ float block_max(float v) {
  __shared__ float part[32];
  __shared__ float total;
  __syncthreads();
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) part[w] = v;
  __syncthreads();
  if (w == 0) {
    float s = lane < (int)(blockDim.x >> 5) ? part[lane] : -3.0e38f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, o));
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// embed_fwd: x[t] = table[ids[t]] (fp32). One block per token.
extern "C" __global__ void embed_fwd(const float* __restrict__ table, const int* __restrict__ ids,
                                     float* __restrict__ x, int h) {
  int t = blockIdx.x;
  const float* row = table + (size_t)ids[t] * h;
  for (int i = threadIdx.x; i < h; i += blockDim.x) x[(size_t)t * h + i] = row[i];
}

// embed_bwd: gtable[ids[t]] += dx[t]. One block per token; tokens sharing
// an id add through atomics.
extern "C" __global__ void embed_bwd(float* __restrict__ gtable, const int* __restrict__ ids,
                                     const float* __restrict__ dx, int h) {
  int t = blockIdx.x;
  float* row = gtable + (size_t)ids[t] * h;
  for (int i = threadIdx.x; i < h; i += blockDim.x) atomicAdd(&row[i], dx[(size_t)t * h + i]);
}

// rmsnorm_fwd: rstd[r] = 1/sqrt(mean(x[r]^2) + eps), y[r] = bf16(x[r] *
// rstd[r] * w). One block per row.
extern "C" __global__ void rmsnorm_fwd(const float* __restrict__ x, const float* __restrict__ w,
                                       u16* __restrict__ y, float* __restrict__ rstd, int h, float eps) {
  int r = blockIdx.x;
  const float* xr = x + (size_t)r * h;
  float ss = 0.f;
  for (int i = threadIdx.x; i < h; i += blockDim.x) ss += xr[i] * xr[i];
  float iv = 1.f / sqrtf(block_sum(ss) / (float)h + eps);
  if (threadIdx.x == 0) rstd[r] = iv;
  for (int i = threadIdx.x; i < h; i += blockDim.x) y[(size_t)r * h + i] = (u16)f_to_bf(xr[i] * iv * w[i]);
}

// rmsnorm_bwd_dx: dx[r] += dy*w*iv - x*(sum(dy*w*x) * iv^3 / h), the
// input gradient added into the residual stream's. One block per row.
extern "C" __global__ void rmsnorm_bwd_dx(float* __restrict__ dx, const float* __restrict__ dy,
                                          const float* __restrict__ x, const float* __restrict__ w,
                                          const float* __restrict__ rstd, int h) {
  int r = blockIdx.x;
  const float* xr = x + (size_t)r * h;
  const float* dyr = dy + (size_t)r * h;
  float* dxr = dx + (size_t)r * h;
  float dot = 0.f;
  for (int i = threadIdx.x; i < h; i += blockDim.x) dot += dyr[i] * w[i] * xr[i];
  float iv = rstd[r];
  float c = block_sum(dot) * iv * iv * iv / (float)h;
  for (int i = threadIdx.x; i < h; i += blockDim.x) dxr[i] += dyr[i] * w[i] * iv - xr[i] * c;
}

// rmsnorm_bwd_dw: dw[i] += sum over rows of dy[r][i] * x[r][i] * rstd[r].
// Thread = column; blockIdx.y takes rows_per rows; one atomic per thread.
extern "C" __global__ void rmsnorm_bwd_dw(float* __restrict__ dw, const float* __restrict__ dy,
                                          const float* __restrict__ x, const float* __restrict__ rstd, int rows,
                                          int h, int rows_per) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= h) return;
  int r0 = blockIdx.y * rows_per, r1 = min(rows, r0 + rows_per);
  float s = 0.f;
  for (int r = r0; r < r1; ++r) s += dy[(size_t)r * h + i] * x[(size_t)r * h + i] * rstd[r];
  atomicAdd(&dw[i], s);
}

// rope_cast: dst (bf16) = src (fp32) with the first nrot heads of hd values
// of each token rotated by its position's angles (sign -1: the inverse
// rotation, the backward), the other columns of the width-wide row copied.
// Token t sits at position t % seq; cos and sin are [position][hd/2].
// One block per token.
extern "C" __global__ void rope_cast(const float* __restrict__ src, u16* __restrict__ dst,
                                     const float* __restrict__ cosT, const float* __restrict__ sinT, int seq,
                                     int nrot, int hd, int width, float sign) {
  int t = blockIdx.x;
  int half = hd / 2, pos = t % seq;
  const float* s = src + (size_t)t * width;
  u16* d = dst + (size_t)t * width;
  for (int p = threadIdx.x; p < nrot * half; p += blockDim.x) {
    int head = p / half, i = p % half;
    float c = cosT[pos * half + i], sn = sign * sinT[pos * half + i];
    float a = s[head * hd + i], b = s[head * hd + i + half];
    d[head * hd + i] = (u16)f_to_bf(a * c - b * sn);
    d[head * hd + i + half] = (u16)f_to_bf(b * c + a * sn);
  }
  for (int i = nrot * hd + threadIdx.x; i < width; i += blockDim.x) d[i] = (u16)f_to_bf(s[i]);
}

// cast_bf16: dst = bf16(src), n values.
extern "C" __global__ void cast_bf16(const float* __restrict__ src, u16* __restrict__ dst, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = (u16)f_to_bf(src[i]);
}

// unit_pre returns the pre-activations of unit j in row r: gated, gu rows
// hold the f gate values then the f up values; ungated, the f up values.
__device__ __forceinline__ void unit_pre(const float* gu, int r, int j, int f, int gated, float& g, float& u) {
  if (gated) {
    g = gu[(size_t)r * 2 * f + j];
    u = gu[(size_t)r * 2 * f + f + j];
  } else {
    u = gu[(size_t)r * f + j];
    g = u;
  }
}

// unit_out returns h, the hidden activation: relu(g) * u (gated) or relu(u).
__device__ __forceinline__ float unit_out(float g, float u, int gated) {
  if (!(g > 0.f)) return 0.f;
  return gated ? g * u : u;
}

// relu_fwd: h = bf16(relu(g) * u) or bf16(relu(u)) for m rows of f units,
// and the statistics: active[j] += rows where unit j fired (g > 0),
// stats[0] += l1_scale * sum |h|, stats[1] += l0_scale * (units fired).
// Thread = unit; blockIdx.y takes rows_per rows.
extern "C" __global__ void relu_fwd(const float* __restrict__ gu, u16* __restrict__ hout, int* __restrict__ active,
                                    double* __restrict__ stats, int m, int f, int gated, int rows_per,
                                    double l1_scale, double l0_scale) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  int r0 = blockIdx.y * rows_per, r1 = min(m, r0 + rows_per);
  int cnt = 0;
  float sabs = 0.f;
  if (j < f) {
    for (int r = r0; r < r1; ++r) {
      float g, u;
      unit_pre(gu, r, j, f, gated, g, u);
      float hv = unit_out(g, u, gated);
      cnt += g > 0.f;
      sabs += fabsf(hv);
      hout[(size_t)r * f + j] = (u16)f_to_bf(hv);
    }
    if (cnt) atomicAdd(&active[j], cnt);
  }
  float c = warp_sum((float)cnt);
  sabs = warp_sum(sabs);
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&stats[0], (double)sabs * l1_scale);
    atomicAdd(&stats[1], (double)c * l0_scale);
  }
}

// relu_bwd: dgu = bf16 gradient of the pre-activations from dh (fp32, the
// gradient of h) plus l1_grad * sign(h): gated, dg = dh'*u and du = dh'*g
// where g > 0; ungated, du = dh' where u > 0. Zero elsewhere.
extern "C" __global__ void relu_bwd(const float* __restrict__ gu, const float* __restrict__ dh,
                                    u16* __restrict__ dgu, int m, int f, int gated, float l1_grad) {
  long long n = (long long)m * f;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    int r = (int)(i / f), j = (int)(i % f);
    float g, u;
    unit_pre(gu, r, j, f, gated, g, u);
    float hv = unit_out(g, u, gated);
    float d = dh[i];
    if (hv > 0.f) d += l1_grad;
    if (hv < 0.f) d -= l1_grad;
    bool on = g > 0.f;
    if (gated) {
      dgu[(size_t)r * 2 * f + j] = (u16)f_to_bf(on ? d * u : 0.f);
      dgu[(size_t)r * 2 * f + f + j] = (u16)f_to_bf(on ? d * g : 0.f);
    } else {
      dgu[i] = (u16)f_to_bf(on ? d : 0.f);
    }
  }
}

// ce_chunk: for each row (one block) of fp32 logits [rows][V] with its
// target: loss[0] += loss_scale * (logsumexp(row) - row[target]); with
// dlogits set, dlogits (bf16) = grad_scale * (softmax(row) - onehot(target)).
extern "C" __global__ void ce_chunk(const float* __restrict__ logits, const int* __restrict__ targets,
                                    u16* __restrict__ dlogits, double* __restrict__ loss, int V, float grad_scale,
                                    double loss_scale) {
  int r = blockIdx.x;
  const float* row = logits + (size_t)r * V;
  int t = targets[r];
  float mx = -3.0e38f;
  for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, row[i]);
  mx = block_max(mx);
  float s = 0.f;
  for (int i = threadIdx.x; i < V; i += blockDim.x) s += expf(row[i] - mx);
  s = block_sum(s);
  if (threadIdx.x == 0) atomicAdd(loss, (double)(logf(s) - (row[t] - mx)) * loss_scale);
  if (!dlogits) return;
  float inv = grad_scale / s;
  u16* d = dlogits + (size_t)r * V;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    float p = expf(row[i] - mx) * inv;
    if (i == t) p -= grad_scale;
    d[i] = (u16)f_to_bf(p);
  }
}
