// d2t_mma.cu: D2T with mma.sync tensor cores (any sm_80+ GPU): the simple,
// correct version. C = relu(x W^T) for x [m_pad, K] and W [N, K] (both bf16,
// K contiguous), written only as TwELL. One CTA computes a 128 x 256 tile
// with 8 warps; warp w owns rows 16w..16w+15 and all 256 columns, so its
// accumulators have the same layout as a wgmma m64n256 warp slice and the
// packing epilogue is shared with the wgmma kernel.
#include "common.cuh"

#define MMA_BK 32
#define MMA_LD 40  // smem row stride in bf16 elements (80 bytes: no ldmatrix bank conflicts)
#define MMA_STAGES 3

template <int S>
__global__ void __launch_bounds__(256, 1)
    d2t_mma(const u16* __restrict__ x, const u16* __restrict__ w, u32* __restrict__ packed, int* __restrict__ flags,
            int* __restrict__ ovf, u64* __restrict__ nnz, int m_tiles, int n_tiles, int K, int row_words, int m_valid) {
  extern __shared__ __align__(128) unsigned char smem[];
  u16* As = (u16*)smem;                                  // [STAGES][128][LD]
  u16* Bs = As + MMA_STAGES * 128 * MMA_LD;              // [STAGES][256][LD]
  u32* stage = (u32*)(Bs + MMA_STAGES * 256 * MMA_LD);   // [128][S]

  // Tile order: groups of 8 M tiles sweep all N tiles, so that concurrently
  // running CTAs share x rows and weight tiles in L2.
  const int G = 8;
  int t = blockIdx.x;
  int group = t / (G * n_tiles);
  int gm = min(G, m_tiles - group * G);
  int within = t - group * G * n_tiles;
  int mt = group * G + within % gm, nt = within / gm;
  int m0 = mt * 128, n0 = nt * 256;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < 128 * S; i += 256) stage[i] = 0;

  const int k_iters = K / MMA_BK;
  auto load_stage = [&](int s, int k) {
    int k0 = k * MMA_BK;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      int idx = tid + c * 256;  // 512 chunks of 16 B for A
      int r = idx >> 2, cc = idx & 3;
      bool ok = m0 + r < m_valid;
      cp_async16(smem_addr(As + (s * 128 + r) * MMA_LD + cc * 8), x + (size_t)(ok ? m0 + r : 0) * K + k0 + cc * 8, ok);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      int idx = tid + c * 256;  // 1024 chunks for B
      int r = idx >> 2, cc = idx & 3;
      cp_async16(smem_addr(Bs + (s * 256 + r) * MMA_LD + cc * 8), w + (size_t)(n0 + r) * K + k0 + cc * 8, true);
    }
  };

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;

#pragma unroll
  for (int s = 0; s < MMA_STAGES - 1; ++s) {
    if (s < k_iters) load_stage(s, s);
    cp_async_commit();
  }
  for (int k = 0; k < k_iters; ++k) {
    cp_async_wait<MMA_STAGES - 2>();
    __syncthreads();
    int nk = k + MMA_STAGES - 1;
    if (nk < k_iters) load_stage(nk % MMA_STAGES, nk);
    cp_async_commit();
    int s = k % MMA_STAGES;
#pragma unroll
    for (int kk = 0; kk < MMA_BK; kk += 16) {
      u32 a0, a1, a2, a3;
      {
        const u16* p = As + (s * 128 + warp * 16 + (lane & 15)) * MMA_LD + kk + (lane >> 4) * 8;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3)
                     : "r"(smem_addr(p)));
      }
#pragma unroll
      for (int p2 = 0; p2 < 16; ++p2) {
        u32 b0, b1, b2, b3;
        const u16* p = Bs + (s * 256 + p2 * 16 + (lane & 7) + ((lane >> 4) << 3)) * MMA_LD + kk + ((lane >> 3) & 1) * 8;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                     : "r"(smem_addr(p)));
        float* c0 = &acc[(2 * p2) * 4];
        float* c1 = &acc[(2 * p2 + 1) * 4];
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c0[0]), "+f"(c0[1]), "+f"(c0[2]), "+f"(c0[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c1[0]), "+f"(c1[1]), "+f"(c1[2]), "+f"(c1[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b2), "r"(b3));
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  u32 hb[64];
  u64 mask[2];
  acc_to_bf(acc, hb, mask);
  int tot = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int r = warp * 16 + (lane >> 2) + 8 * h;
    int row = m0 + r;
    auto bits = [&](int i, int e) { return (hb[32 * h + i] >> (16 * e)) & 0xffffu; };
    int n = pack_row_epilogue<S>(mask[h], bits, stage + r * S, n0, row, row < m_valid, flags, ovf);
    tot += ((lane & 3) == 0 && row < m_valid) ? n : 0;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
  if (lane == 0 && tot) atomicAdd(nnz, (u64)tot);
  __syncthreads();
  // Copy the staged 128 x S words out, 16 bytes per thread per step.
  const int v4 = S / 4;
  for (int i = tid; i < 128 * v4; i += 256) {
    int r = i / v4, c = i - r * v4;
    uint4 val = ((const uint4*)(stage + r * S))[c];
    *(uint4*)(packed + (size_t)(m0 + r) * row_words + nt * S + c * 4) = val;
  }
}
