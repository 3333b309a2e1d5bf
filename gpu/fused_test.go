package gpu

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/twell"
)

// fixOne is the unit of the fixed-point accumulators (common.cuh's
// FIX_ONE): 2^-24.
const fixOne = 1 << 24

// put copies v to a new device buffer, freed when the test ends.
func put[T any](t *testing.T, dev *cuda.Device, v []T) *cuda.Buffer {
	t.Helper()
	b := cudatest.Alloc(t, dev, len(cuda.Bytes(v)))
	if err := dev.CopyHtoD(b, cuda.Bytes(v)); err != nil {
		t.Fatal(err)
	}
	return b
}

// get copies n values of type T from b.
func get[T any](t *testing.T, dev *cuda.Device, b *cuda.Buffer, n int) []T {
	t.Helper()
	v := make([]T, n)
	if err := dev.CopyDtoH(cuda.Bytes(v), b); err != nil {
		t.Fatal(err)
	}
	return v
}

// TestQueueFusedMatchesFloat64 runs the one-token MLP kernel with the
// norm before it and the down projection in it (QueueFused) on random
// layers, gated and not, with a bf16 delta, a fixed-point one and none,
// at hidden sizes whose down rows take one chunk of columns and more: the
// residual sum must be resid + delta in float32, the accumulated output
// must agree with the float64 MLP of the normed token (rel err <= 1e-2)
// and repeat bit for bit, and a non-finite addend (a delta flagged bad)
// must flag the output and make the residual sum NaN.
func TestQueueFusedMatchesFloat64(t *testing.T) {
	dev, blas := setup(t)
	for _, c := range []struct {
		d, f  int
		gated bool
		delta string
	}{
		{256, 512, true, "bf16"},
		{2048, 5632, true, "fix"},
		{2112, 512, false, "fix"}, // down rows in chunks of 2048 and 64 columns
		{4096, 768, true, "none"},
	} {
		t.Run(fmt.Sprintf("d%d_f%d_gated%v_%s", c.d, c.f, c.gated, c.delta), func(t *testing.T) {
			r, seed := testutil.Rand(t)
			sl := newLayer(t, r, c.d, c.f, 0.02, synth.Skewed, c.gated)
			l := newMLP(t, dev, blas, sl, twell.DefaultLayout, seed)
			resid, w := synth.Tokens(r, 1, c.d), make([]float32, c.d)
			for i := range w {
				w[i] = 0.5 + r.Float32()
			}
			v := make([]float32, c.d) // resid + delta as the kernel adds them
			in := NormedInput{Resid: put(t, dev, resid), ResidOut: cudatest.Alloc(t, dev, 4*c.d), Weight: put(t, dev, w), Eps: 1e-5}
			delta := synth.Tokens(r, 1, c.d)
			switch c.delta {
			case "bf16":
				h := make([]uint16, c.d)
				for i, x := range delta {
					h[i] = bf16.FromFloat32(x)
					v[i] = resid[i] + bf16.ToFloat32(h[i])
				}
				in.Delta = put(t, dev, h)
			case "fix":
				q := make([]int64, c.d+1)
				for i, x := range delta {
					q[i] = int64(math.RoundToEven(float64(x) * fixOne))
					v[i] = resid[i] + float32(q[i])*(1.0/fixOne)
				}
				in.DeltaFix = put(t, dev, q)
			default:
				copy(v, resid)
			}
			run := func() []int64 {
				acc := cudatest.Alloc(t, dev, FixBytes(c.d))
				if err := dev.Memset8(acc, 0, nil); err != nil {
					t.Fatal(err)
				}
				if err := l.QueueFused(nil, acc, in); err != nil {
					t.Fatalf("seed %d: %v", seed, err)
				}
				if err := dev.Synchronize(); err != nil {
					t.Fatal(err)
				}
				return get[int64](t, dev, acc, c.d+1)
			}
			acc := run()
			for i, got := range get[float32](t, dev, in.ResidOut, c.d) {
				if math.Abs(float64(got-v[i])) > 1e-6*math.Abs(float64(v[i])) {
					t.Fatalf("seed %d: residual sum %d is %v, want %v", seed, i, got, v[i])
				}
			}
			if acc[c.d] != 0 {
				t.Fatalf("seed %d: %d addends flagged not finite", seed, acc[c.d])
			}
			y := make([]float32, c.d)
			for i, q := range acc[:c.d] {
				y[i] = float32(float64(q) / fixOne)
			}
			want := refRows(bf16Layer(sl), normedBF16(v, w, 1e-5), c.d, []int{0})
			if e := synth.RelErr(y, c.d, []int{0}, want); !(e <= 1e-2) {
				t.Errorf("seed %d: rel err %.3g vs float64, want <= 1e-2", seed, e)
			}
			for i, q := range run() {
				if q != acc[i] {
					t.Fatalf("seed %d: accumulator word %d is %d, then %d", seed, i, acc[i], q)
				}
			}
			if c.delta != "fix" {
				return
			}
			// A delta flagged bad: every value is NaN.
			q := get[int64](t, dev, in.DeltaFix, c.d+1)
			q[c.d] = 1
			in.DeltaFix = put(t, dev, q)
			acc = run()
			if acc[c.d] == 0 {
				t.Errorf("seed %d: a NaN input left the output unflagged", seed)
			}
			for i, got := range get[float32](t, dev, in.ResidOut, c.d) {
				if !math.IsNaN(float64(got)) {
					t.Fatalf("seed %d: residual sum %d is %v under a bad delta, want NaN", seed, i, got)
				}
			}
		})
	}
	// What QueueFused refuses.
	r, seed := testutil.Rand(t)
	l := newMLP(t, dev, blas, newLayer(t, r, 256, 512, 0.02, synth.Skewed, true), twell.DefaultLayout, seed)
	buf := func(n int) *cuda.Buffer { return cudatest.Alloc(t, dev, n) }
	acc, resid, w := buf(FixBytes(256)), buf(4*256), buf(4*256)
	for _, k := range []struct {
		acc  *cuda.Buffer
		in   NormedInput
		want string
	}{
		{acc, NormedInput{Resid: resid, ResidOut: resid, Weight: w}, "the buffer it reads"},
		{acc, NormedInput{Resid: resid, ResidOut: buf(4 * 256), Weight: w, Delta: buf(512), DeltaFix: buf(FixBytes(256))}, "not both"},
		{buf(8 * 256), NormedInput{Resid: resid, ResidOut: buf(4 * 256), Weight: w}, "accumulator"},
		{acc, NormedInput{Resid: resid, ResidOut: buf(4 * 256), Weight: w, DeltaFix: acc}, "delta it reads"},
		{acc, NormedInput{Resid: resid, ResidOut: buf(4 * 100), Weight: w}, "fewer than 256"},
	} {
		if err := l.QueueFused(nil, k.acc, k.in); err == nil || !strings.Contains(err.Error(), k.want) {
			t.Errorf("QueueFused: %v, want an error with %q", err, k.want)
		}
	}
}

// normedBF16 returns bf16(v / rms(v) * w), the RMSNorm of v in float64,
// rounded as the kernels round the normed token.
func normedBF16(v, w []float32, eps float64) []float32 {
	var ss float64
	for _, x := range v {
		ss += float64(x) * float64(x)
	}
	inv := 1 / math.Sqrt(ss/float64(len(v))+eps)
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = bf16.Round(float32(float64(x) * inv * float64(w[i])))
	}
	return out
}
