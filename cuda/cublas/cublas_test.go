package cublas

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/cuda/internal/dl"
	"github.com/twell-ai/twell/internal/testutil"
)

func fakeLookup(string) (uintptr, error) { return 0x1000, nil }

func TestBindingSignatures(t *testing.T) {
	if err := dl.Bind("fake libcublasLt", fakeLookup, (&ltLib{}).symbols()); err != nil {
		t.Fatal(err)
	}
	if err := dl.Bind("fake libcublas", fakeLookup, (&legacyLib{}).symbols()); err != nil {
		t.Fatal(err)
	}
}

// rowMajorRef computes C = alpha·op(A)·op(B) + beta·C in float64 from the
// row-major description.
func rowMajorRef(g Gemm, a, b, c []float64) {
	for bt := 0; bt < g.Batch; bt++ {
		for i := 0; i < g.M; i++ {
			for j := 0; j < g.N; j++ {
				var s float64
				for k := 0; k < g.K; k++ {
					var x, y float64
					if g.TransA {
						x = a[int64(bt)*g.StrideA+int64(k*g.LDA+i)]
					} else {
						x = a[int64(bt)*g.StrideA+int64(i*g.LDA+k)]
					}
					if g.TransB {
						y = b[int64(bt)*g.StrideB+int64(j*g.LDB+k)]
					} else {
						y = b[int64(bt)*g.StrideB+int64(k*g.LDB+j)]
					}
					s += x * y
				}
				idx := int64(bt)*g.StrideC + int64(i*g.LDC+j)
				c[idx] = float64(g.Alpha)*s + float64(g.Beta)*c[idx]
			}
		}
	}
}

// colMajorEmu runs the column-major problem cuBLAS would get, on the CPU:
// C(col-major, m×n) = op(first)·op(second), first = the B buffer.
func colMajorEmu(cm colMajor, g Gemm, a, b, c []float64) {
	at := func(buf []float64, base int64, ld, r, col int) float64 { return buf[base+int64(col*ld+r)] }
	for bt := 0; bt < g.Batch; bt++ {
		for i := 0; i < cm.m; i++ {
			for j := 0; j < cm.n; j++ {
				var s float64
				for k := 0; k < cm.k; k++ {
					var x, y float64
					if cm.transA == 1 {
						x = at(b, int64(bt)*cm.strideA, cm.lda, k, i)
					} else {
						x = at(b, int64(bt)*cm.strideA, cm.lda, i, k)
					}
					if cm.transB == 1 {
						y = at(a, int64(bt)*cm.strideB, cm.ldb, j, k)
					} else {
						y = at(a, int64(bt)*cm.strideB, cm.ldb, k, j)
					}
					s += x * y
				}
				idx := int64(bt)*cm.strideC + int64(j*cm.ldc+i)
				c[idx] = float64(g.Alpha)*s + float64(g.Beta)*c[idx]
			}
		}
	}
}

// TestColumnMajorMapping checks, without a GPU, that the row-major problem
// is handed to cuBLAS as the right column-major one.
func TestColumnMajorMapping(t *testing.T) {
	rng, seed := testutil.Rand(t)
	for trial := 0; trial < 40; trial++ {
		g := Gemm{M: 1 + rng.IntN(9), N: 1 + rng.IntN(9), K: 1 + rng.IntN(9),
			TransA: rng.IntN(2) == 1, TransB: rng.IntN(2) == 1, Batch: 1 + rng.IntN(3),
			Alpha: float32(rng.IntN(3) + 1), Beta: float32(rng.IntN(3))}
		if rng.IntN(2) == 1 {
			g.LDA, g.LDB, g.LDC = 12, 13, 14
		}
		g, err := g.normalized()
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		a := randSlice(rng, int(g.StrideA)*g.Batch+200)
		b := randSlice(rng, int(g.StrideB)*g.Batch+200)
		c := randSlice(rng, int(g.StrideC)*g.Batch+200)
		want := append([]float64(nil), c...)
		rowMajorRef(g, a, b, want)
		colMajorEmu(g.colMajor(), g, a, b, c)
		for i := range c {
			if math.Abs(c[i]-want[i]) > 1e-9 {
				t.Fatalf("seed %d, %+v: element %d = %v, want %v", seed, g, i, c[i], want[i])
			}
		}
	}
}

func randSlice(rng *rand.Rand, n int) []float64 {
	s := make([]float64, n)
	for i := range s {
		s[i] = float64(rng.IntN(7) - 3)
	}
	return s
}

func TestNormalizedErrors(t *testing.T) {
	for _, g := range []Gemm{{M: 0, N: 1, K: 1}, {M: 4, N: 4, K: 4, LDA: 3}, {M: 4, N: 4, K: 4, LDC: 2}, {M: 1, N: 1, K: 1, CType: 9}} {
		if _, err := g.normalized(); err == nil {
			t.Errorf("%+v: no error", g)
		}
	}
	g, err := Gemm{M: 2, N: 3, K: 4, TransA: true}.normalized()
	if err != nil || g.LDA != 2 || g.LDB != 3 || g.LDC != 3 || g.Alpha != 1 || g.Batch != 1 {
		t.Errorf("defaults: %+v, %v", g, err)
	}
}

func handle(t *testing.T) (*cuda.Device, *Handle) {
	t.Helper()
	dev := cudatest.Device(t)
	h, err := New(dev)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return dev, h
}

// upload writes n random bf16 (or f32) values in [-1, 1) and returns them.
func upload(t *testing.T, dev *cuda.Device, rng *rand.Rand, n int, typ DataType) (*cuda.Buffer, []float64) {
	t.Helper()
	vals := make([]float64, n)
	var raw []byte
	switch typ {
	case F32:
		f := make([]float32, n)
		for i := range f {
			f[i] = float32(rng.Float64()*2 - 1)
			vals[i] = float64(f[i])
		}
		raw = cuda.Bytes(f)
	default:
		h := make([]uint16, n)
		for i := range h {
			h[i] = bf16.FromFloat32(float32(rng.Float64()*2 - 1))
			vals[i] = float64(bf16.ToFloat32(h[i]))
		}
		raw = cuda.Bytes(h)
	}
	buf, err := dev.Alloc(len(raw))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { buf.Free() })
	if err := dev.CopyHtoD(buf, raw); err != nil {
		t.Fatal(err)
	}
	return buf, vals
}

func download(t *testing.T, dev *cuda.Device, buf *cuda.Buffer, n int, typ DataType) []float64 {
	t.Helper()
	out := make([]float64, n)
	if typ == F32 {
		f := make([]float32, n)
		if err := dev.CopyDtoH(cuda.Bytes(f), buf); err != nil {
			t.Fatal(err)
		}
		for i, v := range f {
			out[i] = float64(v)
		}
		return out
	}
	h := make([]uint16, n)
	if err := dev.CopyDtoH(cuda.Bytes(h), buf); err != nil {
		t.Fatal(err)
	}
	for i, v := range h {
		out[i] = float64(bf16.ToFloat32(v))
	}
	return out
}

// relErr returns ‖got − want‖₂ / ‖want‖₂ over the entries of C.
func relErr(g Gemm, got, want []float64) float64 {
	var num, den float64
	for bt := 0; bt < g.Batch; bt++ {
		for i := 0; i < g.M; i++ {
			for j := 0; j < g.N; j++ {
				idx := int64(bt)*g.StrideC + int64(i*g.LDC+j)
				d := got[idx] - want[idx]
				num += d * d
				den += want[idx] * want[idx]
			}
		}
	}
	return math.Sqrt(num / den)
}

// TestMatmulAgainstFloat64 checks GEMMs of several shapes, transposes,
// strides and batches, on fresh random bf16 data, through each backend,
// against a float64 CPU reference: relative error ≤ 1e-2. The cases with
// an addend also run through MatmulAdd into a separate output, whose
// addend must come back unchanged.
func TestMatmulAgainstFloat64(t *testing.T) {
	dev, h := handle(t)
	rng, seed := testutil.Rand(t)
	cases := []Gemm{
		{M: 256, N: 384, K: 512},
		{M: 128, N: 256, K: 1024, TransB: true},
		{M: 192, N: 64, K: 320, TransA: true, TransB: true},
		{M: 64, N: 128, K: 256, TransA: true, Batch: 4},
		{M: 96, N: 160, K: 128, LDA: 136, LDB: 168, LDC: 176, Batch: 3, Alpha: 0.5, Beta: 2},
		{M: 128, N: 128, K: 256, CType: F32},
		{M: 256, N: 192, K: 128, TransB: true, Alpha: 1, Beta: 1, CType: F32}, // a residual add
		{M: 64, N: 96, K: 128, AType: F32, BType: F32, CType: F32},
		{M: 77, N: 45, K: 33}, // unaligned leading dimensions
	}
	for _, backend := range []Backend{Lt, Legacy, Auto} {
		if (backend == Lt && !h.HasLt()) || (backend == Legacy && !h.HasLegacy()) {
			t.Logf("%v not available", backend)
			continue
		}
		for _, c := range cases {
			for _, into := range []bool{false, true} {
				if into && c.Beta == 0 {
					continue
				}
				c.Backend = backend
				name := fmt.Sprintf("%v/%s", backend, c.describeShort())
				if into {
					name += "_into"
				}
				t.Run(name, func(t *testing.T) {
					g, err := c.normalized()
					if err != nil {
						t.Fatal(err)
					}
					ar, br := g.M, g.K
					if g.TransA {
						ar = g.K
					}
					if g.TransB {
						br = g.N
					}
					da, a := upload(t, dev, rng, int(int64(g.Batch-1)*g.StrideA)+ar*g.LDA, g.AType)
					db, b := upload(t, dev, rng, int(int64(g.Batch-1)*g.StrideB)+br*g.LDB, g.BType)
					nc := int(int64(g.Batch-1)*g.StrideC) + g.M*g.LDC
					dc, cvals := upload(t, dev, rng, nc, g.CType)
					out := dc
					if into {
						out, _ = upload(t, dev, rng, nc, g.CType)
					}
					err = h.MatmulAdd(nil, c, da, db, dc, out)
					if backend == Lt && err != nil && strings.Contains(err.Error(), "NOT_SUPPORTED") {
						t.Skipf("cuBLASLt has no algorithm: %v", err)
					}
					if err != nil {
						t.Fatalf("seed %d: %v", seed, err)
					}
					want := append([]float64(nil), cvals...)
					rowMajorRef(g, a, b, want)
					got := download(t, dev, out, nc, g.CType)
					if e := relErr(g, got, want); e > 1e-2 || math.IsNaN(e) {
						t.Fatalf("seed %d: relative error %.3g > 1e-2", seed, e)
					} else {
						t.Logf("relative error %.2e", e)
					}
					if into && !slices.Equal(download(t, dev, dc, nc, g.CType), cvals) {
						t.Errorf("seed %d: MatmulAdd changed its addend", seed)
					}
				})
			}
		}
	}
}

func (g Gemm) describeShort() string {
	s := fmt.Sprintf("%dx%dx%d", g.M, g.N, g.K)
	if g.TransA {
		s += "_TA"
	}
	if g.TransB {
		s += "_TB"
	}
	if g.Batch > 1 {
		s += fmt.Sprintf("_b%d", g.Batch)
	}
	if g.LDA != 0 {
		s += "_ld"
	}
	if g.CType == F32 {
		s += "_outF32"
	}
	if g.AType == F32 {
		s += "_inF32"
	}
	return s
}

func TestMatmulMisuse(t *testing.T) {
	dev, h := handle(t)
	small, err := dev.Alloc(1024)
	if err != nil {
		t.Fatal(err)
	}
	defer small.Free()
	err = h.Matmul(nil, Gemm{M: 64, N: 64, K: 64}, small, small, small)
	if !errors.Is(err, cuda.ErrorInvalidValue) || !strings.Contains(err.Error(), "matrix A needs 8192 bytes") {
		t.Errorf("too-small buffer: %v", err)
	}
	if err := h.Matmul(nil, Gemm{M: -1, N: 1, K: 1}, small, small, small); err == nil {
		t.Error("negative M accepted")
	}
}

// TestMatmulTiming times a 4096³ bf16 GEMM with CUDA events.
func TestMatmulTiming(t *testing.T) {
	dev, h := handle(t)
	rng, _ := testutil.Rand(t)
	const n = 4096
	a, _ := upload(t, dev, rng, n*n, BF16)
	b, _ := upload(t, dev, rng, n*n, BF16)
	c, _ := upload(t, dev, rng, n*n, BF16)
	g := Gemm{M: n, N: n, K: n}
	start, _ := dev.NewEvent()
	end, err := dev.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	defer start.Destroy()
	defer end.Destroy()
	for i := 0; i < 3; i++ {
		if err := h.Matmul(nil, g, a, b, c); err != nil {
			t.Fatal(err)
		}
	}
	const reps = 10
	start.Record(nil)
	for i := 0; i < reps; i++ {
		if err := h.Matmul(nil, g, a, b, c); err != nil {
			t.Fatal(err)
		}
	}
	end.Record(nil)
	if err := end.Synchronize(); err != nil {
		t.Fatal(err)
	}
	dt, err := start.Elapsed(end)
	if err != nil {
		t.Fatal(err)
	}
	tf := g.Flops() * reps / dt.Seconds() / 1e12
	t.Logf("4096³ bf16 GEMM: %v each, %.0f TFLOP/s", dt/reps, tf)
	if tf < 50 {
		t.Errorf("%.0f TFLOP/s is implausibly slow", tf)
	}
}

// TestTunedMatmul checks the timed choice of algorithms (TuneFlops): tuned
// products match float64, each is tuned once and then reuses its choice,
// and calls that must not run twice (output = addend, or a stream
// capturing a graph) take the heuristic's choice untimed and add C once.
func TestTunedMatmul(t *testing.T) {
	dev, h := handle(t)
	if !h.HasLt() {
		t.Skip("cuBLASLt not available")
	}
	h.TuneFlops = 1
	rng, seed := testutil.Rand(t)
	check := func(g Gemm, dc *cuda.Buffer, a, b, c []float64) {
		t.Helper()
		g, _ = g.normalized()
		want := append([]float64(nil), c...)
		rowMajorRef(g, a, b, want)
		got := download(t, dev, dc, g.M*g.N, g.CType)
		if e := relErr(g, got, want); e > 1e-2 || math.IsNaN(e) {
			t.Fatalf("seed %d: %s: relative error %.3g > 1e-2", seed, g.describeShort(), e)
		}
	}
	g := Gemm{M: 256 + 64*rng.IntN(4), N: 384, K: 512, TransB: true, Backend: Lt}
	da, a := upload(t, dev, rng, g.M*g.K, BF16)
	db, b := upload(t, dev, rng, g.N*g.K, BF16)
	dc, c := upload(t, dev, rng, g.M*g.N, BF16)
	for range 2 {
		if err := h.Matmul(nil, g, da, db, dc); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		check(g, dc, a, b, make([]float64, len(c)))
	}
	tn := h.Tunings()
	if len(tn) > 1 {
		t.Fatalf("one product tuned %d times: %+v", len(tn), tn)
	}
	if len(tn) == 1 { // none if the heuristic offered one algorithm
		ran := 0
		for _, cd := range tn[0].Candidates {
			if cd.Err == "" {
				ran++
				if cd.Time <= 0 {
					t.Errorf("candidate %d ran in %v", cd.Rank, cd.Time)
				}
			}
		}
		if ch := tn[0].Chosen; ch < 0 || ch >= len(tn[0].Candidates) || tn[0].Candidates[ch].Err != "" || ran < 2 {
			t.Fatalf("tuning %+v", tn[0])
		}
		t.Logf("%s: chose rank %d of %d", tn[0].Gemm, tn[0].Chosen, len(tn[0].Candidates))
	}

	// An addend that is also the output: C += A·Bᵀ exactly once, untimed.
	acc := Gemm{M: 128, N: 256, K: 384, TransB: true, Alpha: 1, Beta: 1, CType: F32, Backend: Lt}
	xa, av := upload(t, dev, rng, acc.M*acc.K, BF16)
	xb, bv := upload(t, dev, rng, acc.N*acc.K, BF16)
	xc, cv := upload(t, dev, rng, acc.M*acc.N, F32)
	if err := h.Matmul(nil, acc, xa, xb, xc); err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	check(acc, xc, av, bv, cv)
	// The same through a second view of the addend's memory: still once.
	cv2 := download(t, dev, xc, acc.M*acc.N, F32)
	view, err := xc.Slice(0, xc.Len())
	if err != nil {
		t.Fatal(err)
	}
	if err := h.MatmulAdd(nil, acc, xa, xb, xc, view); err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	check(acc, xc, av, bv, cv2)
	if n := len(h.Tunings()); n != len(tn) {
		t.Fatalf("an addend-is-output call was tuned: %d tunings, want %d", n, len(tn))
	}

	// An addend apart from the output: timed, D = A·Bᵀ + C whatever the runs.
	wa, wav := upload(t, dev, rng, acc.M*acc.K, BF16)
	wc, wcv := upload(t, dev, rng, acc.M*acc.N, F32)
	wd, _ := upload(t, dev, rng, acc.M*acc.N, F32)
	if err := h.MatmulAdd(nil, acc, wa, xb, wc, wd); err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	check(acc, wd, wav, bv, wcv)
	nt := len(h.Tunings())

	// A capturing stream: recorded untimed, the replay computes the product.
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Destroy()
	cg := Gemm{M: 192, N: 320, K: 256, Backend: Lt}
	ya, yav := upload(t, dev, rng, cg.M*cg.K, BF16)
	yb, ybv := upload(t, dev, rng, cg.K*cg.N, BF16)
	yc, _ := upload(t, dev, rng, cg.M*cg.N, BF16)
	if err := s.BeginCapture(); err != nil {
		t.Fatal(err)
	}
	err = h.Matmul(s, cg, ya, yb, yc)
	gr, errEnd := s.EndCapture()
	if err != nil || errEnd != nil {
		t.Fatalf("seed %d: capture: %v, %v", seed, err, errEnd)
	}
	defer gr.Destroy()
	if err := gr.Launch(s); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	check(cg, yc, yav, ybv, make([]float64, cg.M*cg.N))
	if n := len(h.Tunings()); n != nt {
		t.Fatalf("the captured call was tuned: %d tunings, want %d", n, nt)
	}
}

// failingLt is a cuBLASLt stand-in whose calls fail from the failAt-th on
// (counting from 1; 0: none fails) and that counts the descriptors, layouts
// and preferences alive.
type failingLt struct {
	calls, failAt, alive int
	cands                []int32 // states of the heuristic's results
}

func (f *failingLt) call() int32 {
	f.calls++
	if f.failAt > 0 && f.calls >= f.failAt {
		return 7 // CUBLAS_STATUS_INVALID_VALUE
	}
	return 0
}

func (f *failingLt) lib() *ltLib {
	create := func(h *uintptr) int32 {
		if r := f.call(); r != 0 {
			return r
		}
		f.alive++
		*h = uintptr(f.calls)
		return 0
	}
	destroy := func(uintptr) int32 { f.alive--; return 0 }
	set := func(uintptr, int32, unsafe.Pointer, uint64) int32 { return f.call() }
	return &ltLib{
		descCreate:    func(d *uintptr, _, _ int32) int32 { return create(d) },
		descDestroy:   destroy,
		descSet:       set,
		layoutCreate:  func(l *uintptr, _ int32, _, _ uint64, _ int64) int32 { return create(l) },
		layoutDestroy: destroy,
		layoutSet:     set,
		prefCreate:    create,
		prefDestroy:   destroy,
		prefSet:       set,
		heuristic: func(_, _, _, _, _, _, _ uintptr, n int32, results unsafe.Pointer, count *int32) int32 {
			if r := f.call(); r != 0 {
				return r
			}
			res := unsafe.Slice((*heuristicResult)(results), n)
			*count = int32(min(len(f.cands), int(n)))
			for i := range *count {
				res[i] = heuristicResult{state: f.cands[i]}
			}
			return 0
		},
	}
}

// TestNewPlanFailures fails each cuBLASLt call of building a plan in turn,
// and lets the heuristic offer nothing usable: newPlan returns an error, no
// plan, and leaves nothing it created alive.
func TestNewPlanFailures(t *testing.T) {
	g, err := Gemm{M: 64, N: 96, K: 128, TransB: true, Alpha: 1, Batch: 2, StrideA: 64 * 128, StrideB: 96 * 128, StrideC: 64 * 96}.normalized()
	if err != nil {
		t.Fatal(err)
	}
	ok := &failingLt{cands: []int32{0}}
	h := &Handle{lt: ok.lib(), workspace: &cuda.Buffer{}}
	p, cands, err := h.newPlan(g, planKey{g: g, alignA: 16, alignB: 16, aC: 16})
	if err != nil || p == nil || len(cands) != 1 {
		t.Fatalf("no failure: plan %v, %d candidates, err %v", p, len(cands), err)
	}
	p.destroy(h.lt)
	if ok.alive != 0 {
		t.Fatalf("no failure: %d objects left alive", ok.alive)
	}
	steps := ok.calls
	for failAt := 1; failAt <= steps+1; failAt++ {
		f := &failingLt{failAt: failAt, cands: []int32{0}}
		if failAt == steps+1 { // every call succeeds, no candidate is usable
			f = &failingLt{cands: []int32{3, 5}}
		}
		h := &Handle{lt: f.lib(), workspace: &cuda.Buffer{}}
		p, cands, err := h.newPlan(g, planKey{g: g, alignA: 16, alignB: 16, aC: 16})
		if err == nil || p != nil || cands != nil {
			t.Errorf("failing at call %d of %d: plan %v, %d candidates, err %v; want an error alone", failAt, steps, p, len(cands), err)
		}
		if f.alive != 0 {
			t.Errorf("failing at call %d of %d: %d objects left alive", failAt, steps, f.alive)
		}
	}
}
