// act.cu: the elementwise step of the dense MLP of layers that do not run
// on package gpu's TwELL MLP (package gpu/llm).
#include "common.cuh"

// The dense MLP's elementwise step, for layers that do not run on package
// gpu's TwELL MLP (SiLU gates, or shapes its kernels do not take).
// act 0: relu, 1: silu. gated: h = act(g) * u (h may alias g); else
// g = act(g) in place (u unused).

__device__ __forceinline__ float act_f(float x, int act) {
  if (act == 0) return fmaxf(x, 0.f);
  return x / (1.f + __expf(-x));
}

extern "C" __global__ void act_mul(u16* __restrict__ g, const u16* __restrict__ u, long long n, int act, int gated) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    float v = act_f(bf_to_f(g[i]), act);
    if (gated) v *= bf_to_f(u[i]);
    g[i] = (u16)f_to_bf(v);
  }
}
