package cupti

import (
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/cuda/internal/dl"
)

func TestMain(m *testing.M) { cudatest.Main(m) }

// record lays out a CUpti_ActivityKernel record with k's fields, its name
// pointer at name (nil: none), in a buffer of n bytes.
func record(kind uint32, k Kernel, name *byte, n int) []byte {
	b := make([]byte, n)
	le := binary.LittleEndian
	le.PutUint32(b[0:], kind)
	if n < kernelRecordMin {
		return b
	}
	le.PutUint16(b[offRegisters:], k.Registers)
	le.PutUint64(b[offStart:], k.Start)
	le.PutUint64(b[offEnd:], k.End)
	le.PutUint32(b[offDevice:], k.Device)
	le.PutUint32(b[offContext:], k.Context)
	le.PutUint32(b[offStream:], k.Stream)
	for i := range 3 {
		le.PutUint32(b[offGrid+4*i:], uint32(k.Grid[i]))
		le.PutUint32(b[offBlock+4*i:], uint32(k.Block[i]))
	}
	le.PutUint32(b[offStaticShared:], uint32(k.StaticShared))
	le.PutUint32(b[offDynamicShared:], uint32(k.DynamicShared))
	le.PutUint32(b[offCorrelation:], k.Correlation)
	le.PutUint64(b[offGraphNode:], k.GraphNode)
	le.PutUint32(b[offGraph:], k.Graph)
	*(*unsafe.Pointer)(unsafe.Pointer(&b[offName])) = unsafe.Pointer(name)
	return b
}

func TestParseKernelReadsEveryField(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 1))
	cname := []byte("_Z8gemv_actILi4ELb1ELb0EEvPKt\x00")
	for range 100 {
		start := r.Uint64() >> 1
		want := Kernel{Name: "gemv_act<4, true, false>", Start: start, End: start + r.Uint64N(1<<30),
			Device: r.Uint32(), Context: r.Uint32(), Stream: r.Uint32(), Correlation: r.Uint32(), Graph: r.Uint32(),
			GraphNode: r.Uint64(), Registers: uint16(r.Uint32()), StaticShared: int32(r.Uint32()),
			DynamicShared: int32(r.Uint32())}
		for i := range 3 {
			want.Grid[i], want.Block[i] = int32(r.Uint32()), int32(r.Uint32())
		}
		kind := []uint32{kindConcurrentKernel, kindKernel}[r.IntN(2)]
		rec := record(kind, want, &cname[0], kernelRecordMin+8*r.IntN(8))
		got, ok, err := parseKernel(rec, func(p unsafe.Pointer) string {
			if p != unsafe.Pointer(&cname[0]) {
				t.Fatalf("seed %d: name pointer %p, want %p", seed, p, &cname[0])
			}
			s := unsafe.String((*byte)(p), len(cname)-1)
			return Demangle(s)
		})
		if err != nil || !ok {
			t.Fatalf("seed %d: parseKernel: ok %v, err %v", seed, ok, err)
		}
		if got != want {
			t.Fatalf("seed %d: parsed\n%+v\nwant\n%+v", seed, got, want)
		}
		if got.Duration() != want.End-want.Start {
			t.Fatalf("seed %d: Duration %d, want %d", seed, got.Duration(), want.End-want.Start)
		}
	}
}

func TestParseKernelOtherRecords(t *testing.T) {
	noName := func(unsafe.Pointer) string { t.Fatal("name read for a record without one"); return "" }
	// Other kinds are skipped, whatever their size.
	for _, kind := range []uint32{0, 1, 2, 4, 5, 9, 11, 40} {
		for _, n := range []int{8, 64, kernelRecordMin} {
			if _, ok, err := parseKernel(record(kind, Kernel{}, nil, n), noName); ok || err != nil {
				t.Errorf("kind %d, %d bytes: ok %v, err %v; want skipped", kind, n, ok, err)
			}
		}
	}
	// A kernel record without a name gets none.
	k, ok, err := parseKernel(record(kindConcurrentKernel, Kernel{Start: 5, End: 9}, nil, kernelRecordMin), noName)
	if !ok || err != nil || k.Name != "" || k.Start != 5 || k.End != 9 {
		t.Errorf("nameless record: %+v ok %v err %v", k, ok, err)
	}
	// Records too short for their kind are errors, not panics.
	for _, n := range []int{0, 3} {
		if _, _, err := parseKernel(make([]byte, n), noName); err == nil {
			t.Errorf("%d-byte record: no error", n)
		}
	}
	if _, _, err := parseKernel(record(kindKernel, Kernel{}, nil, kernelRecordMin-8), noName); err == nil ||
		!strings.Contains(err.Error(), "kernel record") {
		t.Errorf("short kernel record: err %v", err)
	}
}

func TestDemangle(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"add_rmsnorm", "add_rmsnorm"},
		{"_Z8gemv_actILi1ELb1ELb0EEvPKtPKfS3_", "gemv_act<1, true, false>"},
		{"_Z12gemv_act_mmaILb1EEvPKtS1_", "gemv_act_mma<true>"},
		{"_Z3t2uILb1EEvPKtPjS1_PiPKiiiiii", "t2u<true>"},
		{"_Z3fooILin3ELj7EEvv", "foo<-3, 7>"},
		{"_Z3barIfiEvv", "bar<float, int>"},
		{"_ZN7cutlass6KernelINS_4gemmEEEvNT_6ParamsE", "cutlass::Kernel<...>"},
		{"_ZN2ns3fooEv", "ns::foo"},
		{"_ZN2ns3fooILi2EEEvv", "ns::foo<2>"},
		{"_Z", "_Z"},
		{"_Z99x", "_Z99x"},
		{"_ZN3fooE", "foo"},
		{"_ZNE", "_ZNE"},
		{"_Z3fooILi", "foo<...>"},
		{"", ""},
	} {
		if got := Demangle(c.in); got != c.want {
			t.Errorf("Demangle(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func FuzzDemangle(f *testing.F) {
	for _, s := range []string{"_Z8gemv_actILi1ELb1ELb0EEvPKt", "_ZN2ns3fooILi2EEEvv", "plain", "_Z3fooILin3E", "_ZN"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got := Demangle(s)
		if !strings.HasPrefix(s, "_Z") && got != s {
			t.Fatalf("Demangle(%q) = %q: a name that is not mangled must come back as it is", s, got)
		}
		if s != "" && got == "" {
			t.Fatalf("Demangle(%q) is empty", s)
		}
	})
}

// TestRecorderSeesKernelsAndGraphs launches a kernel directly and inside a
// CUDA graph recorded after Start, and wants one record per launch, with
// the names, launch shapes and ordered timestamps, the graph's kernels
// sharing one correlation id and a graph id.
func TestRecorderSeesKernelsAndGraphs(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	src, err := os.ReadFile("../testdata/vecadd.cu")
	if err != nil {
		t.Fatal(err)
	}
	mod, err := dev.Compile("vecadd.cu", src)
	if err != nil {
		t.Fatal(err)
	}
	fill, err := mod.Function("fill_u32")
	if err != nil {
		t.Fatal(err)
	}
	const n = 1 << 20
	buf := cudatest.Alloc(t, dev, 4*n)
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Destroy()
	rec, err := Start()
	if errors.Is(err, ErrNoCUPTI) && os.Getenv(cudatest.EnvRequireGPU) != "1" {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Start(); !errors.Is(err, ErrBusy) {
		t.Errorf("second Start: %v, want ErrBusy", err)
	}
	t0, err := Now()
	if err != nil {
		t.Fatal(err)
	}
	launch := func(v uint32) error {
		return fill.Launch(cuda.Dim3{64, 1, 1}, cuda.Dim3{128, 1, 1}, 0, s, buf, v, int64(n))
	}
	const direct, inGraph, replays = 5, 3, 2
	for i := range direct {
		if err := launch(uint32(i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.BeginCapture(); err != nil {
		t.Fatal(err)
	}
	for i := range inGraph {
		if err := launch(uint32(100 + i)); err != nil {
			t.Fatal(err)
		}
	}
	g, err := s.EndCapture()
	if err != nil {
		t.Fatal(err)
	}
	defer g.Destroy()
	for range replays {
		if err := g.Launch(s); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	ks, err := rec.Stop()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rec.Stop(); err == nil {
		t.Error("second Stop: no error")
	}
	var fills []Kernel
	for _, k := range ks {
		if k.Name == "fill_u32" {
			fills = append(fills, k)
		}
	}
	if len(fills) != direct+inGraph*replays {
		t.Fatalf("%d fill_u32 records (of %d), want %d", len(fills), len(ks), direct+inGraph*replays)
	}
	graphs := map[uint32]int{}
	for i, k := range fills {
		if k.Start < t0 || k.End < k.Start || (i > 0 && k.Start < fills[i-1].End) {
			t.Errorf("record %d: start %d end %d (recording began at %d, the one before ended at %d)", i, k.Start, k.End, t0, fills[max(i-1, 0)].End)
		}
		if k.Grid != [3]int32{64, 1, 1} || k.Block != [3]int32{128, 1, 1} {
			t.Errorf("record %d: grid %v block %v", i, k.Grid, k.Block)
		}
		if i >= direct {
			if k.Graph == 0 {
				t.Errorf("record %d ran in a graph but has graph id 0", i)
			}
			graphs[k.Correlation]++
		}
	}
	if len(graphs) != replays {
		t.Errorf("graph kernels' correlation ids %v: want %d launches of %d kernels", graphs, replays, inGraph)
	}
	// A recording after Stop starts empty.
	rec, err = Start()
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Millisecond)
	if ks, err := rec.Stop(); err != nil || len(ks) != 0 {
		t.Errorf("an idle recording: %d kernels, err %v", len(ks), err)
	}
}

// resetLoad forgets the loaded library, so that the next Start loads one
// again.
func resetLoad() { loadOnce, loaded, loadErr = sync.Once{}, nil, nil }

// fakeCUPTI builds testdata/fakecupti.c into a libcupti.so that Start then
// loads, and returns its fake_emit; it skips the test without a C compiler.
func fakeCUPTI(t *testing.T) (emit func(n, completeNow, otherKinds, dropped int32) int32, emitHere func(n, completeNow int32) int32) {
	cc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skipf("no C compiler for the fake CUPTI library: %v", err)
	}
	dir := t.TempDir()
	so := filepath.Join(dir, "libcupti.so")
	if out, err := exec.Command(cc, "-shared", "-fPIC", "-O1", "-o", so, "testdata/fakecupti.c", "-lpthread").CombinedOutput(); err != nil {
		t.Fatalf("building the fake CUPTI library: %v\n%s", err, out)
	}
	t.Setenv(dl.EnvLibDir, dir)
	resetLoad()
	t.Cleanup(resetLoad)
	h, err := purego.Dlopen(so, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		t.Fatal(err)
	}
	purego.RegisterLibFunc(&emit, h, "fake_emit")
	purego.RegisterLibFunc(&emitHere, h, "fake_emit_here")
	return emit, emitHere
}

// TestRecorderWithFakeCUPTI runs Start and Stop against a stand-in for
// libcupti that hands over records from threads Go did not start, as
// CUPTI's worker thread does: buffers completed there and at the flush in
// Stop, records of other kinds skipped, dropped records reported.
func TestRecorderWithFakeCUPTI(t *testing.T) {
	emit, emitHere := fakeCUPTI(t)
	check := func(ks []Kernel, n int) {
		t.Helper()
		if len(ks) != n {
			t.Fatalf("%d kernels, want %d", len(ks), n)
		}
		for i, k := range ks {
			want := []string{"foo<1>", "plain_kernel"}[i%2]
			if k.Name != want || k.Duration() != uint64(5+i) || k.Stream != 7 || k.Grid[0] != 132 || k.Block[0] != 256 ||
				k.Registers != 32 || k.Correlation != uint32(1000+i) || k.Graph != uint32(i%2) {
				t.Errorf("kernel %d: %+v", i, k)
			}
			if i > 0 && k.Start <= ks[i-1].Start {
				t.Errorf("kernel %d starts at %d, before kernel %d (%d)", i, k.Start, i-1, ks[i-1].Start)
			}
		}
	}
	for _, c := range []struct {
		name                  string
		completeNow, other, n int32
	}{{"completed on the emitting thread", 1, 1, 6}, {"completed at the flush", 0, 0, 9}, {"one record", 1, 0, 1}} {
		t.Run(c.name, func(t *testing.T) {
			rec, err := Start()
			if err != nil {
				t.Fatal(err)
			}
			if r := emit(c.n, c.completeNow, c.other, 0); r != 0 {
				t.Fatalf("fake_emit: %d", r)
			}
			ks, err := rec.Stop()
			if err != nil {
				t.Fatal(err)
			}
			check(ks, int(c.n))
		})
	}
	// Buffers requested and completed inside a call from Go, on its thread.
	for _, now := range []int32{1, 0} {
		rec, err := Start()
		if err != nil {
			t.Fatal(err)
		}
		if r := emitHere(5, now); r != 0 {
			t.Fatalf("fake_emit_here: %d", r)
		}
		ks, err := rec.Stop()
		if err != nil {
			t.Fatal(err)
		}
		check(ks, 5)
	}
	rec, err := Start()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Start(); !errors.Is(err, ErrBusy) {
		t.Errorf("second Start: %v, want ErrBusy", err)
	}
	if r := emit(4, 1, 0, 3); r != 0 {
		t.Fatalf("fake_emit: %d", r)
	}
	ks, err := rec.Stop()
	if err == nil || !strings.Contains(err.Error(), "3 kernel records were dropped") {
		t.Errorf("Stop after dropped records: %v", err)
	}
	check(ks, 4)
	if l := loaded; len(l.freeBuffers) != 1 || len(l.buffers) != 0 {
		t.Errorf("%d free and %d lent buffers after every buffer came back, want 1 and 0 (one buffer reused)", len(l.freeBuffers), len(l.buffers))
	}
	if a, err := Now(); err != nil {
		t.Fatal(err)
	} else if b, _ := Now(); b <= a {
		t.Errorf("Now went from %d to %d", a, b)
	}
}

// TestAvailableNamesTheLibrary: without libcupti, Available (and so Start)
// fails with ErrNoCUPTI, naming the library and where it was looked for.
func TestAvailableNamesTheLibrary(t *testing.T) {
	resetLoad()
	t.Cleanup(resetLoad)
	t.Setenv(dl.EnvLibDir, t.TempDir())
	err := Available()
	if err == nil {
		t.Skip("libcupti is installed here")
	}
	if !errors.Is(err, ErrNoCUPTI) || !strings.Contains(err.Error(), "libcupti") || !strings.Contains(err.Error(), dl.EnvLibDir) {
		t.Errorf("Available without the library: %v", err)
	}
	if _, serr := Start(); !errors.Is(serr, ErrNoCUPTI) {
		t.Errorf("Start without the library: %v", serr)
	}
}
