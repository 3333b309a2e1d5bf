package gpu

import (
	_ "embed"
	"errors"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
)

// denseSrc holds the dense path's elementwise kernels and those of the
// gathered dense pass over flagged rows.
//
//go:embed dense.cu
var denseSrc []byte

// DefaultDenseAbove returns the density (active units per token / f) above
// which the dense MLP is expected to beat the sparse one on an
// H100/H200-class GPU: the sparse path costs one GEMM (D2T) plus a per-unit
// cost bound by reading each active unit's weight rows from L2; the dense
// path costs every GEMM plus the elementwise pass. The rates are those
// measured on an H200 (see docs/gpu-twell.md).
func DefaultDenseAbove(d, f int, gated bool) float64 {
	const (
		gemmRate = 680e12 // FLOP/s, bf16 GEMM through cuBLASLt (H200, run 2)
		hbm      = 3.5e12 // B/s, the elementwise pass
		l2       = 6.2e12 // B/s, weight rows gathered from L2 in T2D (H200, run 2)
	)
	gemm := 2 * float64(d) * float64(f) / gemmRate
	dense, rows := 2*gemm+3*2*float64(f)/hbm, 1.0
	if gated {
		dense, rows = 3*gemm+3*2*float64(f)/hbm, 2
	}
	sparse := 1.15 * gemm // D2T: the GEMM plus its packing epilogue
	pair := rows * 2 * float64(d) / l2
	return max(0, (dense-sparse)/pair) / float64(f)
}

// Dense queues the dense MLP on stream s: cuBLASLt GEMMs (bf16 in and out,
// fp32 accumulate) for the gate, up and down projections and one
// elementwise kernel for relu(g) * u, which also counts the active units.
func (l *MLP) Dense(s *cuda.Stream, y, x *cuda.Buffer, m int) error {
	if err := l.checkIO(y, x, m); err != nil {
		return err
	}
	if l.blas == nil {
		return errors.New("gpu: dense MLP needs a cuBLAS handle (NewMLP was given nil)")
	}
	ws, err := l.denseWorkspace(m)
	if err != nil {
		return err
	}
	reluMul, reluInplace, err := l.k.dense()
	if err != nil {
		return err
	}
	proj := cublas.Gemm{M: m, N: l.F, K: l.D, TransB: true}
	n := int64(m) * int64(l.F)
	grid := elemGrid(n, l.dev.Properties().SMs)
	if l.Gated {
		if err := l.blas.Matmul(s, proj, x, l.gate, ws.g); err != nil {
			return err
		}
		if err := l.blas.Matmul(s, proj, x, l.up, ws.u); err != nil {
			return err
		}
		if err := reluMul.Launch(grid, cuda.Dim3{256, 1, 1}, 0, s, ws.g, ws.u, ws.g, n, l.nnz); err != nil {
			return err
		}
	} else {
		if err := l.blas.Matmul(s, proj, x, l.up, ws.g); err != nil {
			return err
		}
		if err := reluInplace.Launch(grid, cuda.Dim3{256, 1, 1}, 0, s, ws.g, n, l.nnz); err != nil {
			return err
		}
	}
	l.counted += m // the count accumulates until the next D2T zeroes it
	return l.blas.Matmul(s, cublas.Gemm{M: m, N: l.D, K: l.F}, ws.g, l.down, y)
}

// compileDense compiles dense.cu once: the dense MLP's elementwise kernels
// and those of the gathered dense pass over flagged rows.
func (k *kernels) compileDense() error {
	k.denseOnce.Do(func() {
		exprs := []string{"relu_mul", "relu_inplace", "gather_rows", "scatter_rows", "act_exact<true>", "act_exact<false>"}
		fs, err := k.compile("dense.cu", denseSrc, exprs)
		if err != nil {
			k.denseErr = err
			return
		}
		k.reluMul, k.reluInplace = fs[exprs[0]], fs[exprs[1]]
		k.gath = gatheredSet{gather: fs[exprs[2]], scatter: fs[exprs[3]], actGated: fs[exprs[4]], actPlain: fs[exprs[5]]}
	})
	return k.denseErr
}

// dense returns the elementwise kernels of the dense MLP.
func (k *kernels) dense() (reluMul, reluInplace *cuda.Function, err error) {
	err = k.compileDense()
	return k.reluMul, k.reluInplace, err
}
