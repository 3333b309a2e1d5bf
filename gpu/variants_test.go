package gpu

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/twell"
)

// medianMS times run with CUDA events: 3 warm-up calls, then the median of
// reps.
func medianMS(t *testing.T, dev *cuda.Device, reps int, run func() error) float64 {
	t.Helper()
	start, _ := dev.NewEvent()
	end, _ := dev.NewEvent()
	defer start.Destroy()
	defer end.Destroy()
	for i := 0; i < 3; i++ {
		if err := run(); err != nil {
			t.Fatal(err)
		}
	}
	ts := make([]float64, reps)
	for i := range ts {
		start.Record(nil)
		if err := run(); err != nil {
			t.Fatal(err)
		}
		end.Record(nil)
		if err := end.Synchronize(); err != nil {
			t.Fatal(err)
		}
		d, _ := start.Elapsed(end)
		ts[i] = float64(d) / float64(time.Millisecond)
	}
	for i := 1; i < len(ts); i++ { // insertion sort: reps is small
		for j := i; j > 0 && ts[j] < ts[j-1]; j-- {
			ts[j], ts[j-1] = ts[j-1], ts[j]
		}
	}
	return ts[len(ts)/2]
}

// sparseLMLayer returns an MLP of the SparseLM shape (d 2048, f 5632) with
// random weights and a uniform 0.5% gate, and m random input tokens on the
// device, both freed when the test ends, and the seed they came from.
func sparseLMLayer(t *testing.T, dev *cuda.Device, blas *cublas.Handle, m int) (*MLP, *cuda.Buffer, uint64) {
	t.Helper()
	r, seed := cudatest.Rand()
	const d, f = 2048, 5632
	sl, err := synth.NewLayer(r, d, f, 0.005, synth.Uniform, true)
	if err != nil {
		t.Fatal(err)
	}
	l, err := NewMLP(dev, blas, sl.Gate, sl.Up, sl.Down, d, f, twell.DefaultLayout)
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	t.Cleanup(func() { l.Close() })
	xb, err := Upload(dev, synth.Tokens(r, m, d))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { xb.Free() })
	return l, xb, seed
}

// TestD2TVariants times build-time variants of the wgmma D2T kernel and the
// sparse tail on the SparseLM shape, and logs the compiler's resource report.
// It is an experiment, not a check: set TWELL_D2T_VARIANTS=1 to run it
// (=nopipe: without the pipelined-epilogue kernel).
func TestD2TVariants(t *testing.T) {
	if os.Getenv("TWELL_D2T_VARIANTS") == "" {
		t.Skip("set TWELL_D2T_VARIANTS=1 to time the D2T kernel variants")
	}
	dev, blas := setup(t)
	if dev.Properties().Arch != "sm_90a" {
		t.Skipf("the wgmma D2T kernel needs sm_90a; %v is %s", dev, dev.Properties().Arch)
	}
	d, f, m := 2048, 5632, 65536
	l, xb, seed := sparseLMLayer(t, dev, blas, m)
	yb, err := dev.Alloc(2 * m * d)
	if err != nil {
		t.Fatal(err)
	}
	defer yb.Free()
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
	for _, v := range []struct {
		name     string
		pipe     bool
		stages   int // 0: the kernel's default
		clusters int // 0: the default 64
		opts     []string
	}{
		{name: "default"},
		{name: "pipe", pipe: true},
		{name: "pipe-nodefer", pipe: true, opts: []string{"-DTW_DEFER=0"}},
		{name: "pipe-arrive0", pipe: true, opts: []string{"-DTW_ARRIVE=0"}},
		{name: "pipe-g4", pipe: true, opts: []string{"-DTW_GROUP=4"}},
		{name: "pipe-64cl", pipe: true, clusters: 64},
		{name: "pipe-nopack", pipe: true, opts: []string{"-DTW_EPI=0"}},
		{name: "noepi", opts: []string{"-DTW_EPI=0"}},
		{name: "noepi-arrive0", opts: []string{"-DTW_EPI=0", "-DTW_ARRIVE=0"}},
		{name: "peel", opts: []string{"-DTW_PEEL=1"}},
		{name: "pipe-peel", pipe: true, opts: []string{"-DTW_PEEL=1"}},
		{name: "pipe-nopack-peel", pipe: true, opts: []string{"-DTW_EPI=0", "-DTW_PEEL=1"}},
	} {
		if v.pipe && os.Getenv("TWELL_D2T_VARIANTS") == "nopipe" {
			continue
		}
		opts := append([]string{"--ptxas-options=-v"}, v.opts...)
		name := wgmmaName(32, v.pipe)
		if v.stages > 0 {
			name = fmt.Sprintf("d2t_wgmma<32,%d>", v.stages)
		}
		mod, err := dev.Compile("d2t_wgmma.cu", d2tWGMMASrc, cuda.WithHeader("common.cuh", commonCUH),
			cuda.WithHeader("wgmma.cuh", wgmmaCUH), cuda.WithNameExpressions(name), cuda.WithOptions(opts...))
		if err != nil {
			t.Errorf("%s: %v", v.name, err)
			continue
		}
		fn, err := mod.Function(name)
		if err != nil {
			t.Fatal(err)
		}
		if v.name == "default" || v.name == "pipe" || strings.HasSuffix(v.name, "peel") {
			t.Logf("%s compiler log:\n%s", v.name, mod.Program().Log)
		}
		a, _ := fn.Attributes()
		l.d2tOverride, l.d2tOverrideK = fn, KernelWGMMA
		if v.pipe {
			l.d2tOverrideK = KernelWGMMAPipe
		}
		l.d2tClusters = v.clusters
		ms := medianMS(t, dev, 20, func() error { return l.QueueD2T(nil, xb, m) })
		l.d2tClusters = 0
		t.Logf("D2T %-12s %.3f ms  %.0f TFLOP/s  (%d registers, %d B local)", v.name, ms, flop/ms/1e9, a.NumRegs, a.LocalBytes)
		if v.name != "default" && !slices.ContainsFunc(v.opts, func(o string) bool { return o == "-DTW_EPI=0" }) {
			p, err := l.D2T(nil, xb, m)
			if err != nil {
				t.Fatal(err)
			}
			saved, savedK := l.d2tOverride, l.d2tOverrideK
			l.d2tOverride, l.Kernel = nil, KernelWGMMA
			q, err := l.D2T(nil, xb, m)
			l.Kernel = KernelAuto
			l.d2tOverride, l.d2tOverrideK = saved, savedK
			if err != nil {
				t.Fatal(err)
			}
			same := len(p.Words) == len(q.Words)
			for i := 0; same && i < len(p.Words); i++ {
				same = p.Words[i] == q.Words[i]
			}
			t.Logf("D2T %s output identical to the default kernel's: %v", v.name, same)
			if !same {
				t.Errorf("seed %d: D2T %s packs differently from the default kernel", seed, v.name)
			}
		}
	}
	l.d2tOverride = nil
	d2t := medianMS(t, dev, 20, func() error { return l.QueueD2T(nil, xb, m) })
	dense := medianMS(t, dev, 20, func() error { return l.Dense(nil, yb, xb, m) })
	p, err := l.D2T(nil, xb, m)
	if err != nil {
		t.Fatal(err)
	}
	pairs := float64(p.NNZ)
	t.Logf("m=%d: dense %.3f ms, D2T %.3f ms; %.1f active/token", m, dense, d2t, pairs/float64(m))
	for _, tail := range []Tail{TailWarp, TailSplit, TailSorted} {
		l.Tail = tail
		sparse := medianMS(t, dev, 20, func() error { return l.Sparse(nil, yb, xb, m) })
		t.Logf("tail %v: sparse %.3f ms = D2T + %.3f ms (%.2fx dense)", tail, sparse, sparse-d2t, dense/sparse)
	}
	// The split tail's down kernel alone, on the compact lists (and the
	// length order) the last sparse call, TailSorted's, left.
	if err := dev.Synchronize(); err != nil {
		t.Fatal(err)
	}
	set, _ := l.k.t2dFor(d)
	w := l.splitWidth()
	fn := map[int]*cuda.Function{16: set.ws16, 8: set.ws8}[w]
	for _, order := range []any{cuda.DevicePtr(0), l.ws.sp.order} {
		ms := medianMS(t, dev, 20, func() error {
			return fn.Launch(cuda.Dim3{uint32(d / w), 1, 1}, cuda.Dim3{1024, 1, 1}, f*w*2, nil,
				l.ws.sp.packed, l.ws.sp.cnt, order, l.down, yb, int32(m), int32(d), int32(f), int32(f/8), int32(m))
		})
		t.Logf("t2d_ws<%d> alone, length order %v: %.3f ms (%.2f G pairs/s)", w, order != cuda.DevicePtr(0), ms, pairs/ms/1e6)
	}
	// compileT2D builds one kernel of t2d.cu for d = 2048 with extra defines.
	compileT2D := func(name string, defines ...string) (*cuda.Function, error) {
		mod, err := dev.Compile("t2d.cu", t2dSrc, cuda.WithHeader("common.cuh", commonCUH), cuda.WithHeader("wgmma.cuh", wgmmaCUH),
			cuda.WithNameExpressions(name), cuda.WithOptions(append([]string{"-DTW_NCH=8"}, defines...)...))
		if err != nil {
			return nil, err
		}
		return mod.Function(name)
	}
	for _, loads := range []int{1, 4} {
		fn, err := compileT2D(fmt.Sprintf("t2d_ws<%d>", w), fmt.Sprintf("-DTW_WS_LOADS=%d", loads))
		if err != nil {
			t.Errorf("t2d_ws with %d loads: %v", loads, err)
			continue
		}
		ms := medianMS(t, dev, 20, func() error {
			return fn.Launch(cuda.Dim3{uint32(d / w), 1, 1}, cuda.Dim3{1024, 1, 1}, f*w*2, nil,
				l.ws.sp.packed, l.ws.sp.cnt, cuda.DevicePtr(0), l.down, yb, int32(m), int32(d), int32(f), int32(f/8), int32(m))
		})
		t.Logf("t2d_ws<%d> alone, %d list loads in flight: %.3f ms", w, loads, ms)
	}
	// t2u rewrites the packed rows, so it is timed with the D2T before it.
	for _, v := range []struct {
		name string
		opts []string
	}{{"t2u default", nil}, {"t2u 1 block/SM", []string{"-DTW_T2U_MINB=1"}},
		// One U row in flight per warp: no spills under ptxas 12.4 (118
		// registers), where the default spills 220 bytes at the 128 cap.
		{"t2u 1 row", []string{"-DTW_T2U_ROWS=1"}}} {
		fn, err := compileT2D("t2u<true>", v.opts...)
		if err != nil {
			t.Errorf("%s: %v", v.name, err)
			continue
		}
		a, _ := fn.Attributes()
		ms := medianMS(t, dev, 20, func() error {
			ws, err := l.runD2T(nil, xb, m)
			if err != nil {
				return err
			}
			return fn.Launch(cuda.Dim3{uint32((m + 7) / 8), 1, 1}, cuda.Dim3{256, 1, 1}, 0, nil,
				xb, ws.packed, l.up, ws.cnt, ws.flags, int32(m), int32(d), int32(32), int32(f/256), int32(f/8))
		})
		t.Logf("%-16s D2T + t2u %.3f ms: t2u %.3f ms, %.2f TB/s of U rows (%d registers, %d B local)",
			v.name, ms, ms-d2t, pairs*2*float64(d)/(ms-d2t)/1e9, a.NumRegs, a.LocalBytes)
	}
	for name, fn := range map[string]*cuda.Function{"t2d<true>": set.gated, "t2u<true>": set.t2uGated,
		"t2d_ws<16>": set.ws16, "row_fallback<true>": set.fbGated} {
		a, _ := fn.Attributes()
		t.Logf("%s: %d registers, %d B local", name, a.NumRegs, a.LocalBytes)
	}
}

// TestProfileKernels runs the SparseLM-shape kernels a few times each for a
// profiler (ncu -k ...): the cuBLASLt gate GEMM, the default D2T and the
// sparse MLP with the split tail. An experiment, not a check: set
// TWELL_PROFILE=1 to run it.
func TestProfileKernels(t *testing.T) {
	if os.Getenv("TWELL_PROFILE") == "" {
		t.Skip("set TWELL_PROFILE=1 to run the kernels for a profiler")
	}
	dev, blas := setup(t)
	d, f, m := 2048, 5632, 65536
	l, xb, _ := sparseLMLayer(t, dev, blas, m)
	l.Tail = TailSplit
	yb, err := dev.Alloc(max(2*m*d, 2*m*f))
	if err != nil {
		t.Fatal(err)
	}
	defer yb.Free()
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
