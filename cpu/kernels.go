package cpu

import (
	"math"

	"github.com/twell-ai/twell/bf16"
)

// Register-blocking of the GEMM micro-kernel: it computes an mr x nr block
// of C from an A panel packed [k][mr] and a B panel packed [k][nr].
const (
	mr = 12
	nr = 32
)

// The kernels in use; the AVX-512 versions replace these at init where the
// CPU has them.
var (
	microkernel     = kernelGo
	microBF16       = kernelBF16Go
	dotKernel       = dotGo
	axpyKernel      = axpyGo
	dotBF16Kernel   = dotBF16Go
	axpyBF16Kernel  = axpyBF16Go
	gemvKernel      = gemvGo
	gemvBF16Kernel  = gemvBF16Go
	colMaxKernel    = colMaxGo
	scaleRowsKernel = scaleRowsGo
	exp2TileKernel  = exp2TileGo
)

// gemvGo sets c[0:nr] = sum_p a[p] * b[p*nr : p*nr+nr].
func gemvGo(k int, a, b, c []float32) {
	var t [nr]float32
	for p := 0; p < k; p++ {
		axpyGo(a[p], b[p*nr:p*nr+nr], t[:])
	}
	copy(c[:nr], t[:])
}

// gemvBF16Go is gemvGo with b in bfloat16.
func gemvBF16Go(k int, a []float32, b []uint16, c []float32) {
	var t, row [nr]float32
	for p := 0; p < k; p++ {
		widenBF16(row[:], b[p*nr:p*nr+nr])
		axpyGo(a[p], row[:], t[:])
	}
	copy(c[:nr], t[:])
}

// widenBF16 sets dst[i] to the float32 value of the bfloat16 src[i].
func widenBF16(dst []float32, src []uint16) {
	for i, v := range src {
		dst[i] = math.Float32frombits(uint32(v) << 16)
	}
}

// kernelGo is the portable micro-kernel: c[i*ldc+j] (+)= sum_p a[p*mr+i]*b[p*nr+j].
func kernelGo(k int, a, b, c []float32, ldc int, acc bool) {
	var t [mr * nr]float32
	for p := 0; p < k; p++ {
		outerProduct(&t, a[p*mr:p*mr+mr], b[p*nr:p*nr+nr])
	}
	storeTile(&t, c, ldc, acc)
}

// kernelBF16Go is kernelGo with b in bfloat16.
func kernelBF16Go(k int, a []float32, b []uint16, c []float32, ldc int, acc bool) {
	var t [mr * nr]float32
	var row [nr]float32
	for p := 0; p < k; p++ {
		widenBF16(row[:], b[p*nr:p*nr+nr])
		outerProduct(&t, a[p*mr:p*mr+mr], row[:])
	}
	storeTile(&t, c, ldc, acc)
}

// outerProduct adds the outer product of ap (mr values) and bp (nr) to t.
func outerProduct(t *[mr * nr]float32, ap, bp []float32) {
	for i, av := range ap {
		row := t[i*nr : i*nr+nr]
		for j, bv := range bp {
			row[j] += av * bv
		}
	}
}

// storeTile writes (acc: adds) the micro-kernel's block t to c.
func storeTile(t *[mr * nr]float32, c []float32, ldc int, acc bool) {
	for i := 0; i < mr; i++ {
		out := c[i*ldc : i*ldc+nr]
		if acc {
			for j := range out {
				out[j] += t[i*nr+j]
			}
		} else {
			copy(out, t[i*nr:i*nr+nr])
		}
	}
}

// dotGo returns the dot product of x and y[:len(x)].
func dotGo(x, y []float32) float32 {
	y = y[:len(x)]
	var s0, s1, s2, s3 float32
	i := 0
	for ; i+4 <= len(x); i += 4 {
		s0 += x[i] * y[i]
		s1 += x[i+1] * y[i+1]
		s2 += x[i+2] * y[i+2]
		s3 += x[i+3] * y[i+3]
	}
	for ; i < len(x); i++ {
		s0 += x[i] * y[i]
	}
	return (s0 + s1) + (s2 + s3)
}

// dotBF16Go is dotGo with y in bfloat16: the same sums in the same order,
// so the same bits where y's values are those of a float32 y.
func dotBF16Go(x []float32, y []uint16) float32 {
	y = y[:len(x)]
	var s0, s1, s2, s3 float32
	i := 0
	for ; i+4 <= len(x); i += 4 {
		s0 += x[i] * bf16.ToFloat32(y[i])
		s1 += x[i+1] * bf16.ToFloat32(y[i+1])
		s2 += x[i+2] * bf16.ToFloat32(y[i+2])
		s3 += x[i+3] * bf16.ToFloat32(y[i+3])
	}
	for ; i < len(x); i++ {
		s0 += x[i] * bf16.ToFloat32(y[i])
	}
	return (s0 + s1) + (s2 + s3)
}

// axpyBF16Go is axpyGo with x in bfloat16.
func axpyBF16Go(alpha float32, x []uint16, y []float32) {
	y = y[:len(x)]
	for i, v := range x {
		y[i] += alpha * bf16.ToFloat32(v)
	}
}

// axpyGo adds alpha*x to y[:len(x)].
func axpyGo(alpha float32, x, y []float32) {
	y = y[:len(x)]
	for i, v := range x {
		y[i] += alpha * v
	}
}

// Dot returns the dot product of x and y (len(y) >= len(x)), SIMD where the
// machine has it.
func Dot(x, y []float32) float32 { return dotKernel(x, y) }

// Axpy adds alpha*x to y (len(y) >= len(x)), SIMD where the machine has it.
func Axpy(alpha float32, x, y []float32) { axpyKernel(alpha, x, y) }

// The attention tile kernels work on rows of 32 floats, one query per
// column (see attention.go).

// colMaxGo sets m[j] = max(m[j], s[r][j]) over the rows of s.
func colMaxGo(s []float32, rows int, m []float32) {
	for r := 0; r < rows; r++ {
		for j, v := range s[r*32 : r*32+32] {
			if v > m[j] || v != v {
				m[j] = v
			}
		}
	}
}

// scaleRowsGo multiplies column j of s by alpha[j].
func scaleRowsGo(s []float32, rows int, alpha []float32) {
	for r := 0; r < rows; r++ {
		row := s[r*32 : r*32+32]
		for j := range row {
			row[j] *= alpha[j]
		}
	}
}

// exp2TileGo sets s[r][j] = 2^(s[r][j] - m[j]) and adds the new values of
// column j to sum[j].
func exp2TileGo(s []float32, rows int, m, sum []float32) {
	for r := 0; r < rows; r++ {
		row := s[r*32 : r*32+32]
		for j := range row {
			row[j] = exp2Go(row[j] - m[j])
			sum[j] += row[j]
		}
	}
}

// exp2Go returns 2^x for x <= 0 the way exp2tile32 computes it: x clamped
// at -150, where the result rounds to exactly 0 (so masked scores, -inf,
// weigh nothing), 2^x = 2^f * 2^n with n = round(x) and 2^f from its degree-6
// Taylor polynomial (relative error under 2e-7).
func exp2Go(x float32) float32 {
	if x != x {
		return x
	}
	x = max(x, -150)
	n := float32(math.RoundToEven(float64(x)))
	f := x - n
	p := float32(1.540353039338e-4)
	for _, c := range [...]float32{1.333355814643e-3, 9.618129107628e-3, 5.550410866482e-2, 2.402265069591e-1, 6.931471805599e-1, 1} {
		p = p*f + c
	}
	if n < -126 { // a subnormal result, rounded once as VSCALEFPS does
		return float32(float64(p) * math.Ldexp(1, int(n)))
	}
	return p * math.Float32frombits(uint32(int32(n)+127)<<23)
}
