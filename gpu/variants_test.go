package gpu

import (
	"os"
	"slices"
	"strconv"
	"testing"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/twell"
)

// medianMS times run with CUDA events: 3 warm-up calls, then the median of
// reps.
func medianMS(t *testing.T, dev *cuda.Device, reps int, run func() error) float64 {
	t.Helper()
	timer, err := dev.NewTimer()
	if err != nil {
		t.Fatal(err)
	}
	defer timer.Destroy()
	for i := 0; i < 3; i++ {
		if err := run(); err != nil {
			t.Fatal(err)
		}
	}
	ts := make([]float64, reps)
	for i := range ts {
		if ts[i], err = timer.TimeMS(nil, run); err != nil {
			t.Fatal(err)
		}
	}
	slices.Sort(ts)
	return ts[len(ts)/2]
}

// sparseLMLayer returns an MLP of the SparseLM shape (d 2048, f 5632) with
// random weights and a uniform 0.5% gate, and m random input tokens on the
// device, both freed when the test ends, and the seed they came from.
func sparseLMLayer(t *testing.T, dev *cuda.Device, blas *cublas.Handle, m int) (*MLP, *cuda.Buffer, uint64) {
	t.Helper()
	r, seed := testutil.Rand(t)
	const d, f = 2048, 5632
	sl := newLayer(t, r, d, f, 0.005, synth.Uniform, true)
	l := newMLP(t, dev, blas, sl, twell.DefaultLayout, seed)
	xb := upload(t, dev, synth.Tokens(r, m, d))
	return l, xb, seed
}

// TestKernelTimes times the sparse MLP's kernels on the SparseLM shape (the
// cuBLASLt gate GEMM as the yardstick, each D2T kernel, the dense path, each
// tail, the weight-stationary down kernel alone) and logs their register
// and local-memory use. It is an experiment, not a check: set
// TWELL_KERNEL_TIMES=1 to run it.
func TestKernelTimes(t *testing.T) {
	if os.Getenv("TWELL_KERNEL_TIMES") == "" {
		t.Skip("set TWELL_KERNEL_TIMES=1 to time the kernels")
	}
	dev, blas := setup(t)
	d, f, m := 2048, 5632, 65536
	l, xb, seed := sparseLMLayer(t, dev, blas, m)
	yb := cudatest.Alloc(t, dev, 2*m*d)
	flop := 2 * float64(m) * float64(d) * float64(f)
	// The dense gate GEMM alone (cuBLASLt), the mainloop's yardstick.
	gb, err := dev.Alloc(2 * m * f)
	if err != nil {
		t.Fatal(err)
	}
	gemm := medianMS(t, dev, 20, func() error {
		return blas.Matmul(nil, cublas.Gemm{M: m, N: f, K: d, TransB: true}, xb, l.gate, gb)
	})
	gb.Free()
	t.Logf("gate GEMM cuBLASLt %.3f ms  %.0f TFLOP/s", gemm, flop/gemm/1e9)
	var d2t float64
	packed := map[Kernel][]uint32{}
	for _, k := range kernelsToTest(dev) {
		l.Kernel = k
		fn, _, err := l.d2tKernel()
		if err != nil {
			t.Fatal(err)
		}
		a, _ := fn.Attributes()
		ms := medianMS(t, dev, 20, func() error { return l.QueueD2T(nil, xb, m) })
		t.Logf("D2T %-6v %.3f ms  %.0f TFLOP/s  (%d registers, %d B local)", k, ms, flop/ms/1e9, a.NumRegs, a.LocalBytes)
		p, err := l.D2T(nil, xb, m)
		if err != nil {
			t.Fatal(err)
		}
		packed[k] = p.Words
		d2t = ms // the last kernel's time, for the tails below
	}
	// The D2T kernels accumulate alike.
	if a, b := packed[KernelMMA], packed[KernelWGMMA]; a != nil && b != nil && !slices.Equal(a, b) {
		t.Errorf("seed %d: the D2T kernels pack differently", seed)
	}
	l.Kernel = KernelAuto
	dense := medianMS(t, dev, 20, func() error { return l.Dense(nil, yb, xb, m) })
	p, err := l.D2T(nil, xb, m)
	if err != nil {
		t.Fatal(err)
	}
	pairs := float64(p.NNZ)
	t.Logf("m=%d: dense %.3f ms, D2T %.3f ms; %.1f active/token", m, dense, d2t, pairs/float64(m))
	for _, tail := range []Tail{TailWarp, TailSorted} {
		l.Tail = tail
		sparse := medianMS(t, dev, 20, func() error { return l.Sparse(nil, yb, xb, m) })
		t.Logf("tail %v: sparse %.3f ms = D2T + %.3f ms (%.2fx dense)", tail, sparse, sparse-d2t, dense/sparse)
	}
	// The down kernel alone, on the compact lists and the length order the
	// last sparse call, TailSorted's, left.
	if err := dev.Synchronize(); err != nil {
		t.Fatal(err)
	}
	set, _ := l.k.t2dFor(d)
	w := l.splitWidth()
	fn := map[int]*cuda.Function{16: set.ws16, 8: set.ws8}[w]
	ms := medianMS(t, dev, 20, func() error {
		return fn.Launch(cuda.Dim3{uint32(d / w), 1, 1}, cuda.Dim3{1024, 1, 1}, f*w*2, nil,
			l.ws.sp.packed, l.ws.sp.cnt, l.ws.sp.order, l.down, yb, int32(m), int32(d), int32(f), int32(f/8), int32(m))
	})
	t.Logf("t2d_ws<%d> alone: %.3f ms (%.2f G pairs/s)", w, ms, pairs/ms/1e6)
	for name, fn := range map[string]*cuda.Function{"t2d<true>": set.gated, "t2u<true>": set.t2uGated,
		"t2d_ws<16>": set.ws16, "row_fallback<true>": set.fbGated} {
		a, _ := fn.Attributes()
		t.Logf("%s: %d registers, %d B local", name, a.NumRegs, a.LocalBytes)
	}
}

// TestProfileKernels runs the SparseLM-shape kernels a few times each for a
// profiler (ncu -k ...): the cuBLASLt gate GEMM, the default D2T and the
// sparse MLP with the sorted tail, for 65536 tokens or TWELL_PROFILE_M. An
// experiment, not a check: set TWELL_PROFILE=1 to run it.
func TestProfileKernels(t *testing.T) {
	if os.Getenv("TWELL_PROFILE") == "" {
		t.Skip("set TWELL_PROFILE=1 to run the kernels for a profiler")
	}
	d, f, m := 2048, 5632, 65536
	if v := os.Getenv("TWELL_PROFILE_M"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("TWELL_PROFILE_M=%q: want a positive token count", v)
		}
		m = n
	}
	dev, blas := setup(t)
	l, xb, _ := sparseLMLayer(t, dev, blas, m)
	l.Tail = TailSorted
	yb := cudatest.Alloc(t, dev, max(2*m*d, 2*m*f))
	// No gathered dense pass for flagged rows unless a call reports some:
	// its small cuBLASLt GEMMs would shift a profiler's kernel count.
	l.flagKnown, l.flagRate = true, 0
	for i := 0; i < 2; i++ {
		if err := blas.Matmul(nil, cublas.Gemm{M: m, N: f, K: d, TransB: true}, xb, l.gate, yb); err != nil {
			t.Fatal(err)
		}
		if err := l.QueueD2T(nil, xb, m); err != nil {
			t.Fatal(err)
		}
		if err := l.Sparse(nil, yb, xb, m); err != nil {
			t.Fatal(err)
		}
	}
	if err := dev.Synchronize(); err != nil {
		t.Fatal(err)
	}
}
