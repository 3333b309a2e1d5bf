// t2d.cu: the sparse half of the MLP, reading the TwELL gate that D2T wrote.
//
//   gated:     y[r] = sum over active j of (g[r,j] * (x[r] . U[j])) * D[j]
//   non-gated: y[r] = sum over active j of h[r,j] * D[j]
//
// U = Wu and D = Wd^T are bf16 [f, d] row-major, so a unit's rows are
// contiguous. Two tails (MLP.Tail):
//   t2d (warp per token): the warp gathers the row's active entries from the
//     TwELL tiles into a shared-memory list (column order), then walks the
//     list two entries at a time so that two weight rows are in flight at
//     once. x is held in registers; products are exact fp32 FMAs of bf16
//     operands, u and h stay fp32, y is rounded to bf16 once.
//   t2u + t2d_ws (split, for large batches): see below.
// Weights are read with an L2 evict_last policy, activations with
// evict_first.
//
// Rows flagged by D2T (tile overflow, NaN/Inf) are skipped here; the dense
// fallback (a gathered cuBLASLt pass, then gemv.cu's LIST kernels, then
// row_fallback) writes them.
#include "common.cuh"

#ifndef TW_NCH
#define TW_NCH 8  // ceil(d / 256): 256-element chunks per row, 8 elements per lane each
#endif
#define T2D_WARPS 8
#define T2D_MINB 1  // blocks per SM the register budget must allow (2: at most 128 registers)
#define LCAP 256

// gather_list appends a token's active entries (its packed row prow: per
// 256-column tile a count word, then the entries) in column order to the
// warp's shared list (empty on entry), loading words with load(p); when
// the next tile's entries would not fit in LCAP it calls flush(n) (which
// walks the list; the list is then empty) first. Returns the entries left
// in the list.
template <typename Load, typename Flush>
__device__ __forceinline__ int gather_list(const u32* prow, int tiles, int S, u32* list, Load load, Flush flush) {
  const int lane = threadIdx.x & 31;
  int n = 0;
  for (int tg = 0; tg < tiles; tg += 32) {
    const int t = tg + lane;
    const u32 c = (t < tiles) ? load(prow + (size_t)t * S) : 0u;
    u32 nzm = __ballot_sync(0xffffffffu, c != 0u);
    while (nzm) {
      const int src = __ffs(nzm) - 1;
      nzm &= nzm - 1;
      const int cnt = (int)__shfl_sync(0xffffffffu, c, src);
      if (n + cnt > LCAP) {
        flush(n);
        n = 0;
      }
      const u32* tw = prow + (size_t)(tg + src) * S + 1;
      for (int i = lane; i < cnt; i += 32) list[n + i] = load(tw + i);
      n += cnt;
    }
  }
  return n;
}

template <bool GATED>
__device__ __forceinline__ void t2d_process(const u32* list, int n, const uint4 (&xv)[TW_NCH], float (&acc)[TW_NCH * 8],
                                            const u16* __restrict__ U, const u16* __restrict__ D, int d, int lane,
                                            u64 keep) {
  for (int i = 0; i < n; i += 2) {
    const u32 wa = list[i];
    const bool hasb = i + 1 < n;
    const u32 wb = hasb ? list[i + 1] : 0u;
    const size_t ja = (size_t)(wa & 0xffffu) * d, jb = (size_t)(wb & 0xffffu) * d;
    float ha = bf_hi(wa), hb = hasb ? bf_hi(wb) : 0.f;
    if (GATED) {
      uint4 ua[TW_NCH], ub[TW_NCH];
#pragma unroll
      for (int c = 0; c < TW_NCH; ++c) {
        int k = c * 256 + lane * 8;
        uint4 z;
        z.x = z.y = z.z = z.w = 0u;
        ua[c] = z;
        ub[c] = z;
        if (k < d) {
          ua[c] = ld_hint(U + ja + k, keep);
          if (hasb) ub[c] = ld_hint(U + jb + k, keep);
        }
      }
      float pa = 0.f, pb = 0.f;
#pragma unroll
      for (int c = 0; c < TW_NCH; ++c) {
        pa = dot8(xv[c], ua[c], pa);
        pb = dot8(xv[c], ub[c], pb);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        pa += __shfl_xor_sync(0xffffffffu, pa, o);
        pb += __shfl_xor_sync(0xffffffffu, pb, o);
      }
      ha *= pa;
      hb *= pb;
    }
    uint4 da[TW_NCH], db[TW_NCH];
#pragma unroll
    for (int c = 0; c < TW_NCH; ++c) {
      int k = c * 256 + lane * 8;
      uint4 z;
      z.x = z.y = z.z = z.w = 0u;
      da[c] = z;
      db[c] = z;
      if (k < d) {
        da[c] = ld_hint(D + ja + k, keep);
        if (hasb) db[c] = ld_hint(D + jb + k, keep);
      }
    }
#pragma unroll
    for (int c = 0; c < TW_NCH; ++c) {
      axpy8(&acc[c * 8], ha, da[c]);
      if (hasb) axpy8(&acc[c * 8], hb, db[c]);
    }
  }
  __syncwarp();
}

template <bool GATED>
__global__ void __launch_bounds__(256, T2D_MINB)
    t2d(const u16* __restrict__ x, const u32* __restrict__ packed, const u16* __restrict__ U,
        const u16* __restrict__ D, u16* __restrict__ y, const int* __restrict__ flags, int m, int d, int S, int tiles,
        int row_words) {
  __shared__ u32 lists[T2D_WARPS][LCAP];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = blockIdx.x * T2D_WARPS + warp;
  if (r >= m) return;
  if (flags[r]) return;
  const u64 keep = policy_evict_last(), stream = policy_evict_first();
  u32* list = lists[warp];
  const size_t rowoff = (size_t)r * d;
  uint4 xv[TW_NCH];
#pragma unroll
  for (int c = 0; c < TW_NCH; ++c) {
    int k = c * 256 + lane * 8;
    xv[c].x = xv[c].y = xv[c].z = xv[c].w = 0u;
    if (GATED && k < d) xv[c] = ld_hint(x + rowoff + k, stream);
  }
  float acc[TW_NCH * 8];
#pragma unroll
  for (int i = 0; i < TW_NCH * 8; ++i) acc[i] = 0.f;

  const int n = gather_list(
      packed + (size_t)r * row_words, tiles, S, list, [&](const u32* p) { return ld_hint_u32(p, stream); },
      [&](int len) {
        __syncwarp();
        t2d_process<GATED>(list, len, xv, acc, U, D, d, lane, keep);
      });
  __syncwarp();
  t2d_process<GATED>(list, n, xv, acc, U, D, d, lane, keep);

#pragma unroll
  for (int c = 0; c < TW_NCH; ++c) {
    int k = c * 256 + lane * 8;
    if (k < d) {
      uint4 o;
      o.x = pack_bf2(acc[c * 8 + 0], acc[c * 8 + 1]);
      o.y = pack_bf2(acc[c * 8 + 2], acc[c * 8 + 3]);
      o.z = pack_bf2(acc[c * 8 + 4], acc[c * 8 + 5]);
      o.w = pack_bf2(acc[c * 8 + 6], acc[c * 8 + 7]);
      st_hint(y + rowoff + k, o, stream);
    }
  }
}

// ---------------------------------------------------------------------------
// Split tail: t2u then t2d_ws, for large batches.
//
// The warp-per-token t2d reads a U row and a D row from L2 for every active
// pair (8 KB at d = 2048), and is bound by L2 bandwidth. The split tail keeps
// the up projection per token (t2u: 4 KB of U per pair) but makes the down
// projection weight-stationary: a CTA holds the columns c0..c0+W-1 of every D
// row in shared memory and streams all tokens' compact lists through them.
//
// Its kernels (t2u, the three len_* kernels, t2d_ws) may be launched with
// early start (cuda.LaunchConfig.EarlyStart): each waits (grid_wait) before
// it reads or writes anything an earlier kernel touches, so their launches
// overlap the kernel before, and t2d_ws loads its slice of D (weights) into
// shared memory before it waits. What an earlier kernel wrote they read
// through the L2 (ld_cg_hint, __ldcg) or with plain loads (t2u's packed
// rows, which it rewrites; __ldcg there cost 128 bytes of spills), never
// through the read-only path (ld.global.nc, which const __restrict__ loads
// become): that path is for data no kernel writes while the reader lives,
// and an early start overlaps the writer.
#define LEN_BINS 1024  // list-length bins of the sort (below)

// Length order for the split tail (TailSorted): the tokens ordered by the
// length of their compact list, longest first, so that the tokens one warp
// of t2d_ws takes in a round (which lasts as long as its longest list) are
// about as long as each other. A counting sort over cnt: t2u counts each
// token's length (clamped to LEN_BINS - 1; bin LEN_BINS - 1 - length, so
// that longer lists come first) into hist, and len_scatter scans hist into
// each bin's first position and writes each token to order at its bin's
// next position (cur, the bins' fill counts). hist and cur are zeroed with
// the row flags before D2T. The order within a bin is arbitrary, which
// changes no result: every token's sum runs over its own list in list order.
// (In traced calls at m = 4096 on an H100, an earlier form in three kernels,
// a histogram and a one-block scan before the scatter, added about 5.4 us;
// len_scatter alone adds 3.8.)

__device__ __forceinline__ int len_bin(int n) { return LEN_BINS - 1 - min(max(n, 0), LEN_BINS - 1); }

// agg_add adds 1 to *p for every active lane, one atomic per distinct key
// among them (lanes with the same key hit the same *p), and returns this
// lane's old value plus its rank among its peers.
__device__ __forceinline__ int agg_add(int* p, int key) {
  const unsigned peers = __match_any_sync(__activemask(), key);
  const int lane = threadIdx.x & 31, leader = __ffs(peers) - 1;
  int base = 0;
  if (lane == leader) base = atomicAdd(p, __popc(peers));
  base = __shfl_sync(peers, base, leader);
  return base + __popc(peers & ((1u << lane) - 1u));
}

// t2u: one warp per token. Gathers the row's active entries in column order,
// computes h = g * (x . U[j]) (gated; non-gated h is the packed value), and
// overwrites the row's packed words with the compact list, word i =
// bf16(h) << 16 | j, setting cnt[r] to its length. The row is private to its
// warp and every write lands at or before the entry it replaces, below any
// word still to be read. Flagged rows get cnt[r] = 0 (the fallback writes y).
// One U row is in flight per warp (gated): with two, ptxas spilled 220
// bytes at the 128 registers of two blocks an SM (sm_90a, d 2048), and the
// MLP block took 4.58 against 4.42 ms at m = 65536 (H200, 2026-12-05).
// More rows in flight without spills did not help either: with each warp
// copying its U rows by cp.async into a ring of 2 or 3 rows in shared
// memory, 1 or 2 rows ahead of the one it reduces, the block took 4.482 and
// 4.505 ms against 4.364-4.378 (m = 65536, 0.5%, uniform, H100); with x in
// shared memory and two rows in registers, 4.865 against 4.424 (the
// driver's ptxas spilled 136 bytes).
#define T2U_MINB 2  // blocks per SM the register budget must allow (1: 1.57 ms, 2: 1.25 ms on an H200)
// Each token also adds 1 to its list length's bin of the sort's len_bins
// (LEN_BINS ints, zeroed with the row flags before D2T), for len_scatter.
template <bool GATED>
__global__ void __launch_bounds__(256, T2U_MINB)
    t2u(const u16* __restrict__ x, u32* packed, const u16* __restrict__ U, int* __restrict__ cnt,
        const int* __restrict__ flags, int m, int d, int S, int tiles, int row_words, int* __restrict__ len_bins) {
  __shared__ u32 lists[T2D_WARPS][LCAP];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = blockIdx.x * T2D_WARPS + warp;
  grid_wait();  // the packed rows and flags are D2T's
  grid_release();
  if (r >= m) return;
  if (__ldcg(flags + r)) {
    if (lane == 0) {
      cnt[r] = 0;
      atomicAdd(&len_bins[len_bin(0)], 1);
    }
    return;
  }
  const u64 keep = policy_evict_last(), stream = policy_evict_first();
  u32* list = lists[warp];
  uint4 xv[TW_NCH];
#pragma unroll
  for (int c = 0; c < TW_NCH; ++c) {
    int k = c * 256 + lane * 8;
    xv[c].x = xv[c].y = xv[c].z = xv[c].w = 0u;
    if (GATED && k < d) xv[c] = ld_cg_hint(x + (size_t)r * d + k, stream);
  }
  u32* prow = packed + (size_t)r * row_words;
  int out = 0;
  // flush turns the list's n entries into compact words at prow + out.
  auto flush = [&](int n) {
    __syncwarp();
    if (GATED) {
      for (int i = 0; i < n; ++i) {
        const u32 w = list[i];
        const size_t j = (size_t)(w & 0xffffu) * d;
        uint4 ur[TW_NCH];
#pragma unroll
        for (int c = 0; c < TW_NCH; ++c) {
          int k = c * 256 + lane * 8;
          ur[c].x = ur[c].y = ur[c].z = ur[c].w = 0u;
          if (k < d) ur[c] = ld_hint(U + j + k, keep);
        }
        float p = 0.f;
#pragma unroll
        for (int c = 0; c < TW_NCH; ++c) p = dot8(xv[c], ur[c], p);
        p = warp_sum(p);
        if (lane == 0) prow[out + i] = (f_to_bf(bf_hi(w) * p) << 16) | (w & 0xffffu);
      }
    } else {
      for (int i = lane; i < n; i += 32) prow[out + i] = list[i];
    }
    out += n;
    __syncwarp();
  };
  flush(gather_list(prow, tiles, S, list, [](const u32* p) { return *p; }, flush));
  if (lane == 0) {
    cnt[r] = out;
    atomicAdd(&len_bins[len_bin(out)], 1);
  }
}

extern "C" __global__ void __launch_bounds__(256)
    len_scatter(const int* __restrict__ cnt, int m, const int* __restrict__ hist, int* __restrict__ cur,
                int* __restrict__ order) {
  static_assert(LEN_BINS == 4 * 256, "len_scatter scans 4 bins a thread");
  __shared__ int off[LEN_BINS];
  __shared__ int part[8];
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  grid_wait();  // cnt and hist are t2u's
  grid_release();
  // Each block scans hist into its own copy of the bins' first positions.
  int v[4], sum = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) sum += v[q] = __ldcg(hist + 4 * tid + q);
  int incl = sum;  // inclusive scan of the threads' sums within the warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += u;
  }
  if (lane == 31) part[w] = incl;
  __syncthreads();
  int run = incl - sum;
  for (int i = 0; i < w; ++i) run += part[i];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    off[4 * tid + q] = run;
    run += v[q];
  }
  __syncthreads();
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < m; t += gridDim.x * blockDim.x) {
    const int b = len_bin(__ldcg(cnt + t)), pos = off[b] + agg_add(&cur[b], b);
    if (pos < m) order[pos] = t;
  }
}

// t2d_ws: y[t, c0:c0+W] = sum over t's compact list of h * D[j, c0:c0+W],
// for the tokens [t0, t1) of the block's token range and the block's W
// columns. D's slice (f x W bf16) lives in shared memory. W/8 lanes share a
// token, each lane owning 8 of its columns: the lanes walk the token's list
// together (4 entries per 16-byte load) and each reads 16 bytes of the entry's
// slice row, so the W/8 lanes of a token read one contiguous row (fewer bank
// conflicts than one lane reading it all). fp32 accumulators, y rounded to
// bf16 once. Flagged rows (cnt 0) get zeros, overwritten later by the
// fallback.
//
// A warp steps through its tokens' lists together, as many steps as its
// longest list (lanes with shorter lists idle). Walking each lane group's
// tokens as one stream instead (no idle lanes, but a branch per token and
// one list load in flight) measured slower (0.99 vs 0.90 ms at m = 65536 on
// an H200). The kernel is bound by shared-memory wavefronts (random slice
// rows conflict on banks: 47% of wavefronts in ncu) and issue slots.
#define WS_LOADS 2  // 16-byte list loads in flight per lane (1: 1.36 ms, 2: 0.89-0.91, 4: 0.92-0.93 on an H200)
template <int W>
__global__ void __launch_bounds__(1024, 1)
    t2d_ws(const u32* __restrict__ packed, const int* __restrict__ cnt, const int* __restrict__ order,
           const u16* __restrict__ D, u16* __restrict__ y, int m, int d, int f, int row_words, int tok_per_block) {
  extern __shared__ uint4 ds[];
  constexpr int L = W / 8;  // lanes per token, uint4 per slice row
  const int c0 = blockIdx.x * W, tid = threadIdx.x, sub = tid % L;
  const u64 keep = policy_evict_last(), stream = policy_evict_first();
  for (int i = tid; i < f * L; i += blockDim.x) {
    int j = i / L, v = i - j * L;
    ds[i] = ld_hint(D + (size_t)j * d + c0 + v * 8, keep);
  }
  grid_wait();  // the lists, lengths and order are t2u's and the sort's
  grid_release();
  __syncthreads();
  const int t0 = blockIdx.y * tok_per_block, t1 = min(m, t0 + tok_per_block);
  auto store = [&](int t, const float(&acc)[8]) {
    uint4 o;
    o.x = pack_bf2(acc[0], acc[1]);
    o.y = pack_bf2(acc[2], acc[3]);
    o.z = pack_bf2(acc[4], acc[5]);
    o.w = pack_bf2(acc[6], acc[7]);
    st_hint(y + (size_t)t * d + c0 + sub * 8, o, stream);
  };
  auto step = [&](float(&acc)[8], uint4 w4, int left) {
    const u32 ws[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (q < left) axpy8(acc, bf_hi(ws[q]), ds[(int)(ws[q] & 0xffffu) * L + sub]);
  };
  // With order (TailSorted), tokens come by list length, so that a warp's
  // tokens of one round are about as long as each other; the blockIdx.y
  // blocks take every gridDim.y-th sorted position (not a contiguous range,
  // which would give the first block all the longest lists). Without order,
  // round k gives lane group g token base + (g + 37k) mod G rather than
  // base + g: sequences whose lengths are multiples of G would otherwise put
  // every sequence start (often a long list) in the same warp, every round.
  const int G = blockDim.x / L, g = tid / L, ny = gridDim.y;
  for (int base = order ? 0 : t0, k = 0; order ? base * ny < m : base < t1; base += G, ++k) {
    int t;
    if (order) {
      const int pos = (base + g) * ny + blockIdx.y;
      if (pos >= m) continue;
      t = __ldcg(order + pos);
    } else {
      t = base + (g + 37 * k) % G;
      if (t >= t1) continue;
    }
    const int n = __ldcg(cnt + t);
    const u32* e = packed + (size_t)t * row_words;
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = 0.f;
    for (int s = 0; s < n; s += 4 * WS_LOADS) {
      uint4 w4[WS_LOADS];
#pragma unroll
      for (int v = 0; v < WS_LOADS; ++v) {
        w4[v].x = w4[v].y = w4[v].z = w4[v].w = 0u;
        if (s + 4 * v < n) w4[v] = ld_cg_hint(e + s + 4 * v, stream);
      }
#pragma unroll
      for (int v = 0; v < WS_LOADS; ++v) step(acc, w4[v], n - s - 4 * v);
    }
    store(t, acc);
  }
}

// row_fallback computes flagged rows exactly and densely: every unit's gate
// (or, non-gated, up) pre-activation in fp32, h as on the CPU (active when
// > 0 or NaN), then y = h D in a fixed order. Blocks loop over the overflow
// list ovf (ovf[0] = count) from entry first on (the entries before it went
// through the gathered dense pass); hbuf holds gridDim.x x f floats of
// scratch.
template <bool GATED>
__global__ void __launch_bounds__(256)
    row_fallback(const u16* __restrict__ x, const u16* __restrict__ Wsp, const u16* __restrict__ U,
                 const u16* __restrict__ D, u16* __restrict__ y, const int* __restrict__ ovf, float* __restrict__ hbuf,
                 int d, int f, int first) {
  extern __shared__ float xs[];
  float* h = hbuf + (size_t)blockIdx.x * f;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  grid_wait();  // the list is D2T's, y the kernels' before
  grid_release();
  const int count = __ldcg(ovf);
  for (int i = first + blockIdx.x; i < count; i += gridDim.x) {
    const int r = ovf[1 + i];
    __syncthreads();
    for (int k = tid; k < d; k += 256) xs[k] = bf_to_f(x[(size_t)r * d + k]);
    __syncthreads();
    for (int j = warp; j < f; j += 8) {
      const u16* wr = Wsp + (size_t)j * d;
      float g = 0.f;
      for (int k = lane; k < d; k += 32) g = fmaf(xs[k], bf_to_f(wr[k]), g);
      g = warp_sum(g);
      float hv = 0.f;
      if (g > 0.f || g != g) {
        hv = g;
        if (GATED) {
          const u16* ur = U + (size_t)j * d;
          float u = 0.f;
          for (int k = lane; k < d; k += 32) u = fmaf(xs[k], bf_to_f(ur[k]), u);
          hv = g * warp_sum(u);
        }
      }
      if (lane == 0) h[j] = hv;
    }
    __syncthreads();
    for (int k = tid; k < d; k += 256) {
      float a = 0.f;
      for (int j = 0; j < f; ++j) {
        const float hv = h[j];
        if (hv != 0.f) a = fmaf(hv, bf_to_f(D[(size_t)j * d + k]), a);
      }
      y[(size_t)r * d + k] = (u16)f_to_bf(a);
    }
  }
}
