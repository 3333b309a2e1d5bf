// Package gpu runs twell's sparse MLP on NVIDIA GPUs: TwELL kernels written
// in CUDA C++ (the .cu files beside this one, compiled by NVRTC at first use)
// and the cuBLASLt dense baseline they are measured against.
//
// The MLP block, gated or not:
//
//	gated:     y = (relu(x Wg^T) * (x Wu^T)) Wd^T
//	non-gated: y = relu(x Wu^T) Wd^T
//
// The sparse path is two kernels sharing one packed buffer:
//
//   - D2T: the gate GEMM (bf16 in, fp32 accumulate) whose epilogue applies
//     ReLU and packs each row's 256-column tiles into TwELL, with slots in
//     column order (deterministic), true counts, and every row whose tile
//     overflows (more than S-1 entries) or holds NaN/Inf flagged. On Hopper
//     (sm_90a) it is a persistent TMA + wgmma kernel with 2-CTA clusters
//     whose packing runs in separate warps, overlapped with the next tile;
//     elsewhere a simpler mma.sync kernel.
//   - the tail: for each token, the up projection on the active units only,
//     the gating product, and the down projection (gated), or the down
//     projection alone (non-gated); either one warp per token, or (large
//     batches) a per-token up projection followed by a weight-stationary
//     down projection from shared memory. Flagged rows are recomputed
//     densely: a gathered cuBLASLt pass, then an exact per-row kernel.
//
// MLP.Forward runs MLP.Path: under mlp.Auto it picks the sparse or the dense
// path for each call from the measured density (mlp.Choose with
// MLP.DenseAbove) and, below it, from timings of both paths per batch size,
// so the block is not slower than dense for long; MLP.Settled says when
// that choice is made and MLP.Queue runs a fixed path without bookkeeping,
// for recording into CUDA graphs. Layers may share one activation
// workspace (MLP.ShareWorkspace). Weights are stored once, bf16, in the
// layout the kernels want: Wg and Wu as [f, d] (nn.Linear layout) and
// D = Wd^T as [f, d].
package gpu
