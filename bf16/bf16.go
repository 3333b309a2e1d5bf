// Package bf16 converts between float32 and bfloat16, the 16-bit float format
// (1 sign, 8 exponent, 7 mantissa bits) that twell uses for weights and
// packed activations.
//
// A bfloat16 is held as its bit pattern in a uint16: the upper half of the
// float32 with the same value. Conversion from float32 rounds to nearest, ties
// to even; infinities are kept and NaNs stay NaN (quiet, sign kept).
package bf16

import "math"

// FromFloat32 returns the bfloat16 bits nearest to f (ties to even).
func FromFloat32(f float32) uint16 {
	u := math.Float32bits(f)
	if u&0x7fffffff > 0x7f800000 { // NaN: keep sign and top payload bits, force quiet
		return uint16(u>>16) | 0x0040
	}
	// Round to nearest even: add 0x7fff plus the lowest kept bit. Overflow of
	// the largest finite values rounds up to infinity, as IEEE requires.
	u += 0x7fff + (u>>16)&1
	return uint16(u >> 16)
}

// ToFloat32 returns the float32 value of the bfloat16 bits b (exact).
func ToFloat32(b uint16) float32 {
	return math.Float32frombits(uint32(b) << 16)
}

// Round returns f rounded to the nearest bfloat16 value, as a float32.
func Round(f float32) float32 { return ToFloat32(FromFloat32(f)) }

// FromFloat32s converts src into dst, which must be at least as long as src.
func FromFloat32s(dst []uint16, src []float32) {
	dst = dst[:len(src)]
	for i, f := range src {
		u := math.Float32bits(f)
		if u&0x7fffffff > 0x7f800000 {
			dst[i] = uint16(u>>16) | 0x0040
			continue
		}
		u += 0x7fff + (u>>16)&1
		dst[i] = uint16(u >> 16)
	}
}

// ToFloat32s converts src into dst, which must be at least as long as src.
func ToFloat32s(dst []float32, src []uint16) {
	dst = dst[:len(src)]
	for i, b := range src {
		dst[i] = math.Float32frombits(uint32(b) << 16)
	}
}

// Exact reports whether every value of src is a bfloat16 value (its low 16
// bits are zero), so that Truncate keeps each one, bit for bit. Weights
// loaded from a bfloat16 checkpoint are.
func Exact(src []float32) bool {
	for _, f := range src {
		if math.Float32bits(f)&0xffff != 0 {
			return false
		}
	}
	return true
}

// Truncate sets dst[i] to the upper half of src[i]'s bits: exact for the
// values Exact accepts, rounding toward zero for others. dst must be at
// least as long as src.
func Truncate(dst []uint16, src []float32) {
	dst = dst[:len(src)]
	for i, f := range src {
		dst[i] = uint16(math.Float32bits(f) >> 16)
	}
}
