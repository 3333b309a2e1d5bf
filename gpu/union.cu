// union.cu: the sparse MLP of up to 64 tokens (decode steps of several
// sequences), after the gate GEMM (cuBLASLt, g = x Wg^T, bf16 [m][f]).
//
// At 0.5% density 64 tokens together fire about 27% of the units, 8 about
// 4%: the union of the active units is small, and reading only its up and
// down rows saves most of the weight reads of the dense MLP, which at this
// batch size is bound by them. Two kernels:
//
//   union_act   a block per UA_UNITS units: the gate values of all tokens
//               through shared memory, the units active in some token
//               (g > 0 or NaN: live), their down rows requested into the
//               L2 for union_down, and (gated) u = x Wu_j for the live units
//               on tensor cores, their up rows and the tokens streamed
//               through shared memory in chunks of UA_KC columns (STAGES
//               chunks in flight, cp.async). h = g u where g is active, else
//               0, bf16, unit-major: h[j][t] (row stride UA_TOK). Non-gated,
//               h = relu(g). Each block stores its live mask (one u64) and
//               its count of active (token, unit) pairs: plain stores.
//   union_down  a block per UD_COLS output columns: the live units of all
//               blocks, ascending, listed in shared memory; y = h^T D over
//               them on tensor cores, each warp taking a contiguous share
//               of the list through its own UD_STAGES-deep cp.async
//               pipeline; the warps' sums are added in warp order. The
//               order is fixed: results are bitwise reproducible. Block 0
//               also sums union_act's counts into *nnz.
//
// Rows are bf16 [f][d] (up, and down = Wd^T); x and y are bf16 [m][d]. d is
// a multiple of 64, f of UA_UNITS, f at most 65536 (list entries are u16),
// 1 <= m <= UA_TOK. Only the rows of tokens below 16 ceil(m/16) are read or
// written in h.
#include "common.cuh"
#include "mma.cuh"

#define UA_UNITS 64         // units of a union_act block
#define UA_TOK 64           // most tokens
#define UA_KC 256           // columns of a chunk of union_act's pipeline
#define UA_LD (UA_KC + 8)   // row stride of a chunk in shared memory (elements)
#define UA_HLD (UA_TOK + 8) // row stride of the staged h tile (elements)
#define UD_COLS 16          // output columns of a union_down block
#define UD_STAGES 4         // cp.async stages of a union_down warp
#define UD_DLD 24           // row stride of a down tile in shared memory (elements)
#define UD_HLD (UA_TOK + 8) // row stride of an h tile in shared memory (elements)

// bf_active reports whether a bf16 gate value is active: > 0 or NaN.
__device__ __forceinline__ bool bf_active(u32 b) { return (b & 0x7fffu) > 0x7f80u || (b != 0 && !(b & 0x8000u)); }

// union_act: grid f/UA_UNITS blocks of 256 threads. Dynamic shared memory
// (bytes): gs, the gate tile [UA_TOK][UA_UNITS] (8192); hs, the staged h
// tile [UA_UNITS][UA_HLD] (9216); then, gated, STAGES chunks of the x rows
// (16 ceil(m/16) of them) and of UA_UNITS up rows, UA_LD elements each.
template <bool GATED, int STAGES>
__global__ void __launch_bounds__(256, 1)
    union_act(const u16* __restrict__ g, const u16* __restrict__ x, const u16* __restrict__ up,
              const u16* __restrict__ down, u16* __restrict__ h, u64* __restrict__ mask, u32* __restrict__ cnt, int m,
              int d, int f) {
  extern __shared__ __align__(128) u16 smem[];
  u16* gs = smem;
  u16* hs = gs + UA_TOK * UA_UNITS;
  u16* pipe = hs + UA_UNITS * UA_HLD;
  __shared__ u32 wlive[8][4], wcnt[8];
  __shared__ unsigned char lidx[UA_UNITS];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int j0 = blockIdx.x * UA_UNITS, mt_n = (m + 15) >> 4, xrows = 16 * mt_n;
  grid_wait();  // g is the GEMM's
  grid_release();

  // The gate tile: thread (t, q) takes token t's units 16q .. 16q+15.
  {
    const int t = tid >> 2, q = tid & 3;
    uint4 v0 = make_uint4(0, 0, 0, 0), v1 = v0;
    if (t < m) {
      const u16* src = g + (size_t)t * f + j0 + 16 * q;
      v0 = ldg_cg(src);
      v1 = ldg_cg(src + 8);
    }
    *(uint4*)(gs + t * UA_UNITS + 16 * q) = v0;
    *(uint4*)(gs + t * UA_UNITS + 16 * q + 8) = v1;
    const u32 w[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    u32 bits = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      bits |= (u32)bf_active(w[i] & 0xffffu) << (2 * i);
      bits |= (u32)bf_active(w[i] >> 16) << (2 * i + 1);
    }
    u32 n = __popc(bits);
    // Lanes of one q hold the same units: OR over lanes 4 apart.
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) bits |= __shfl_xor_sync(0xffffffffu, bits, o);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
    if (lane < 4) wlive[warp][lane] = bits;
    if (lane == 0) wcnt[warp] = n;
  }
  __syncthreads();
  u64 live = 0;
#pragma unroll
  for (int w = 0; w < 8; ++w)
#pragma unroll
    for (int q = 0; q < 4; ++q) live |= (u64)wlive[w][q] << (16 * q);
  const int nl = __popcll(live);
  if (tid == 0) {
    u32 c = 0;
    for (int w = 0; w < 8; ++w) c += wcnt[w];
    mask[blockIdx.x] = live;
    cnt[blockIdx.x] = c;
  }
  if (tid < UA_UNITS && (live >> tid & 1)) {
    lidx[__popcll(live & ((1ull << tid) - 1))] = (unsigned char)tid;
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(down + (size_t)(j0 + tid) * d), "r"(d * 2)
                 : "memory");
#endif
  }
  __syncthreads();
  if (nl == 0) return;

  if (!GATED) {
    for (int i = tid; i < nl * xrows; i += blockDim.x) {
      const int l = i / xrows, t = i - l * xrows;
      const u16 v = gs[t * UA_UNITS + lidx[l]];
      hs[l * UA_HLD + t] = t < m && bf_active(v) ? v : (u16)0;
    }
  } else {
    // u = x Wu_j for the live units: an mt_n*16 x (8 nt_n) x d product.
    // Warp w takes token tile w & 3 and unit tiles 4 (w >> 2) .. +3.
    const int nt_n = (nl + 7) >> 3, stage = (xrows + UA_UNITS) * UA_LD;
    const int mt = warp & 3, nb = 4 * (warp >> 2);
    const bool busy = mt < mt_n && nb < nt_n;
    const int chunks = (d + UA_KC - 1) / UA_KC;
    const u32 pipe_s = smem_addr(pipe);
    // load queues chunk c into stage buffer b: rows 0..xrows-1 are the
    // tokens (zeros past m), then the nl live up rows.
    auto load = [&](int c, int b) {
      const int c0 = c * UA_KC, per = min(UA_KC, d - c0) >> 3, rows = xrows + nl;
      const u32 base = pipe_s + (u32)(b * stage * 2);
      for (int i = tid; i < rows * per; i += blockDim.x) {
        const int r = i / per, p = i - r * per;
        const u32 dst = base + (u32)((r * UA_LD + 8 * p) * 2);
        if (r < xrows)
          cp_async16(dst, x + (size_t)min(r, m - 1) * d + c0 + 8 * p, r < m);
        else
          cp_async16(dst, up + (size_t)(j0 + lidx[r - xrows]) * d + c0 + 8 * p, true);
      }
    };
    float acc[4][4];
    zero(acc);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      if (s < chunks) load(s, s);
      cp_async_commit();
    }
    for (int c = 0; c < chunks; ++c) {
      cp_async_wait<STAGES - 1>();
      __syncthreads();
      if (busy) {
        const int ksteps = min(UA_KC, d - c * UA_KC) >> 4;
        const u32 xb = pipe_s + (u32)((c % STAGES) * stage * 2), ub = xb + (u32)(xrows * UA_LD * 2);
        // A: rows lane & 15 of the token tile, columns 8 (lane >> 4) on;
        // B: unit rows (lane & 7) + 8 (lane >> 4) of a pair of unit tiles,
        // columns 8 ((lane >> 3) & 1) on.
        const u32 a_at = xb + (u32)(((16 * mt + (lane & 15)) * UA_LD + 8 * (lane >> 4)) * 2);
        const u32 b_at = ub + (u32)(((8 * nb + (lane & 7) + 8 * (lane >> 4)) * UA_LD + 8 * ((lane >> 3) & 1)) * 2);
        for (int k = 0; k < ksteps; ++k) {
          u32 a[4];
          ldsm4a(a_at + 32 * k, a);
#pragma unroll
          for (int p = 0; p < 2; ++p) {
            if (nb + 2 * p >= nt_n) break;
            u32 b0, b1, b2, b3;
            ldsm4(b_at + (u32)(16 * p * UA_LD * 2) + 32 * k, b0, b1, b2, b3);
            mma16816(acc[2 * p], a, b0, b1);
            mma16816(acc[2 * p + 1], a, b2, b3);
          }
        }
      }
      __syncthreads();  // every warp is done with the stage
      if (c + STAGES < chunks) load(c + STAGES, c % STAGES);
      cp_async_commit();
    }
    cp_async_wait<0>();
    if (busy) {
      const int gq = lane >> 2, q = lane & 3;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = 16 * mt + gq + 8 * (e >> 1), l = 8 * (nb + nt) + 2 * q + (e & 1);
          if (l >= nl) continue;
          const u16 gv = gs[t * UA_UNITS + lidx[l]];
          const bool on = t < m && bf_active(gv);
          hs[l * UA_HLD + t] = on ? (u16)f_to_bf(bf_to_f(gv) * acc[nt][e]) : (u16)0;
        }
    }
  }
  __syncthreads();
  // The live rows of h: tokens 0 .. xrows-1, 16 bytes a thread.
  const int per = xrows >> 3;
  for (int i = tid; i < nl * per; i += blockDim.x) {
    const int l = i / per, p = i - l * per;
    *(uint4*)(h + (size_t)(j0 + lidx[l]) * UA_TOK + 8 * p) = *(const uint4*)(hs + l * UA_HLD + 8 * p);
  }
}

// union_down: grid d/UD_COLS blocks of 256 threads. Dynamic shared memory
// (bytes): the list of live units, 2 f rounded up to 16; then per warp
// UD_STAGES stages of a down tile [16][UD_DLD] and an h tile [16][UD_HLD]
// (UD_STAGES * 3072), which after the products hold the warp's partial
// sums [UA_TOK][UD_COLS] fp32.
__global__ void __launch_bounds__(256)
    union_down(const u16* __restrict__ h, const u64* __restrict__ mask, const u16* __restrict__ down,
               u16* __restrict__ y, const u32* __restrict__ cnt, u64* __restrict__ nnz, int m, int d, int f) {
  extern __shared__ __align__(128) u16 smem[];
  __shared__ int wsum[8];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int words = f / UA_UNITS, mt_n = (m + 15) >> 4, c0 = blockIdx.x * UD_COLS;
  u16* list = smem;
  const int stage = 16 * UD_DLD + 16 * UD_HLD;  // elements
  u16* mine = smem + ((f + 7) & ~7) + warp * UD_STAGES * stage;
  grid_wait();  // h and the masks are union_act's
  grid_release();

  // List the live units, ascending: a block-wide scan of the masks' counts,
  // 256 words a round.
  int total = 0;
  for (int w0 = 0; w0 < words; w0 += blockDim.x) {
    const u64 mw = w0 + tid < words ? __ldcg(mask + w0 + tid) : 0ull;
    const int c = __popcll(mw);
    int incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    int before = total, all = 0;
    for (int w = 0; w < 8; ++w) {
      before += w < warp ? wsum[w] : 0;
      all += wsum[w];
    }
    int pos = before + incl - c;
    for (u64 b = mw; b; b &= b - 1) list[pos++] = (u16)((w0 + tid) * UA_UNITS + __ffsll((long long)b) - 1);
    total += all;
    __syncthreads();  // wsum is read before the next round writes it
  }

  // Warp w takes the 16-unit steps [s0, s1) of the list.
  const int steps = (total + 15) >> 4, share = (steps + 7) >> 3;
  const int s0 = min(steps, warp * share), s1 = min(steps, s0 + share);
  const u32 mine_s = smem_addr(mine);
  // load queues step s into stage b: lane l copies half l & 1 of unit
  // row l >> 1's down columns, then the row pieces of h (2 mt_n a row).
  auto load = [&](int s, int b) {
    const u32 base = mine_s + (u32)(b * stage * 2);
    {
      const int r = lane >> 1, i = 16 * s + r;
      const bool ok = i < total;
      const int j = ok ? list[i] : 0;
      cp_async16(base + (u32)((r * UD_DLD + 8 * (lane & 1)) * 2), down + (size_t)j * d + c0 + 8 * (lane & 1), ok);
    }
    const int per = 2 * mt_n;
    for (int p = lane; p < 16 * per; p += 32) {
      const int r = p / per, c = p - r * per, i = 16 * s + r;
      const bool ok = i < total;
      const int j = ok ? list[i] : 0;
      cp_async16(base + (u32)((16 * UD_DLD + r * UD_HLD + 8 * c) * 2), h + (size_t)j * UA_TOK + 8 * c, ok);
    }
  };
  float acc[4][2][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) zero(acc[mt]);
#pragma unroll
  for (int s = 0; s < UD_STAGES; ++s) {
    if (s0 + s < s1) load(s0 + s, s);
    cp_async_commit();
  }
  // A (h^T, transposed loads of the h tile): unit rows (lane & 7) +
  // 8 (lane >> 4), token columns 8 ((lane >> 3) & 1) on; B (transposed
  // loads of the down tile): unit rows (lane & 7) + 8 ((lane >> 3) & 1),
  // columns 8 (lane >> 4) on.
  const u32 a_off = (u32)((16 * UD_DLD + ((lane & 7) + 8 * (lane >> 4)) * UD_HLD + 8 * ((lane >> 3) & 1)) * 2);
  const u32 b_off = (u32)((((lane & 7) + 8 * ((lane >> 3) & 1)) * UD_DLD + 8 * (lane >> 4)) * 2);
  for (int s = s0; s < s1; ++s) {
    cp_async_wait<UD_STAGES - 1>();
    __syncwarp();
    const u32 base = mine_s + (u32)(((s - s0) % UD_STAGES) * stage * 2);
    u32 b[4];
    ldsm4t(base + b_off, b[0], b[1], b[2], b[3]);
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      if (mt >= mt_n) break;
      u32 a[4];
      ldsm4t(base + a_off + 32 * mt, a[0], a[1], a[2], a[3]);
      mma16816(acc[mt][0], a, b[0], b[1]);
      mma16816(acc[mt][1], a, b[2], b[3]);
    }
    __syncwarp();  // every lane is done with the stage
    if (s + UD_STAGES < s1) load(s + UD_STAGES, (s - s0) % UD_STAGES);
    cp_async_commit();
  }
  cp_async_wait<0>();
  __syncwarp();
  // The warp's sums over its units, [token][column] fp32, over its stages.
  float* red = (float*)mine;
  {
    const int gq = lane >> 2, q = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      if (mt >= mt_n) break;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          red[(16 * mt + gq + 8 * (e >> 1)) * UD_COLS + 8 * nt + 2 * q + (e & 1)] = acc[mt][nt][e];
    }
  }
  __syncthreads();
  const float* reds = (const float*)(smem + ((f + 7) & ~7));
  const int wstride = UD_STAGES * stage / 2;  // floats between warps' sums
  for (int i = tid; i < m * UD_COLS; i += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) s += reds[w * wstride + i];
    y[(size_t)(i / UD_COLS) * d + c0 + i % UD_COLS] = (u16)f_to_bf(s);
  }
  if (blockIdx.x == 0) {
    u32 c = 0;
    for (int i = tid; i < words; i += blockDim.x) c += __ldcg(cnt + i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    if (lane == 0) wsum[warp] = (int)c;
    __syncthreads();
    if (tid == 0) {
      u64 t = 0;
      for (int w = 0; w < 8; ++w) t += (u32)wsum[w];
      *nnz = t;
    }
  }
}
