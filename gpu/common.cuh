// common.cuh: types and helpers shared by twell's GPU kernels. The kernels
// are compiled by NVRTC without the CUDA headers, so everything they need is
// declared here (inline PTX where there is no builtin).
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// TmaDesc is a CUtensorMap passed by value as a __grid_constant__ parameter.
struct __align__(64) TmaDesc {
  u64 v[16];
};

// bf16 <-> fp32. A bf16 is the upper half of a float32.
__device__ __forceinline__ float bf_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float bf_to_f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// f_to_bf rounds to nearest even; NaN stays NaN (quiet, sign kept), as
// twell's bf16.FromFloat32.
__device__ __forceinline__ u32 f_to_bf(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}

__device__ __forceinline__ u32 pack_bf2(float lo, float hi) { return f_to_bf(lo) | (f_to_bf(hi) << 16); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// block_sum returns the sum of v over the block (blockDim.x a multiple of
// 32, at most 1024) to every thread. It may be called repeatedly.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
  __shared__ float total;
  __syncthreads();  // earlier readers of total are done
  v = warp_sum(v);
  int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) part[w] = v;
  __syncthreads();
  if (w == 0) {
    float s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// The register-resident RMSNorm of one row of d fp32 values (d % 4 == 0,
// d <= 4 RMS_MAXV blockDim.x): thread i holds float4 i + k blockDim.x in
// v[k]. gpu/llm's add_rmsnorm and the kernels that fuse the norm of a
// decode step's token into their input staging (gemv_act, qkv_rope) share
// these, so their normed values are the same bit for bit.
#define RMS_MAXV 4

// rms_fits reports whether a row of d values takes the register-resident
// form with blockDim.x threads.
__device__ __forceinline__ bool rms_fits(int d) { return d % 4 == 0 && d / 4 <= RMS_MAXV * (int)blockDim.x; }

// rms_load sets v = x + delta, where delta is the bf16 row delta (may be
// null), both read through the L2 (what the kernels before wrote).
__device__ __forceinline__ void rms_load(float4 (&v)[RMS_MAXV], const float* __restrict__ x,
                                         const u16* __restrict__ delta, int d) {
  const int n4 = d / 4;
#pragma unroll
  for (int k = 0; k < RMS_MAXV; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i >= n4) continue;
    v[k] = __ldcg((const float4*)x + i);
    if (delta) {
      const uint2 dd = __ldcg((const uint2*)delta + i);
      v[k].x += bf_lo(dd.x);
      v[k].y += bf_hi(dd.x);
      v[k].z += bf_lo(dd.y);
      v[k].w += bf_hi(dd.y);
    }
  }
}

// rms_inv returns 1 / sqrt(mean(v^2) + eps) over the block's row (every
// thread of the block calls it).
__device__ __forceinline__ float rms_inv(const float4 (&v)[RMS_MAXV], int d, float eps) {
  const int n4 = d / 4;
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < RMS_MAXV; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i >= n4) continue;
    ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
  }
  return rsqrtf(block_sum(ss) / (float)d + eps);
}

// rms_pack returns four normed values v inv w as bf16.
__device__ __forceinline__ uint2 rms_pack(float4 v, float inv, float4 w) {
  uint2 o;
  o.x = pack_bf2(v.x * inv * w.x, v.y * inv * w.y);
  o.y = pack_bf2(v.z * inv * w.z, v.w * inv * w.w);
  return o;
}

// stage_norm_x norms one token into shared memory (xs, d bf16): v = resid +
// delta (bf16, may be null: see rms_load), xs = bf16(v / rms(v) w), as
// add_rmsnorm does; block 0 also writes v to resid_out (the residual add:
// another buffer than resid, which the other blocks are still reading). wv
// holds w's float4s, loaded by the caller (weights: before grid_wait). It
// ends with a barrier.
__device__ __forceinline__ void stage_norm_x(u16* xs, const float* __restrict__ resid, const u16* __restrict__ delta,
                                             float* __restrict__ resid_out, const float4 (&wv)[RMS_MAXV], int d,
                                             float eps) {
  float4 v[RMS_MAXV];
  rms_load(v, resid, delta, d);
  const float inv = rms_inv(v, d, eps);
  const int n4 = d / 4;
#pragma unroll
  for (int k = 0; k < RMS_MAXV; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i >= n4) continue;
    ((uint2*)xs)[i] = rms_pack(v[k], inv, wv[k]);
    if (blockIdx.x == 0) ((float4*)resid_out)[i] = v[k];
  }
  __syncthreads();
}

// rms_weights loads the float4s of norm weights w that stage_norm_x takes.
__device__ __forceinline__ void rms_weights(float4 (&wv)[RMS_MAXV], const float* __restrict__ w, int d) {
#pragma unroll
  for (int k = 0; k < RMS_MAXV; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    wv[k] = i < d / 4 ? ((const float4*)w)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// L2 cache policies: weights are kept (evict_last), streamed activations go
// first (evict_first).
__device__ __forceinline__ u64 policy_evict_last() {
  u64 p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ u64 policy_evict_first() {
  u64 p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

__device__ __forceinline__ uint4 ld_hint(const void* p, u64 pol) {
  uint4 r;
  asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p), "l"(pol));
  return r;
}
__device__ __forceinline__ u32 ld_hint_u32(const void* p, u64 pol) {
  u32 r;
  asm volatile("ld.global.nc.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(r) : "l"(p), "l"(pol));
  return r;
}
__device__ __forceinline__ void st_hint(void* p, uint4 v, u64 pol) {
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w), "l"(pol)
               : "memory");
}

// ldg_nc loads 16 bytes through the read-only path (data no kernel writes
// while the caller runs).
__device__ __forceinline__ uint4 ldg_nc(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// ldg_cg loads 16 bytes through the L2 only: for what an earlier kernel
// wrote, read by an early-start kernel after grid_wait (the read-only path
// is for data that does not change while the kernel runs).
__device__ __forceinline__ uint4 ldg_cg(const void* p) {
  uint4 r;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// ld_cg_hint is ldg_cg with an L2 policy, for an early-start kernel reading
// an earlier kernel's results that it streams once.
__device__ __forceinline__ uint4 ld_cg_hint(const void* p, u64 pol) {
  uint4 r;
  asm volatile("ld.global.cg.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p), "l"(pol));
  return r;
}

// Early start (programmatic dependent launch, sm_90 and later): a kernel
// launched with cuda.LaunchConfig.EarlyStart may begin while the kernel
// before it on the stream still runs. grid_wait blocks until the earlier
// kernels have finished and their writes are visible: before it, a kernel
// only reads weights (issuing those loads is the point) and writes nothing.
// grid_release lets the next early-start kernel's blocks take free SM slots
// now rather than when this grid exits. For plain launches both do nothing.
// A kernel may release before it waits: the next kernel's blocks then start
// (and issue their weight loads) as soon as every block of this one is
// resident, while the kernel before still runs, rather than when that one
// has finished. The chain stays ordered, since each grid_wait waits for a
// kernel that itself waited for the one before it; what the earlier start
// costs is SM slots held by waiting blocks. grid_enter picks the order.
__device__ __forceinline__ void grid_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_release() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// grid_enter is where an early-start kernel waits for the kernels before
// and releases the next one: release first, or wait first. The kernels of
// one-token decode steps, all early-start kernels of the engine's own,
// release first: decode at b=1 (H100, 512 cached tokens) went from
// 812.8-830.4 to 837.0-852.4 tokens/s, ahead in 8 of 8 pairs. At b=4 the
// four-token kernels releasing first ran 1930.4-1952.6 against
// 1952.2-1954.7, no gain, so the others wait first.
__device__ __forceinline__ void grid_enter(bool release_first) {
  if (release_first) grid_release();
  grid_wait();
  if (!release_first) grid_release();
}

// grid_sync: every block of the grid meets here, and what any block wrote
// before it is visible to every block after it (read it through the L2).
// Every block adds its arrival to a 64-bit counter that only grows (cnt,
// zero at first) and waits until it reaches the next multiple of the
// grid's size: the last arrival is itself the release, and the last block,
// seeing the target reached in what its add returns, does not poll. The
// same counter serves every later launch of the same grid size (and graph
// replay) with no reset. Every block of the grid must be resident at once,
// or it hangs: launch it cooperatively (cuda.LaunchConfig.Cooperative), at
// most as many blocks as fit. (A sense-reversing barrier, a count the last
// block reset and a generation word it bumped, took one more L2 round trip
// after the last arrival: gemv_mlp's blocks left it 1.9 us after the last
// one reached it, against 1.2 us here; docs/gpu-llm.md.) grid_arrive_wait
// is one thread's part, for a barrier of some of a block's warps; fence
// adds the __threadfence grid_sync has.
__device__ __forceinline__ void grid_arrive_wait(u64* cnt, bool fence) {
  const u64 n = gridDim.x * gridDim.y * gridDim.z;
  u64 prev, now;
  if (fence) __threadfence();
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(prev) : "l"(cnt) : "memory");
  const u64 target = (prev / n + 1) * n;
  if (prev + 1 != target) {
    do {
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(now) : "l"(cnt) : "memory");
    } while (now < target);
  }
}
__device__ __forceinline__ void grid_sync(u64* cnt) {
  __syncthreads();
  if (threadIdx.x == 0) grid_arrive_wait(cnt, true);
  __syncthreads();
}

// mbarriers (shared memory, CTA scope) for asynchronous copies: a barrier
// completes a phase when its arrivals are in and the bytes it expects have
// landed.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// list_units (one warp) writes the units whose bits are set in activity
// words w0, w0 + step, w0 + 2 step, ... below w1 of mask (bit b of word w:
// unit 32 w + b), ascending, into list, and returns how many in every
// lane; the words are read through the L2 (an earlier kernel wrote them).
__device__ __forceinline__ int list_units(const u32* __restrict__ mask, int w0, int w1, int step, int* list) {
  const int lane = threadIdx.x & 31;
  const int n = w0 < w1 ? (w1 - w0 + step - 1) / step : 0;
  int len = 0;
  for (int i0 = 0; i0 < n; i0 += 32) {
    const int w = w0 + (i0 + lane) * step;
    u32 mine = i0 + lane < n ? __ldcg(mask + w) : 0u;
    int c = __popc(mine), incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    int pos = len + incl - c;
    for (u32 b = mine; b; b &= b - 1) list[pos++] = w * 32 + __ffs(b) - 1;
    len += __shfl_sync(0xffffffffu, incl, 31);
  }
  return len;
}

// tma_load copies the box of tensor map tm at coordinates (c0, c1) into
// shared memory at dst, completing on the mbarrier bar (sm_90).
__device__ __forceinline__ void tma_load(u32 dst, const TmaDesc* tm, int c0, int c1, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(tm), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// dot8 returns sum_i a[i]*b[i] over 8 bf16 pairs, in fp32 (exact products).
__device__ __forceinline__ float dot8(uint4 a, uint4 b, float s) {
  s = fmaf(bf_lo(a.x), bf_lo(b.x), s);
  s = fmaf(bf_hi(a.x), bf_hi(b.x), s);
  s = fmaf(bf_lo(a.y), bf_lo(b.y), s);
  s = fmaf(bf_hi(a.y), bf_hi(b.y), s);
  s = fmaf(bf_lo(a.z), bf_lo(b.z), s);
  s = fmaf(bf_hi(a.z), bf_hi(b.z), s);
  s = fmaf(bf_lo(a.w), bf_lo(b.w), s);
  s = fmaf(bf_hi(a.w), bf_hi(b.w), s);
  return s;
}

// axpy8 adds h*b to the 8 accumulators acc[0..7].
__device__ __forceinline__ void axpy8(float* acc, float h, uint4 b) {
  acc[0] = fmaf(h, bf_lo(b.x), acc[0]);
  acc[1] = fmaf(h, bf_hi(b.x), acc[1]);
  acc[2] = fmaf(h, bf_lo(b.y), acc[2]);
  acc[3] = fmaf(h, bf_hi(b.y), acc[3]);
  acc[4] = fmaf(h, bf_lo(b.z), acc[4]);
  acc[5] = fmaf(h, bf_hi(b.z), acc[5]);
  acc[6] = fmaf(h, bf_lo(b.w), acc[6]);
  acc[7] = fmaf(h, bf_hi(b.w), acc[7]);
}

// cp_async16 copies 16 bytes from global to shared memory (through L2
// only), or writes 16 zero bytes when !valid.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
// st_shared16 stores 16 bytes at shared-memory address dst (a 32-bit
// shared-window address, as smem_addr gives).
__device__ __forceinline__ void st_shared16(u32 dst, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
// cp_async4 copies 4 bytes from global to shared memory, or writes 4 zero
// bytes when !valid.
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
// cp_async_commit closes a group of cp.async copies; cp_async_wait<N> waits
// until at most N groups are pending.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// flag_row marks row as needing the dense fallback, once, and appends it to
// the overflow list ovf (ovf[0] = count, ovf[1..] = rows).
__device__ __forceinline__ void flag_row(int* flags, int* ovf, int row) {
  if (atomicExch(&flags[row], 1) == 0) {
    int i = atomicAdd(&ovf[0], 1);
    ovf[1 + i] = row;
  }
}

__device__ __forceinline__ u64 shfl64(u64 v, int src) {
  u32 lo = __shfl_sync(0xffffffffu, (u32)v, src);
  u32 hi = __shfl_sync(0xffffffffu, (u32)(v >> 32), src);
  return ((u64)hi << 32) | lo;
}

// cvt_bf2 rounds two floats to bf16 (nearest even) in one instruction and
// packs them, lo in the low half. NaN becomes the canonical NaN.
__device__ __forceinline__ u32 cvt_bf2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// acc_to_bf takes a thread's 16 x 256 accumulator fragment (mma/wgmma
// layout: acc[4i + 2h + e] is row half h, column 8i + 2q + e of quad lane
// q) to the packing's inputs: mask[h] has bit 2i + e set where the value is
// active (> 0, or NaN), and hb[32h + i] holds the bf16 pair (e = 0 low).
// The 128 fp32 accumulators are dead after it: with them live through the
// packing, ptxas ran out of registers and serialized the wgmmas.
__device__ __forceinline__ void acc_to_bf(const float* acc, u32 (&hb)[64], u64 (&mask)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    u32 lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const u32 on = !(acc[4 * i + 2 * h + e] <= 0.f);  // > 0, or NaN
        if (i < 16)
          lo |= on << (2 * i + e);
        else
          hi |= on << (2 * i + e - 32);
      }
      hb[32 * h + i] = cvt_bf2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]);
    }
    mask[h] = ((u64)hi << 32) | lo;
  }
}

// pack_row_epilogue packs one row of a 256-column tile into the TwELL
// staging row srow (S words, zeroed beforehand). The row's 256 values, as
// bf16 bits and activity masks from acc_to_bf, are spread over the 4
// threads of a quad in the mma/wgmma accumulator layout: thread q of the
// quad holds, for each 8-column group i, columns 8i+2q and 8i+2q+1 in
// bits(i, 0) and bits(i, 1), and bit 2i+e of mine says whether bits(i, e) is
// active. Active entries are ranked in column order from the quad's
// masks, so slot order is deterministic; word 0 gets the true count. A
// row whose tile holds more than S-1 entries, or a value bf16 cannot hold
// (NaN, Inf), is flagged for the exact dense fallback. Returns the true
// count (valid on every lane).
template <int S, typename B>
__device__ __forceinline__ int pack_row_epilogue(u64 mine, B bits, u32* srow, int col_base, int row, bool row_valid,
                                                 int* flags, int* ovf) {
  const int lane = threadIdx.x & 31, q = lane & 3, qb = lane & ~3;
  u64 M0 = shfl64(mine, qb + 0), M1 = shfl64(mine, qb + 1), M2 = shfl64(mine, qb + 2), M3 = shfl64(mine, qb + 3);
  int total = __popcll(M0) + __popcll(M1) + __popcll(M2) + __popcll(M3);
  bool bad = false;
  if (mine != 0) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      u32 two = (u32)(mine >> (2 * i)) & 3u;
      if (two) {
        const u64 low = (i == 0) ? 0ull : ((1ull << (2 * i)) - 1ull);
        int base = __popcll(M0 & low) + __popcll(M1 & low) + __popcll(M2 & low) + __popcll(M3 & low);
        if (q > 0) base += __popc((u32)(M0 >> (2 * i)) & 3u);
        if (q > 1) base += __popc((u32)(M1 >> (2 * i)) & 3u);
        if (q > 2) base += __popc((u32)(M2 >> (2 * i)) & 3u);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (two & (1u << e)) {
            int rank = base + ((e == 1) ? (int)(two & 1u) : 0);
            u32 b = bits(i, e);
            if (b == 0) b = 1;  // positive but under bf16's smallest subnormal
            if ((b & 0x7fffu) >= 0x7f80u) bad = true;
            if (rank < S - 1) srow[1 + rank] = (b << 16) | (u32)(col_base + 8 * i + 2 * q + e);
          }
        }
      }
    }
  }
  u32 bq = bad ? 1u : 0u;
  bq |= __shfl_xor_sync(0xffffffffu, bq, 1);
  bq |= __shfl_xor_sync(0xffffffffu, bq, 2);
  if (q == 0) {
    srow[0] = (u32)total;
    if (row_valid && (bq || total > S - 1)) flag_row(flags, ovf, row);
  }
  return total;
}
