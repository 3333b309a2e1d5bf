// Example kernels for the cuda package's tests: the embed + NVRTC + launch
// path that GPU launchers in twell follow.
#include <cuda_bf16.h>

// out[i] = bf16(a[i] + b[i]) for i < n.
extern "C" __global__ void add_bf16(__nv_bfloat16* out, const __nv_bfloat16* a,
                                    const __nv_bfloat16* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __float2bfloat16(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

// out[i] = v for i < n, grid-stride.
extern "C" __global__ void fill_u32(unsigned int* out, unsigned int v, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    out[i] = v;
}

// Does nothing: for measuring launch overhead.
extern "C" __global__ void empty() {}

// Each block stages its slice of in through dynamic shared memory (sized by
// the launch, possibly above 48 KiB) and writes it out reversed.
extern "C" __global__ void reverse_blocks(unsigned int* out, const unsigned int* in, int words_per_block) {
  extern __shared__ unsigned int smem[];
  const unsigned int* src = in + (long long)blockIdx.x * words_per_block;
  unsigned int* dst = out + (long long)blockIdx.x * words_per_block;
  for (int i = threadIdx.x; i < words_per_block; i += blockDim.x) smem[i] = src[i];
  __syncthreads();
  for (int i = threadIdx.x; i < words_per_block; i += blockDim.x) dst[i] = smem[words_per_block - 1 - i];
}

// out[block] = rank in cluster | cluster size << 8 | checksum << 16, where
// the checksum is read from the next block's shared memory through
// distributed shared memory (mapa), proving the cluster really shares.
extern "C" __global__ void cluster_info(unsigned int* out) {
  __shared__ unsigned int mine;
  unsigned int rank, size;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
  if (threadIdx.x == 0) mine = 1000 + rank;
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
  unsigned int peer = (rank + 1) % size;
  unsigned int local = (unsigned int)__cvta_generic_to_shared(&mine);
  unsigned int remote, value;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(peer));
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(value) : "r"(remote) : "memory");
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (threadIdx.x == 0) out[blockIdx.x] = rank | (size << 8) | ((value - 1000) << 16);
}

// A CUtensorMap as the kernel sees it: 128 opaque bytes, 64-byte aligned.
struct alignas(64) TensorMap { unsigned long long opaque[16]; };

// Copies one 32x64 bf16 tile per block from a 2D tensor with the TMA engine
// (cp.async.bulk.tensor completing on an mbarrier) into out, tile by tile.
extern "C" __global__ void tma_tiles(const __grid_constant__ TensorMap tm, unsigned short* out, int tiles_x) {
  __shared__ alignas(128) unsigned short tile[32 * 64];
  __shared__ alignas(8) unsigned long long bar;
  unsigned int bar_addr = (unsigned int)__cvta_generic_to_shared(&bar);
  unsigned int tile_addr = (unsigned int)__cvta_generic_to_shared(tile);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar_addr));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar_addr), "r"(32 * 64 * 2) : "memory");
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        :: "r"(tile_addr), "l"((unsigned long long)&tm), "r"((int)blockIdx.x * 64), "r"((int)blockIdx.y * 32), "r"(bar_addr)
        : "memory");
  }
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
      "@!done bra WAIT;\n"
      "}\n" :: "r"(bar_addr) : "memory");
  unsigned short* dst = out + ((long long)blockIdx.y * tiles_x + blockIdx.x) * (32 * 64);
  for (int i = threadIdx.x; i < 32 * 64; i += blockDim.x) dst[i] = tile[i];
}
