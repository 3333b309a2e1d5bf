// sparse.cu: the sparse MLP block of GPU training (package gpu/trainer).
//
// The gate pre-activations G = X·Wgᵀ (bf16 [m][f], one dense GEMM) are
// packed into a row-major compressed form (CSR: rowptr [m+1], col [nnz],
// ascending columns) of the active units (g > 0) and a column-major index
// of the same entries (colptr [f+1]; per entry its token and its position
// in the row-major form, tokens ascending). Every entry of every row is
// kept: the caller sizes nnz for the worst case (m·f), so no row is ever
// dropped and no count has to reach the host. The up projection, the down
// projection and all five gradients then touch only the active entries:
//
//   forward   R = (X·Wuᵀ) on the support (SDDMM), T = R ⊙ P, out = base + T·Wd
//   backward  dT = (dY·Wdᵀ) on the support + l1·sign(T)
//             dR = dT ⊙ P, dG = dT ⊙ R                    (gated)
//             dX = dG·Wg + dR·Wu                            (row SpMM)
//             dWg += dGᵀ·X, dWu += dRᵀ·X, dWd += (Tᵀ·dY)ᵀ  (column SpMM)
//
// Values are bf16 (P, R, T, dR, dG: rounded once each, the rounding points
// of a bf16 PyTorch MLP); every dot product and sum is fp32; every sum runs
// in a fixed order, with no floating-point atomics (the statistics go
// through per-block partial sums and sum_f64), so results are repeatable
// bit for bit.
// The row kernels take one block per token row; the column kernel loops a
// grid that fills the GPU over its work items (measured faster each way). Ungated (h =
// relu(u)), P is the single activation and T = P.

#include "common.cuh"

// is_on: a unit fires when its bf16 pre-activation is > 0 (NaN does not).
__device__ __forceinline__ bool is_on(u16 v) { return bf_to_f(v) > 0.f; }

// block_scan returns carry (shared, the same on every thread) plus the
// exclusive prefix of v over the block's threads, and advances carry by
// the block's total. warp_tot: 32 ints of shared memory. Every thread of
// the block calls it.
__device__ __forceinline__ int block_scan(int v, int* warp_tot, int* carry) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_tot[w] = x;
  __syncthreads();
  if (w == 0) {
    int t = lane < (int)(blockDim.x >> 5) ? warp_tot[lane] : 0, s = t;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    warp_tot[lane] = s - t;  // exclusive prefix of the warps
  }
  __syncthreads();
  const int ex = *carry + warp_tot[w] + x - v;
  __syncthreads();
  if (threadIdx.x == blockDim.x - 1) *carry = ex + v;
  __syncthreads();
  return ex;
}

// sp_scan: ptr[i] = sum of cnt[0..i) for i <= n (exclusive scan with the
// total at ptr[n]). One block of 1024 threads.
extern "C" __global__ void sp_scan(const int* __restrict__ cnt, int* __restrict__ ptr, int n) {
  __shared__ int warp_tot[32];
  __shared__ int carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const int ex = block_scan(i < n ? cnt[i] : 0, warp_tot, &carry);
    if (i < n) ptr[i] = ex;
  }
  if (threadIdx.x == 0) ptr[n] = carry;
}

// Row index: the row-major form of the active units of G (bf16 [m][f],
// f % 8 == 0): rowptr (m + 1 offsets), and per row in ascending column
// order col and pv (bf16 P; also tv when set, ungated: T = P). Two passes
// with no wait between blocks: sp_row_count reads G once, keeping each
// row's first cap entries in a stash, and sp_row_write, after sp_scan has
// turned the blocks' totals into offsets, copies them into place (a row
// with more than cap entries is read from G again). (One pass whose blocks
// looked back for their offset spent a quarter of its time waiting at the
// barrier behind that look-back: 80 us at 49% of DRAM bandwidth for 16384
// x 5632 at 0.5% on an H200; the two passes take the same 0.10 ms, with
// no block waiting on another.) One warp per row, SPI_ROWS rows a block.
#define SPI_ROWS 8

// SpiChunk is one lane's part of a 256-column chunk of a row (columns
// 8 c .. 8 c + 7): its 8 values (zeros past f), which of them fire, how
// many, where its entries start among the chunk's (at) and the chunk's
// count (tot).
struct SpiChunk {
  u32 wd[4];
  u32 mask;
  int n, at, tot;
  __device__ __forceinline__ u16 val(int e) const { return (u16)((wd[e >> 1] >> (16 * (e & 1))) & 0xffffu); }
};

// spi_load returns chunk c of row (zeros past f).
__device__ __forceinline__ uint4 spi_load(const uint4* row, int c, int f) {
  return c < f / 8 ? ldg_nc(row + c) : make_uint4(0, 0, 0, 0);
}

// spi_chunk decodes a lane's chunk. Most lanes of a sparse row hold no
// entry and the rest one, which a ballot places; a warp scan runs only
// when some lane holds more.
__device__ __forceinline__ SpiChunk spi_chunk(uint4 v, int lane) {
  SpiChunk k;
  k.wd[0] = v.x, k.wd[1] = v.y, k.wd[2] = v.z, k.wd[3] = v.w;
  k.mask = 0;
#pragma unroll
  for (int e = 0; e < 8; ++e) k.mask |= (u32)is_on(k.val(e)) << e;
  k.n = __popc(k.mask);
  const u32 some = __ballot_sync(0xffffffffu, k.n != 0);
  if (!__any_sync(0xffffffffu, k.n > 1)) {
    k.at = __popc(some & ((1u << lane) - 1u));
    k.tot = __popc(some);
    return k;
  }
  int x = k.n;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  k.at = x - k.n;
  k.tot = __shfl_sync(0xffffffffu, x, 31);
  return k;
}

// SPI_BATCH: the chunks of a row whose loads a lane issues before it
// decodes any (written load, decode, load, decode, the compiler kept one
// or two in flight).
#define SPI_BATCH 4

// sp_row_count: cnt[r] = row r's active units, its first cap entries (col,
// value) in stash_col/stash_val[r·cap ..]; btot[b] = block b's total,
// part0[b] = l0_scale · btot[b] and, ungated, part1[b] = l1_scale · Σ P
// over its rows (when set); active[j] (when set) counts the rows where
// unit j fired.
extern "C" __global__ void __launch_bounds__(32 * SPI_ROWS)
    sp_row_count(const u16* __restrict__ G, int* __restrict__ cnt, int* __restrict__ btot, int* __restrict__ stash_col,
                 u16* __restrict__ stash_val, int cap, int* __restrict__ active, double* __restrict__ part0,
                 double* __restrict__ part1, int ungated, int m, int f, double l0_scale, double l1_scale) {
  __shared__ int s_cnt[SPI_ROWS];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, r = blockIdx.x * SPI_ROWS + w;
  int n = 0;
  float l1 = 0.f;
  if (r < m) {
    const uint4* row = reinterpret_cast<const uint4*>(G + (size_t)r * f);
    int* scol = stash_col + (size_t)r * cap;
    u16* sval = stash_val + (size_t)r * cap;
    for (int c0 = 0; c0 < f / 8; c0 += 32 * SPI_BATCH) {
      uint4 v[SPI_BATCH];
#pragma unroll
      for (int u = 0; u < SPI_BATCH; ++u) v[u] = spi_load(row, c0 + 32 * u + lane, f);
#pragma unroll
      for (int u = 0; u < SPI_BATCH; ++u) {
        const SpiChunk k = spi_chunk(v[u], lane);
        if (k.n) {
          const int c = c0 + 32 * u + lane;
          int at = n + k.at;
#pragma unroll
          for (int e = 0; e < 8; ++e)
            if (k.mask & (1u << e)) {
              const u16 x = k.val(e);
              if (at < cap) {
                scol[at] = 8 * c + e;
                sval[at] = x;
              }
              if (active) atomicAdd(&active[8 * c + e], 1);
              if (ungated) l1 += bf_to_f(x);
              ++at;
            }
        }
        n += k.tot;
      }
    }
    if (lane == 0) cnt[r] = n;
  }
  if (lane == 0) s_cnt[w] = n;
  if (ungated) l1 = block_sum(l1);  // its barrier orders s_cnt too
  else __syncthreads();
  if (threadIdx.x == 0) {
    int tot = 0;
#pragma unroll
    for (int i = 0; i < SPI_ROWS; ++i) tot += s_cnt[i];
    btot[blockIdx.x] = tot;
    if (part0) part0[blockIdx.x] = (double)tot * l0_scale;
    if (ungated && part1) part1[blockIdx.x] = (double)l1 * l1_scale;
  }
}

// sp_row_write: rowptr, col, pv (and tv when set) from the counts, the
// stash and boff (block b's first entry, from sp_scan over btot).
extern "C" __global__ void __launch_bounds__(32 * SPI_ROWS)
    sp_row_write(const u16* __restrict__ G, const int* __restrict__ cnt, const int* __restrict__ boff,
                 const int* __restrict__ stash_col, const u16* __restrict__ stash_val, int cap,
                 int* __restrict__ rowptr, int* __restrict__ col, u16* __restrict__ pv, u16* __restrict__ tv, int m, int f) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * SPI_ROWS, r = r0 + w;
  if (r >= m) return;
  // The row's offset: the block's, then the rows before it in the block.
  int before = lane < w ? cnt[r0 + lane] : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) before += __shfl_xor_sync(0xffffffffu, before, o);
  const int base = boff[blockIdx.x] + before, n = cnt[r];
  if (lane == 0) {
    rowptr[r] = base;
    if (r == m - 1) rowptr[m] = base + n;
  }
  if (n <= cap) {
    const int* scol = stash_col + (size_t)r * cap;
    const u16* sval = stash_val + (size_t)r * cap;
    for (int k = lane; k < n; k += 32) {
      const u16 v = sval[k];
      col[base + k] = scol[k];
      pv[base + k] = v;
      if (tv) tv[base + k] = v;
    }
    return;
  }
  const uint4* row = reinterpret_cast<const uint4*>(G + (size_t)r * f);
  int at0 = base;
  for (int c0 = 0; c0 < f / 8; c0 += 32) {
    const int c = c0 + lane;
    const SpiChunk k = spi_chunk(spi_load(row, c, f), lane);
    int at = at0 + k.at;
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (k.mask & (1u << e)) {
        const u16 v = k.val(e);
        col[at] = 8 * c + e;
        pv[at] = v;
        if (tv) tv[at] = v;
        ++at;
      }
    at0 += k.tot;
  }
}

// Column index. Rows are cut into chunks of rows_per rows (< 65536).

// sp_col_count: chunk[b][j] = entries of column j in chunk b's rows. One
// block per chunk; dynamic shared memory 4·ceil(f/2) bytes: 16-bit
// counters, two to a word.
extern "C" __global__ void sp_col_count(const int* __restrict__ rowptr, const int* __restrict__ col,
                                        int* __restrict__ chunk, int m, int f, int rows_per) {
  extern __shared__ u32 ctr[];
  for (int i = threadIdx.x; i < (f + 1) / 2; i += blockDim.x) ctr[i] = 0;
  __syncthreads();
  int r0 = blockIdx.x * rows_per, r1 = min(m, r0 + rows_per);
  for (int k = rowptr[r0] + threadIdx.x; k < rowptr[r1]; k += blockDim.x) {
    int j = col[k];
    atomicAdd(&ctr[j >> 1], 1u << (16 * (j & 1)));
  }
  __syncthreads();
  for (int j = threadIdx.x; j < f; j += blockDim.x)
    chunk[(size_t)blockIdx.x * f + j] = (int)((ctr[j >> 1] >> (16 * (j & 1))) & 0xffffu);
}

// sp_col_prefix: per column j, chunk[b][j] becomes the entries of column j
// in chunks before b, and colcnt[j] the column's total. Blocks of 32 x 32
// threads: x a column of the block's 32, y a slice of the chunks.
extern "C" __global__ void sp_col_prefix(int* __restrict__ chunk, int* __restrict__ colcnt, int chunks, int f) {
  __shared__ int part[32][33];
  const int j = blockIdx.x * 32 + threadIdx.x, per = (chunks + 31) / 32;
  const int b0 = min(chunks, (int)threadIdx.y * per), b1 = min(chunks, b0 + per);
  int s = 0;
  if (j < f)
    for (int b = b0; b < b1; ++b) s += chunk[(size_t)b * f + j];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0) {
    int run = 0;
    for (int y = 0; y < 32; ++y) {
      int v = part[y][threadIdx.x];
      part[y][threadIdx.x] = run;
      run += v;
    }
    if (j < f) colcnt[j] = run;
  }
  __syncthreads();
  if (j < f) {
    int run = part[threadIdx.y][threadIdx.x];
    for (int b = b0; b < b1; ++b) {
      int v = chunk[(size_t)b * f + j];
      chunk[(size_t)b * f + j] = run;
      run += v;
    }
  }
}

// sp_col_fill: for every entry k (row i, column j) of the row-major form,
// colpos[e] = k and coltok[e] = i at e = colptr[j] + its rank among column
// j's entries, tokens ascending. One warp per chunk of rows_per <= 32 rows;
// dynamic shared memory 4f bytes: each column's next position. The warp
// takes the chunk's entries in order, 32 a step (their columns loaded
// FILL_BATCH steps at a time): the lanes of a step that share a column
// take consecutive positions in lane order, which is token order. (Walking
// the chunk row by row, each row a chain of dependent loads, took 45 us
// at 5.8% occupancy for 16384 x 5632 at 0.5% on an H200; the column index
// went from 0.059-0.061 to 0.053-0.058 ms with this walk.)
#define FILL_BATCH 4
extern "C" __global__ void sp_col_fill(const int* __restrict__ rowptr, const int* __restrict__ col,
                                       const int* __restrict__ chunk, const int* __restrict__ colptr,
                                       int* __restrict__ coltok, int* __restrict__ colpos, int m, int f, int rows_per) {
  extern __shared__ int next[];
  const unsigned full = 0xffffffffu;
  const int lane = threadIdx.x;
  const int* base = chunk + (size_t)blockIdx.x * f;
  for (int j = lane; j < f; j += 32) next[j] = colptr[j] + base[j];
  const int r0 = blockIdx.x * rows_per, r1 = min(m, r0 + rows_per);
  // Lane i holds where row r0 + i starts (the chunk's end for rows past it).
  const int start = rowptr[min(r0 + lane, r1)];
  const int k0 = __shfl_sync(full, start, 0), kend = rowptr[r1];
  __syncwarp();
  for (int kb = k0; kb < kend; kb += 32 * FILL_BATCH) {
    int js[FILL_BATCH];
#pragma unroll
    for (int u = 0; u < FILL_BATCH; ++u) {
      const int k = kb + 32 * u + lane;
      js[u] = k < kend ? col[k] : -1;
    }
#pragma unroll
    for (int u = 0; u < FILL_BATCH; ++u) {
      const int k = kb + 32 * u + lane;
      const bool valid = k < kend;
      int row = 0;  // the last lane whose row starts at or before k
#pragma unroll
      for (int s = 16; s > 0; s >>= 1) {
        const int v = __shfl_sync(full, start, row + s);
        if (v <= k) row += s;
      }
      // Lanes past the end get keys of their own (negative).
      const unsigned peers = __match_any_sync(full, valid ? js[u] : -1 - lane);
      const int rank = __popc(peers & ((1u << lane) - 1u));
      const int e0 = valid ? next[js[u]] : 0;
      __syncwarp();
      if (valid && rank == 0) next[js[u]] = e0 + __popc(peers);
      __syncwarp();
      if (valid) {
        coltok[e0 + rank] = r0 + row;
        colpos[e0 + rank] = k;
      }
    }
  }
}

// stage_row copies n bf16 values (n % 8 == 0) of src into shared memory
// (read once: evict_first).
__device__ __forceinline__ void stage_row(uint4* dst, const u16* src, int n) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  const u64 stream = policy_evict_first();
  for (int c = threadIdx.x; c < n / 8; c += blockDim.x) dst[c] = ld_hint(s + c, stream);
  __syncthreads();
}

// row_dot2: one warp's dot products of the staged row xs with rows j0 and
// j1 of B (bf16 [.][h], kept in the L2), on every lane: two rows in flight
// hide the gathers' latency. Not unrolled: at 32 registers eight blocks fit
// an SM, and the gathers of its SDDMMs are bound by the L2's throughput,
// which more resident warps use better than more loads in flight per warp
// (16384 x 5632 at 0.5% on an H200: unrolled 4 times, 60 registers and 4
// blocks an SM, the up SDDMM took 0.253 ms at 80% of the L2's throughput;
// this way 0.234 ms; the whole block 2.36 -> 2.31 ms. Issuing all of a
// row's loads before using any took it to 2.63 ms).
__device__ __forceinline__ void row_dot2(const uint4* xs, const u16* B, int j0, int j1, int h, float& d0, float& d1) {
  const uint4* b0 = reinterpret_cast<const uint4*>(B + (size_t)j0 * h);
  const uint4* b1 = reinterpret_cast<const uint4*>(B + (size_t)j1 * h);
  const u64 keep = policy_evict_last();
  float s0 = 0.f, s1 = 0.f;
#pragma unroll 1
  for (int c = threadIdx.x & 31; c < h / 8; c += 32) {
    uint4 x = xs[c];
    s0 = dot8(x, ld_hint(b0 + c, keep), s0);
    s1 = dot8(x, ld_hint(b1 + c, keep), s1);
  }
  d0 = warp_sum(s0);
  d1 = warp_sum(s1);
}

// sp_up: the gated forward's SDDMM. For each entry k of row r: rv[k] =
// bf16(X[r]·Wu[j]), tv[k] = bf16(rv[k]·pv[k]); part[r] = l1_scale·Σ|T|
// (when part is set). One block of 256 threads (rowBlock) per row, X's row
// staged in shared memory (2h bytes).
extern "C" __global__ void __launch_bounds__(256, 8)
    sp_up(const u16* __restrict__ X, const u16* __restrict__ Wu, const int* __restrict__ rowptr,
          const int* __restrict__ col, const u16* __restrict__ pv, u16* __restrict__ rv, u16* __restrict__ tv,
          double* __restrict__ part, int h, double l1_scale) {
  extern __shared__ uint4 xs[];
  const int r = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  stage_row(xs, X + (size_t)r * h, h);
  float l1 = 0.f;
  const int k1 = rowptr[r + 1];
  for (int k = rowptr[r] + 2 * w; k < k1; k += 2 * nw) {
    const bool two = k + 1 < k1;
    float d[2];
    row_dot2(xs, Wu, col[k], col[two ? k + 1 : k], h, d[0], d[1]);
    if (lane < 2 && (lane == 0 || two)) {
      const int kk = k + lane;
      u32 rb = f_to_bf(d[lane]);
      u32 t = f_to_bf(bf_to_f((u16)rb) * bf_to_f(pv[kk]));
      rv[kk] = (u16)rb;
      tv[kk] = (u16)t;
      l1 += fabsf(bf_to_f((u16)t));
    }
  }
  l1 = block_sum(l1);
  if (threadIdx.x == 0 && part) part[r] = (double)l1 * l1_scale;
}

// sp_grad: the backward's SDDMM. For each entry k of row r: d = dY[r]·WdT[j]
// + l1_grad·sign(tv[k]); gated, pv[k] becomes dR = bf16(d·P) and rv[k]
// becomes dG = bf16(d·R); ungated, pv[k] becomes bf16(d). One block of
// 256 threads (rowBlock) per row, dY's row staged (2h bytes).
extern "C" __global__ void __launch_bounds__(256, 8)
    sp_grad(const u16* __restrict__ dY, const u16* __restrict__ WdT, const int* __restrict__ rowptr,
            const int* __restrict__ col, u16* __restrict__ pv, u16* __restrict__ rv, const u16* __restrict__ tv, int h,
            int gated, float l1_grad) {
  extern __shared__ uint4 xs[];
  const int r = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  stage_row(xs, dY + (size_t)r * h, h);
  const int k1 = rowptr[r + 1];
  for (int k = rowptr[r] + 2 * w; k < k1; k += 2 * nw) {
    const bool two = k + 1 < k1;
    float dd[2];
    row_dot2(xs, WdT, col[k], col[two ? k + 1 : k], h, dd[0], dd[1]);
    if (lane < 2 && (lane == 0 || two)) {
      const int kk = k + lane;
      float d = dd[lane];
      float t = bf_to_f(tv[kk]);
      if (t > 0.f) d += l1_grad;
      if (t < 0.f) d -= l1_grad;
      if (gated) {
        float p = bf_to_f(pv[kk]), u = bf_to_f(rv[kk]);
        pv[kk] = (u16)f_to_bf(d * p);
        rv[kk] = (u16)f_to_bf(d * u);
      } else {
        pv[kk] = (u16)f_to_bf(d);
      }
    }
  }
}

// Eight fp32 values at a time (16-byte aligned), with an L2 policy: the
// gathered weight or activation rows are kept (evict_last), the rows a
// kernel streams out go first (evict_first), so that they do not push the
// gathered rows out of the L2.

// ld8 sets a[0..8) to the 8 floats at p.
__device__ __forceinline__ void ld8(float (&a)[8], const float* p, u64 pol) {
  uint4 x, y;
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
               : "l"(p), "l"(pol));
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(y.x), "=r"(y.y), "=r"(y.z), "=r"(y.w)
               : "l"(p + 4), "l"(pol));
  a[0] = __uint_as_float(x.x), a[1] = __uint_as_float(x.y), a[2] = __uint_as_float(x.z), a[3] = __uint_as_float(x.w);
  a[4] = __uint_as_float(y.x), a[5] = __uint_as_float(y.y), a[6] = __uint_as_float(y.z), a[7] = __uint_as_float(y.w);
}

// store8 sets the 8 floats at p to a[0..8).
__device__ __forceinline__ void store8(float* p, const float (&a)[8], u64 pol) {
  st_hint(p, make_uint4(__float_as_uint(a[0]), __float_as_uint(a[1]), __float_as_uint(a[2]), __float_as_uint(a[3])), pol);
  st_hint(p + 4, make_uint4(__float_as_uint(a[4]), __float_as_uint(a[5]), __float_as_uint(a[6]), __float_as_uint(a[7])),
          pol);
}

// add8 adds a[0..8) to the 8 floats at p.
__device__ __forceinline__ void add8(float* p, const float (&a)[8], u64 pol) {
  float s[8];
  ld8(s, p, pol);
#pragma unroll
  for (int e = 0; e < 8; ++e) s[e] += a[e];
  store8(p, s, pol);
}

// sp_rows: out[r] = base[r] (or 0) + Σ_k v1[k]·B1[col[k]] (+ v2[k]·B2[col[k]])
// over row r's entries; B1, B2 bf16 [.][h], out and base fp32 [m][h]. One
// block per row; thread t takes columns 8t, 8t + 8·blockDim, ...
extern "C" __global__ void sp_rows(float* __restrict__ out, const float* __restrict__ base,
                                   const int* __restrict__ rowptr, const int* __restrict__ col,
                                   const u16* __restrict__ v1, const u16* __restrict__ B1, const u16* __restrict__ v2,
                                   const u16* __restrict__ B2, int h) {
  __shared__ int sj[128];
  __shared__ float s1[128], s2[128];
  const u64 keep = policy_evict_last(), stream = policy_evict_first();
  const int r = blockIdx.x;
  const int k0 = rowptr[r], k1 = rowptr[r + 1];
  for (int c0 = 0; c0 < h; c0 += 8 * blockDim.x) {
    // Every thread runs every pass (the staging below synchronises the block).
    const int c = min(c0 + 8 * (int)threadIdx.x, h - 8);
    const bool mine = c0 + 8 * (int)threadIdx.x < h;
    float acc[8];
    if (base) {
      ld8(acc, base + (size_t)r * h + c, stream);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    }
    for (int kb = k0; kb < k1; kb += 128) {
      int n = min(128, k1 - kb);
      __syncthreads();
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        sj[i] = col[kb + i];
        s1[i] = bf_to_f(v1[kb + i]);
        if (v2) s2[i] = bf_to_f(v2[kb + i]);
      }
      __syncthreads();
      if (v2) {
#pragma unroll 8
        for (int i = 0; i < n; ++i) {
          size_t o = (size_t)sj[i] * h + c;
          uint4 a = ld_hint(B1 + o, keep), b = ld_hint(B2 + o, keep);
          axpy8(acc, s1[i], a);
          axpy8(acc, s2[i], b);
        }
      } else {
#pragma unroll 8
        for (int i = 0; i < n; ++i) axpy8(acc, s1[i], ld_hint(B1 + (size_t)sj[i] * h + c, keep));
      }
    }
    if (mine) store8(out + (size_t)r * h + c, acc, stream);
  }
}

// sp_col_plan cuts each unit's gradient rows into the parts sp_cols sums:
// none for a unit that never fired, one up to chunk entries,
// ceil(entries / chunk) for a busier unit (a unit that fires for most
// tokens), so that one unit does not hold up the whole kernel. partptr
// (f + 1) is the exclusive scan of the parts, slotptr (f + 1) that of the
// partial-sum slots (a unit in p > 1 parts takes p, others none). chunk
// grows from chunk0 with the total entry count so that the units in parts
// take at most slots slots: a unit in p > 1 parts has more than (p - 1)
// chunks of entries, so p < 2 entries / chunk. One block of 1024 threads.
extern "C" __global__ void sp_col_plan(const int* __restrict__ colptr, int* __restrict__ partptr,
                                       int* __restrict__ slotptr, int f, int chunk0, int slots) {
  __shared__ int warp_tot[32];
  __shared__ int carry[2];
  if (threadIdx.x < 2) carry[threadIdx.x] = 0;
  __syncthreads();
  const long long nnz = colptr[f];
  const int chunk = (int)max((long long)chunk0, (2 * nnz + slots - 1) / slots);
  for (int base = 0; base < f; base += blockDim.x) {
    const int j = base + threadIdx.x;
    const int cnt = j < f ? colptr[j + 1] - colptr[j] : 0;
    const int p = (cnt + chunk - 1) / chunk;
    const int parts = block_scan(p, warp_tot, &carry[0]);
    const int slot = block_scan(p > 1 ? p : 0, warp_tot, &carry[1]);
    if (j < f) partptr[j] = parts, slotptr[j] = slot;
  }
  if (threadIdx.x == 0) partptr[f] = carry[0], slotptr[f] = carry[1];
}

// group_add: on the threads of group 0, acc += the acc of the same column
// thread (q of ct) in groups 1 .. G-1, in group order. red: shared, 8 floats
// a thread.
__device__ __forceinline__ void group_add(float* acc, float4* red, int G, int ct, int g, int q) {
  __syncthreads();
  if (g < G) {
    red[2 * threadIdx.x] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    red[2 * threadIdx.x + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
  __syncthreads();
  if (g != 0) return;
  for (int k = 1; k < G; ++k) {
    float4 a = red[2 * (k * ct + q)], b = red[2 * (k * ct + q) + 1];
    acc[0] += a.x, acc[1] += a.y, acc[2] += a.z, acc[3] += a.w;
    acc[4] += b.x, acc[5] += b.y, acc[6] += b.z, acc[7] += b.w;
  }
}

// sp_cols: for each unit j, out1[j] += Σ_e v1[pos]·A[tok] and out2[j] +=
// Σ_e v2[pos]·A[tok] over column j's entries e (tokens ascending); A bf16
// [m][h], out1 and out2 fp32 rows of h. Work items are the parts of
// partptr (from sp_col_plan); blocks loop over them. Part p of a
// unit in P parts sums the p-th of P ranges of its entries. A unit in one
// part adds its sum into out; the parts of a busier unit store theirs in
// slot slotptr[j] + p (2h floats: out1's, then out2's), which
// sp_col_reduce adds in part order: no atomics, and the sums repeat bit
// for bit. When a row takes fewer column threads (ct) than the block has,
// the block splits into G groups, group g summing entries g, g + G, ...
// of the range in order, then adds the groups' sums in group order.
// Entries are staged SP_COLS_STAGE at a time (1024 measured faster than
// 128 at 0.5% density, uniform and skewed, on an H200).
#define SP_COLS_STAGE 1024
// The gathers of a range go out SP_COLS_BATCH at a time before any is
// used: written as load, use, load, use, the compiler kept one or two in
// flight (the loads are asm volatile) and the kernel waited on memory
// latency. 4 at 4 blocks an SM (64 registers) measured faster than 8 at 3
// on an H200: dWg dWu 0.349 -> 0.317 ms uniform (8: 0.341), 0.526 -> 0.466
// ms skewed (8: 0.450).
#define SP_COLS_BATCH 4
extern "C" __global__ void __launch_bounds__(256, 4) sp_cols(float* __restrict__ out1, float* __restrict__ out2,
                                   const int* __restrict__ colptr, const int* __restrict__ coltok,
                                   const int* __restrict__ colpos, const int* __restrict__ partptr,
                                   const int* __restrict__ slotptr, float* __restrict__ slot,
                                   const u16* __restrict__ v1, const u16* __restrict__ v2, const u16* __restrict__ A,
                                   int f, int h) {
  __shared__ int st[SP_COLS_STAGE];
  __shared__ float s1[SP_COLS_STAGE], s2[SP_COLS_STAGE];
  __shared__ float4 red[2 * 256];
  const u64 keep = policy_evict_last(), stream = policy_evict_first();
  const int items = partptr[f], oct = h / 8;
  // ct column threads in each of G groups (G a power of two dividing the
  // staged entries).
  const int ct = min((int)blockDim.x, oct);
  int G = 1;
  while (G < 32 && 2 * G * ct <= (int)blockDim.x) G *= 2;
  const int g = threadIdx.x / ct, q = threadIdx.x % ct;
  for (int it = blockIdx.x; it < items; it += gridDim.x) {
    int lo = 0, hi = f - 1;  // the unit: the last j with partptr[j] <= it
    while (lo < hi) {
      int mid = (lo + hi + 1) >> 1;
      if (partptr[mid] <= it)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int j = lo, parts = partptr[j + 1] - partptr[j], p = it - partptr[j];
    const int e0 = colptr[j], cnt = colptr[j + 1] - e0;
    const int a0 = e0 + (int)((long long)cnt * p / parts), a1 = e0 + (int)((long long)cnt * (p + 1) / parts);
    for (int ob = 0; ob < oct; ob += ct) {
      // Every thread runs every pass (the staging below synchronises the block).
      const int c = 8 * min(ob + q, oct - 1);
      const bool mine = g < G && ob + q < oct;
      float a1v[8], a2v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) a1v[e] = 0.f, a2v[e] = 0.f;
      for (int eb = a0; eb < a1; eb += SP_COLS_STAGE) {
        int n = min(SP_COLS_STAGE, a1 - eb);
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
          int k = colpos[eb + i];
          st[i] = coltok[eb + i];
          s1[i] = bf_to_f(v1[k]);
          if (v2) s2[i] = bf_to_f(v2[k]);
        }
        __syncthreads();
        if (g >= G) continue;
        const int kn = (n - g + G - 1) / G;
        int k = 0;
        for (; k + SP_COLS_BATCH <= kn; k += SP_COLS_BATCH) {
          uint4 a[SP_COLS_BATCH];
#pragma unroll
          for (int u = 0; u < SP_COLS_BATCH; ++u) a[u] = ld_hint(A + (size_t)st[g + (k + u) * G] * h + c, keep);
#pragma unroll
          for (int u = 0; u < SP_COLS_BATCH; ++u) {
            const int i = g + (k + u) * G;
            axpy8(a1v, s1[i], a[u]);
            if (v2) axpy8(a2v, s2[i], a[u]);
          }
        }
        for (; k < kn; ++k) {
          const int i = g + k * G;
          const uint4 a = ld_hint(A + (size_t)st[i] * h + c, keep);
          axpy8(a1v, s1[i], a);
          if (v2) axpy8(a2v, s2[i], a);
        }
      }
      if (G > 1) {
        group_add(a1v, red, G, ct, g, q);
        if (v2) group_add(a2v, red, G, ct, g, q);
      }
      if (!mine || g != 0) continue;
      if (parts == 1) {
        add8(out1 + (size_t)j * h + c, a1v, stream);
        if (v2) add8(out2 + (size_t)j * h + c, a2v, stream);
      } else {
        float* s = slot + (size_t)(slotptr[j] + p) * 2 * h + c;
        store8(s, a1v, stream);
        if (v2) store8(s + h, a2v, stream);
      }
    }
  }
}

// sp_col_reduce: for each unit j in more than one part, out1[j] (and
// out2[j]) += the sum of its parts' slots, in part order. Blocks loop over
// the units; thread t takes columns 8t, 8t + 8·blockDim, ...
extern "C" __global__ void sp_col_reduce(float* __restrict__ out1, float* __restrict__ out2,
                                         const int* __restrict__ partptr, const int* __restrict__ slotptr,
                                         const float* __restrict__ slot, int f, int h) {
  if (slotptr[f] == 0) return;  // no unit in more than one part
  for (int j = blockIdx.x; j < f; j += gridDim.x) {
    const int parts = partptr[j + 1] - partptr[j];
    if (parts < 2) continue;
    const float* s0 = slot + (size_t)slotptr[j] * 2 * h;
    for (int c = 8 * threadIdx.x; c < h; c += 8 * blockDim.x) {
      for (int o = 0; o < (out2 ? 2 : 1); ++o) {
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.f;
        for (int p = 0; p < parts; ++p) {
          const float4* q = reinterpret_cast<const float4*>(s0 + (size_t)p * 2 * h + o * h + c);
          float4 x = q[0], y = q[1];
          acc[0] += x.x, acc[1] += x.y, acc[2] += x.z, acc[3] += x.w;
          acc[4] += y.x, acc[5] += y.y, acc[6] += y.z, acc[7] += y.w;
        }
        add8((o ? out2 : out1) + (size_t)j * h + c, acc, policy_evict_first());
      }
    }
  }
}
