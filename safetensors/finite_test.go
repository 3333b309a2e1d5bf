package safetensors

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// badRef reports, by converting, whether element i of t is NaN or infinite
// (or, for F64, beyond float32's range).
func badRef(t Tensor, i int) bool {
	isBad := func(v float64) bool { return math.IsNaN(v) || math.IsInf(v, 0) }
	switch t.DType {
	case BF16:
		return isBad(float64(bf16ToF32(binary.LittleEndian.Uint16(t.Data[2*i:]))))
	case F16:
		return isBad(float64(f16ToF32(binary.LittleEndian.Uint16(t.Data[2*i:]))))
	case F32:
		return isBad(float64(math.Float32frombits(binary.LittleEndian.Uint32(t.Data[4*i:]))))
	case F64:
		return isBad(float64(float32(math.Float64frombits(binary.LittleEndian.Uint64(t.Data[8*i:])))))
	case F8E5M2:
		return isBad(float64(f16ToF32(uint16(t.Data[i]) << 8)))
	case F8E4M3:
		return t.Data[i]&0x7f == 0x7f
	}
	return false
}

// checkAgainstRef compares CheckFinite with an element-by-element scan.
func checkAgainstRef(t *testing.T, tn Tensor, context string) {
	t.Helper()
	first, count := -1, 0
	for i := 0; i < tn.NumElements(); i++ {
		if badRef(tn, i) {
			if first < 0 {
				first = i
			}
			count++
		}
	}
	err := tn.CheckFinite()
	if first < 0 {
		if err != nil {
			t.Fatalf("%s: %s %v: CheckFinite = %v, but every element is finite", context, tn.DType, tn.Shape, err)
		}
		return
	}
	var nf *NonFiniteError
	if !errors.As(err, &nf) || !errors.Is(err, ErrNonFinite) {
		t.Fatalf("%s: %s %v: CheckFinite = %v, want a NonFiniteError at element %d", context, tn.DType, tn.Shape, err, first)
	}
	if nf.Index != first || nf.Count != count || nf.Tensor != tn.Name || nf.Total != tn.NumElements() {
		t.Fatalf("%s: %s %v: error %+v, want index %d, count %d, tensor %q", context, tn.DType, tn.Shape, nf, first, count, tn.Name)
	}
	if !strings.Contains(err.Error(), fmt.Sprintf("%q: element %d ", tn.Name, first)) {
		t.Fatalf("%s: error text %q does not name the tensor and element %d", context, err, first)
	}
	// Coords is the flat index in the shape.
	flat := 0
	for k, c := range nf.Coords {
		if c < 0 || c >= tn.Shape[k] {
			t.Fatalf("%s: coords %v outside shape %v", context, nf.Coords, tn.Shape)
		}
		flat = flat*tn.Shape[k] + c
	}
	if flat != first {
		t.Fatalf("%s: coords %v of shape %v are element %d, want %d", context, nf.Coords, tn.Shape, flat, first)
	}
}

// TestCheckFiniteAll16BitPatterns puts every bf16 and f16 bit pattern in
// every lane of a word (and in the scalar tail) among finite neighbours.
func TestCheckFiniteAll16BitPatterns(t *testing.T) {
	for _, dt := range []DType{BF16, F16} {
		for bits := 0; bits < 1<<16; bits++ {
			for _, pos := range []int{0, 3, 17, 32} { // lane 0, lane 3, second block, tail
				data := make([]byte, 2*33)
				for i := 0; i < 33; i++ {
					binary.LittleEndian.PutUint16(data[2*i:], 0x3f80|uint16(i)) // finite in both types
				}
				binary.LittleEndian.PutUint16(data[2*pos:], uint16(bits))
				checkAgainstRef(t, Tensor{Name: "w", DType: dt, Shape: []int{3, 11}, Data: data}, fmt.Sprintf("bits %#04x at %d", bits, pos))
			}
		}
	}
}

// TestCheckFinite8BitAndF32Patterns covers every 8-bit float pattern and the
// float32 (and float64) exponent boundaries in every lane.
func TestCheckFinite8BitAndF32Patterns(t *testing.T) {
	for _, dt := range []DType{F8E4M3, F8E5M2} {
		for bits := 0; bits < 256; bits++ {
			for pos := 0; pos < 41; pos++ {
				data := make([]byte, 41)
				for i := range data {
					data[i] = 0x30 | byte(i&7)
				}
				data[pos] = byte(bits)
				checkAgainstRef(t, Tensor{Name: "f8", DType: dt, Shape: []int{41}, Data: data}, fmt.Sprintf("bits %#02x at %d", bits, pos))
			}
		}
	}
	f32 := []uint32{0, 0x80000000, 1, 0x007fffff, 0x00800000, 0x7f7fffff, 0xff7fffff, 0x7f800000, 0xff800000, 0x7f800001, 0x7fc00000, 0xffffffff, 0x3f800000}
	for _, bits := range f32 {
		for pos := 0; pos < 13; pos++ {
			data := make([]byte, 4*13)
			for i := 0; i < 13; i++ {
				binary.LittleEndian.PutUint32(data[4*i:], 0x3f800000+uint32(i))
			}
			binary.LittleEndian.PutUint32(data[4*pos:], bits)
			checkAgainstRef(t, Tensor{Name: "f32", DType: F32, Shape: []int{13}, Data: data}, fmt.Sprintf("bits %#08x at %d", bits, pos))
		}
	}
	for _, v := range []float64{0, 1, math.MaxFloat32, -math.MaxFloat32, 1e39, -1e300, math.Inf(1), math.NaN(), math.SmallestNonzeroFloat64} {
		data := binary.LittleEndian.AppendUint64(nil, math.Float64bits(1))
		data = binary.LittleEndian.AppendUint64(data, math.Float64bits(v))
		checkAgainstRef(t, Tensor{Name: "f64", DType: F64, Shape: []int{2}, Data: data}, fmt.Sprintf("value %g", v))
	}
}

// TestCheckFiniteRandom: random tensors of every dtype and shape, and
// random float tensors with NaN and ±Inf put at random places.
func TestCheckFiniteRandom(t *testing.T) {
	rng, seed := testutil.Rand(t)
	for iter := 0; iter < 3000; iter++ {
		tn := randomTensor(rng, fmt.Sprintf("model.layers.%d.mlp.up_proj.weight", iter))
		checkAgainstRef(t, tn, fmt.Sprintf("seed %d random bytes", seed))
	}
	for iter := 0; iter < 500; iter++ {
		dt := []DType{BF16, F16, F32, F64}[rng.IntN(4)]
		shape := []int{1 + rng.IntN(40), 1 + rng.IntN(40)}
		n := shape[0] * shape[1]
		vals := make([]float32, n)
		for i := range vals {
			vals[i] = float32(rng.NormFloat64())
		}
		for k := rng.IntN(4); k > 0; k-- {
			vals[rng.IntN(n)] = []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))}[rng.IntN(3)]
		}
		data, err := encodeFloat32(nil, dt, vals)
		if err != nil {
			t.Fatal(err)
		}
		checkAgainstRef(t, Tensor{Name: "lm_head.weight", DType: dt, Shape: shape, Data: data}, fmt.Sprintf("seed %d injected", seed))
	}
}

func TestCheckFiniteErrors(t *testing.T) {
	err := Tensor{Name: "short", DType: BF16, Shape: []int{3}, Data: make([]byte, 5)}.CheckFinite()
	if err == nil || !strings.Contains(err.Error(), `"short"`) {
		t.Fatalf("short data: %v, want a size error naming the tensor", err)
	}
	if err := (Tensor{Name: "empty", DType: F32, Shape: []int{0, 4}}).CheckFinite(); err != nil {
		t.Fatalf("empty tensor: %v", err)
	}
	data := make([]byte, 2*6)
	binary.LittleEndian.PutUint16(data[2*4:], 0x7fc0)
	err = Tensor{Name: "model.norm.weight", DType: BF16, Shape: []int{2, 3}, Data: data}.CheckFinite()
	want := `safetensors: tensor "model.norm.weight": element 4 [1 1] is NaN (BF16 bits 0x7fc0); 1 of 6 elements are NaN or ±Inf`
	if err == nil || err.Error() != want {
		t.Fatalf("error text\n%v\nwant\n%s", err, want)
	}
}

// benchTensor returns a finite tensor of n elements of dt.
func benchTensor(b *testing.B, dt DType, n int) Tensor {
	vals := make([]float32, n)
	for i := range vals {
		vals[i] = float32(i%1000)*0.001 - 0.5
	}
	data, err := encodeFloat32(nil, dt, vals)
	if err != nil {
		b.Fatal(err)
	}
	return Tensor{Name: "w", DType: dt, Shape: []int{n}, Data: data}
}

// BenchmarkCheckFinite and BenchmarkFloat32Into measure the check against
// the conversion it guards, on the same finite 4M-element tensors.
func BenchmarkCheckFinite(b *testing.B) {
	for _, dt := range []DType{BF16, F16, F32} {
		b.Run(string(dt), func(b *testing.B) {
			tn := benchTensor(b, dt, 1<<22)
			b.SetBytes(int64(len(tn.Data)))
			for b.Loop() {
				if err := tn.CheckFinite(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkFloat32Into(b *testing.B) {
	for _, dt := range []DType{BF16, F16, F32} {
		b.Run(string(dt), func(b *testing.B) {
			tn := benchTensor(b, dt, 1<<22)
			dst := make([]float32, tn.NumElements())
			b.SetBytes(int64(len(tn.Data)))
			for b.Loop() {
				if err := tn.Float32Into(dst); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
