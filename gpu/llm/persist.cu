// persist.cu: every decoder layer of a decode step in one persistent kernel
// (package gpu/llm, Engine.Persistent), for steps of 1 to 8 sequences whose
// layers all run the gated TwELL MLP sparse. sm_90 and later (bulk copies,
// mbarrier transaction counts).
//
// A decode step is bound by reading the weights (about 57 MB a layer at
// the SparseLM shape), yet the layer-by-layer kernels stream them at a
// third to a half of the memory bandwidth: each kernel's reads start at
// its launch and drain at its end, and the chain of dependent phases
// (norm, q/k/v, attention, output, gate, down) leaves the memory system
// idle between them. Here the weights never wait for the phases: one block
// per SM, launched cooperatively, runs the whole step. Its warp 0 (the
// producer) copies the block's share of every layer's q/k/v, output and
// gate rows, in the order the phases use them, in chunks of P_ROWS rows,
// into a ring of shared-memory slots with bulk asynchronous copies
// completing on the slot's "full" mbarrier; it only waits for a slot to be
// released ("empty" mbarrier). The other warps (the consumers) run the
// phases of each layer, meeting at a grid barrier between phases (the
// consumers' named barrier, then grid_arrive), which the producer
// never joins:
//
//   1. norm + q/k/v: every block norms the tokens (resid + delta, RMSNorm)
//      into shared memory, block 0 writes the residual sum; the block's
//      q/k/v chunks (two RoPE pairs each: columns j and j + hd/2 of a head)
//      are rotated, queries written to qbuf, keys and values to the cache.
//      Each warp also plans its attention run of phase 2 (the run's keys,
//      the addresses of their pages) and asks the L2 for its cached keys
//      and values.
//   2. attention: a warp per run of keys of a (token, head), R runs a
//      head; runs write their maximum, sum and unnormalized output, and
//      the last run of a (token, head) to finish (a counter, reset by it)
//      merges them, in an order fixed by the runs alone (so the result
//      repeats bit for bit).
//   3. output projection of the attention output into delta.
//   4. norm + gate: the tokens normed again (resid + delta), block 0 writes
//      the sum back; per gate chunk the gate values, ReLU, and for the
//      units active in some token the up row's dot product (read directly:
//      few) and h = gate * up, the units' activity nibble, and an L2
//      prefetch of their down rows.
//   5. down: each block owns P_COLS output columns at a time; its warps
//      list the active units of their share of the activity words and sum
//      h * down over them, the warps' sums added in warp order, into delta.
//
// The layers leave the residual stream in resA and the last MLP output in
// delta (the final norm adds them). Consumer warps take a block's chunks
// in turn (chunk i of the block by warp i mod NC), so each chunk's dot
// products are one warp's: no reduction across warps. Every consumer warp
// waits for every chunk and releases it (the empty mbarrier counts NC
// arrivals), the others as soon as it has landed: so no warp waits on a
// slot's mbarrier a phase before the one it means (which a parity wait
// cannot tell apart), whichever order the copies land in. Every wait is
// bounded (P_TIMEOUT): a bug traps rather than hangs the grid. Everything
// that another block wrote during the kernel is read through the L2
// (ld.cg); weights and metadata, which nothing writes, through the
// read-only path.

#include "common.cuh"
#include "rowdot.cuh"
#include "mma.cuh"
#include "kvpage.cuh"

#define P_ROWS 4      // weight rows of a chunk
#define P_MAXSLOT 16  // most ring slots
#define P_COLS 16     // output columns of a down slice
#define P_MAXRUNS 32  // most attention runs of a (token, head)
// P_UPLOADS is the 16-byte loads of an up row a lane has in flight (all of
// a d 2048 row).
#define P_UPLOADS 8

// P_NC is the number of consumer warps: with the producer, 256 threads,
// so that a thread may have 255 registers (9 to 12 warps get 168).
#define P_NC 7

// PLayer is one decoder layer's weights as the kernel reads them: bf16
// rows q/k/v [(nq + 2 nkv) hd][d], o [d][nq hd], gate and up [f][d], down
// (Wd^T) [f][d]; fp32 norm weights [d].
struct PLayer {
  const u16 *qkv, *o, *gate, *up, *down;
  const float *attn_norm, *mlp_norm;
};

// P_TIMEOUT bounds every wait of the kernel (nanoseconds; a step takes
// about a millisecond): past it the kernel traps, so that a bug shows as a
// launch failure, not as a cooperative grid that never ends.
#define P_TIMEOUT 2000000000ull

// ring_wait waits for phase parity of the ring's mbarrier bar (bounded by
// P_TIMEOUT).
__device__ __forceinline__ void ring_wait(u32 bar, u32 parity) {
  u64 t0 = 0;
  for (;;) {
    u32 ok;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    if (ok) return;
    const u64 t = globaltimer();
    if (t0 == 0) t0 = t;
    if (t - t0 > P_TIMEOUT) asm volatile("trap;");
  }
}

// ring_release marks the ring slot of mbarrier bar read by this warp
// (lane 0 arrives, after the warp's reads).
__device__ __forceinline__ void ring_release(u32 bar) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// consumers_sync is a barrier among the NC consumer warps (named barrier 1).
template <int NC>
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(NC * 32) : "memory");
}

// chunk_count returns the chunks of phase ph (0 q/k/v, 1 output, 2 gate).
__device__ __forceinline__ int chunk_count(int ph, int d, int f, int qkv_w) {
  return ph == 0 ? qkv_w / P_ROWS : ph == 1 ? d / P_ROWS : f / P_ROWS;
}

// chunk_row returns row k of chunk c of phase ph: for q/k/v the RoPE pairs
// 2c and 2c + 1 (rows j and j + hd/2 of a head), else rows 4c + k.
template <int HD>
__device__ __forceinline__ int chunk_row(int ph, int c, int k) {
  if (ph != 0) return P_ROWS * c + k;
  const int p = 2 * c + (k >> 1), head = p / (HD / 2), j = p % (HD / 2);
  return head * HD + j + (k & 1) * (HD / 2);
}

// produce (the producer warp) streams the block's chunks of every layer
// into the ring: slot i % nslot, once its previous contents are released.
template <int HD>
__device__ __forceinline__ void produce(const PLayer* __restrict__ layers, int nl, u32 ring, int slot_bytes,
                                        int nslot, u32 full, u32 empty, int d, int f, int nq, int qkv_w) {
  const int lane = threadIdx.x & 31;
  const u64 pol = policy_evict_first();  // each weight is read once a step
  u32 i = 0;
  for (int l = 0; l < nl; ++l) {
    const PLayer L = layers[l];
    for (int ph = 0; ph < 3; ++ph) {
      const u16* w = ph == 0 ? L.qkv : ph == 1 ? L.o : L.gate;
      const int len = ph == 1 ? nq * HD : d, n = chunk_count(ph, d, f, qkv_w);
      for (int c = blockIdx.x; c < n; c += gridDim.x, ++i) {
        const u32 s = i % nslot;
        if (i >= (u32)nslot) ring_wait(empty + 8 * s, (i / nslot - 1) & 1);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the consumers' reads of the slot come first
        if (lane == 0) mbar_expect_tx(full + 8 * s, (u32)(P_ROWS * len * 2));
        __syncwarp();
        if (lane < P_ROWS)
          asm volatile(
              "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, "
              "[%3], %4;" ::"r"(ring + s * slot_bytes + lane * len * 2),
              "l"(w + (size_t)chunk_row<HD>(ph, c, lane) * len), "r"(len * 2), "r"(full + 8 * s), "l"(pol)
              : "memory");
      }
    }
  }
}

// chunk_dot sets acc[k][t] = rows[k] . xs[t] (t < m) in every lane: rows
// are P_ROWS rows of len bf16 in shared memory, xs the m tokens (stride
// len).
template <int MB>
__device__ __forceinline__ void chunk_dot(const u16* rows, const u16* xs, int len, int m,
                                          float (&acc)[P_ROWS][MB]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < P_ROWS; ++k)
#pragma unroll
    for (int t = 0; t < MB; ++t) acc[k][t] = 0.f;
  for (int c = lane * 8; c < len; c += 256) {
    uint4 w[P_ROWS];
#pragma unroll
    for (int k = 0; k < P_ROWS; ++k) w[k] = *(const uint4*)(rows + k * len + c);
#pragma unroll
    for (int t = 0; t < MB; ++t) {
      if (t >= m) break;
      const uint4 x = *(const uint4*)(xs + t * len + c);
#pragma unroll
      for (int k = 0; k < P_ROWS; ++k) acc[k][t] = dot8(w[k], x, acc[k][t]);
    }
  }
#pragma unroll
  for (int k = 0; k < P_ROWS; ++k)
#pragma unroll
    for (int t = 0; t < MB; ++t) acc[k][t] = warp_sum(acc[k][t]);
}

// norm_tokens (consumers) norms the m tokens into xs (bf16, stride d):
// v = resid + delta (delta may be null), xs = bf16(v / rms(v) w); block 0
// writes v to resid_out. part is NC x MB floats of shared memory. For one
// token the values stay in registers; for more they are read again from
// the L2 for the second pass. Ends with a consumer barrier.
template <int MB, int NC>
__device__ __forceinline__ void norm_tokens(u16* xs, const float* resid, const u16* delta, float* resid_out,
                                            const float* __restrict__ w, int m, int d, float eps,
                                            float (*part)[MB]) {
  constexpr int NCT = NC * 32, KEEP = MB == 1 ? 4 : 1;
  const int ct = threadIdx.x - 32, lane = threadIdx.x & 31, cw = ct >> 5, n4 = d / 4;
  const bool kept = MB == 1 && n4 <= KEEP * NCT;
  auto load = [&](int t, int i) {
    float4 v = __ldcg((const float4*)(resid + (size_t)t * d) + i);
    if (delta) {
      const uint2 dd = __ldcg((const uint2*)(delta + (size_t)t * d) + i);
      v.x += bf_lo(dd.x), v.y += bf_hi(dd.x), v.z += bf_lo(dd.y), v.w += bf_hi(dd.y);
    }
    return v;
  };
  float4 keep[KEEP];
  float ss[MB];
#pragma unroll
  for (int t = 0; t < MB; ++t) {
    ss[t] = 0.f;
    if (t >= m) continue;
    for (int i = ct, k = 0; i < n4; i += NCT, ++k) {
      const float4 v = load(t, i);
      ss[t] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      if (kept) {
#pragma unroll
        for (int q = 0; q < KEEP; ++q)
          if (q == k) keep[q] = v;
      }
    }
  }
#pragma unroll
  for (int t = 0; t < MB; ++t) {
    ss[t] = warp_sum(ss[t]);
    if (lane == 0) part[cw][t] = ss[t];
  }
  consumers_sync<NC>();
  for (int t = 0; t < m; ++t) {
    float s = 0.f;
    for (int i = 0; i < NC; ++i) s += part[i][t];
    const float inv = rsqrtf(s / (float)d + eps);
    for (int i = ct, k = 0; i < n4; i += NCT, ++k) {
      float4 v;
      if (kept) {
#pragma unroll
        for (int q = 0; q < KEEP; ++q)
          if (q == k) v = keep[q];
      } else {
        v = load(t, i);
      }
      const float4 g = __ldg((const float4*)w + i);
      uint2 o;
      o.x = pack_bf2(v.x * inv * g.x, v.y * inv * g.y);
      o.y = pack_bf2(v.z * inv * g.z, v.w * inv * g.w);
      ((uint2*)(xs + (size_t)t * d))[i] = o;
      if (blockIdx.x == 0) ((float4*)(resid_out + (size_t)t * d))[i] = v;
    }
  }
  consumers_sync<NC>();  // xs is complete, and part may be written again
}

// prefetch_row asks the L2 for a row of bytes bytes (one 128-byte line a
// lane and step).
__device__ __forceinline__ void prefetch_row(const void* row, int bytes) {
  for (int o = (threadIdx.x & 31) * 128; o < bytes; o += 32 * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)row + o));
}

// AttnRun is one attention run of phase 2: token t, head (kv head kh),
// run r of R, keys [k0, k1) of the past + 1 (the new token's last), and
// where they are: the sequence's page table pt, and in lane i the address
// of page pg0 + i (the run's first 32 pages), so that a key's address
// costs a shuffle rather than two dependent loads.
struct AttnRun {
  int t, head, kh, r, k0, k1, past, pg0;
  const u64* pt;
  u64 pg;
};

// attn_run (a whole warp) plans run item of the m nq R runs.
__device__ __forceinline__ AttnRun attn_run(int item, int nq, int nkv, int R, int page,
                                            const int* __restrict__ tok_seq, const int* __restrict__ tok_pos,
                                            const u64* __restrict__ seq_pt) {
  AttnRun a;
  a.t = item / (nq * R);
  a.head = item / R % nq;
  a.kh = a.head / (nq / nkv);
  a.r = item % R;
  a.past = tok_pos[a.t];
  const int keys = a.past + 1;
  a.k0 = (int)((long)a.r * keys / R);
  a.k1 = (int)((long)(a.r + 1) * keys / R);
  a.pt = kv_table(seq_pt, tok_seq[a.t]);
  a.pg0 = a.k0 / page;
  const int lane = threadIdx.x & 31, npg = a.k1 > a.k0 ? (a.k1 - 1) / page - a.pg0 + 1 : 0;
  a.pg = lane < npg ? a.pt[a.pg0 + lane] : 0;
  return a;
}

// kv_row (every lane of the warp, for its own position p) returns the
// address of position p's keys (kv 0) or values (kv 1) of run a's kv head
// in layer l.
template <int HD>
__device__ __forceinline__ const u16* kv_row(const AttnRun& a, int page, int l, int kv, int nkv, int p) {
  const int i = p / page - a.pg0;
  u64 pg = __shfl_sync(0xffffffffu, a.pg, i & 31);
  if (i >= 32) pg = a.pt[p / page];
  return (const u16*)pg + kv_off(page, l, kv, nkv, a.kh, p % page, HD);
}

// prefetch_run (a consumer warp) asks the L2 for run a's cached keys and
// values (positions before the new token's), for phase 2.
template <int HD>
__device__ __forceinline__ void prefetch_run(const AttnRun& a, int page, int l, int nkv) {
  constexpr int LINES = HD * 2 / 128;  // 128-byte lines of a row
  const int lane = threadIdx.x & 31, n = (min(a.k1, a.past) - a.k0) * 2 * LINES;
  for (int i0 = 0; i0 < n; i0 += 32) {  // whole warps: kv_row shuffles
    const int i = min(i0 + lane, n - 1);
    const int p = a.k0 + i / (2 * LINES), kv = i / LINES % 2, line = i % LINES;
    const u16* row = kv_row<HD>(a, page, l, kv, nkv, p);
    if (i0 + lane < n) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + line * 64));
  }
}

// P_UNROLL is how many key steps of a run a warp has in flight.
#define P_UNROLL 8

// attend (a consumer warp) runs attention run a: groups of HD/8 lanes
// take one key at a time (a lane: 8 dimensions), an online softmax per
// group, merged across the warp's groups; then the output, or the run's
// partial result and, for the last run of the (token, head), the merge
// (MERGE runs a group of lanes reads at once).
template <int HD, int MERGE>
__device__ __forceinline__ void attend(const AttnRun& a, int nq, int nkv, int R, int l, int page, float scale_log2,
                                       const u16* qbuf, u16* att, float* runs, u32* cnt) {
  constexpr int LPK = HD / 8, KPS = 32 / LPK;  // lanes per key; keys per step
  const int lane = threadIdx.x & 31, grp = lane / LPK, sub = lane % LPK;
  const uint4 q = ldg_cg(qbuf + ((size_t)a.t * nq + a.head) * HD + sub * 8);
  float m = NEG_INF, lsum = 0.f, acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  for (int p0 = a.k0; p0 < a.k1; p0 += KPS * P_UNROLL) {
    uint4 kr[P_UNROLL], vr[P_UNROLL];
#pragma unroll
    for (int u = 0; u < P_UNROLL; ++u) {
      const int p = min(p0 + u * KPS + grp, a.k1 - 1);
      const u16* K = kv_row<HD>(a, page, l, 0, nkv, p) + sub * 8;
      if (p0 + u * KPS + grp < a.k1) {
        kr[u] = ldg_cg(K);
        vr[u] = ldg_cg(K + (size_t)nkv * page * HD);  // the values: kv_off's next (layer, k|v) section
      }
    }
    float sc[P_UNROLL], mb = NEG_INF;
#pragma unroll
    for (int u = 0; u < P_UNROLL; ++u) {
      const int p = p0 + u * KPS + grp;
      float x = p < a.k1 ? dot8(q, kr[u], 0.f) : 0.f;
#pragma unroll
      for (int o = LPK / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
      sc[u] = p < a.k1 ? x * scale_log2 : NEG_INF;
      mb = fmaxf(mb, sc[u]);
    }
    const float mn = fmaxf(m, mb);
    if (mn != NEG_INF) {
      const float corr = ex2(m - mn);
      lsum *= corr;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] *= corr;
#pragma unroll
      for (int u = 0; u < P_UNROLL; ++u)
        if (sc[u] != NEG_INF) {
          const float pr = ex2(sc[u] - mn);
          lsum += pr;
          axpy8(acc, pr, vr[u]);
        }
      m = mn;
    }
  }
  // Merge the warp's groups (a butterfly: every group ends with the sum).
#pragma unroll
  for (int o = LPK; o < 32; o <<= 1) {
    const float mo = __shfl_xor_sync(0xffffffffu, m, o), lo = __shfl_xor_sync(0xffffffffu, lsum, o);
    const float M = fmaxf(m, mo);
    const float wa = M == NEG_INF ? 0.f : ex2(m - M), wb = M == NEG_INF ? 0.f : ex2(mo - M);
    lsum = lsum * wa + lo * wb;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = acc[e] * wa + __shfl_xor_sync(0xffffffffu, acc[e], o) * wb;
    m = M;
  }
  u16* out = att + ((size_t)a.t * nq + a.head) * HD + sub * 8;
  auto store = [&](const float (&o)[8], float inv) {
    *(uint4*)out = make_uint4(pack_bf2(o[0] * inv, o[1] * inv), pack_bf2(o[2] * inv, o[3] * inv),
                              pack_bf2(o[4] * inv, o[5] * inv), pack_bf2(o[6] * inv, o[7] * inv));
  };
  if (R == 1) {  // the run holds key 0: lsum > 0
    if (grp == 0) store(acc, 1.f / lsum);
    return;
  }
  // Pair (t, head)'s runs: P_MAXRUNS outputs of HD floats, then their
  // maxima and sums.
  const int pair = a.t * nq + a.head;
  float* base = runs + (size_t)pair * P_MAXRUNS * (HD + 2);
  float* ro = base + a.r * HD;
  float* rml = base + P_MAXRUNS * HD;
  if (grp == 0) {
    *(float4*)(ro + sub * 8) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    *(float4*)(ro + sub * 8 + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
  if (lane == 0) rml[2 * a.r] = m, rml[2 * a.r + 1] = lsum;
  __threadfence();
  __syncwarp();
  u32 last = 0;
  if (lane == 0) last = atomicAdd(cnt + pair, 1u) == (u32)R - 1;
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  __threadfence();
  // The last run merges all R: group g takes runs g, g + NG, ...,
  // MERGE at a time in flight, and a butterfly adds the groups' sums.
  constexpr int NG = 32 / LPK;
  const float mr = lane < R ? __ldcg(rml + 2 * lane) : NEG_INF;
  const float lr = lane < R ? __ldcg(rml + 2 * lane + 1) : 0.f;
  float M = mr;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  const float wr = mr == NEG_INF ? 0.f : ex2(mr - M);  // run lane's weight
  const float L = warp_sum(lr * wr);
  float o8[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) o8[e] = 0.f;
  for (int r0 = 0; r0 < R; r0 += MERGE * NG) {
    float4 x[MERGE][2];
    float w[MERGE];
#pragma unroll
    for (int k = 0; k < MERGE; ++k) {
      const int r = r0 + k * NG + grp;
      w[k] = __shfl_sync(0xffffffffu, wr, r & 31);
      if (r < R) {
        const float4* rr = (const float4*)(base + r * HD + sub * 8);
        x[k][0] = __ldcg(rr), x[k][1] = __ldcg(rr + 1);
      }
    }
#pragma unroll
    for (int k = 0; k < MERGE; ++k) {
      if (r0 + k * NG + grp >= R) continue;
      o8[0] = fmaf(x[k][0].x, w[k], o8[0]), o8[1] = fmaf(x[k][0].y, w[k], o8[1]);
      o8[2] = fmaf(x[k][0].z, w[k], o8[2]), o8[3] = fmaf(x[k][0].w, w[k], o8[3]);
      o8[4] = fmaf(x[k][1].x, w[k], o8[4]), o8[5] = fmaf(x[k][1].y, w[k], o8[5]);
      o8[6] = fmaf(x[k][1].z, w[k], o8[6]), o8[7] = fmaf(x[k][1].w, w[k], o8[7]);
    }
  }
#pragma unroll
  for (int o = LPK; o < 32; o <<= 1)
#pragma unroll
    for (int e = 0; e < 8; ++e) o8[e] += __shfl_xor_sync(0xffffffffu, o8[e], o);
  if (grp == 0) store(o8, 1.f / L);
  if (lane == 0) cnt[pair] = 0;
}

// list_active (a consumer warp) writes the units active in some token of
// activity words w0, w0 + step, ... below nw into list, ascending, and
// returns how many (every lane). Word w is the activity bytes of chunks
// 4w .. 4w + 3 (units 16w .. 16w + 15; a byte's low nibble, one bit a
// unit), read through the L2.
__device__ __forceinline__ int list_active(const unsigned char* act, int w0, int nw, int step, int* list) {
  const int lane = threadIdx.x & 31, n = w0 < nw ? (nw - w0 + step - 1) / step : 0;
  int len = 0;
  for (int i0 = 0; i0 < n; i0 += 32) {
    const int w = w0 + (i0 + lane) * step;
    u32 mine = 0;
    if (i0 + lane < n) {
      const u32 b = __ldcg((const unsigned int*)act + w);
      mine = (b & 0xfu) | (b >> 4 & 0xf0u) | (b >> 8 & 0xf00u) | (b >> 12 & 0xf000u);
    }
    const int c = __popc(mine);
    int incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    int pos = len + incl - c;
    for (u32 b = mine; b; b &= b - 1) list[pos++] = 16 * w + __ffs(b) - 1;
    len += __shfl_sync(0xffffffffu, incl, 31);
  }
  return len;
}

// down_slice (consumers) writes delta[t][c0 .. c0 + P_COLS) = sum over the
// active units j of h[t][j] down[j][c]: warp cw sums the units it lists
// (its share of the activity words), lanes 16 a half-warp each taking a
// column of units at even or odd places of the list, eight in flight; the
// warps' sums are added in warp order. lists: the warps' lists (cap ints
// each); red: NC x MB x P_COLS floats. Ends with a consumer barrier.
template <int MB, int NC>
__device__ __forceinline__ void down_slice(const float* h, const unsigned char* act, const u16* __restrict__ down,
                                           u16* delta, int m, int d, int f, int c0, int* lists, int cap,
                                           float (*red)[MB][P_COLS]) {
  const int ct = threadIdx.x - 32, cw = ct >> 5, lane = threadIdx.x & 31;
  int* list = lists + cw * cap;
  const int len = list_active(act, cw, f / 16, NC, list);
  __syncwarp();
  const int col = c0 + (lane & 15), half = lane >> 4;
  float acc[MB];
  down_dot<MB>(list, len, half, down, h, m, d, f, col, acc);
#pragma unroll
  for (int t = 0; t < MB; ++t) {
    const float other = __shfl_down_sync(0xffffffffu, acc[t], 16);
    if (half == 0) red[cw][t][lane] = acc[t] + other;
  }
  consumers_sync<NC>();
  for (int i = ct; i < m * P_COLS; i += NC * 32) {
    const int t = i / P_COLS, c = i % P_COLS;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < NC; ++w) s += red[w][t][c];
    delta[(size_t)t * d + c0 + c] = (u16)f_to_bf(s);
  }
  consumers_sync<NC>();  // red and the lists may be written again
}

// persist_decode: grid one block per SM (cooperative), 32 (P_NC + 1)
// threads; dynamic shared memory: the ring (nslot slots of slot_bytes =
// P_ROWS max(d, nq HD) 2 bytes, from offset 0), then the scratch (the
// tokens, MB max(d, nq HD) bf16, or the down phase's lists, NC cap ints).
// m <= MB tokens, token t of sequence tok_seq[t] at position tok_pos[t];
// resA holds the layers' input (the embeddings) and gets their output,
// resB is the other residual buffer (both fp32 [m][d]), delta bf16 [m][d]
// (the last layer's MLP output at the end), qbuf and att bf16 [m][nq HD],
// h fp32 [m][f], act f / 4 bytes, runs m nq P_MAXRUNS (HD + 2) floats,
// cnt m nq words (zero, and left zero), bar the grid barrier's two words
// (grid_sync's), stamps null or 10 nl words a block (the phases' start and
// end times, globaltimer).
template <int HD, int MB>
__global__ void __launch_bounds__(32 * (P_NC + 1), 1)
    persist_decode(const PLayer* __restrict__ layers, int nl, float* resA, float* resB, u16* delta, u16* qbuf,
                   u16* att, float* h, unsigned char* act, float* runs, u32* cnt, u32* bar, u64* stamps,
                   const float* __restrict__ cosT, const float* __restrict__ sinT, const int* __restrict__ tok_seq,
                   const int* __restrict__ tok_pos, const u64* __restrict__ seq_pt, int page, int m, int d, int f,
                   int nq, int nkv, int R, int nslot, int slot_bytes, int cap, float eps, float scale_log2) {
  constexpr int NC = P_NC;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) u64 bars[2 * P_MAXSLOT];
  __shared__ float part[NC][MB];
  __shared__ float red[NC][MB][P_COLS];
  __shared__ AttnRun plans[NC * 32];  // each lane's copy of its warp's first attention run
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int qkv_w = (nq + 2 * nkv) * HD, ow = nq * HD, half = HD / 2;
  const u32 ring = smem_addr(smem), full = smem_addr(bars), empty = full + 8 * P_MAXSLOT;
  if (threadIdx.x == 0) {
    for (int s = 0; s < nslot; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, NC);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == 0) {
    produce<HD>(layers, nl, ring, slot_bytes, nslot, full, empty, d, f, nq, qkv_w);
    return;
  }
  const int cw = warp - 1;
  u16* xs = (u16*)(smem + (size_t)nslot * slot_bytes);
  int* lists = (int*)xs;
  u32 i = 0;  // the block's chunk counter, as the producer's
  // chunks runs the block's chunks of phase ph (rows of len) in turn: warp
  // cw takes those with i % NC == cw, waits for its slot, computes the dot
  // products with xs, releases the slot and hands the sums to epi(c, acc).
  auto chunks = [&](int ph, int len, auto&& epi) {
    const int n = chunk_count(ph, d, f, qkv_w);
    for (int c = blockIdx.x; c < n; c += gridDim.x, ++i) {
      const u32 s = i % nslot;
      ring_wait(full + 8 * s, (i / nslot) & 1);
      if ((int)(i % NC) != cw) {
        ring_release(empty + 8 * s);
        continue;
      }
      float acc[P_ROWS][MB];
      chunk_dot<MB>((const u16*)(smem + (size_t)s * slot_bytes), xs, len, m, acc);
      ring_release(empty + 8 * s);
      epi(c, acc);
    }
  };
  const int gw = blockIdx.x * NC + cw, nw = gridDim.x * NC, items = m * nq * R;
  const bool leader = threadIdx.x == 32;
  // The grid barrier's generation, counted from here: no block can pass
  // the first barrier before this one arrives at it.
  u32 gen = leader ? grid_generation(bar) : 0;
  // stamp records, with stamps, when the block's consumers start (end 0)
  // or finish (end 1) phase ph of layer l.
  auto stamp = [&](int l, int ph, int end) {
    if (stamps && leader) stamps[((size_t)blockIdx.x * nl + l) * 10 + 2 * ph + end] = globaltimer();
  };
  // meet ends phase ph of layer l: the grid barrier, but after the last
  // phase of the last layer.
  auto meet = [&](int l, int ph) {
    consumers_sync<NC>();
    stamp(l, ph, 1);
    if (l + 1 == nl && ph == 4) return;
    if (leader) grid_arrive(bar, gen++, P_TIMEOUT);
    consumers_sync<NC>();
    stamp(ph == 4 ? l + 1 : l, (ph + 1) % 5, 0);
  };
  stamp(0, 0, 0);
  for (int l = 0; l < nl; ++l) {
    const PLayer L = layers[l];
    // 1. norm, q/k/v, RoPE, cache write.
    if (gw < items) {  // the warp's first run of phase 2, planned now: its loads off the critical path
      const AttnRun run = attn_run(gw, nq, nkv, R, page, tok_seq, tok_pos, seq_pt);
      prefetch_run<HD>(run, page, l, nkv);
      plans[threadIdx.x - 32] = run;  // in shared memory: registers are short in phase 1
    }
    if (cw == 0) prefetch_row(L.mlp_norm, d * 4);
    norm_tokens<MB, NC>(xs, resA, l > 0 ? delta : nullptr, resB, L.attn_norm, m, d, eps, part);
    chunks(0, d, [&](int c, float (&acc)[P_ROWS][MB]) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int p = 2 * c + e, head = p / half, j = p % half;
        float a = pick<MB>(acc[2 * e], lane), b = pick<MB>(acc[2 * e + 1], lane);
        if (lane >= m) continue;
        const int t = lane, pos = tok_pos[t];
        if (head < nq + nkv) {
          const float cs = cosT[(size_t)pos * half + j], sn = sinT[(size_t)pos * half + j];
          const float ra = a * cs - b * sn, rb = b * cs + a * sn;
          a = ra, b = rb;
        }
        u16* dst;
        if (head < nq) {
          dst = qbuf + ((size_t)t * nq + head) * HD;
        } else {
          const int kv = head < nq + nkv ? 0 : 1;
          dst = (u16*)kv_table(seq_pt, tok_seq[t])[pos / page] +
                kv_off(page, l, kv, nkv, head - nq - kv * nkv, pos % page, HD);
        }
        dst[j] = (u16)f_to_bf(a);
        dst[j + half] = (u16)f_to_bf(b);
      }
    });
    meet(l, 0);
    // 2. attention.
    for (int it = gw; it < items; it += nw) {
      const AttnRun run = it == gw ? plans[threadIdx.x - 32] : attn_run(it, nq, nkv, R, page, tok_seq, tok_pos, seq_pt);
      attend<HD, MB == 1 ? 4 : 1>(run, nq, nkv, R, l, page, scale_log2, qbuf, att, runs, cnt);
    }
    meet(l, 1);
    // 3. output projection.
    for (int k = threadIdx.x - 32; k < m * ow / 8; k += NC * 32) ((uint4*)xs)[k] = __ldcg((const uint4*)att + k);
    consumers_sync<NC>();
    chunks(1, ow, [&](int c, float (&acc)[P_ROWS][MB]) {
#pragma unroll
      for (int k = 0; k < P_ROWS; ++k) {
        const float v = pick<MB>(acc[k], lane);
        if (lane < m) delta[(size_t)lane * d + P_ROWS * c + k] = (u16)f_to_bf(v);
      }
    });
    meet(l, 2);
    // 4. norm, gate, ReLU, up.
    if (cw == 0 && l + 1 < nl) prefetch_row(layers[l + 1].attn_norm, d * 4);
    norm_tokens<MB, NC>(xs, resB, delta, resA, L.mlp_norm, m, d, eps, part);
    chunks(2, d, [&](int c, float (&acc)[P_ROWS][MB]) {
      u32 bits = 0;
#pragma unroll
      for (int k = 0; k < P_ROWS; ++k) {
        const int j = P_ROWS * c + k;
        bool on[MB], any = false;
#pragma unroll
        for (int t = 0; t < MB; ++t) {
          acc[k][t] = __uint_as_float(f_to_bf(acc[k][t]) << 16);  // the gate GEMM's bf16 output
          on[t] = t < m && (acc[k][t] > 0.f || acc[k][t] != acc[k][t]);
          any |= on[t];
        }
        float u[MB];
#pragma unroll
        for (int t = 0; t < MB; ++t) u[t] = 0.f;
        if (any) {
          prefetch_row(L.down + (size_t)j * d, d * 2);
          const u16* row = L.up + (size_t)j * d;
          for (int base = lane * 8; base < d; base += P_UPLOADS * 256) {
            uint4 w[P_UPLOADS];  // in flight together
#pragma unroll
            for (int q = 0; q < P_UPLOADS; ++q)
              if (base + q * 256 < d) w[q] = __ldg((const uint4*)(row + base + q * 256));
#pragma unroll
            for (int q = 0; q < P_UPLOADS; ++q) {
              if (base + q * 256 >= d) break;
#pragma unroll
              for (int t = 0; t < MB; ++t)
                if (t < m) u[t] = dot8(w[q], *(const uint4*)(xs + (size_t)t * d + base + q * 256), u[t]);
            }
          }
#pragma unroll
          for (int t = 0; t < MB; ++t) u[t] = warp_sum(u[t]);
        }
        float hv = 0.f;
#pragma unroll
        for (int t = 0; t < MB; ++t)
          if (t == lane && on[t]) hv = acc[k][t] * u[t];
        if (lane < m) h[(size_t)lane * f + j] = hv;
        bits |= (u32)any << k;
      }
      if (lane == 0) act[c] = (unsigned char)bits;
    });
    meet(l, 3);
    // 5. down.
    for (int s = blockIdx.x; s < d / P_COLS; s += gridDim.x)
      down_slice<MB, NC>(h, act, L.down, delta, m, d, f, s * P_COLS, lists, cap, red);
    meet(l, 4);
  }
}

