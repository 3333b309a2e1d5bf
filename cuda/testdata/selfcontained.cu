// A kernel with no includes, so that any NVRTC (even without the CUDA
// include folder) can compile it: bf16 held as raw 16-bit words.
extern "C" __global__ void scale_bf16(unsigned short* x, float s, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float f = __uint_as_float(((unsigned int)x[i]) << 16) * s;
  unsigned int u = __float_as_uint(f);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  x[i] = (unsigned short)(u >> 16);
}

template <int N>
__global__ void add_const(int* x) { x[threadIdx.x] += N; }
