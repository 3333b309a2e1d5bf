// d2t_pack.cu: the packing half of D2T for KernelLt, where the gate GEMM
// runs on cuBLASLt into a bf16 scratch g ([rows][f], the rows of one chunk)
// instead of a fused epilogue. One warp per (row, 256-column tile) packs
// ReLU(g) into TwELL with pack_row_warp (common.cuh), as d2t_wgmma's packer
// warps do: slots in column order, word 0 the true count, words past it
// zero; a row whose tile holds more than S - 1 active values, or a NaN or
// Inf, is flagged for the dense fallback. Rows of the chunk at or past
// m_valid (the padding to 256 rows) are packed empty.
#include "common.cuh"

template <int S>
__global__ void __launch_bounds__(256)
    d2t_pack(const u16* __restrict__ g, u32* __restrict__ packed, int* __restrict__ flags, int* __restrict__ ovf,
             u64* __restrict__ nnz, int row0, int rows, int m_valid, int f, int row_words) {
  __shared__ __align__(16) u32 erows[8][S];
  __shared__ __align__(16) u32 zeros[128];  // a row of 256 bf16 zeros, for the padding rows
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  u32* erow = erows[wid];
  for (int i = lane; i < S; i += 32) erow[i] = 0u;
  for (int i = threadIdx.x; i < 128; i += 256) zeros[i] = 0u;
  __syncthreads();
  const int tiles = f / 256;
  const long long tasks = (long long)rows * tiles;
  u64 sum = 0;
  for (long long t = (long long)blockIdx.x * 8 + wid; t < tasks; t += (long long)gridDim.x * 8) {
    const int r = (int)(t / tiles), nt = (int)(t - (long long)r * tiles), row = row0 + r;
    const bool valid = row < m_valid;
    const u32* src = valid ? (const u32*)(g + (size_t)r * f + nt * 256) : zeros;
    bool bad;
    const int n = pack_row_warp<S>(src, erow, packed + (size_t)row * row_words + nt * S, nt * 256, bad);
    if (valid) {
      sum += (u64)n;
      if (lane == 0 && (bad || n > S - 1)) flag_row(flags, ovf, row);
    }
  }
  if (lane == 0 && sum) atomicAdd(nnz, sum);
}
