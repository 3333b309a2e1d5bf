package cpu

import "golang.org/x/sys/cpu"

//go:generate go run gen_asm.go

//go:noescape
func kernel12x32(k int, a, b, c *float32, ldc int, acc bool)

//go:noescape
func kernel12x32bf16(k int, a *float32, b *uint16, c *float32, ldc int, acc bool)

//go:noescape
func dot64(x, y *float32, n int) float32

//go:noescape
func axpy64(alpha float32, x, y *float32, n int)

//go:noescape
func dot64bf16(x *float32, y *uint16, n int) float32

//go:noescape
func axpy64bf16(alpha float32, x *uint16, y *float32, n int)

//go:noescape
func gemv32(k int, a, b, c *float32)

//go:noescape
func gemv32bf16(k int, a *float32, b *uint16, c *float32)

//go:noescape
func colmax32(s *float32, rows int, m *float32)

//go:noescape
func scalerows32(s *float32, rows int, alpha *float32)

//go:noescape
func exp2tile32(s *float32, rows int, m, sum *float32)

func init() {
	if cpu.X86.HasAVX512F {
		useSIMD(true)
	}
}

// useSIMD switches between the AVX-512 kernels and the portable Go ones.
func useSIMD(on bool) {
	if !on {
		microkernel, microBF16, dotKernel, axpyKernel = kernelGo, kernelBF16Go, dotGo, axpyGo
		dotBF16Kernel, axpyBF16Kernel = dotBF16Go, axpyBF16Go
		gemvKernel, gemvBF16Kernel = gemvGo, gemvBF16Go
		colMaxKernel, scaleRowsKernel, exp2TileKernel = colMaxGo, scaleRowsGo, exp2TileGo
		return
	}
	// The tile kernels check their bounds here: the assembly does not.
	colMaxKernel = func(s []float32, rows int, m []float32) {
		if rows > 0 {
			_, _ = s[rows*32-1], m[31]
			colmax32(&s[0], rows, &m[0])
		}
	}
	scaleRowsKernel = func(s []float32, rows int, alpha []float32) {
		if rows > 0 {
			_, _ = s[rows*32-1], alpha[31]
			scalerows32(&s[0], rows, &alpha[0])
		}
	}
	exp2TileKernel = func(s []float32, rows int, m, sum []float32) {
		if rows > 0 {
			_, _, _ = s[rows*32-1], m[31], sum[31]
			exp2tile32(&s[0], rows, &m[0], &sum[0])
		}
	}
	gemvKernel = func(k int, a, b, c []float32) { gemv32(k, &a[0], &b[0], &c[0]) }
	gemvBF16Kernel = func(k int, a []float32, b []uint16, c []float32) { gemv32bf16(k, &a[0], &b[0], &c[0]) }
	microkernel = func(k int, a, b, c []float32, ldc int, acc bool) {
		kernel12x32(k, &a[0], &b[0], &c[0], ldc, acc)
	}
	microBF16 = func(k int, a []float32, b []uint16, c []float32, ldc int, acc bool) {
		kernel12x32bf16(k, &a[0], &b[0], &c[0], ldc, acc)
	}
	dotKernel = func(x, y []float32) float32 {
		n := len(x) &^ 63
		s := float32(0)
		if n > 0 {
			s = dot64(&x[0], &y[0], n)
		}
		return s + dotGo(x[n:], y[n:len(x)])
	}
	axpyKernel = func(alpha float32, x, y []float32) {
		n := len(x) &^ 63
		if n > 0 {
			axpy64(alpha, &x[0], &y[0], n)
		}
		axpyGo(alpha, x[n:], y[n:len(x)])
	}
	dotBF16Kernel = func(x []float32, y []uint16) float32 {
		n := len(x) &^ 63
		s := float32(0)
		if n > 0 {
			_ = y[n-1]
			s = dot64bf16(&x[0], &y[0], n)
		}
		return s + dotBF16Go(x[n:], y[n:len(x)])
	}
	axpyBF16Kernel = func(alpha float32, x []uint16, y []float32) {
		n := len(x) &^ 63
		if n > 0 {
			_ = y[n-1]
			axpy64bf16(alpha, &x[0], &y[0], n)
		}
		axpyBF16Go(alpha, x[n:], y[n:len(x)])
	}
}

// simdAvailable reports whether this machine runs the AVX-512 kernels.
func simdAvailable() bool { return cpu.X86.HasAVX512F }
