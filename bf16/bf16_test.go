package bf16

import (
	"math"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// nearest returns the bfloat16 nearest to f computed through float64, the
// slow and obvious way, as an oracle for FromFloat32.
func nearest(f float32) uint16 {
	u := math.Float32bits(f)
	lo := uint16(u >> 16)
	hi := lo + 1
	dlo := math.Abs(float64(ToFloat32(lo)) - float64(f))
	fhi := float64(ToFloat32(hi))
	if math.IsInf(fhi, 0) && !math.IsInf(float64(f), 0) {
		// The next pattern up is infinity; IEEE rounding treats it as 2^128.
		fhi = math.Copysign(math.Ldexp(1, 128), fhi)
	}
	dhi := math.Abs(fhi - float64(f))
	switch {
	case dlo < dhi:
		return lo
	case dhi < dlo:
		return hi
	case lo&1 == 0:
		return lo
	default:
		return hi
	}
}

func TestFromFloat32MatchesOracle(t *testing.T) {
	r, seed := testutil.Rand(t)
	for i := 0; i < 1_000_000; i++ {
		u := r.Uint32()
		f := math.Float32frombits(u)
		if f != f {
			continue
		}
		if got, want := FromFloat32(f), nearest(f); got != want {
			t.Fatalf("seed %d: FromFloat32(%g = %#08x) = %#04x, want %#04x", seed, f, u, got, want)
		}
	}
}

func TestSpecialValues(t *testing.T) {
	cases := []struct {
		in   float32
		want uint16
	}{
		{0, 0x0000},
		{float32(math.Copysign(0, -1)), 0x8000},
		{1, 0x3f80},
		{-2, 0xc000},
		{0.5, 0x3f00},
		{float32(math.Inf(1)), 0x7f80},
		{float32(math.Inf(-1)), 0xff80},
		{math.MaxFloat32, 0x7f80},                  // rounds up to +Inf
		{math.Float32frombits(0x3f808000), 0x3f80}, // tie, even stays
		{math.Float32frombits(0x3f818000), 0x3f82}, // tie, odd rounds up
		{math.Float32frombits(0x00000001), 0x0000}, // smallest subnormal
		{math.Float32frombits(0x00010000), 0x0001}, // subnormal kept
	}
	for _, c := range cases {
		if got := FromFloat32(c.in); got != c.want {
			t.Errorf("FromFloat32(%g) = %#04x, want %#04x", c.in, got, c.want)
		}
	}
	for _, nan := range []uint32{0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001, 0x7fffffff} {
		b := FromFloat32(math.Float32frombits(nan))
		if f := ToFloat32(b); f == f {
			t.Errorf("NaN %#08x became %#04x = %g, not NaN", nan, b, f)
		}
		if b>>15 != uint16(nan>>31) {
			t.Errorf("NaN %#08x lost its sign: %#04x", nan, b)
		}
	}
}

func TestRoundTripExact(t *testing.T) {
	for b := 0; b < 1<<16; b++ {
		f := ToFloat32(uint16(b))
		if f != f {
			continue
		}
		if got := FromFloat32(f); got != uint16(b) {
			t.Fatalf("FromFloat32(ToFloat32(%#04x)) = %#04x", b, got)
		}
	}
}

func TestSlicesMatchScalar(t *testing.T) {
	r, seed := testutil.Rand(t)
	n := 1 + r.IntN(5000)
	src := make([]float32, n)
	for i := range src {
		src[i] = math.Float32frombits(r.Uint32())
	}
	dst := make([]uint16, n)
	FromFloat32s(dst, src)
	back := make([]float32, n)
	ToFloat32s(back, dst)
	for i := range src {
		if dst[i] != FromFloat32(src[i]) {
			t.Fatalf("seed %d: element %d: slice %#04x, scalar %#04x", seed, i, dst[i], FromFloat32(src[i]))
		}
		if math.Float32bits(back[i]) != math.Float32bits(ToFloat32(dst[i])) {
			t.Fatalf("seed %d: element %d: ToFloat32s differs from ToFloat32", seed, i)
		}
	}
}

func BenchmarkFromFloat32s(b *testing.B) {
	src := make([]float32, 1<<16)
	for i := range src {
		src[i] = float32(i) * 0.37
	}
	dst := make([]uint16, len(src))
	b.SetBytes(int64(4 * len(src)))
	for b.Loop() {
		FromFloat32s(dst, src)
	}
}

// TestExactAndTruncate: Exact accepts exactly the values whose widened
// truncation gives their bits back, and Round's results are all exact.
func TestExactAndTruncate(t *testing.T) {
	r, seed := testutil.Rand(t)
	for i := 0; i < 100000; i++ {
		u := r.Uint32()
		if r.IntN(2) == 0 {
			u &^= 0xffff
		}
		f := math.Float32frombits(u)
		var b [1]uint16
		Truncate(b[:], []float32{f})
		back := math.Float32bits(ToFloat32(b[0]))
		if got, want := Exact([]float32{f}), back == u; got != want {
			t.Fatalf("seed %d: Exact(%#08x) = %v, but truncation gives %#08x", seed, u, got, back)
		}
		if g := Round(f); !math.IsNaN(float64(g)) && !Exact([]float32{g}) {
			t.Fatalf("seed %d: Round(%#08x) = %#08x is not exact", seed, u, math.Float32bits(g))
		}
	}
	if !Exact(nil) {
		t.Fatal("Exact of no values is false")
	}
}
