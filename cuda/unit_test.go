package cuda

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"github.com/twell-ai/twell/cuda/internal/dl"
)

// fakeLookup resolves every symbol to a non-zero address that is never
// called, so that binding tables can be checked without CUDA libraries.
func fakeLookup(string) (uintptr, error) { return 0x1000, nil }

// TestBindingSignatures checks that purego accepts every function signature
// of the driver and NVRTC tables on this platform (it panics on a bad one,
// which Bind turns into an error).
func TestBindingSignatures(t *testing.T) {
	d := &driver{}
	if err := dl.Bind("fake libcuda", fakeLookup, d.symbols()); err != nil {
		t.Fatalf("driver table: %v", err)
	}
	if d.cuMemAlloc == nil || d.pLaunchKernel == 0 || d.cuTensorMapEncodeTiled == nil {
		t.Fatalf("driver table left entries unbound")
	}
	n := &nvrtcLib{}
	if err := dl.Bind("fake libnvrtc", fakeLookup, n.symbols()); err != nil {
		t.Fatalf("NVRTC table: %v", err)
	}
}

func TestBindMissingSymbol(t *testing.T) {
	d := &driver{}
	lookup := func(name string) (uintptr, error) {
		if name == "cuMemAlloc_v2" {
			return 0, errors.New("undefined symbol")
		}
		return 0x1000, nil
	}
	err := dl.Bind("libcuda", lookup, d.symbols())
	if !errors.Is(err, dl.ErrMissingSymbol) || !strings.Contains(err.Error(), "cuMemAlloc_v2") {
		t.Fatalf("got %v, want a missing-symbol error naming cuMemAlloc_v2", err)
	}
	// Optional symbols may be missing.
	lookup = func(name string) (uintptr, error) {
		if name == "cuFuncGetParamInfo" {
			return 0, errors.New("undefined symbol")
		}
		return 0x1000, nil
	}
	d = &driver{}
	if err := dl.Bind("libcuda", lookup, d.symbols()); err != nil || d.cuFuncGetParamInfo != nil {
		t.Fatalf("optional symbol: err %v, bound %v", err, d.cuFuncGetParamInfo != nil)
	}
}

func TestErrorNames(t *testing.T) {
	err := error(&Error{Op: "cuMemAlloc(2.0 TiB)", Code: ErrorOutOfMemory, Detail: "out of memory"})
	if !errors.Is(err, ErrorOutOfMemory) {
		t.Errorf("errors.Is(%v, ErrorOutOfMemory) = false", err)
	}
	if errors.Is(err, ErrorInvalidValue) {
		t.Errorf("errors.Is(%v, ErrorInvalidValue) = true", err)
	}
	if got := err.Error(); got != "cuda: cuMemAlloc(2.0 TiB): CUDA_ERROR_OUT_OF_MEMORY (out of memory)" {
		t.Errorf("Error() = %q", got)
	}
	if got := Result(12345).Name(); loadedDriver() == nil && got != "CUDA_ERROR_12345" {
		t.Errorf("unknown code name = %q", got)
	}
	if !NoGPU(wrapNoDriver()) || NoGPU(ErrorOutOfMemory) {
		t.Errorf("NoGPU misclassifies")
	}
}

func wrapNoDriver() error { return errors.Join(errors.New("x"), ErrNoDriver) }

// TestNoGPUHere checks the CPU-machine path: without a driver (or a driver
// without a GPU), Open returns an error for which NoGPU is true, and does
// not panic. On a GPU machine it checks that Open works.
func TestOpenWithoutGPU(t *testing.T) {
	dev, err := Open(0)
	if err == nil {
		t.Logf("a GPU is present: %v", dev)
		return
	}
	if !NoGPU(err) {
		t.Fatalf("Open(0) = %v; want an error for which NoGPU is true", err)
	}
	t.Logf("no GPU, as expected on a CPU machine: %v", err)
	if _, err := Count(); !NoGPU(err) {
		t.Fatalf("Count() error %v; want NoGPU", err)
	}
}

func TestArchFor(t *testing.T) {
	for _, c := range []struct {
		major, minor int
		want         string
	}{{9, 0, "sm_90a"}, {8, 0, "sm_80"}, {8, 9, "sm_89"}, {10, 0, "sm_100a"}, {7, 5, "sm_75"}} {
		if got := archFor(c.major, c.minor); got != c.want {
			t.Errorf("archFor(%d, %d) = %q, want %q", c.major, c.minor, got, c.want)
		}
	}
}

func TestRoundBlock(t *testing.T) {
	for _, c := range []struct{ n, want int }{
		{1, 512}, {512, 512}, {513, 1024}, {1 << 20, 1 << 20}, {1<<20 + 1, 2 << 20}, {5 << 20, 6 << 20},
	} {
		if got := roundBlock(c.n); got != c.want {
			t.Errorf("roundBlock(%d) = %d, want %d", c.n, got, c.want)
		}
	}
}

func TestCacheKeyAndStore(t *testing.T) {
	n := &nvrtcLib{major: 13, minor: 0}
	src := []byte("extern \"C\" __global__ void k() {}")
	base := cacheKey("k.cu", src, nil, []string{"--gpu-architecture=sm_90a"}, nil, n)
	if base != cacheKey("k.cu", src, nil, []string{"--gpu-architecture=sm_90a"}, nil, n) {
		t.Fatal("cache key is not deterministic")
	}
	for name, k := range map[string]string{
		"arch":    cacheKey("k.cu", src, nil, []string{"--gpu-architecture=sm_80"}, nil, n),
		"source":  cacheKey("k.cu", append(src, ' '), nil, []string{"--gpu-architecture=sm_90a"}, nil, n),
		"header":  cacheKey("k.cu", src, []header{{"h.cuh", []byte("x")}}, []string{"--gpu-architecture=sm_90a"}, nil, n),
		"nvrtc":   cacheKey("k.cu", src, nil, []string{"--gpu-architecture=sm_90a"}, nil, &nvrtcLib{major: 13, minor: 1}),
		"names":   cacheKey("k.cu", src, nil, []string{"--gpu-architecture=sm_90a"}, []string{"k<1>"}, n),
		"options": cacheKey("k.cu", src, nil, []string{"--gpu-architecture=sm_90a", "-DX=1"}, nil, n),
	} {
		if k == base {
			t.Errorf("changing the %s does not change the cache key", name)
		}
	}

	dir := t.TempDir()
	t.Setenv(EnvKernelCache, dir)
	prog := &Program{Name: "k.cu", Arch: "sm_90a", Image: []byte{1, 2, 3, 0, 5}, Log: "warning", LoweredNames: map[string]string{"k<1>": "_Z1kILi1EEvv"}}
	writeCache(base, prog)
	got, ok := readCache(base)
	if !ok || string(got.image) != string(prog.Image) || got.meta.Log != "warning" || got.meta.Lowered["k<1>"] != "_Z1kILi1EEvv" {
		t.Fatalf("cache round trip: ok %v, entry %+v", ok, got)
	}
	// A truncated entry is ignored, not trusted.
	path := filepath.Join(dir, base+".bin")
	data, _ := os.ReadFile(path)
	if err := os.WriteFile(path, data[:10], 0o644); err != nil {
		t.Fatal(err)
	}
	if _, ok := readCache(base); ok {
		t.Fatal("a truncated cache entry was accepted")
	}
	t.Setenv(EnvKernelCache, "off")
	if _, ok := readCache(base); ok || cacheDir() != "" {
		t.Fatal("TWELL_KERNEL_CACHE=off still reads the cache")
	}
}

// TestPackArguments checks the kernel-parameter block: sizes, alignment,
// int adaptation and the errors for wrong counts and sizes.
func TestPackArguments(t *testing.T) {
	dev := &Device{}
	f := &Function{mod: &Module{dev: dev}, name: "k"}
	buf := &Buffer{dev: dev, ptr: 0xdead0000, size: 64, owned: true}
	buf.root = buf
	tm := &TensorMap{}
	for i := range tm.opaque {
		tm.opaque[i] = uint64(i + 1)
	}
	f.params = []int{8, 4, 8, 2, 128, 4, 8}
	pb := paramPool.Get().(*paramBlock) // on the heap, as in Launch: the block holds its own addresses
	args := []any{buf, float32(1.5), 7, uint16(0x3f80), tm, int32(-3), DevicePtr(42)}
	if err := pb.pack(f, args); err != nil {
		t.Fatalf("pack: %v", err)
	}
	read := func(i int, n int) []byte {
		off := pb.ptrs[i] - uintptr(unsafe.Pointer(&pb.words[0]))
		return unsafe.Slice((*byte)(unsafe.Add(unsafe.Pointer(&pb.words[0]), off)), n)
	}
	if got := *(*uint64)(unsafe.Pointer(&read(0, 8)[0])); got != 0xdead0000 {
		t.Errorf("buffer argument = %#x", got)
	}
	if got := *(*float32)(unsafe.Pointer(&read(1, 4)[0])); got != 1.5 {
		t.Errorf("float32 argument = %v", got)
	}
	if got := *(*int64)(unsafe.Pointer(&read(2, 8)[0])); got != 7 {
		t.Errorf("int to an 8-byte parameter = %v", got)
	}
	if got := *(*uint16)(unsafe.Pointer(&read(3, 2)[0])); got != 0x3f80 {
		t.Errorf("uint16 argument = %#x", got)
	}
	if pb.ptrs[4]%64 != 0 {
		t.Errorf("TensorMap argument at %#x is not 64-byte aligned", pb.ptrs[4])
	}
	if got := *(*[16]uint64)(unsafe.Pointer(&read(4, 128)[0])); got != tm.opaque {
		t.Errorf("TensorMap argument = %v", got)
	}
	if got := *(*int32)(unsafe.Pointer(&read(5, 4)[0])); got != -3 {
		t.Errorf("int32 argument = %v", got)
	}

	if err := pb.pack(f, args[:6]); !errors.Is(err, ErrorInvalidValue) || !strings.Contains(err.Error(), "takes 7 parameters") {
		t.Errorf("wrong argument count: %v", err)
	}
	bad := append([]any(nil), args...)
	bad[1] = 1.5 // float64 where the kernel has 4 bytes
	if err := pb.pack(f, bad); !errors.Is(err, ErrorInvalidValue) || !strings.Contains(err.Error(), "argument 1") {
		t.Errorf("wrong argument size: %v", err)
	}
	bad[1] = "text"
	if err := pb.pack(f, bad); err == nil || !strings.Contains(err.Error(), "unsupported type string") {
		t.Errorf("unsupported type: %v", err)
	}
	f.params = nil // driver without cuFuncGetParamInfo: int is a C int
	if err := pb.pack(f, []any{1 << 40}); err == nil || !strings.Contains(err.Error(), "does not fit") {
		t.Errorf("int overflow: %v", err)
	}
	buf.freed.Store(true)
	if err := pb.pack(f, []any{buf}); !errors.Is(err, ErrorInvalidValue) || !strings.Contains(err.Error(), "freed") {
		t.Errorf("freed buffer argument: %v", err)
	}
}

func TestBufferViewsAndMisuse(t *testing.T) {
	dev := &Device{}
	b := &Buffer{dev: dev, ptr: 0x1000, size: 100, owned: true}
	b.root = b
	v, err := b.Slice(10, 20)
	if err != nil || v.Ptr() != 0x100a || v.Len() != 20 {
		t.Fatalf("Slice(10, 20) = %v, %v", v, err)
	}
	if _, err := b.Slice(90, 11); !errors.Is(err, ErrorInvalidValue) {
		t.Errorf("Slice past the end: %v", err)
	}
	if _, err := b.Slice(-1, 5); !errors.Is(err, ErrorInvalidValue) {
		t.Errorf("Slice with negative offset: %v", err)
	}
	if err := v.Free(); !errors.Is(err, ErrorInvalidValue) {
		t.Errorf("freeing a view: %v", err)
	}
	if err := dev.copyCheck("CopyHtoD", 101, b); !errors.Is(err, ErrorInvalidValue) || !strings.Contains(err.Error(), "out of bounds") {
		t.Errorf("copy out of bounds: %v", err)
	}
	if got := Bytes([]uint32{1, 2}); len(got) != 8 || got[0] != 1 || got[4] != 2 {
		t.Errorf("Bytes = %v", got)
	}
}

// TestLaunchConfigFill checks the CUlaunchConfig that LaunchEx and
// MaxActiveClusters hand the driver: dimensions, shared memory, stream, and
// the cluster (unset dimensions as 1), cooperative and early-start
// attributes.
func TestLaunchConfigFill(t *testing.T) {
	var c cuLaunchConfig
	var attrs [3]cuLaunchAttribute
	c.fill(LaunchConfig{Grid: Dim3{132, 1, 1}, Block: Dim3{384, 1, 1}, SharedBytes: 1 << 17}, 7, &attrs)
	if c.gridX != 132 || c.blockX != 384 || c.shared != 1<<17 || c.stream != 7 || c.numAttrs != 0 || c.attrs != 0 {
		t.Fatalf("plain config: %+v", c)
	}
	c.fill(LaunchConfig{Grid: Dim3{4, 1, 1}, Block: Dim3{32, 1, 1}, Cluster: Dim3{2, 0, 0}, Cooperative: true}, 0, &attrs)
	if c.numAttrs != 2 || c.attrs != uintptr(unsafe.Pointer(&attrs[0])) {
		t.Fatalf("cluster + cooperative: %d attributes at %#x", c.numAttrs, c.attrs)
	}
	if attrs[0].id != launchAttrClusterDim || *(*Dim3)(unsafe.Pointer(&attrs[0].val[0])) != (Dim3{2, 1, 1}) {
		t.Errorf("cluster attribute %d %v", attrs[0].id, *(*Dim3)(unsafe.Pointer(&attrs[0].val[0])))
	}
	if attrs[1].id != launchAttrCooperative || *(*int32)(unsafe.Pointer(&attrs[1].val[0])) != 1 {
		t.Errorf("cooperative attribute %d", attrs[1].id)
	}
	c.fill(LaunchConfig{Grid: Dim3{4, 1, 1}, Block: Dim3{32, 1, 1}, EarlyStart: true}, 0, &attrs)
	if c.numAttrs != 1 || attrs[0].id != launchAttrProgrammatic || *(*int32)(unsafe.Pointer(&attrs[0].val[0])) != 1 {
		t.Errorf("early start: %d attributes, first %d", c.numAttrs, attrs[0].id)
	}
}
