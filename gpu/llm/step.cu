// step.cu: a whole one-token decode step, every layer, in one kernel
// (step_b1), for models with head_dim 64, a gated ReLU MLP, d and nq 64 at
// most 2048 (multiples of 256) and f at most 8192 (a multiple of 32).
//
// The separate decode kernels each read their weights only once the kernel
// before is far enough along (early start needs room on the SMs), so most
// of a layer's time went to the waits between them rather than to reading
// its 57 MB (docs/gpu-llm.md, Decode steps). Here one block per SM runs
// the whole step: warp 8 (the producer) streams the block's share of every
// layer's q/k/v, output projection and gate rows, in the order the block
// uses them, into a ring of ST_SLOTS shared-memory slots of 8 rows with
// bulk asynchronous copies, running ahead of the activations (the rows do
// not depend on them) and across the barriers, and between them the 64-key
// blocks of keys and values its attention items read (all cached before the
// step but for the new token's); warps 0-7 (the consumers) compute. Per
// layer five phases, each ended by a grid barrier of the consumers
// (grid_arrive_wait):
//
//   qkv    norm the residual; 8-row units of q/k/v rows (a q or k unit is
//          rows 4i..4i+3 and 32+4i.. of a head, the pairs RoPE rotates
//          together, warps w and w+4 meeting at a barrier of their own):
//          dot products, RoPE on the fp32 results, q into q, the new key
//          and value into the cache at the token's position
//   attn   (head, run) items, a run being whole 64-key blocks of the keys
//          0..pos: online softmax in each warp over the keys from the ring
//          (the new token's through the L2), the warps merged; partial
//          (max, sum, output) to part
//   oproj  every block merges the runs into the attention output; 8-row
//          units of the output projection, added (bf16) to the residual
//   gate   norm the residual; 8-row units of gate rows: g = bf16(x . w);
//          a unit with g > 0 (or NaN) reads its up row: h = g (x . u), and
//          asks the L2 for its down row; h and a byte of activity per unit
//   down   block b owns columns 16b..16b+15: each warp lists the active
//          units of its eighth of the units and sums h_j down[j][c] over
//          them, a unit a lane; the lanes' and then the warps' sums added
//          in a fixed order, bf16, added to the residual
//
// Sums are in a fixed order: the step is deterministic. Every value the
// kernel's blocks pass each other is read through the L2 (ld.global.cg).
#include "common.cuh"
#include "kvpage.cuh"

#define ST_HD 64
#define ST_ROWS 8
#define ST_MAXK 2048
#define ST_SLOT (ST_ROWS * ST_MAXK * 2)
#define ST_SLOTS 6
#define ST_CONS 8
#define ST_RUNS 4
#define ST_PART (ST_HD + 2)
#define ST_BLOCK (ST_HD * ST_HD * 2)  // a 64-key block's keys (or values), bytes
#define ST_MAXF 8192
#define ST_LIST 128
#define ST_NEG_INF __int_as_float(0xff800000)

// StepLayer is one layer's weights: bf16 rows of d (or nq 64) columns.
struct StepLayer {
  const u16* qkv;          // [(nq + 2 nkv) 64][d]
  const u16* o;            // [d][nq 64]
  const u16* gate;         // [f][d]
  const u16* up;           // [f][d]
  const u16* down;         // [f][d]: Wd^T
  const float* attn_norm;  // [d]
  const float* mlp_norm;   // [d]
};

// A head's keys are cut into ST_RUNS runs of whole 64-key blocks (nblk
// blocks in all), the first runs one block longer where they do not divide.
__device__ __forceinline__ int st_run_start(int r, int nblk) {
  const int per = nblk / ST_RUNS, extra = nblk % ST_RUNS;
  return r * per + min(r, extra);
}
__device__ __forceinline__ int st_run_end(int r, int nblk) { return st_run_start(r + 1, nblk); }

__device__ __forceinline__ void st_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

__device__ __forceinline__ void st_grid(u64* cnt) {
  st_sync();
  if (threadIdx.x == 0) grid_arrive_wait(cnt, true);
  st_sync();
}

__device__ __forceinline__ void st_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void st_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// st_norm norms the residual (fp32, d) into xs (bf16): x / rms(x) w.
__device__ __forceinline__ void st_norm(u16* xs, const float* __restrict__ resid, const float* __restrict__ w, int d,
                                        float eps, float* red) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  float4 v[ST_MAXK / 1024];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < ST_MAXK / 1024; ++k) {
    const int i = t + k * 256;
    if (i < d / 4) {
      v[k] = __ldcg((const float4*)resid + i);
      ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
    }
  }
  ss = warp_sum(ss);
  if (lane == 0) red[warp] = ss;
  st_sync();
  float tot = 0.f;
#pragma unroll
  for (int i = 0; i < ST_CONS; ++i) tot += red[i];
  const float inv = rsqrtf(tot / (float)d + eps);
#pragma unroll
  for (int k = 0; k < ST_MAXK / 1024; ++k) {
    const int i = t + k * 256;
    if (i < d / 4) {
      const float4 g = *((const float4*)w + i);
      uint2 o;
      o.x = pack_bf2(v[k].x * inv * g.x, v[k].y * inv * g.y);
      o.y = pack_bf2(v[k].z * inv * g.z, v[k].w * inv * g.w);
      ((uint2*)xs)[i] = o;
    }
  }
  st_sync();
}

// st_dot returns (to every lane) row . xs over k columns (a multiple of
// 256), the row in shared memory.
__device__ __forceinline__ float st_dot(const u16* row, const u16* xs, int k, int lane) {
  float acc = 0.f;
  for (int c = lane * 8; c < k; c += 256) acc = dot8(*(const uint4*)(row + c), *(const uint4*)(xs + c), acc);
  return warp_sum(acc);
}

// st_dot_g is st_dot with the row in global memory (weights).
__device__ __forceinline__ float st_dot_g(const u16* __restrict__ row, const u16* xs, int k, int lane) {
  float acc = 0.f;
  uint4 w[ST_MAXK / 256];
#pragma unroll
  for (int j = 0; j < ST_MAXK / 256; ++j)
    if (lane * 8 + j * 256 < k) w[j] = ldg_nc(row + lane * 8 + j * 256);
#pragma unroll
  for (int j = 0; j < ST_MAXK / 256; ++j)
    if (lane * 8 + j * 256 < k) acc = dot8(w[j], *(const uint4*)(xs + lane * 8 + j * 256), acc);
  return warp_sum(acc);
}

// step_b1: grid = one block per SM (cooperative), 288 threads, dynamic
// shared memory ST_SLOTS * ST_SLOT + max(d, nq 64) * 2 bytes (xs). resid (fp32, d) holds
// the token's embedding and is left holding the residual stream after the
// last layer; q (bf16, nq 64), part (fp32, nq ST_RUNS ST_PART), h (fp32, f)
// and act (bytes, f) are scratch; cnt is the grid barrier's counter (zero
// at first, shared by every launch of the same grid size).
extern "C" __global__ void __launch_bounds__(288, 1)
    step_b1(const StepLayer* __restrict__ layers, int nl, int d, int f, int nq, int nkv, int page,
            float* __restrict__ resid, const float* __restrict__ cosT, const float* __restrict__ sinT,
            const int* __restrict__ tok_pos, const u64* __restrict__ seq_pt, float eps, u16* __restrict__ q,
            float* __restrict__ part, float* __restrict__ h, unsigned char* __restrict__ act, u64* cnt) {
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) u64 bars[2 * ST_SLOTS];
  __shared__ float red[ST_CONS], pair[2][ST_ROWS], wm[ST_CONS], wl[ST_CONS], dn[ST_CONS][16];
  __shared__ float wo[ST_CONS][ST_HD];
  __shared__ int lst[ST_CONS][ST_LIST];
  u16* ring = (u16*)sm;
  u16* xs = (u16*)(sm + ST_SLOTS * ST_SLOT);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int G = gridDim.x, b = blockIdx.x;
  const int nqkv = (nq + 2 * nkv) * (ST_HD / ST_ROWS), no = d / ST_ROWS, ng = f / ST_ROWS;
  const int kq = nq * ST_HD;
  const u32 full0 = smem_addr(&bars[0]), empty0 = smem_addr(&bars[ST_SLOTS]);
  if (threadIdx.x == 0) {
    for (int s = 0; s < ST_SLOTS; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, ST_CONS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int pos = tok_pos[0], n = pos + 1, nblk = (n + ST_HD - 1) / ST_HD;
  const u64* table = kv_table(seq_pt, 0);
  const int group = nq / nkv;
  if (warp == ST_CONS) {  // the producer
    if (lane != 0) return;
    const u32 ring0 = smem_addr(ring);
    int i = 0;
    auto slot = [&](int& s) {
      s = i % ST_SLOTS;
      const int k = i / ST_SLOTS;
      if (k > 0) mbar_wait(empty0 + 8 * s, (k - 1) & 1);
      ++i;
    };
    for (int l = 0; l < nl; ++l) {
      const StepLayer L = layers[l];
      for (int u = b; u < nqkv; u += G) {
        int s;
        slot(s);
        const int head = u / 8, iu = u % 8;
        const u32 dst = ring0 + s * ST_SLOT, bar = full0 + 8 * s;
        mbar_expect_tx(bar, ST_ROWS * d * 2);
        if (head < nq + nkv) {
          st_copy(dst, L.qkv + (size_t)(head * ST_HD + 4 * iu) * d, 4 * d * 2, bar);
          st_copy(dst + 4 * d * 2, L.qkv + (size_t)(head * ST_HD + 32 + 4 * iu) * d, 4 * d * 2, bar);
        } else {
          st_copy(dst, L.qkv + (size_t)(head * ST_HD + 8 * iu) * d, ST_ROWS * d * 2, bar);
        }
      }
      for (int it = b; it < nq * ST_RUNS; it += G) {
        const int kh = it / ST_RUNS / group, bk1 = st_run_end(it % ST_RUNS, nblk);
        for (int blk = st_run_start(it % ST_RUNS, nblk); blk < bk1; blk += 2) {
          int s;
          slot(s);
          const int nb = min(2, bk1 - blk);
          const u32 dst = ring0 + s * ST_SLOT, bar = full0 + 8 * s;
          mbar_expect_tx(bar, nb * 2 * ST_BLOCK);
          for (int e = 0; e < nb; ++e) {
            const int p0 = (blk + e) * ST_HD;
            const u16* pg = (const u16*)table[p0 / page];
            st_copy(dst + e * 2 * ST_BLOCK, pg + kv_off(page, l, 0, nkv, kh, p0 % page, ST_HD), ST_BLOCK, bar);
            st_copy(dst + e * 2 * ST_BLOCK + ST_BLOCK, pg + kv_off(page, l, 1, nkv, kh, p0 % page, ST_HD), ST_BLOCK,
                    bar);
          }
        }
      }
      for (int u = b; u < no; u += G) {
        int s;
        slot(s);
        const u32 bar = full0 + 8 * s;
        mbar_expect_tx(bar, ST_ROWS * kq * 2);
        st_copy(ring0 + s * ST_SLOT, L.o + (size_t)u * ST_ROWS * kq, ST_ROWS * kq * 2, bar);
      }
      for (int u = b; u < ng; u += G) {
        int s;
        slot(s);
        const u32 bar = full0 + 8 * s;
        mbar_expect_tx(bar, ST_ROWS * d * 2);
        st_copy(ring0 + s * ST_SLOT, L.gate + (size_t)u * ST_ROWS * d, ST_ROWS * d * 2, bar);
      }
    }
    return;
  }

  // The consumers.
  int i = 0;   // the ring's iteration, as the producer's
  int par = 0; // which pair[] buffer a qkv unit uses
  auto take = [&]() -> const u16* {
    const int s = i % ST_SLOTS, k = i / ST_SLOTS;
    ++i;
    mbar_wait(full0 + 8 * s, k & 1);
    return ring + s * (ST_SLOT / 2);
  };
  auto give = [&](const u16* slot) {
    __syncwarp();
    if (lane == 0) st_arrive(empty0 + 8 * (int)((slot - ring) / (ST_SLOT / 2)));
  };
  for (int l = 0; l < nl; ++l) {
    const StepLayer L = layers[l];
    // qkv
    st_norm(xs, resid, L.attn_norm, d, eps, red);
    for (int u = b; u < nqkv; u += G) {
      const u16* slot = take();
      const float v = st_dot(slot + warp * d, xs, d, lane);
      give(slot);
      const int head = u / 8, iu = u % 8;
      if (head >= nq + nkv) {  // values: no rotation, each warp writes its own
        if (lane == 0) {
          u16* dst = (u16*)table[pos / page] + kv_off(page, l, 1, nkv, head - nq - nkv, pos % page, ST_HD);
          dst[8 * iu + warp] = (u16)f_to_bf(v);
        }
        continue;
      }
      // warps w and w + 4 hold rows j and j + 32 of a head: they meet at a
      // barrier of their own, and warp w rotates the pair.
      if (lane == 0) pair[par][warp] = v;
      asm volatile("bar.sync %0, 64;" ::"r"(2 + (warp & 3)) : "memory");
      if (warp < 4 && lane == 0) {
        const int j = 4 * iu + warp;
        const float a = v, bb = pair[par][warp + 4];
        const float c = cosT[(size_t)pos * 32 + j], sn = sinT[(size_t)pos * 32 + j];
        const float ra = a * c - bb * sn, rb = bb * c + a * sn;
        u16* dst = head < nq ? q + head * ST_HD
                             : (u16*)table[pos / page] + kv_off(page, l, 0, nkv, head - nq, pos % page, ST_HD);
        dst[j] = (u16)f_to_bf(ra);
        dst[j + 32] = (u16)f_to_bf(rb);
      }
      par ^= 1;
    }
    st_grid(cnt);

    // attention: items (head, run), the run's key and value blocks from the
    // ring (two blocks a slot) but for the new token's, read through the L2
    const float scale = 0.125f * 1.4426950408889634f;  // 1/sqrt(64), in log2 units
    for (int it = b; it < nq * ST_RUNS; it += G) {
      const int hh = it / ST_RUNS, r = it % ST_RUNS, kh = hh / group;
      const int bk1 = st_run_end(r, nblk);
      const u32 qv = __ldcg((const unsigned int*)(q + hh * ST_HD) + lane);
      const float q0 = bf_lo(qv), q1 = bf_hi(qv);
      float m = ST_NEG_INF, sum = 0.f, o0 = 0.f, o1 = 0.f;
      for (int blk = st_run_start(r, nblk); blk < bk1; blk += 2) {
        const u16* slot = take();
        const int nk = min(2 * ST_HD, min(bk1 * ST_HD, n) - blk * ST_HD);  // the slot's keys
        for (int kk = warp; kk < nk; kk += ST_CONS) {
          const int key = blk * ST_HD + kk;
          // a slot is [keys 0][values 0][keys 1][values 1], ST_BLOCK bytes each
          const u16* kr = slot + (kk / ST_HD) * ST_BLOCK + (kk % ST_HD) * ST_HD;
          u32 kw, vw;
          if (key == pos) {
            const u16* pg = (const u16*)table[pos / page];
            kw = __ldcg((const unsigned int*)(pg + kv_off(page, l, 0, nkv, kh, pos % page, ST_HD)) + lane);
            vw = __ldcg((const unsigned int*)(pg + kv_off(page, l, 1, nkv, kh, pos % page, ST_HD)) + lane);
          } else {
            kw = ((const unsigned int*)kr)[lane];
            vw = ((const unsigned int*)(kr + ST_BLOCK / 2))[lane];
          }
          const float sc = warp_sum(q0 * bf_lo(kw) + q1 * bf_hi(kw)) * scale;
          const float mn = fmaxf(m, sc);
          const float alpha = exp2f(m - mn), p = exp2f(sc - mn);
          sum = sum * alpha + p;
          o0 = o0 * alpha + p * bf_lo(vw);
          o1 = o1 * alpha + p * bf_hi(vw);
          m = mn;
        }
        give(slot);
      }
      if (lane == 0) {
        wm[warp] = m;
        wl[warp] = sum;
      }
      wo[warp][2 * lane] = o0;
      wo[warp][2 * lane + 1] = o1;
      st_sync();
      if (threadIdx.x < ST_HD) {
        float M = ST_NEG_INF;
#pragma unroll
        for (int w = 0; w < ST_CONS; ++w) M = fmaxf(M, wm[w]);
        float S = 0.f, O = 0.f;
        if (M != ST_NEG_INF) {
#pragma unroll
          for (int w = 0; w < ST_CONS; ++w) {
            const float a = wm[w] == ST_NEG_INF ? 0.f : exp2f(wm[w] - M);
            S += wl[w] * a;
            O += wo[w][threadIdx.x] * a;
          }
        }
        float* pp = part + (size_t)it * ST_PART;
        pp[2 + threadIdx.x] = O;
        if (threadIdx.x == 0) {
          pp[0] = M;
          pp[1] = S;
        }
      }
      st_sync();
    }
    st_grid(cnt);

    // oproj: merge the runs into xs (nq 64 bf16), then the rows
    for (int e = threadIdx.x; e < kq; e += ST_CONS * 32) {
      const int hh = e / ST_HD, c = e % ST_HD;
      const float* pp = part + (size_t)hh * ST_RUNS * ST_PART;
      float mr[ST_RUNS], lr[ST_RUNS], orr[ST_RUNS];
#pragma unroll
      for (int r = 0; r < ST_RUNS; ++r) {
        mr[r] = __ldcg(pp + r * ST_PART);
        lr[r] = __ldcg(pp + r * ST_PART + 1);
        orr[r] = __ldcg(pp + r * ST_PART + 2 + c);
      }
      float M = ST_NEG_INF;
#pragma unroll
      for (int r = 0; r < ST_RUNS; ++r) M = fmaxf(M, mr[r]);
      float S = 0.f, O = 0.f;
#pragma unroll
      for (int r = 0; r < ST_RUNS; ++r) {
        const float a = mr[r] == ST_NEG_INF ? 0.f : exp2f(mr[r] - M);
        S += lr[r] * a;
        O += orr[r] * a;
      }
      xs[e] = (u16)f_to_bf(O / S);
    }
    st_sync();
    for (int u = b; u < no; u += G) {
      const u16* slot = take();
      const float v = st_dot(slot + warp * kq, xs, kq, lane);
      give(slot);
      if (lane == 0) {
        const int row = u * ST_ROWS + warp;
        __stcg(resid + row, __ldcg(resid + row) + __uint_as_float(f_to_bf(v) << 16));
      }
    }
    st_grid(cnt);

    // gate and up
    st_norm(xs, resid, L.mlp_norm, d, eps, red);
    for (int u = b; u < ng; u += G) {
      const u16* slot = take();
      float g = st_dot(slot + warp * d, xs, d, lane);
      give(slot);
      g = __uint_as_float(f_to_bf(g) << 16);
      const int j = u * ST_ROWS + warp;
      const bool on = g > 0.f || g != g;
      float hv = 0.f;
      if (on) {
        hv = g * st_dot_g(L.up + (size_t)j * d, xs, d, lane);
        if (lane == 0)
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(L.down + (size_t)j * d), "r"(d * 2)
                       : "memory");
      }
      if (lane == 0) {
        __stcg(h + j, hv);
        act[j] = on;
      }
    }
    st_grid(cnt);

    // down: block b owns columns 16b .. 16b+15
    if (b < d / 16) {
      const int c0 = b * 16, per = f / ST_CONS, j0 = warp * per, nw = per / 4;
      float acc[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) acc[k] = 0.f;
      // lane i of a pass takes the i-th listed unit: its h and the 32 bytes
      // of its down row in flight together with the other lanes'.
      auto pass = [&](int n) {
        __syncwarp();
        for (int base = 0; base < n; base += 32) {
          if (base + lane >= n) break;
          const int j = lst[warp][base + lane];
          const float hv = __ldcg(h + j);
          const uint4 w0 = ldg_nc(L.down + (size_t)j * d + c0), w1 = ldg_nc(L.down + (size_t)j * d + c0 + 8);
          axpy8(acc, hv, w0);
          axpy8(acc + 8, hv, w1);
        }
        __syncwarp();
      };
      u32 wv[ST_MAXF / ST_CONS / 4 / 32];
#pragma unroll
      for (int t = 0; t < ST_MAXF / ST_CONS / 4 / 32; ++t)
        wv[t] = lane + 32 * t < nw ? __ldcg((const unsigned int*)(act + j0) + lane + 32 * t) : 0u;
      int listed = 0;
#pragma unroll
      for (int t = 0; t < ST_MAXF / ST_CONS / 4 / 32; ++t)
#pragma unroll
        for (int bb = 0; bb < 4; ++bb) {
          const bool on = (wv[t] >> (8 * bb) & 0xffu) != 0;
          const u32 bits = __ballot_sync(0xffffffffu, on);
          if (on) lst[warp][listed + __popc(bits & ((1u << lane) - 1u))] = j0 + 4 * (lane + 32 * t) + bb;
          listed += __popc(bits);
          if (listed > ST_LIST - 32) {
            pass(listed);
            listed = 0;
          }
        }
      pass(listed);
#pragma unroll
      for (int k = 0; k < 16; ++k) acc[k] = warp_sum(acc[k]);
      if (lane == 0)
#pragma unroll
        for (int k = 0; k < 16; ++k) dn[warp][k] = acc[k];
      st_sync();
      if (threadIdx.x < 16) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < ST_CONS; ++w) sum += dn[w][threadIdx.x];
        const int c = c0 + threadIdx.x;
        __stcg(resid + c, __ldcg(resid + c) + __uint_as_float(f_to_bf(sum) << 16));
      }
    }
    st_grid(cnt);
  }
}
