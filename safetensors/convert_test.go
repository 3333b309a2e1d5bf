package safetensors

import (
	"math"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// decodeRef decodes a 16-bit float with exponent width ebits independently of the code
// under test, through math.Ldexp.
func decodeRef(h uint16, ebits, mbits int) float64 {
	sign := 1.0
	if h&0x8000 != 0 {
		sign = -1
	}
	e := int(h>>mbits) & (1<<ebits - 1)
	m := float64(h & (1<<mbits - 1))
	bias := 1<<(ebits-1) - 1
	switch e {
	case 1<<ebits - 1:
		if m != 0 {
			return math.NaN()
		}
		return math.Inf(int(sign))
	case 0:
		return sign * math.Ldexp(m, 1-bias-mbits)
	}
	return sign * math.Ldexp(m+float64(int(1)<<mbits), e-bias-mbits)
}

func TestDecode16Exhaustive(t *testing.T) {
	for i := range 1 << 16 {
		h := uint16(i)
		for _, c := range []struct {
			name         string
			got          float32
			ebits, mbits int
		}{{"bf16", bf16ToF32(h), 8, 7}, {"f16", f16ToF32(h), 5, 10}} {
			want := decodeRef(h, c.ebits, c.mbits)
			if math.IsNaN(want) {
				if !math.IsNaN(float64(c.got)) {
					t.Fatalf("%s %#04x: got %v, want NaN", c.name, h, c.got)
				}
				continue
			}
			if float64(c.got) != want || math.Signbit(float64(c.got)) != math.Signbit(want) {
				t.Fatalf("%s %#04x: got %v, want %v", c.name, h, c.got, want)
			}
		}
	}
}

// nearestRef rounds x to the nearest encoding of a 16-bit format, ties to the even
// encoding, by binary search over the sorted non-negative encodings [0, inf]; inf stands
// for the next power of two past the largest finite value, as IEEE rounding prescribes.
func nearestRef(x float32, inf uint16, decode func(uint16) float64, ulpAtMax float64) uint16 {
	sign := uint16(0)
	v := float64(x)
	if math.Signbit(v) {
		sign, v = 0x8000, -v
	}
	val := func(h uint16) float64 {
		if h == inf {
			return decode(inf-1) + ulpAtMax
		}
		return decode(h)
	}
	lo, hi := uint16(0), inf // invariant: val(lo) <= v, answer in [lo, hi]
	if v >= val(inf) {
		return sign | inf
	}
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if val(mid) <= v {
			lo = mid
		} else {
			hi = mid
		}
	}
	dl, dh := v-val(lo), val(hi)-v
	switch {
	case dl < dh:
		return sign | lo
	case dh < dl:
		return sign | hi
	case lo&1 == 0:
		return sign | lo
	}
	return sign | hi
}

func TestEncode16MatchesReference(t *testing.T) {
	rng, seed := testutil.Rand(t)
	bfDec := func(h uint16) float64 { return decodeRef(h, 8, 7) }
	hDec := func(h uint16) float64 { return decodeRef(h, 5, 10) }
	inputs := []float32{0, float32(math.Copysign(0, -1)), 1, -1, 65504, 65519.99, 65520, 65536, 1e-8, 2.98e-8, 2.99e-8,
		5.96e-8, 6.1e-5, float32(math.Inf(1)), float32(math.Inf(-1)), math.MaxFloat32, math.SmallestNonzeroFloat32, 3.3895314e38}
	for range 200000 {
		// Random bit patterns cover every exponent; the halfway cases come from the low bits.
		b := rng.Uint32()
		if rng.IntN(4) == 0 {
			b &^= 0x7fff // exact ties and near-ties for bf16
			b |= uint32(rng.IntN(2)) << 15
		}
		if f := math.Float32frombits(b); !math.IsNaN(float64(f)) {
			inputs = append(inputs, f)
		}
	}
	for _, x := range inputs {
		if got, want := f32ToBF16(x), nearestRef(x, 0x7f80, bfDec, math.Ldexp(1, 120)); got != want {
			t.Fatalf("seed %d: f32ToBF16(%g = %#08x) = %#04x, want %#04x", seed, x, math.Float32bits(x), got, want)
		}
		if got, want := f32ToF16(x), nearestRef(x, 0x7c00, hDec, 32); got != want {
			t.Fatalf("seed %d: f32ToF16(%g = %#08x) = %#04x, want %#04x", seed, x, math.Float32bits(x), got, want)
		}
	}
}

func TestEncode16RoundTripsExactValues(t *testing.T) {
	for i := range 1 << 16 {
		h := uint16(i)
		if f := bf16ToF32(h); !math.IsNaN(float64(f)) && f32ToBF16(f) != h {
			t.Fatalf("bf16 %#04x -> %v -> %#04x", h, f, f32ToBF16(f))
		}
		if f := f16ToF32(h); !math.IsNaN(float64(f)) && f32ToF16(f) != h {
			t.Fatalf("f16 %#04x -> %v -> %#04x", h, f, f32ToF16(f))
		}
	}
}

func TestEncode16KeepsNaN(t *testing.T) {
	// Payloads that live only in the low bits must not truncate to infinity.
	for _, b := range []uint32{0x7f800001, 0xff800001, 0x7fc00000, 0x7f800100, 0xffffffff} {
		f := math.Float32frombits(b)
		if g := bf16ToF32(f32ToBF16(f)); !math.IsNaN(float64(g)) || math.Signbit(float64(g)) != math.Signbit(float64(f)) {
			t.Errorf("bf16 NaN %#08x became %v", b, g)
		}
		if g := f16ToF32(f32ToF16(f)); !math.IsNaN(float64(g)) || math.Signbit(float64(g)) != math.Signbit(float64(f)) {
			t.Errorf("f16 NaN %#08x became %v", b, g)
		}
	}
}

func TestFloat32ConversionAllDTypes(t *testing.T) {
	rng, seed := testutil.Rand(t)
	vals := make([]float32, 1000)
	for i := range vals {
		vals[i] = float32(rng.NormFloat64() * 10)
	}
	for _, dt := range []DType{BF16, F16, F32, F64} {
		b, err := encodeFloat32(nil, dt, vals)
		if err != nil {
			t.Fatal(err)
		}
		got, err := Tensor{Name: "x", DType: dt, Shape: []int{10, 100}, Data: b}.Float32()
		if err != nil {
			t.Fatal(err)
		}
		for i, v := range vals {
			var want float32
			switch dt {
			case BF16:
				want = bf16ToF32(f32ToBF16(v))
			case F16:
				want = f16ToF32(f32ToF16(v))
			default:
				want = v
			}
			if got[i] != want {
				t.Fatalf("seed %d: %s value %d: got %v, want %v", seed, dt, i, got[i], want)
			}
		}
	}
	if _, err := (Tensor{Name: "ids", DType: I32, Shape: []int{1}, Data: make([]byte, 4)}).Float32(); err == nil {
		t.Error("Float32 on I32 succeeded")
	}
	if _, err := (Tensor{Name: "x", DType: F32, Shape: []int{2}, Data: make([]byte, 4)}).Float32(); err == nil {
		t.Error("Float32 with short data succeeded")
	}
}
