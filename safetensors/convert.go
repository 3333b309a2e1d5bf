package safetensors

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/twell-ai/twell/bf16"
)

// The bfloat16 conversions are those of package bf16 (round to nearest even, NaN kept).
var (
	bf16ToF32 = bf16.ToFloat32
	f32ToBF16 = bf16.FromFloat32
)

// f16ToF32 widens an IEEE 754 binary16 exactly, including subnormals, infinities and NaNs.
func f16ToF32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f: // Inf or NaN; the payload moves to the top of the float32 mantissa
		return math.Float32frombits(sign | 0x7f800000 | mant<<13)
	case exp != 0: // normal: rebias 15 -> 127
		return math.Float32frombits(sign | (exp+112)<<23 | mant<<13)
	case mant == 0:
		return math.Float32frombits(sign)
	}
	// Subnormal mant*2^-24: shift the leading one up to the implicit bit position.
	e := uint32(113)
	for mant&0x400 == 0 {
		mant <<= 1
		e--
	}
	return math.Float32frombits(sign | e<<23 | (mant&0x3ff)<<13)
}

// f32ToF16 rounds to the nearest binary16, ties to even; values beyond the range become
// infinities, tiny values become subnormals or signed zeros, NaNs stay (quiet) NaNs.
func f32ToF16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int(b>>23) & 0xff
	mant := b & 0x7fffff
	if exp == 0xff {
		if mant != 0 {
			return sign | 0x7e00 | uint16(mant>>13)
		}
		return sign | 0x7c00
	}
	e := exp - 127 + 15 // binary16 biased exponent
	if e >= 0x1f {
		return sign | 0x7c00
	}
	var m, rem, half uint32
	if e > 0 {
		m, rem, half = mant>>13, mant&0x1fff, 0x1000
		m |= uint32(e) << 10
	} else {
		if e < -10 { // below half the smallest subnormal (also covers float32 subnormals)
			return sign
		}
		full := mant | 0x800000
		shift := uint32(14 - e)
		m, rem, half = full>>shift, full&(1<<shift-1), 1<<(shift-1)
	}
	// A carry out of the mantissa correctly bumps the exponent (up to infinity).
	if rem > half || (rem == half && m&1 == 1) {
		m++
	}
	return sign | uint16(m)
}

// decodeFloat32 converts little-endian elements of a float dtype into dst, which must hold
// exactly len(src)/dtype.Size() values.
func decodeFloat32(dst []float32, dtype DType, src []byte) error {
	switch dtype {
	case BF16:
		for i := range dst {
			dst[i] = bf16ToF32(binary.LittleEndian.Uint16(src[2*i:]))
		}
	case F16:
		for i := range dst {
			dst[i] = f16ToF32(binary.LittleEndian.Uint16(src[2*i:]))
		}
	case F32:
		for i := range dst {
			dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
		}
	case F64:
		for i := range dst {
			dst[i] = float32(math.Float64frombits(binary.LittleEndian.Uint64(src[8*i:])))
		}
	default:
		return fmt.Errorf("cannot convert dtype %s to float32", dtype)
	}
	return nil
}

// encodeFloat32 appends values in the given float dtype (little-endian) to dst.
func encodeFloat32(dst []byte, dtype DType, values []float32) ([]byte, error) {
	switch dtype {
	case BF16:
		for _, v := range values {
			dst = binary.LittleEndian.AppendUint16(dst, f32ToBF16(v))
		}
	case F16:
		for _, v := range values {
			dst = binary.LittleEndian.AppendUint16(dst, f32ToF16(v))
		}
	case F32:
		for _, v := range values {
			dst = binary.LittleEndian.AppendUint32(dst, math.Float32bits(v))
		}
	case F64:
		for _, v := range values {
			dst = binary.LittleEndian.AppendUint64(dst, math.Float64bits(float64(v)))
		}
	default:
		return dst, fmt.Errorf("cannot store float32 values as dtype %s", dtype)
	}
	return dst, nil
}
