package train

import (
	"math"

	"github.com/twell-ai/twell/cpu"
)

// Float is the element type of the training math: float32 for training,
// float64 for gradient checks.
type Float interface{ float32 | float64 }

// mmNT sets c (m x n) = a (m x k) b^T (b is n x k). The float32 products
// pack b with pk (nil: a fresh buffer); so do mmNN and mmTNAcc.
func mmNT[T Float](c, a, b []T, m, n, k int, pk *cpu.Packer) {
	if c32, ok := any(c).([]float32); ok && m > 0 {
		pb, err := pk.PackB(any(b).([]float32), n, k)
		if err != nil {
			panic(err) // shapes are internal invariants here
		}
		if err := cpu.Gemm(c32, any(a).([]float32), m, pb); err != nil {
			panic(err)
		}
		return
	}
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			var s T
			for q := 0; q < k; q++ {
				s += a[i*k+q] * b[j*k+q]
			}
			c[i*n+j] = s
		}
	}
}

// mmNN sets c (m x n) = a (m x k) b (b is k x n).
func mmNN[T Float](c, a, b []T, m, n, k int, pk *cpu.Packer) {
	if c32, ok := any(c).([]float32); ok && m > 0 {
		pb, err := pk.PackBT(any(b).([]float32), k, n)
		if err != nil {
			panic(err)
		}
		if err := cpu.Gemm(c32, any(a).([]float32), m, pb); err != nil {
			panic(err)
		}
		return
	}
	for i := 0; i < m; i++ {
		row := c[i*n : (i+1)*n]
		clear(row)
		for q := 0; q < k; q++ {
			av := a[i*k+q]
			if av == 0 {
				continue
			}
			for j, bv := range b[q*n : (q+1)*n] {
				row[j] += av * bv
			}
		}
	}
}

// mmTNAcc adds a^T b to c: a is k x m, b is k x n, c is m x n. It is the
// weight-gradient product dW += dY^T X.
func mmTNAcc[T Float](c, a, b []T, m, n, k int, pk *cpu.Packer) {
	if k == 0 {
		return
	}
	if c32, ok := any(c).([]float32); ok {
		pb, err := pk.PackBT(any(b).([]float32), k, n)
		if err != nil {
			panic(err)
		}
		if err := cpu.GemmTA(c32, any(a).([]float32), m, pb, true); err != nil {
			panic(err)
		}
		return
	}
	at := make([]T, m*k)
	Transpose(at, a, k, m)
	tmp := make([]T, m*n)
	mmNN(tmp, at, b, m, n, k, nil)
	for i, v := range tmp {
		c[i] += v
	}
}

// Transpose writes the transpose of src (rows x cols) into dst (cols x rows).
func Transpose[T Float](dst, src []T, rows, cols int) {
	const blk = 32
	for i0 := 0; i0 < rows; i0 += blk {
		for j0 := 0; j0 < cols; j0 += blk {
			for i := i0; i < min(i0+blk, rows); i++ {
				for j := j0; j < min(j0+blk, cols); j++ {
					dst[j*rows+i] = src[i*cols+j]
				}
			}
		}
	}
}

// vecOps are the vector kernels of the attention loops: the AVX-512 ones of
// package cpu for float32, plain loops for float64 (gradient checks).
type vecOps[T Float] struct {
	dot  func(x, y []T) T
	axpy func(alpha T, x, y []T) // y += alpha x
}

func vectorOps[T Float]() vecOps[T] {
	if dot, ok := any(cpu.Dot).(func(x, y []T) T); ok {
		return vecOps[T]{dot: dot, axpy: any(cpu.Axpy).(func(alpha T, x, y []T))}
	}
	return vecOps[T]{
		dot: func(x, y []T) T {
			var s T
			for i, v := range x {
				s += v * y[i]
			}
			return s
		},
		axpy: func(alpha T, x, y []T) {
			for i, v := range x {
				y[i] += alpha * v
			}
		},
	}
}

func sqrt[T Float](v T) T { return T(math.Sqrt(float64(v))) }
func exp[T Float](v T) T  { return T(math.Exp(float64(v))) }

func logf(v float64) float64 { return math.Log(v) }
