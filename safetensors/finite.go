package safetensors

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strings"
)

// ErrNonFinite marks a tensor that holds a NaN or an infinity; errors.Is
// finds it in the *NonFiniteError that [Tensor.CheckFinite] returns.
var ErrNonFinite = errors.New("NaN or infinite value")

// NonFiniteError reports the first NaN or infinite element of a tensor.
// Its text reads
//
//	safetensors: tensor "NAME": element 1234 [3 210] is NaN (bits 0x7fc0); 57 of 4096 elements are NaN or ±Inf
type NonFiniteError struct {
	Tensor string  // the tensor's name
	DType  DType   // its element type
	Index  int     // flat (row-major) index of the first bad element
	Coords []int   // the same index in the tensor's shape
	Value  float64 // that element: NaN, +Inf or -Inf (for F64, also a finite value beyond float32's range)
	Bits   uint64  // its raw bits, as stored
	Count  int     // how many elements are bad in all
	Total  int     // how many elements the tensor has
}

// Error names the tensor, the first bad element and how many there are.
func (e *NonFiniteError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "safetensors: tensor %q: element %d %v is ", e.Tensor, e.Index, e.Coords)
	switch {
	case math.IsNaN(e.Value), math.IsInf(e.Value, 0):
		fmt.Fprintf(&b, "%v", e.Value)
	default:
		fmt.Fprintf(&b, "%g, beyond float32's range", e.Value)
	}
	fmt.Fprintf(&b, " (%s bits %#0*x); %d of %d elements are NaN or ±Inf", e.DType, 2*e.DType.Size(), e.Bits, e.Count, e.Total)
	return b.String()
}

// Is reports whether target is ErrNonFinite.
func (e *NonFiniteError) Is(target error) bool { return target == ErrNonFinite }

// CheckFinite returns nil when every element of t is a finite number, and
// otherwise a *NonFiniteError naming the tensor and its first NaN or
// infinite element (errors.Is(err, ErrNonFinite) holds). Integer, bool and
// 8-bit float tensors are checked too (integers are always finite). For F64,
// a finite value too large for float32 counts as infinite, since
// [Tensor.Float32] would turn it into one.
//
// It reads the raw bytes without converting them, eight bytes at a time,
// so it costs a fraction of [Tensor.Float32Into] (see BenchmarkCheckFinite):
// a loader can call it on each tensor before converting it, to refuse a
// checkpoint whose weights hold NaN or Inf by the tensor's name. It returns
// the same size error as Float32Into when Data does not hold the shape.
func (t Tensor) CheckFinite() error {
	size := t.DType.Size()
	if size == 0 || len(t.Data) != t.NumElements()*size {
		return fmt.Errorf("safetensors: tensor %q: %d bytes do not hold shape %v of %s", t.Name, len(t.Data), t.Shape, t.DType)
	}
	// SWAR masks: an element is NaN or infinite when all its exponent bits
	// (mask m) are set; adding a, the lowest exponent bit, to the masked
	// lane then carries into the lane's top bit h, and no lane carries into
	// the next. Each mask covers the eight bytes of one word.
	var m, a, h uint64
	var bad func(i int) bool // whether element i is NaN or infinite
	switch t.DType {
	case BF16:
		m, a, h = 0x7f807f807f807f80, 0x0080008000800080, 0x8000800080008000
		bad = func(i int) bool { return binary.LittleEndian.Uint16(t.Data[2*i:])&0x7f80 == 0x7f80 }
	case F16:
		m, a, h = 0x7c007c007c007c00, 0x0400040004000400, 0x8000800080008000
		bad = func(i int) bool { return binary.LittleEndian.Uint16(t.Data[2*i:])&0x7c00 == 0x7c00 }
	case F32:
		m, a, h = 0x7f8000007f800000, 0x0080000000800000, 0x8000000080000000
		bad = func(i int) bool { return binary.LittleEndian.Uint32(t.Data[4*i:])&0x7f800000 == 0x7f800000 }
	case F64:
		bad = func(i int) bool {
			v := math.Float64frombits(binary.LittleEndian.Uint64(t.Data[8*i:]))
			return !(math.Abs(float64(float32(v))) <= math.MaxFloat32)
		}
	case F8E5M2: // IEEE-like: exponent 0x7c all set is Inf or NaN
		m, a, h = 0x7c7c7c7c7c7c7c7c, 0x0404040404040404, 0x8080808080808080
		bad = func(i int) bool { return t.Data[i]&0x7c == 0x7c }
	case F8E4M3: // the "fn" variant: no infinities, NaN is S.1111.111
		m, a, h = 0x7f7f7f7f7f7f7f7f, 0x0101010101010101, 0x8080808080808080
		bad = func(i int) bool { return t.Data[i]&0x7f == 0x7f }
	default: // integers and bool
		return nil
	}
	n := t.NumElements()
	first := 0 // elements before first are known good
	if m != 0 {
		first = scanWords(t.Data, m, a, h) / size
	}
	for i := first; i < n; i++ {
		if bad(i) {
			return t.nonFinite(i, bad)
		}
	}
	return nil
}

// scanWords returns the offset of the first 8-byte word of data that holds
// a lane x with (x&m + a)&h != 0, or the offset of the bytes after the last
// whole word when none does.
func scanWords(data []byte, m, a, h uint64) int {
	off := 0
	for ; off+32 <= len(data); off += 32 {
		d := data[off : off+32]
		x0 := binary.LittleEndian.Uint64(d[0:]) & m
		x1 := binary.LittleEndian.Uint64(d[8:]) & m
		x2 := binary.LittleEndian.Uint64(d[16:]) & m
		x3 := binary.LittleEndian.Uint64(d[24:]) & m
		if ((x0+a)|(x1+a)|(x2+a)|(x3+a))&h != 0 {
			break
		}
	}
	for ; off+8 <= len(data); off += 8 {
		if (binary.LittleEndian.Uint64(data[off:])&m+a)&h != 0 {
			break
		}
	}
	return off
}

// nonFinite builds the error for the first bad element i.
func (t Tensor) nonFinite(i int, bad func(int) bool) error {
	size := t.DType.Size()
	var bits uint64
	for k := size - 1; k >= 0; k-- {
		bits = bits<<8 | uint64(t.Data[i*size+k])
	}
	e := &NonFiniteError{Tensor: t.Name, DType: t.DType, Index: i, Bits: bits, Total: t.NumElements()}
	switch t.DType {
	case BF16:
		e.Value = float64(bf16ToF32(uint16(bits)))
	case F16:
		e.Value = float64(f16ToF32(uint16(bits)))
	case F32:
		e.Value = float64(math.Float32frombits(uint32(bits)))
	case F64:
		e.Value = math.Float64frombits(bits)
	case F8E5M2:
		e.Value = float64(f16ToF32(uint16(bits) << 8)) // E5M2 is the top byte of a binary16
	default:
		e.Value = math.NaN()
	}
	e.Coords = make([]int, len(t.Shape))
	for k, rest := len(t.Shape)-1, i; k >= 0; k-- {
		if d := t.Shape[k]; d > 0 {
			e.Coords[k] = rest % d
			rest /= d
		}
	}
	for j := i; j < e.Total; j++ {
		if bad(j) {
			e.Count++
		}
	}
	return e
}
