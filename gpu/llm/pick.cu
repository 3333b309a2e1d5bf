// pick.cu: greedy picks of decode steps on the device (package gpu/llm), so
// that a step's next tokens feed the step after it without a trip through
// the host. No CUDA headers: package gpu's common.cuh comes from the
// launcher (gpu.Headers).

#include "common.cuh"

#define PICK_THREADS 1024
#define PICK_NONE 0x7fffffff

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

// argmax_rows: for row r of logits (one block each; rows ld floats apart),
// picks[r] is the greedy pick among its first vocab values, and none[r] is 1
// when no value is above -Inf (nothing to sample; the pick is then the
// lowest index that is not NaN, or 0), else 0. Each
// thread loads its values 16 bytes at a time, four loads in flight, where
// the row and vocab allow it.
//
// Launched with early start, it waits (grid_wait) before reading logits.
extern "C" __global__ void __launch_bounds__(PICK_THREADS)
    argmax_rows(const float* __restrict__ logits, int ld, int vocab, int* __restrict__ picks, int* __restrict__ none) {
  grid_wait();
  grid_release();
  const float* x = logits + (size_t)blockIdx.x * ld;
  float bv = __int_as_float(0x7fc00000);  // NaN: every value comes before it
  int bi = PICK_NONE;
  int head = 0;
  if ((ld & 3) == 0 && (((size_t)logits) & 15) == 0) {
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
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float v = __shfl_down_sync(0xffffffffu, bv, o);
    int i = __shfl_down_sync(0xffffffffu, bi, o);
    pick_merge(bv, bi, v, i);
  }
  __shared__ float sv[PICK_THREADS / 32];
  __shared__ int si[PICK_THREADS / 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
  }
  __syncthreads();
  if (warp != 0) return;
  bv = sv[lane];
  bi = si[lane];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float v = __shfl_down_sync(0xffffffffu, bv, o);
    int i = __shfl_down_sync(0xffffffffu, bi, o);
    pick_merge(bv, bi, v, i);
  }
  if (lane == 0) {
    picks[blockIdx.x] = bi == PICK_NONE ? 0 : bi;
    none[blockIdx.x] = bv > __int_as_float(0xff800000) ? 0 : 1;
  }
}
