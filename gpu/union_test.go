package gpu

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/twell"
)

// Shared memory a block may opt in to on the GPUs the tests reason about.
const (
	optinHopper = 232448 // H100, H200: 227 KiB
	optinAmpere = 166912 // A100: 163 KiB
)

// TestUnionPlan checks which calls the union path takes, why it refuses
// the others, and that what it takes fits the device's shared memory.
func TestUnionPlan(t *testing.T) {
	for _, c := range []struct {
		m, from, d, f int
		blas          bool
		optin         int
		stages        int
		why           string // part of the refusal
	}{
		{9, 9, 2048, 5632, true, optinHopper, 3, ""},
		{64, 9, 2048, 5632, true, optinHopper, 3, ""},
		{1, 1, 2048, 5632, true, optinHopper, 3, ""},
		{33, 9, 320, 768, true, optinAmpere, 2, ""},
		{64, 9, 4096, 1 << 16, true, optinHopper, 3, ""},
		{8, 9, 2048, 5632, true, optinHopper, 0, "8 tokens: the union path takes 9 to 64"},
		{65, 1, 2048, 5632, true, optinHopper, 0, "65 tokens"},
		{16, 0, 2048, 5632, true, optinHopper, 0, "off"},
		{16, 9, 2048, 5632, false, optinHopper, 0, "cuBLAS"},
		{16, 9, 2080, 5632, true, optinHopper, 0, "hidden size 2080"},
		{16, 9, 2048, 5632 + 32, true, optinHopper, 0, "width 5664"},
		{16, 9, 2048, 1<<16 + 64, true, optinHopper, 0, "width 65600"},
		{16, 9, 2048, 1 << 16, true, optinAmpere, 0, "union_down needs"},
		{16, 9, 2048, 5632, true, 120 << 10, 0, "union_act needs"},
	} {
		stages, why := unionPlan(c.m, c.from, c.d, c.f, c.blas, c.optin)
		if stages != c.stages || !strings.Contains(why, c.why) || (c.why == "") != (why == "") {
			t.Errorf("unionPlan(m %d, from %d, d %d, f %d, blas %v, optin %d) = %d stages, %q; want %d, %q",
				c.m, c.from, c.d, c.f, c.blas, c.optin, stages, why, c.stages, c.why)
		}
	}
	// Whatever it takes fits: every token count and width it accepts, on
	// either device.
	r, seed := testutil.Rand(t)
	for range 2000 {
		m, d, f := 1+r.IntN(80), 64*(1+r.IntN(128)), 64*(1+r.IntN(1100))
		optin := []int{optinHopper, optinAmpere}[r.IntN(2)]
		stages, _ := unionPlan(m, 1+r.IntN(64), d, f, true, optin)
		if stages == 0 {
			continue
		}
		if act, down := unionActShared(m, stages)+unionStatic, unionDownShared(f)+unionStatic; act > optin || down > optin {
			t.Fatalf("seed %d: m %d, d %d, f %d: %d stages need %d and %d bytes of shared memory, over %d", seed, m, d, f, stages, act, down, optin)
		}
	}
}

// TestUnionBatchMatchesFloat64 checks the union path (batches of 1 to 64
// tokens) against the float64 reference, gated and not, on shapes where d
// is not a multiple of the 256-column chunks, and at a density where every
// block has all of its units live; its results must repeat bit for bit and
// its count of active pairs must match the reference's. Then rows where
// every unit fires and rows holding NaN and Inf: exact results, NaN and Inf
// where the reference has them.
func TestUnionBatchMatchesFloat64(t *testing.T) {
	dev, blas := setup(t)
	for _, c := range []struct {
		d, f    int
		density float64
		gated   bool
	}{
		{320, 768, 0.02, true},  // chunks of 256 and 64 columns
		{256, 512, 0.05, false}, // no up rows
		{2048, 5632, 0.005, true},
		{2048, 5632, 0.005, false},
		{576, 1024, 0.3, true}, // every block fully live
	} {
		t.Run(fmt.Sprintf("d%d_f%d_p%g_gated%v", c.d, c.f, c.density, c.gated), func(t *testing.T) {
			r, seed := testutil.Rand(t)
			sl := newLayer(t, r, c.d, c.f, c.density, synth.Skewed, c.gated)
			l := newMLP(t, dev, blas, sl, twell.DefaultLayout, seed)
			l.UnionFrom = 1
			bl := bf16Layer(sl)
			for _, m := range []int{1, 4, 9, 16, 23, 40, 64} {
				if l.unionStages(m) == 0 {
					t.Fatalf("the union path does not take m %d here", m)
				}
				x := roundBF16(synth.Tokens(r, m, c.d))
				rows := make([]int, m)
				for i := range rows {
					rows[i] = i
				}
				y := runPath(t, dev, l, "sparse", x, m)
				if l.ws.sp.packed != nil || l.ws.sp.uh == nil || l.ws.sp.gh != nil || l.KernelsFor(m) != "union" {
					t.Fatalf("m %d: the call did not take the union path", m)
				}
				for i, v := range y {
					if math.IsNaN(float64(v)) {
						t.Fatalf("seed %d: m %d: output %d (row %d) is NaN: not written", seed, m, i, i/c.d)
					}
				}
				if e := synth.RelErr(y, c.d, rows, refRows(bl, x, c.d, rows)); !(e <= 1e-2) {
					t.Errorf("seed %d: m %d: rel err %.3g vs float64 on the bf16 weights, want <= 1e-2", seed, m, e)
				}
				again := runPath(t, dev, l, "sparse", x, m)
				for i := range y {
					if math.Float32bits(y[i]) != math.Float32bits(again[i]) {
						t.Fatalf("seed %d: m %d: output %d is %v, then %v", seed, m, i, y[i], again[i])
					}
				}
				if l.counted != m {
					t.Errorf("seed %d: m %d: counted %d tokens", seed, m, l.counted)
				}
				got, want := deviceNNZ(t, dev, l), activePairs(bl, x, m)
				if math.Abs(float64(got-want)) > 0.01*float64(want)+3 {
					t.Errorf("seed %d: m %d: %d active pairs counted, the reference has %d", seed, m, got, want)
				}
			}
		})
	}
	t.Run("stress", func(t *testing.T) {
		r, seed := testutil.Rand(t)
		d, f := 256, 512
		sl := newLayer(t, r, d, f, 0.01, synth.Uniform, true)
		l := newMLP(t, dev, blas, sl, twell.DefaultLayout, seed)
		l.UnionFrom = 1
		for _, m := range []int{4, 16, 64} {
			x := synth.Tokens(r, m, d)
			x[0*d] = -1000 // every gate bias is negative here: all units fire
			x[1*d+7] = float32(math.NaN())
			x[(m-1)*d+9] = float32(math.Inf(1))
			rows := make([]int, m)
			for i := range rows {
				rows[i] = i
			}
			checkStress(t, seed, fmt.Sprintf("union path, %d tokens", m), runPath(t, dev, l, "sparse", x, m),
				refRows(sl, x, d, rows), rows, d, m)
		}
	})
}

// deviceNNZ returns l's count of active pairs from its last call.
func deviceNNZ(t *testing.T, dev *cuda.Device, l *MLP) int64 {
	t.Helper()
	var n [1]uint64
	if err := dev.CopyDtoH(cuda.Bytes(n[:]), l.nnz); err != nil {
		t.Fatal(err)
	}
	return int64(n[0])
}

// activePairs counts the (token, unit) pairs of the m tokens x whose gate
// value, rounded to bf16 as the GEMM's output is, is positive.
func activePairs(sl *synth.Layer, x []float32, m int) int64 {
	w := sl.Gate
	if w == nil {
		w = sl.Up
	}
	var n int64
	for t := range m {
		xt := x[t*sl.D : (t+1)*sl.D]
		for j := range sl.F {
			var g float64
			for k, v := range w[j*sl.D : (j+1)*sl.D] {
				g += float64(v) * float64(xt[k])
			}
			if bf16.Round(float32(g)) > 0 {
				n++
			}
		}
	}
	return n
}
