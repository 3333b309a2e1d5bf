// layers.cu: the per-layer kernels of GPU training (package gpu/trainer):
// embedding, RMSNorm, RoPE, casts, the ReLU MLP activation with its L1
// statistics, and the cross-entropy of a chunk of logits, each forward
// beside its backward. Master values are fp32; bf16 only feeds GEMMs.
// No CUDA headers: package gpu's common.cuh comes from the launcher.
//
// No floating-point atomics: a sum across blocks is written as per-block
// partial sums that a second kernel adds up in a fixed order, so that a
// training step repeats bit for bit.

#include "common.cuh"

// embed_fwd: x[t] = table[ids[t]] (fp32). One block per token.
extern "C" __global__ void embed_fwd(const float* __restrict__ table, const int* __restrict__ ids,
                                     float* __restrict__ x, int h) {
  int t = blockIdx.x;
  const float* row = table + (size_t)ids[t] * h;
  for (int i = threadIdx.x; i < h; i += blockDim.x) x[(size_t)t * h + i] = row[i];
}

// block_sum_f64 returns the sum of v over the block (blockDim.x a multiple
// of 32) to thread 0, in a fixed tree.
__device__ __forceinline__ double block_sum_f64(double v) {
  __shared__ double part[32];
  __syncthreads();
  int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) part[w] = v;
  __syncthreads();
  if (w == 0) {
    v = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// sum_f64: out[q] += the sum of the n partial sums part[q·n ..] for q =
// blockIdx.x: thread i adds elements i, i + blockDim.x, ... in turn, then a
// fixed tree. The second pass of every fp64 statistic, the loss and the
// gradient norm.
extern "C" __global__ void sum_f64(double* __restrict__ out, const double* __restrict__ part, int n) {
  const double* p = part + (size_t)blockIdx.x * n;
  double s = 0.0;
#pragma unroll 8
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += p[i];
  s = block_sum_f64(s);
  if (threadIdx.x == 0) out[blockIdx.x] += s;
}

// The embedding gradient gtable[ids[t]] += dx[t] in a fixed order: the
// token positions are sorted by id (sort_pass, a stable radix sort of 8 bits
// a pass, so that each id's positions ascend), embed_seg sums chunks of
// sorted positions, one id's run at a time, and embed_join adds up, in
// chunk order, the pieces of the runs that cross chunks.

// sort_pass: one pass of the stable radix sort of m keys on the digit (key
// >> shift) & 255, a tile of 1024 keys per block (blockDim 1024). With hist
// set it writes each tile's digit counts to hist[digit][tile] (to be
// scanned); else it moves each key and its value (vin null: its index) to
// off[digit][tile] plus its rank among the tile's keys of that digit.
extern "C" __global__ void sort_pass(const int* __restrict__ kin, const int* __restrict__ vin, int* __restrict__ kout,
                                     int* __restrict__ vout, int* __restrict__ hist, const int* __restrict__ off, int m,
                                     int shift) {
  __shared__ int wc[33][256];  // per warp and digit: count, then the warps' exclusive prefix; row 32: tile total
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, t = blockIdx.x * 1024 + threadIdx.x;
  for (int i = threadIdx.x; i < 32 * 256; i += blockDim.x) wc[i >> 8][i & 255] = 0;
  __syncthreads();
  const int key = t < m ? kin[t] : 0, d = t < m ? (key >> shift) & 255 : 256;
  const u32 peers = __match_any_sync(0xffffffffu, d);
  const int r = __popc(peers & ((1u << lane) - 1u));  // rank among the warp's lanes of digit d
  if (d < 256 && r == 0) wc[w][d] = __popc(peers);
  __syncthreads();
  if (threadIdx.x < 256) {
    int s = 0;
    for (int i = 0; i < 32; ++i) {
      int c = wc[i][threadIdx.x];
      wc[i][threadIdx.x] = s;
      s += c;
    }
    wc[32][threadIdx.x] = s;
  }
  __syncthreads();
  if (hist) {
    if (threadIdx.x < 256) hist[threadIdx.x * gridDim.x + blockIdx.x] = wc[32][threadIdx.x];
    return;
  }
  if (d < 256) {
    const int at = off[d * gridDim.x + blockIdx.x] + wc[w][d] + r;
    kout[at] = key;
    vout[at] = vin ? vin[t] : t;
  }
}

// embed_seg: for chunk blockIdx.x of 256 sorted positions (blockDim 256;
// sid the sorted ids, pos their positions) and column c of h: each run of
// one id, its dx rows summed in position order. A run inside the chunk is
// added into gtable; the piece of a run begun in an earlier chunk goes to
// part[chunk][0], that of a run going on past the chunk to part[chunk][1]
// (part [chunks][2][h]), for embed_join.
extern "C" __global__ void embed_seg(float* __restrict__ gtable, const int* __restrict__ sid,
                                     const int* __restrict__ pos, const float* __restrict__ dx,
                                     float* __restrict__ part, int m, int h) {
  __shared__ int sk[256], sp[256];
  const int i0 = blockIdx.x * 256, n = min(256, m - i0);
  if ((int)threadIdx.x < n) {
    sk[threadIdx.x] = sid[i0 + threadIdx.x];
    sp[threadIdx.x] = pos[i0 + threadIdx.x];
  }
  __syncthreads();
  const int c = blockIdx.y * 256 + threadIdx.x;
  if (c >= h) return;
  const bool before = i0 > 0 && sid[i0 - 1] == sk[0], after = i0 + n < m && sid[i0 + n] == sk[n - 1];
  float* pc = part + (size_t)blockIdx.x * 2 * h + c;
  float s = 0.f;
  for (int k0 = 0; k0 < n; k0 += 8) {
    float v[8];  // loaded ahead: eight rows in flight
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = k0 + q < n ? dx[(size_t)sp[k0 + q] * h + c] : 0.f;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const int k = k0 + q;
      if (k >= n) break;
      s += v[q];
      if (k + 1 < n && sk[k + 1] == sk[k]) continue;
      if (before && sk[k] == sk[0])
        pc[0] = s;
      else if (after && k == n - 1)
        pc[h] = s;
      else
        gtable[(size_t)sk[k] * h + c] += s;
      s = 0.f;
    }
  }
}

// embed_join: the run that begins in chunk blockIdx.x and goes on past it:
// its piece there (part[chunk][1]) plus its pieces in the chunks after, in
// chunk order, added into gtable. Column c = blockIdx.y·256 + threadIdx.x.
extern "C" __global__ void embed_join(float* __restrict__ gtable, const int* __restrict__ sid,
                                      const float* __restrict__ part, int m, int h) {
  const int c = blockIdx.y * 256 + threadIdx.x, i0 = blockIdx.x * 256, i1 = i0 + 256;
  if (c >= h || i1 >= m) return;
  const int id = sid[i1 - 1];
  if (sid[i1] != id || (i0 > 0 && sid[i0 - 1] == id && sid[i0] == id)) return;
  float s = part[(size_t)blockIdx.x * 2 * h + h + c];
  for (int k = blockIdx.x + 1;; ++k) {  // chunk k holds a piece of the run, from its start
    s += part[(size_t)k * 2 * h + c];
    const int e = (k + 1) * 256;
    if (e >= m || sid[e - 1] != id || sid[e] != id) break;
  }
  gtable[(size_t)id * h + c] += s;
}

// The RMSNorm kernels keep a row in registers: thread t of a block of
// blockDim threads (normThreads in Go: 256 up to h = 4096, then 32 more per
// 512 columns, at most NORM_THREADS) owns float4 columns t, t + blockDim,
// ... (at most NORM_VEC of them; h % 4 == 0), and every load of a row is
// issued before its sum is taken.
#define NORM_VEC 4
#define NORM_THREADS 512  // the backward's registers (rmsnorm_bwd4) allow no more

// rmsnorm_fwd: rstd[r] = 1/sqrt(mean(x[r]^2) + eps), y[r] = bf16(x[r] *
// rstd[r] * w). One block of normThreads(h) threads per row; x is read
// once (16-byte loads, 8-byte stores of y).
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm_fwd(const float* __restrict__ x, const float* __restrict__ w,
                                       u16* __restrict__ y, float* __restrict__ rstd, int h, float eps) {
  const int r = blockIdx.x, n4 = h / 4;
  const float4* xr = (const float4*)(x + (size_t)r * h);
  float4 v[NORM_VEC];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < NORM_VEC; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < n4) v[k] = xr[i];
  }
#pragma unroll
  for (int k = 0; k < NORM_VEC; ++k)
    if (threadIdx.x + k * blockDim.x < n4) ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
  const float iv = 1.f / sqrtf(block_sum(ss) / (float)h + eps);
  if (threadIdx.x == 0) rstd[r] = iv;
  uint2* yr = (uint2*)(y + (size_t)r * h);
#pragma unroll
  for (int k = 0; k < NORM_VEC; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i >= n4) continue;
    const float4 wv = ((const float4*)w)[i];
    yr[i] = make_uint2(pack_bf2(v[k].x * iv * wv.x, v[k].y * iv * wv.y), pack_bf2(v[k].z * iv * wv.z, v[k].w * iv * wv.w));
  }
}

// block_sum_n replaces each of the R values v[q] by its sum over the block
// (blockDim.x a multiple of 32), in the same fixed tree as block_sum, one
// round of barriers for all R.
template <int R>
__device__ __forceinline__ void block_sum_n(float (&v)[R]) {
  __shared__ float part[R][32];
  __shared__ float total[R];
  __syncthreads();  // earlier readers of total are done
#pragma unroll
  for (int q = 0; q < R; ++q) v[q] = warp_sum(v[q]);
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
#pragma unroll
    for (int q = 0; q < R; ++q) part[q][w] = v[q];
  }
  __syncthreads();
  if (w == 0) {
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const float s = warp_sum(lane < (int)(blockDim.x >> 5) ? part[q][lane] : 0.f);
      if (lane == 0) total[q] = s;
    }
  }
  __syncthreads();
#pragma unroll
  for (int q = 0; q < R; ++q) v[q] = total[q];
}

// rmsnorm_bwd_rows is the body of the RMSNorm backward kernels: block b
// takes rows r0 = b per .. min(rows, r0 + per) - 1, R at a time, and for
// each row r, with iv = rstd[r] and g = dy[r] * w,
//   dx[r] += g * iv - x[r] * (sum(g * x[r]) * iv^3 / h)
// (the input gradient added into the residual stream's), and where dxb is
// not null also writes bf16(dx[r]) there (the next layer's bf16 input
// gradient, without a cast reading dx again); it also sums
// dy[r] * x[r] * iv over its rows, in order, into part[b] (the gain
// gradient's partial sums, which rmsnorm_dw_sum adds up). Each thread
// keeps VEC float4 columns of a row (the RMSNorm layout above). The R rows'
// dy, x and dx are all loaded before their sums are taken (R·VEC = 4:
// twelve 16-byte loads in flight a thread), so a round of R rows waits for
// memory once; dy, x and dx are each read once.
template <int VEC, int R>
__device__ __forceinline__ void rmsnorm_bwd_rows(float* __restrict__ dx, u16* __restrict__ dxb, float* __restrict__ part,
                                                 const float* __restrict__ dy, const float* __restrict__ x,
                                                 const float* __restrict__ w, const float* __restrict__ rstd, int rows,
                                                 int h, int per) {
  const int n4 = h / 4;
  const int r0 = blockIdx.x * per, r1 = min(rows, r0 + per);
  float4 wv[VEC], acc[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (i < n4) wv[k] = ((const float4*)w)[i];
  }
  for (int r = r0; r < r1; r += R) {
    float4 d[R][VEC], xv[R][VEC], o[R][VEC];
    float dot[R], iv[R];
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const int rq = min(r + q, r1 - 1);  // past r1: row r1 - 1 again, not written
      const size_t row = (size_t)rq * n4;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i >= n4) continue;
        d[q][k] = ((const float4*)dy)[row + i];
        xv[q][k] = ((const float4*)x)[row + i];
        o[q][k] = ((const float4*)dx)[row + i];
      }
      iv[q] = rstd[rq];
    }
#pragma unroll
    for (int q = 0; q < R; ++q) {
      dot[q] = 0.f;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        if (threadIdx.x + k * blockDim.x >= n4) continue;
        const float4 a = d[q][k], b = xv[q][k], c = wv[k];
        dot[q] += a.x * c.x * b.x + a.y * c.y * b.y + a.z * c.z * b.z + a.w * c.w * b.w;
      }
    }
    block_sum_n<R>(dot);
#pragma unroll
    for (int q = 0; q < R; ++q) {
      if (r + q >= r1) break;
      const float c = dot[q] * iv[q] * iv[q] * iv[q] / (float)h;
      float4* dxr = (float4*)dx + (size_t)(r + q) * n4;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i >= n4) continue;
        const float4 a = d[q][k], b = xv[q][k], ww = wv[k];
        float4 y = o[q][k];
        y.x += a.x * ww.x * iv[q] - b.x * c;
        y.y += a.y * ww.y * iv[q] - b.y * c;
        y.z += a.z * ww.z * iv[q] - b.z * c;
        y.w += a.w * ww.w * iv[q] - b.w * c;
        dxr[i] = y;
        if (dxb) ((uint2*)dxb)[(size_t)(r + q) * n4 + i] = make_uint2(pack_bf2(y.x, y.y), pack_bf2(y.z, y.w));
        acc[k].x += a.x * b.x * iv[q];
        acc[k].y += a.y * b.y * iv[q];
        acc[k].z += a.z * b.z * iv[q];
        acc[k].w += a.w * b.w * iv[q];
      }
    }
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < n4) ((float4*)part)[(size_t)blockIdx.x * n4 + i] = acc[k];
  }
}

// rmsnorm_bwd1, rmsnorm_bwd2, rmsnorm_bwd4: rmsnorm_bwd_rows for threads
// that keep 1, 2 or 4 float4 columns (h up to 1024, up to 2048 with 256
// threads; wider rows). Grid: the parts, min(rows, normParts) blocks of
// normThreads(h) threads (256 for the first two).
#define RMSNORM_BWD_ARGS                                                                                       \
  float* __restrict__ dx, u16* __restrict__ dxb, float* __restrict__ part, const float* __restrict__ dy, const float* __restrict__ x, \
      const float* __restrict__ w, const float* __restrict__ rstd, int rows, int h, int per
extern "C" __global__ void __launch_bounds__(256) rmsnorm_bwd1(RMSNORM_BWD_ARGS) {
  rmsnorm_bwd_rows<1, 4>(dx, dxb, part, dy, x, w, rstd, rows, h, per);
}
extern "C" __global__ void __launch_bounds__(256) rmsnorm_bwd2(RMSNORM_BWD_ARGS) {
  rmsnorm_bwd_rows<2, 2>(dx, dxb, part, dy, x, w, rstd, rows, h, per);
}
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm_bwd4(RMSNORM_BWD_ARGS) {
  rmsnorm_bwd_rows<4, 1>(dx, dxb, part, dy, x, w, rstd, rows, h, per);
}

// rmsnorm_dw_sum: dw[c] += the sum over the n parts of part[p][c] (fp32
// [n][h]). A block (blockDim.x a multiple of 32, at most 1024) takes 32
// columns, blockIdx.x * 32 + lane: warp q adds parts q, q + W, q + 2W, ...
// (W warps) in order, then warp 0 adds the W sums in warp order; a fixed
// order for given n and blockDim. Grid: ceil(h / 32) blocks.
extern "C" __global__ void rmsnorm_dw_sum(float* __restrict__ dw, const float* __restrict__ part, int n, int h) {
  __shared__ float ws[32][32];
  const int lane = threadIdx.x & 31, q = threadIdx.x >> 5, nw = blockDim.x >> 5, c = blockIdx.x * 32 + lane;
  float s = 0.f;
  if (c < h) {
#pragma unroll 8
    for (int p = q; p < n; p += nw) s += part[(size_t)p * h + c];
  }
  ws[q][lane] = s;
  __syncthreads();
  if (q == 0 && c < h) {
    for (int k = 1; k < nw; ++k) s += ws[k][lane];
    dw[c] += s;
  }
}

// rope_bf16: the first nrot heads of hd values of each token's row (width
// bf16 values: the q and k heads, then v) rotated in place by its
// position's angles (rotate_half, in fp32, rounded to bf16 once). Token t
// sits at position t % seq; cos and sin are [position][hd/2]. One block per
// token; four pairs a thread at a time (8-byte accesses: hd % 8 == 0).
extern "C" __global__ void rope_bf16(u16* __restrict__ x, const float* __restrict__ cosT,
                                     const float* __restrict__ sinT, int seq, int nrot, int hd, int width) {
  const int t = blockIdx.x;
  const int half = hd / 2, q = half / 4, pos = t % seq;
  u16* d = x + (size_t)t * width;
  for (int p = threadIdx.x; p < nrot * q; p += blockDim.x) {
    const int head = p / q, i = 4 * (p % q);
    const float4 c = *(const float4*)(cosT + pos * half + i), sn = *(const float4*)(sinT + pos * half + i);
    const uint2 av = *(const uint2*)(d + head * hd + i), bv = *(const uint2*)(d + head * hd + i + half);
    const float a[4] = {bf_lo(av.x), bf_hi(av.x), bf_lo(av.y), bf_hi(av.y)};
    const float b[4] = {bf_lo(bv.x), bf_hi(bv.x), bf_lo(bv.y), bf_hi(bv.y)};
    *(uint2*)(d + head * hd + i) = make_uint2(pack_bf2(a[0] * c.x - b[0] * sn.x, a[1] * c.y - b[1] * sn.y),
                                              pack_bf2(a[2] * c.z - b[2] * sn.z, a[3] * c.w - b[3] * sn.w));
    *(uint2*)(d + head * hd + i + half) = make_uint2(pack_bf2(b[0] * c.x + a[0] * sn.x, b[1] * c.y + a[1] * sn.y),
                                                     pack_bf2(b[2] * c.z + a[2] * sn.z, b[3] * c.w + a[3] * sn.w));
  }
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
// active[j] += rows where unit j fired (g > 0), and per block b (of nb) the
// statistics' partial sums: part[b] = l1_scale * sum |h|, part[nb + b] =
// l0_scale * (units fired). Thread = unit; blockIdx.y takes rows_per rows.
extern "C" __global__ void relu_fwd(const float* __restrict__ gu, u16* __restrict__ hout, int* __restrict__ active,
                                    double* __restrict__ part, int m, int f, int gated, int rows_per,
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
  float c = block_sum((float)cnt);  // exact: at most 2^24 firings a block
  sabs = block_sum(sabs);
  if (threadIdx.x == 0) {
    const int b = blockIdx.y * gridDim.x + blockIdx.x, nb = gridDim.x * gridDim.y;
    part[b] = (double)sabs * l1_scale;
    part[nb + b] = (double)c * l0_scale;
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

// max_sum is a running softmax normaliser: the largest value m seen and
// s = sum of exp(x - m) over the values seen.
struct max_sum {
  float m, s;
};

// ms_add adds value x to a.
__device__ __forceinline__ max_sum ms_add(max_sum a, float x) {
  if (x <= a.m) return {a.m, a.s + expf(x - a.m)};
  return {x, a.s * expf(a.m - x) + 1.f};
}

// ms_merge merges two normalisers (a.m and b.m may be -3e38: none seen).
__device__ __forceinline__ max_sum ms_merge(max_sum a, max_sum b) {
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// block_max_sum merges the threads' normalisers over the block, in a fixed
// tree (warps by shuffles, then warp 0 over the warps).
__device__ __forceinline__ max_sum block_max_sum(max_sum v) {
  __shared__ max_sum part[32];
  __shared__ max_sum total;
  __syncthreads();
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    v = ms_merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) part[w] = v;
  __syncthreads();
  if (w == 0) {
    max_sum x = lane < (int)(blockDim.x >> 5) ? part[lane] : max_sum{-3.0e38f, 0.f};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      x = ms_merge(x, {__shfl_xor_sync(0xffffffffu, x.m, o), __shfl_xor_sync(0xffffffffu, x.s, o)});
    if (lane == 0) total = x;
  }
  __syncthreads();
  return total;
}

// ce_chunk: for each row r (one block) of fp32 logits [rows][V] with its
// target: loss[r] = loss_scale * (logsumexp(row) - row[target]) (summed by
// sum_f64); with dlogits set, dlogits (bf16) = grad_scale * (softmax(row) -
// onehot(target)). Two passes over the row: the maximum and the sum of
// exponentials together (an online softmax), then the gradient; 16-byte
// loads and 8-byte stores when V % 4 == 0.
extern "C" __global__ void ce_chunk(const float* __restrict__ logits, const int* __restrict__ targets,
                                    u16* __restrict__ dlogits, double* __restrict__ loss, int V, float grad_scale,
                                    double loss_scale) {
  const int r = blockIdx.x, t = targets[r];
  const float* row = logits + (size_t)r * V;
  const int n4 = V % 4 == 0 ? V / 4 : 0;
  max_sum ms = {-3.0e38f, 0.f};
  for (int i = threadIdx.x; i < n4; i += blockDim.x) {
    const float4 v = ((const float4*)row)[i];
    ms = ms_add(ms_add(ms_add(ms_add(ms, v.x), v.y), v.z), v.w);
  }
  for (int i = 4 * n4 + threadIdx.x; i < V; i += blockDim.x) ms = ms_add(ms, row[i]);
  ms = block_max_sum(ms);
  const float mx = ms.m, s = ms.s;
  if (threadIdx.x == 0) loss[r] = (double)(logf(s) - (row[t] - mx)) * loss_scale;
  if (!dlogits) return;
  const float inv = grad_scale / s;
  u16* d = dlogits + (size_t)r * V;
  for (int i = threadIdx.x; i < n4; i += blockDim.x) {
    const float4 v = ((const float4*)row)[i];
    float p[4] = {expf(v.x - mx) * inv, expf(v.y - mx) * inv, expf(v.z - mx) * inv, expf(v.w - mx) * inv};
    if (t / 4 == i) p[t % 4] -= grad_scale;
    ((uint2*)d)[i] = make_uint2(pack_bf2(p[0], p[1]), pack_bf2(p[2], p[3]));
  }
  for (int i = 4 * n4 + threadIdx.x; i < V; i += blockDim.x) {
    float p = expf(row[i] - mx) * inv;
    if (i == t) p -= grad_scale;
    d[i] = (u16)f_to_bf(p);
  }
}
