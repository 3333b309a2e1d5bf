// hot.cu: the kernels of hot-unit calibration (hot.go): counting how often
// each unit fires in a packed gate, and reordering the weight rows so that
// the hot units come last.
#include "common.cuh"

// unit_count adds one to counts[j] for every active entry j of the first
// tiles tiles of each unflagged row r < m of the packed gate (row_words
// words a row, S a tile; an entry is bf16 << 16 | column). One warp per
// (row, tile); flagged rows are skipped (their tiles may be incomplete).
extern "C" __global__ void __launch_bounds__(256)
    unit_count(const u32* __restrict__ packed, const int* __restrict__ flags, int m, int S, int tiles, int row_words,
               unsigned* __restrict__ counts) {
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < (long long)m * tiles;
       w += warps) {
    const int r = (int)(w / tiles), t = (int)(w - (long long)r * tiles);
    if (flags[r]) continue;
    const u32* p = packed + (size_t)r * row_words + (size_t)t * S;
    const int n = min((int)p[0], S - 1);
    for (int i = lane; i < n; i += 32) atomicAdd(&counts[p[1 + i] & 0xffffu], 1u);
  }
}

// permute_rows: row i of dst = row perm[i] of src, for n rows of d bf16
// (d % 8 == 0); src and dst must not overlap.
extern "C" __global__ void __launch_bounds__(256)
    permute_rows(const u16* __restrict__ src, u16* __restrict__ dst, const int* __restrict__ perm, int n, int d) {
  for (int i = blockIdx.x; i < n; i += gridDim.x) {
    const uint4* s = (const uint4*)(src + (size_t)perm[i] * d);
    uint4* o = (uint4*)(dst + (size_t)i * d);
    for (int k = threadIdx.x; k < d / 8; k += blockDim.x) o[k] = s[k];
  }
}
