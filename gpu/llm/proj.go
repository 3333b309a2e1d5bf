package llm

import (
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/gpu"
)

// gemvMaxRows is the largest token count whose projections run gemv_rows
// rather than cuBLASLt.
const gemvMaxRows = 4

// gemv reports whether the projections of a pass of m tokens with inputs
// of width k run the engine's own kernels (gemv_rows, qkv_rope).
func (e *Engine) gemv(m, k int) bool { return m <= gemvMaxRows && k%8 == 0 && !e.NoGEMV }

// gemvKernel returns, of a gemv_rows or qkv_rope pair, the kernel for a
// pass of m tokens that gemv takes: one for m = 1, four for 2 to 4.
func gemvKernel(one, four *cuda.Function, m int) *cuda.Function {
	if m == 1 {
		return one
	}
	return four
}

// project queues y = x w^T for m tokens (x: m x k, w: n x k, y: m x n, bf16):
// gemv_rows for decode-sized batches, else cuBLASLt.
func (e *Engine) project(m, n, k int, x, w, y *cuda.Buffer) error {
	if !e.gemv(m, k) {
		return e.blas.Matmul(e.stream, cublas.Gemm{M: m, N: n, K: k, TransB: true}, x, w, y)
	}
	fn := gemvKernel(e.k.gemv1, e.k.gemv4, m)
	return gemvRows(fn, e.stream, e.early(), x, w, y, m, n, k)
}

// gemvRows queues gemv_rows1 or 4 (proj.cu): y = x w^T for m
// tokens (x m x k, w n x k, y m x n, bf16), one warp per output column, x
// staged in shared memory; with early start if early.
func gemvRows(fn *cuda.Function, s *cuda.Stream, early bool, x, w, y *cuda.Buffer, m, n, k int) error {
	return fn.LaunchEx(cuda.LaunchConfig{Grid: cuda.Dim3{uint32((n + 7) / 8), 1, 1}, Block: cuda.Dim3{256, 1, 1}, SharedBytes: 2 * m * k,
		Stream: s, EarlyStart: early}, x, w, y, int32(m), int32(n), int32(k))
}

// early reports whether the engine launches the kernels that wait with
// grid_wait with early start.
func (e *Engine) early() bool { return gpu.EarlyStart(e.dev, e.Serial) }
