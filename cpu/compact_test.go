package cpu

import (
	"math"
	"slices"
	"testing"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/twell"
)

// roundAll rounds every value of each slice to bfloat16 in place, as a
// bfloat16 checkpoint's weights are.
func roundAll(ws ...[]float32) {
	for _, w := range ws {
		for i, v := range w {
			w[i] = bf16.Round(v)
		}
	}
}

// sameBits returns the index of the first element where a and b differ in
// their bits, or -1.
func sameBits(a, b []float32) int {
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return i
		}
	}
	return -1
}

// TestCompactGemmSameBits: products over compact (bf16-only) panels give
// the bits of the float32 panels at every size of A, on both kernel sets,
// and a matrix with a value bf16 cannot hold keeps its float32 panels.
func TestCompactGemmSameBits(t *testing.T) {
	forEachKernel(t, func(t *testing.T) {
		r, seed := testutil.Rand(t)
		for _, m := range []int{1, 3, 4, 5, 12, 16, 17, 40, 97 + r.IntN(100)} {
			n, k := 1+r.IntN(300), 1+r.IntN(400)
			w := randMat(r, n*k)
			roundAll(w)
			full, _ := PackB(w, n, k)
			compact, _ := PackB(w, n, k)
			if !compact.Compact() {
				t.Fatalf("seed %d: %d x %d matrix of bf16 values did not compact", seed, n, k)
			}
			if got, want := compact.Bytes(), full.Bytes()/2; got != want {
				t.Errorf("seed %d: compact panels take %d bytes, want %d", seed, got, want)
			}
			if direct, err := PackBCompact(w, n, k); err != nil || direct.data != nil || !slices.Equal(direct.bf16, compact.bf16) {
				t.Fatalf("seed %d: PackBCompact's panels differ from PackB then Compact's (err %v)", seed, err)
			}
			a := randMat(r, m*k)
			c1, c2 := make([]float32, m*n), randMat(r, m*n)
			if err := Gemm(c1, a, m, full); err != nil {
				t.Fatal(err)
			}
			if err := Gemm(c2, a, m, compact); err != nil {
				t.Fatal(err)
			}
			if i := sameBits(c1, c2); i >= 0 {
				t.Fatalf("seed %d: m %d, %d x %d: element %d is %g from compact panels, %g from float32 ones", seed, m, n, k, i, c2[i], c1[i])
			}
			// GemmTA (A given transposed) reads the same panels.
			at := make([]float32, k*m)
			for i := 0; i < m; i++ {
				for q := 0; q < k; q++ {
					at[q*m+i] = a[i*k+q]
				}
			}
			if err := GemmTA(c1, at, m, full, false); err != nil {
				t.Fatal(err)
			}
			if err := GemmTA(c2, at, m, compact, false); err != nil {
				t.Fatal(err)
			}
			if i := sameBits(c1, c2); i >= 0 {
				t.Fatalf("seed %d: GemmTA m %d, %d x %d: element %d is %g from compact panels, %g from float32 ones", seed, m, n, k, i, c2[i], c1[i])
			}
			// One value off the bf16 grid: the panels stay float32.
			w[r.IntN(len(w))] += 1.0 / 3
			odd, _ := PackB(w, n, k)
			if odd.Compact() || odd.data == nil || odd.Bytes() != full.Bytes() {
				t.Fatalf("seed %d: a matrix with a value bf16 cannot hold was compacted", seed)
			}
			if direct, _ := PackBCompact(w, n, k); direct.bf16 != nil || !slices.Equal(direct.data, odd.data) {
				t.Fatalf("seed %d: PackBCompact made bf16 panels of a matrix bf16 cannot hold", seed)
			}
		}
	})
}

// TestBF16RowKernelsSameBits: the dot and axpy kernels over bf16 rows give
// the float32 kernels' bits for bf16 values, at every length.
func TestBF16RowKernelsSameBits(t *testing.T) {
	forEachKernel(t, func(t *testing.T) {
		r, seed := testutil.Rand(t)
		for _, n := range []int{1, 3, 63, 64, 65, 128, 200, 2048 + r.IntN(300)} {
			x, w := randMat(r, n), randMat(r, n)
			roundAll(w)
			w16 := make([]uint16, n)
			bf16.Truncate(w16, w)
			if a, b := dotKernel(x, w), dotBF16Kernel(x, w16); math.Float32bits(a) != math.Float32bits(b) {
				t.Fatalf("seed %d: n %d: dot %g from bf16 row, %g from float32", seed, n, b, a)
			}
			alpha := float32(r.NormFloat64())
			y1 := randMat(r, n)
			y2 := append([]float32(nil), y1...)
			axpyKernel(alpha, w, y1)
			axpyBF16Kernel(alpha, w16, y2)
			if i := sameBits(y1, y2); i >= 0 {
				t.Fatalf("seed %d: n %d: axpy element %d is %g from bf16 row, %g from float32", seed, n, i, y2[i], y1[i])
			}
		}
	})
}

// TestCompactMLPSameBits: an MLP of bf16 weights gives the same bits on
// every path (auto, sparse, dense; gated or not; decode and prefill sizes)
// once compact, and takes about half the memory.
func TestCompactMLPSameBits(t *testing.T) {
	forEachKernel(t, func(t *testing.T) {
		r, seed := testutil.Rand(t)
		d, f := 64*(1+r.IntN(3))+r.IntN(2)*16, 512
		for _, gated := range []bool{true, false} {
			for _, density := range []float64{0.01, 0.3} {
				sl, err := synth.NewLayer(r, d, f, density, synth.Skewed, gated)
				if err != nil {
					t.Fatal(err)
				}
				roundAll(sl.Gate, sl.Up, sl.Down)
				full, err := NewMLP(sl.Gate, sl.Up, sl.Down, d, f)
				if err != nil {
					t.Fatal(err)
				}
				compact, _ := NewMLP(sl.Gate, sl.Up, sl.Down, d, f)
				before := compact.Bytes()
				if !compact.Compact() {
					t.Fatalf("seed %d: an MLP of bf16 weights did not compact", seed)
				}
				if got, want := compact.Bytes(), before/2; got != want {
					t.Errorf("seed %d: compact MLP takes %d bytes, want %d", seed, got, want)
				}
				for _, m := range []int{1, 5, 16, 70} {
					x := synth.Tokens(r, m, d)
					for _, path := range []mlp.Path{mlp.Auto, mlp.Sparse, mlp.Dense} {
						full.Path, compact.Path = path, path
						y1, y2 := make([]float32, m*d), randMat(r, m*d)
						_, n1, p1, err1 := full.Forward(y1, x, m, twell.DefaultLayout)
						_, n2, p2, err2 := compact.Forward(y2, x, m, twell.DefaultLayout)
						if err1 != nil || err2 != nil {
							t.Fatal(err1, err2)
						}
						if i := sameBits(y1, y2); i >= 0 || n1 != n2 || p1 != p2 {
							t.Fatalf("seed %d: gated=%v density %g m %d %v: element %d, active %d/%d, path %v/%v: compact differs", seed, gated, density, m, path, i, n1, n2, p1, p2)
						}
					}
				}
			}
		}
	})
}

// TestCompactKeepsInexact: an MLP whose weights bf16 cannot hold keeps
// them all in float32 and says so.
func TestCompactKeepsInexact(t *testing.T) {
	r, seed := testutil.Rand(t)
	sl, err := synth.NewLayer(r, 64, 256, 0.02, synth.Uniform, true)
	if err != nil {
		t.Fatal(err)
	}
	l, _ := NewMLP(sl.Gate, sl.Up, sl.Down, 64, 256)
	before := l.Bytes()
	if l.Compact() || l.Bytes() != before {
		t.Fatalf("seed %d: float32 weights compacted (%d -> %d bytes)", seed, before, l.Bytes())
	}
}

// FuzzCompact: whatever the values, Compact compacts exactly the matrices
// whose values are all bf16 values, and products over compact panels have
// the float32 panels' bits.
func FuzzCompact(f *testing.F) {
	f.Add(uint8(3), uint8(5), uint8(2), []byte{0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0})
	f.Add(uint8(33), uint8(1), uint8(6), []byte{1, 2, 3, 4})
	f.Fuzz(func(t *testing.T, n8, k8, m8 uint8, raw []byte) {
		n, k, m := 1+int(n8)%40, 1+int(k8)%70, int(m8)%24
		w := make([]float32, n*k)
		for i := range w {
			var u uint32
			for j := 0; j < 4; j++ {
				if len(raw) > 0 {
					u |= uint32(raw[(4*i+j)%len(raw)]) << (8 * j)
				}
			}
			if len(raw) > 0 && raw[0]&1 == 0 {
				u &^= 0xffff // mostly bf16 values
			}
			w[i] = math.Float32frombits(u)
		}
		full, err := PackB(w, n, k)
		if err != nil {
			t.Fatal(err)
		}
		compact, _ := PackB(w, n, k)
		if got, want := compact.Compact(), bf16.Exact(w); got != want {
			t.Fatalf("Compact() = %v for a matrix with Exact = %v", got, want)
		}
		a := make([]float32, m*k)
		for i := range a {
			a[i] = float32(i%7) - 2.5
		}
		c1, c2 := make([]float32, m*n), make([]float32, m*n)
		if err := Gemm(c1, a, m, full); err != nil {
			t.Fatal(err)
		}
		if err := Gemm(c2, a, m, compact); err != nil {
			t.Fatal(err)
		}
		for i := range c1 {
			if math.Float32bits(c1[i]) != math.Float32bits(c2[i]) && !(c1[i] != c1[i] && c2[i] != c2[i]) {
				t.Fatalf("m %d, %d x %d: element %d is %g from compact panels, %g from float32", m, n, k, i, c2[i], c1[i])
			}
		}
	})
}

// TestTrimRepacksSameBits: an MLP whose dense panels Trim dropped runs the
// sparse finish from its rows and, when the dense finish comes, packs the
// panels again with the same bits, for bf16 and float32 weights, gated or
// not, with the bf16 decode copies where they were made.
func TestTrimRepacksSameBits(t *testing.T) {
	forEachKernel(t, func(t *testing.T) {
		r, seed := testutil.Rand(t)
		d, f := 64+r.IntN(2)*16, 512
		for _, gated := range []bool{true, false} {
			for _, exact := range []bool{true, false} {
				for _, small := range []bool{false, true} {
					sl, err := synth.NewLayer(r, d, f, 0.02, synth.Skewed, gated)
					if err != nil {
						t.Fatal(err)
					}
					if exact {
						roundAll(sl.Gate, sl.Up, sl.Down)
					}
					whole, _ := NewMLP(sl.Gate, sl.Up, sl.Down, d, f)
					trimmed, _ := NewMLP(sl.Gate, sl.Up, sl.Down, d, f)
					for _, l := range []*MLP{whole, trimmed} {
						l.Compact()
						if small {
							l.UseBF16ForSmallM()
						}
					}
					before := trimmed.Bytes()
					trimmed.Trim()
					want := before - whole.down.Bytes()
					if gated {
						want -= whole.up.Bytes()
					}
					if got := trimmed.Bytes(); got != want {
						t.Errorf("seed %d: gated=%v exact=%v small=%v: trimmed MLP takes %d bytes, want %d", seed, gated, exact, small, got, want)
					}
					for _, step := range []struct {
						path mlp.Path
						m    int
					}{{mlp.Auto, 9}, {mlp.Sparse, 1}, {mlp.Dense, 4}, {mlp.Dense, 40}, {mlp.Auto, 13}} {
						x := synth.Tokens(r, step.m, d)
						whole.Path, trimmed.Path = step.path, step.path
						y1, y2 := make([]float32, step.m*d), randMat(r, step.m*d)
						_, n1, p1, err1 := whole.Forward(y1, x, step.m, twell.DefaultLayout)
						_, n2, p2, err2 := trimmed.Forward(y2, x, step.m, twell.DefaultLayout)
						if err1 != nil || err2 != nil {
							t.Fatal(err1, err2)
						}
						if i := sameBits(y1, y2); i >= 0 || n1 != n2 || p1 != p2 {
							t.Fatalf("seed %d: gated=%v exact=%v small=%v %v m %d: element %d, active %d/%d, path %v/%v: trimmed differs", seed, gated, exact, small, step.path, step.m, i, n1, n2, p1, p2)
						}
					}
					if trimmed.Bytes() != before {
						t.Errorf("seed %d: gated=%v exact=%v small=%v: after the dense path ran, %d bytes, want %d again", seed, gated, exact, small, trimmed.Bytes(), before)
					}
				}
			}
		}
	})
}
