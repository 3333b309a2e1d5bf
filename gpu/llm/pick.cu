// pick.cu: the picks of decode steps on the device (package gpu/llm), so
// that a step's next tokens need no trip of its logits through the host:
// greedy picks, and draws at a temperature with top-k and top-p made as
// package sample's Sampler makes them, bit for bit (its package doc says
// how: integer weights, a counter-based random stream). No CUDA headers:
// package gpu's common.cuh comes from the launcher (gpu.Headers).

#include "common.cuh"

#define PICK_THREADS 1024
#define PICK_WARPS (PICK_THREADS / 32)
#define PICK_NONE 0x7fffffff
#define PICK_INF __int_as_float(0x7f800000)

// DrawParams is one row's draw (package llm's drawParams, 32 bytes).
struct DrawParams {
  float temp;   // <= 0: greedy
  float top_p;  // >= 1: off
  int top_k;    // <= 0: off
  u32 pad;
  u64 seed;
  u64 index;  // the draw's place in seed's stream; the launch adds its step
};

// pick_better reports whether logit va at index ia comes before vb at ib in
// greedy order, the order of package sample's greedy mode: any number before
// NaN, the larger first (+Inf before every finite value), and among equal
// values, and among NaNs, the lower index.
__device__ __forceinline__ bool pick_better(float va, int ia, float vb, int ib) {
  bool na = va != va, nb = vb != vb;
  if (na != nb) return nb;
  if (!na && va != vb) return va > vb;
  return ia < ib;
}

__device__ __forceinline__ void pick_merge(float& bv, int& bi, float v, int i) {
  if (pick_better(v, i, bv, bi)) {
    bv = v;
    bi = i;
  }
}

// Block-wide reductions over PICK_THREADS threads, the result to every
// thread. Each call begins with a barrier, so calls may follow each other
// on the same shared memory.
__device__ __forceinline__ void pick_best(float& bv, int& bi, float* shv, int* shi) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float v = __shfl_xor_sync(0xffffffffu, bv, o);
    int i = __shfl_xor_sync(0xffffffffu, bi, o);
    pick_merge(bv, bi, v, i);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) {
    shv[warp] = bv;
    shi[warp] = bi;
  }
  __syncthreads();
  bv = shv[lane];
  bi = shi[lane];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float v = __shfl_xor_sync(0xffffffffu, bv, o);
    int i = __shfl_xor_sync(0xffffffffu, bi, o);
    pick_merge(bv, bi, v, i);
  }
}

// block_reduce returns op over v of every thread of the block; sh is
// PICK_WARPS values of shared memory.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T* sh, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = sh[threadIdx.x & 31];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// warp_scan returns the sum of v over the lanes of the warp up to this
// one's, this one's included.
template <typename T>
__device__ __forceinline__ T warp_scan(T v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// warp_sum_u64 returns the sum of v over the warp, to every lane.
__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct OpAdd {
  template <typename T>
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct OpMax {
  template <typename T>
  __device__ T operator()(T a, T b) const { return max(a, b); }
};
struct OpMin {
  template <typename T>
  __device__ T operator()(T a, T b) const { return min(a, b); }
};

// row_argmax returns the greedy pick among x's first vocab values (bv its
// value), to every thread. Each thread loads its values 16 bytes at a time,
// four loads in flight, where the row and vocab allow it.
__device__ __forceinline__ void row_argmax(const float* __restrict__ x, bool aligned, int vocab, float& bv, int& bi,
                                           float* shv, int* shi) {
  bv = __int_as_float(0x7fc00000);  // NaN: every value comes before it
  bi = PICK_NONE;
  int head = 0;
  if (aligned) {
    head = vocab & ~3;
    const float4* x4 = (const float4*)x;
#pragma unroll 4
    for (int i = threadIdx.x; i < head / 4; i += PICK_THREADS) {
      float4 v = x4[i];
      pick_merge(bv, bi, v.x, 4 * i);
      pick_merge(bv, bi, v.y, 4 * i + 1);
      pick_merge(bv, bi, v.z, 4 * i + 2);
      pick_merge(bv, bi, v.w, 4 * i + 3);
    }
  }
  for (int i = head + threadIdx.x; i < vocab; i += PICK_THREADS) pick_merge(bv, bi, x[i], i);
  pick_best(bv, bi, shv, shi);
}

// Sampling. A row's candidates are its +Inf logits when it has any (then
// equally likely: each ranks as 0), else its logits above -Inf; NaN never
// is one. They rank by value, the larger first, and among equal values by
// index, the lower first. A rank's cut is a key and an index: a candidate
// is kept when its key is above cv, or equal to cv with its index at most
// ci. Keys are the values' bits mapped so that unsigned order is the
// values' order (-0 as +0).

__device__ __forceinline__ u32 key_of(float f) {
  u32 u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float value_of(u32 k) { return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

struct Row {
  const float* x;
  int vocab;
  bool inf;   // the candidates are the +Inf logits
  float m;    // the largest candidate's value (0 when inf)
  float inv;  // 1 / temperature
  u32 cv;     // the cut
  int ci;
};

// row_kept reports whether logit v at index i is a kept candidate of r,
// with its key.
__device__ __forceinline__ bool row_kept(const Row& r, int i, float v, u32& key) {
  bool cand;
  if (r.inf) {
    cand = v == PICK_INF;
    key = key_of(0.f);
  } else {
    cand = v > -PICK_INF;  // false for NaN
    key = key_of(v);
  }
  return cand && (key > r.cv || (key == r.cv && i <= r.ci));
}

// PICK_AHEAD is how many values each thread loads before it uses the
// first: a pass over a row is a chain of L2 round trips otherwise.
#define PICK_AHEAD 8

// for_row calls f(i, v) for every index i of a row of vocab values x, each
// thread for i = threadIdx.x + k PICK_THREADS, PICK_AHEAD loads in flight;
// past the row with i >= vocab and v NaN, so that every thread calls f
// equally often (f may hold warp-wide steps).
template <typename F>
__device__ __forceinline__ void for_row(const float* __restrict__ x, int vocab, F f) {
  for (int base = 0; base < vocab; base += PICK_AHEAD * PICK_THREADS) {
    float v[PICK_AHEAD];
#pragma unroll
    for (int k = 0; k < PICK_AHEAD; k++) {
      const int i = base + k * PICK_THREADS + threadIdx.x;
      v[k] = i < vocab ? x[i] : __int_as_float(0x7fc00000);
    }
#pragma unroll
    for (int k = 0; k < PICK_AHEAD; k++) f(base + k * PICK_THREADS + threadIdx.x, v[k]);
  }
}

// exp_neg is package sample's ExpNeg: e^x for x <= 0 in float32, 0 below
// -32 and for NaN, every operation rounded on its own (no fused
// multiply-adds), with its constants' bits, so that the two agree bit for
// bit.
__device__ __forceinline__ float exp_neg(float x) {
  if (!(x >= -32.f)) return 0.f;
  const float log2e = __int_as_float(0x3fb8aa3b), ln2hi = __int_as_float(0x3f318000), ln2lo = __int_as_float(0xb95e8083);
  float k = floorf(__fadd_rn(__fmul_rn(x, log2e), 0.5f));
  float r = __fsub_rn(__fsub_rn(x, __fmul_rn(k, ln2hi)), __fmul_rn(k, ln2lo));
  float p = __fadd_rn(__fmul_rn(r, __int_as_float(0x3ab60b61)), __int_as_float(0x3c088889));
  p = __fadd_rn(__fmul_rn(r, p), __int_as_float(0x3d2aaaab));
  p = __fadd_rn(__fmul_rn(r, p), __int_as_float(0x3e2aaaab));
  p = __fadd_rn(__fmul_rn(r, p), 0.5f);
  p = __fadd_rn(__fmul_rn(r, p), 1.f);
  p = __fadd_rn(__fmul_rn(r, p), 1.f);
  return __fmul_rn(p, __int_as_float(((int)k + 127) << 23));
}

// weight is a kept key's weight, package sample's Weight: exp((v - m) / T)
// in fixed point, 2^40 for the largest. Integer sums do not depend on the
// order of the adds, so neither does a draw.
#define PICK_ONE 1099511627776.0  // 2^40

__device__ __forceinline__ u64 weight(const Row& r, u32 key) {
  if (r.inf) return (u64)PICK_ONE;
  const float x = __fmul_rn(__fsub_rn(value_of(key), r.m), r.inv);
  return (u64)(long long)((double)exp_neg(x) * PICK_ONE + 0.5);
}

__device__ __forceinline__ u32 match_any(u32 v) {
  u32 m;
  asm volatile("match.any.sync.b32 %0, %1, 0xffffffff;" : "=r"(m) : "r"(v));
  return m;
}

__device__ __forceinline__ u32 redux_add(u32 mask, u32 v) {
  u32 s;
  asm volatile("redux.sync.add.u32 %0, %1, %2;" : "=r"(s) : "r"(v), "r"(mask));
  return s;
}

// hist_add adds a count of 1 (and w to mass, when mass is set) to digit d's
// bin for each lane with on set, one shared-memory atomic per digit per
// warp: a row's keys crowd into a few bins of the first digit. Every lane
// of the warp calls it. A weight is at most 2^40, so its two 20-bit halves
// sum over a warp within 32 bits.
__device__ __forceinline__ void hist_add(u32* cnt, u64* mass, bool on, u32 d, u64 w) {
  const u32 peers = match_any(on ? d : 0xffffffffu);
  if (!on) return;
  const int lane = threadIdx.x & 31;
  const bool leader = lane == __ffs(peers) - 1;
  if (mass != nullptr) {
    u32 lo = redux_add(peers, (u32)(w & 0xfffffu));
    u32 hi = redux_add(peers, (u32)(w >> 20));
    if (leader) atomicAdd(&mass[d], ((u64)hi << 20) + lo);
  }
  if (leader) atomicAdd(&cnt[d], __popc(peers));
}

// The cuts search a key's 32 bits in three digits, the highest first.
#define PICK_BINS 2048
__device__ __forceinline__ int digit_shift(int pass) { return pass == 0 ? 21 : pass == 1 ? 10 : 0; }
__device__ __forceinline__ u32 digit_bins(int pass) { return pass == 2 ? 1024u : 2048u; }

// PICK_CHUNKS bounds the chunks of a row whose kept weight the draw sums
// first (2048: a chunk is one warp's 32 values up to a vocabulary of 65536).
#define PICK_CHUNKS 2048

// The shared memory of a row's draw.
struct PickShared {
  u32 cnt[PICK_BINS];
  union {
    u64 mass[PICK_BINS];     // the cuts' weight per digit
    u64 chunk[PICK_CHUNKS];  // the draw's kept weight per chunk
  };
  u64 red[PICK_WARPS];
  float bv[PICK_WARPS];
  int bi[PICK_WARPS];
  u32 pick[2];  // a digit chosen and its offset; an index found
  u64 at[2];    // the draw's chunk and the weight before it
};

// histogram counts the kept keys k with (k & mask) == prefix by their digit
// (k >> shift) & (bins - 1) into sh.cnt, and with mass set their weights
// into sh.mass.
__device__ __forceinline__ void histogram(const Row& r, u32 prefix, u32 mask, int shift, u32 bins, bool mass,
                                          PickShared& sh) {
  __syncthreads();
  for (int i = threadIdx.x; i < PICK_BINS; i += PICK_THREADS) {
    sh.cnt[i] = 0;
    sh.mass[i] = 0;
  }
  __syncthreads();
  for_row(r.x, r.vocab, [&](int i, float v) {
    u32 key = 0;
    const bool on = i < r.vocab && row_kept(r, i, v, key) && (key & mask) == prefix;
    hist_add(sh.cnt, mass ? sh.mass : nullptr, on, (key >> shift) & (bins - 1), on && mass ? weight(r, key) : 0);
  });
  __syncthreads();
}

// nth_kept returns the index of the n-th (from 1, in index order) kept
// candidate whose key is key (n at most their count).
__device__ int nth_kept(const Row& r, u32 key, int n, PickShared& sh) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int run = 0;
  for (int base = 0; base < r.vocab; base += PICK_THREADS) {
    const int i = base + threadIdx.x;
    u32 k = 0;
    const bool on = i < r.vocab && row_kept(r, i, r.x[i], k) && k == key;
    const u32 b = __ballot_sync(0xffffffffu, on);
    __syncthreads();
    if (lane == 0) sh.cnt[warp] = __popc(b);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < PICK_WARPS; w++) {
      const int c = sh.cnt[w];
      total += c;
      before += w < warp ? c : 0;
    }
    if (on && run + before + __popc(b & ((1u << lane) - 1)) + 1 == n) sh.pick[1] = i;
    __syncthreads();
    if (run + total >= n) return sh.pick[1];
    run += total;
  }
  return PICK_NONE;
}

// top_k cuts r to its k most likely candidates (k below their number).
__device__ void top_k(Row& r, int k, PickShared& sh) {
  u32 prefix = 0, mask = 0, need = k, ties = 0;
  for (int pass = 0; pass < 3; pass++) {
    const int shift = digit_shift(pass);
    const u32 bins = digit_bins(pass), per = bins / 32;
    histogram(r, prefix, mask, shift, bins, false, sh);
    // Warp 0 finds the digit where the count from the top reaches need:
    // lane l sums the l-th run of per digits from the top.
    if (threadIdx.x < 32) {
      const int top = bins - 1 - per * threadIdx.x;
      u32 own = 0;
      for (int j = 0; j < (int)per; j++) own += sh.cnt[top - j];
      const u32 incl = warp_scan(own), excl = incl - own;
      if (excl < need && incl >= need) {
        u32 c = excl;
        for (int j = 0; j < (int)per; j++) {
          const u32 n = sh.cnt[top - j];
          if (c + n >= need) {
            sh.pick[0] = top - j;
            sh.pick[1] = c;
            break;
          }
          c += n;
        }
      }
    }
    __syncthreads();
    const u32 d = sh.pick[0];
    need -= sh.pick[1];
    ties = sh.cnt[d];
    prefix |= d << shift;
    mask |= (bins - 1) << shift;
  }
  const int ci = need == ties ? (prefix == r.cv ? r.ci : PICK_NONE) : nth_kept(r, prefix, need, sh);
  r.cv = prefix;
  r.ci = ci;
}

// top_p cuts r to its smallest set of most likely candidates whose
// probability reaches p, as package sample does: the first in rank order
// at which the kept weight of it and those before it reaches ceil(p S),
// S the kept weight (the first pass's sum).
__device__ void top_p(Row& r, float p, PickShared& sh) {
  u64 target = 0, above = 0;  // above: the weight of the kept keys above the prefix's
  u32 prefix = 0, mask = 0, ties = 0;
  for (int pass = 0; pass < 3; pass++) {
    const int shift = digit_shift(pass);
    const u32 bins = digit_bins(pass), per = bins / 32;
    histogram(r, prefix, mask, shift, bins, true, sh);
    // Warp 0 finds the first digit from the top whose weight brings the
    // sum to the target (or, where rounding would leave it short, the last
    // digit with a key).
    if (threadIdx.x < 32) {
      const int l = threadIdx.x, top = bins - 1 - per * l;
      u64 own = 0;
      for (int j = 0; j < (int)per; j++) own += sh.mass[top - j];
      const u64 incl = warp_scan(own), excl = incl - own;
      if (pass == 0) {
        const u64 sum = __shfl_sync(0xffffffffu, incl, 31);
        target = max((u64)ceil((double)p * (double)sum), (u64)1);
      }
      const bool here = above + excl < target && above + incl >= target;
      int last = -1;
      for (int j = 0; j < (int)per; j++)
        if (sh.cnt[top - j] > 0) last = top - j;
      const u32 lanes = __ballot_sync(0xffffffffu, last >= 0);
      const bool any = __ballot_sync(0xffffffffu, here) != 0;
      if (here) {
        u64 c = above + excl;
        for (int j = 0; j < (int)per; j++) {
          const int d = top - j;
          if (sh.cnt[d] > 0 && c + sh.mass[d] >= target) {
            sh.pick[0] = d;
            break;
          }
          c += sh.mass[d];
        }
      } else if (!any && l == 31 - __clz(lanes)) {
        sh.pick[0] = last;
      }
      if (l == 0) sh.at[0] = target;
    }
    __syncthreads();
    target = sh.at[0];
    const u32 d = sh.pick[0];
    u64 add = 0;
    for (u32 j = (threadIdx.x & 31) + d + 1; j < bins; j += 32) add += sh.mass[j];
    above += warp_sum_u64(add);
    ties = sh.cnt[d];
    prefix |= d << shift;
    mask |= (bins - 1) << shift;
  }
  // Equal keys weigh the same: keep as few as reach the target.
  const u64 w = weight(r, prefix);
  u32 n = ties;
  if (w > 0 && target > above) n = (u32)min((u64)ties, (target - above + w - 1) / w);
  n = max(n, 1u);
  const int ci = n == ties ? (prefix == r.cv ? r.ci : PICK_NONE) : nth_kept(r, prefix, n, sh);
  r.cv = prefix;
  r.ci = ci;
}

// philox returns package sample's 64 random bits of a draw: the first two
// words of Philox4x32-10 of the counter (index, "pick") under the key seed,
// the first the low half.
__device__ __forceinline__ u64 philox(u64 seed, u64 index) {
  u32 c0 = (u32)index, c1 = (u32)(index >> 32), c2 = 0, c3 = 0x7069636bu;
  u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
#pragma unroll
  for (int i = 0; i < 10; i++) {
    const u32 h0 = __umulhi(0xD2511F53u, c0), l0 = 0xD2511F53u * c0;
    const u32 h1 = __umulhi(0xCD9E8D57u, c2), l1 = 0xCD9E8D57u * c2;
    c0 = h1 ^ c1 ^ k0;
    c1 = l1;
    c2 = h0 ^ c3 ^ k1;
    c3 = l0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return (u64)c0 | ((u64)c1 << 32);
}

// draw_kept returns the draw among r's kept candidates, to every thread:
// with S their weight and t = u S / 2^64, the first kept candidate in index
// order at which the running sum of weights passes t. One pass sums the
// kept weight of each chunk of 32 g consecutive values (g = 1 up to a
// vocabulary of 65536); a block-wide scan over the chunks finds the one
// that holds t, and one warp scans it.
__device__ int draw_kept(const Row& r, u64 u, PickShared& sh) {
  const int lane = threadIdx.x & 31;
  const int g = (r.vocab + 32 * PICK_CHUNKS - 1) / (32 * PICK_CHUNKS), span = 32 * g;
  const int chunks = (r.vocab + span - 1) / span;
  __syncthreads();
  for (int c = threadIdx.x; c < chunks; c += PICK_THREADS) sh.chunk[c] = 0;
  __syncthreads();
  for_row(r.x, r.vocab, [&](int i, float v) {
    u32 key;
    u64 w = i < r.vocab && row_kept(r, i, v, key) ? weight(r, key) : 0;
    w = warp_sum_u64(w);
    // i - lane is the warp's first index, a multiple of 32.
    if (lane == 0 && w > 0) atomicAdd(&sh.chunk[(i - lane) / span], w);
  });
  __syncthreads();
  // Thread t holds chunks [t per, (t+1) per).
  const int per = (chunks + PICK_THREADS - 1) / PICK_THREADS, c0 = threadIdx.x * per;
  u64 own = 0;
  for (int c = c0; c < min(c0 + per, chunks); c++) own += sh.chunk[c];
  const u64 incl = warp_scan(own);
  if (lane == 31) sh.red[threadIdx.x >> 5] = incl;
  __syncthreads();
  u64 before = incl - own, total = 0;
  for (int w = 0; w < PICK_WARPS; w++) {
    const u64 v = sh.red[w];
    before += w < (int)(threadIdx.x >> 5) ? v : 0;
    total += v;
  }
  const u64 t = __umul64hi(u, total);
  if (t >= before && t - before < own) {
    u64 run = before;
    for (int c = c0;; c++) {
      if (t - run < sh.chunk[c]) {
        sh.at[0] = c;
        sh.at[1] = run;
        break;
      }
      run += sh.chunk[c];
    }
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    u64 run = sh.at[1];
    const int first = (int)sh.at[0] * span;
    for (int base = first; base < min(first + span, r.vocab); base += 32) {
      const int i = base + lane;
      u64 w = 0;
      u32 key;
      if (i < r.vocab && row_kept(r, i, r.x[i], key)) w = weight(r, key);
      const u64 incl = warp_scan(w);
      const u32 hit = __ballot_sync(0xffffffffu, t - run < incl);
      if (hit != 0) {
        if (lane == __ffs(hit) - 1) sh.pick[1] = i;
        break;
      }
      run += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  __syncthreads();
  return sh.pick[1];
}

// pick_rows: for row r of logits (one block each; rows ld floats apart),
// picks[r] is the pick among its first vocab values and none[r] is 1 when
// no value is above -Inf (nothing to draw; the pick is then the lowest
// index that is not NaN, or 0), else 0. With params null, or a row's
// temperature 0 (or so small that 1/T is not a float), the pick is the
// greedy one; else it is package sample's draw at place index + step of
// the seed's stream: top-k, then top-p, then the draw among the kept
// candidates, with the same integer weights and random bits.
//
// Launched with early start, it waits (grid_wait) before reading logits.
extern "C" __global__ void __launch_bounds__(PICK_THREADS)
    pick_rows(const float* __restrict__ logits, int ld, int vocab, const DrawParams* __restrict__ params, u64 step,
              int* __restrict__ picks, int* __restrict__ none) {
  grid_wait();
  grid_release();
  __shared__ PickShared sh;
  const float* x = logits + (size_t)blockIdx.x * ld;
  DrawParams dp = {};
  float inv = 0.f;
  if (params != nullptr) {
    dp = params[blockIdx.x];
    if (dp.temp > 0.f) inv = __fdiv_rn(1.f, dp.temp);
  }
  if (!(inv > 0.f && inv < PICK_INF)) {
    float bv;
    int bi;
    row_argmax(x, (ld & 3) == 0 && (((size_t)logits) & 15) == 0, vocab, bv, bi, sh.bv, sh.bi);
    if (threadIdx.x == 0) {
      picks[blockIdx.x] = bi == PICK_NONE ? 0 : bi;
      none[blockIdx.x] = bv > -PICK_INF ? 0 : 1;
    }
    return;
  }
  // The candidates: the largest key, how many are +Inf, how many are
  // above -Inf, and the lowest index that is not NaN.
  u32 top = 0;
  u64 infs = 0, cands = 0;
  int lowest = PICK_NONE;
  for_row(x, vocab, [&](int i, float v) {
    if (v == v) lowest = min(lowest, i);
    if (v > -PICK_INF) {
      cands++;
      top = max(top, key_of(v));
    }
    if (v == PICK_INF) infs++;
  });
  top = block_reduce(top, sh.cnt, OpMax());
  lowest = block_reduce(lowest, sh.bi, OpMin());
  const u64 counts = block_reduce(infs << 32 | cands, sh.red, OpAdd());
  infs = counts >> 32;
  cands = counts & 0xffffffffu;
  if (cands == 0) {
    if (threadIdx.x == 0) {
      picks[blockIdx.x] = lowest == PICK_NONE ? 0 : lowest;
      none[blockIdx.x] = 1;
    }
    return;
  }
  Row r = {x, vocab, infs > 0, infs > 0 ? 0.f : value_of(top), inv, 0u, -1};
  const u64 n = infs > 0 ? infs : cands;
  if (dp.top_k > 0 && (u64)dp.top_k < n) top_k(r, dp.top_k, sh);
  if (dp.top_p < 1.f) top_p(r, dp.top_p, sh);
  const int pick = draw_kept(r, philox(dp.seed, dp.index + step), sh);
  if (threadIdx.x == 0) {
    picks[blockIdx.x] = pick;
    none[blockIdx.x] = 0;
  }
}
