package cuda_test

import (
	_ "embed"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/internal/testutil"
)

// The example kernels: embedded beside their launchers, compiled by NVRTC
// for the device, launched from Go.
//
//go:embed testdata/vecadd.cu
var vecaddSrc []byte

func vecadd(t *testing.T) (*cuda.Device, *cuda.Module) {
	t.Helper()
	dev := cudatest.Device(t)
	mod, err := dev.Compile("vecadd.cu", vecaddSrc)
	if err != nil {
		t.Fatalf("compile vecadd.cu: %v", err)
	}
	return dev, mod
}

func fn(t *testing.T, mod *cuda.Module, name string) *cuda.Function {
	t.Helper()
	f, err := mod.Function(name)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestDeviceProperties(t *testing.T) {
	dev := cudatest.Device(t)
	p := dev.Properties()
	t.Logf("%s: CC %s (%s), %d SMs, %.1f GiB, L2 %d MiB, smem/block %d KiB (opt-in %d KiB), smem/SM %d KiB, clusters %v, PCI %s",
		p.Name, p.ComputeCapability(), p.Arch, p.SMs, float64(p.TotalMemory)/(1<<30), p.L2Bytes>>20,
		p.SharedPerBlock>>10, p.SharedPerBlockOptin>>10, p.SharedPerSM>>10, p.ClusterLaunch, p.PCIBusID)
	if p.Name == "" || p.Major < 3 || p.SMs <= 0 || p.TotalMemory <= 0 || p.L2Bytes <= 0 ||
		p.SharedPerBlock < 48<<10 || p.MaxThreadsPerBlock < 1024 || p.WarpSize != 32 {
		t.Fatalf("implausible properties: %+v", p)
	}
	free, total, err := dev.MemInfo()
	if err != nil || free <= 0 || total != p.TotalMemory {
		t.Fatalf("MemInfo = %d, %d, %v (total memory %d)", free, total, err, p.TotalMemory)
	}
	v, err := cuda.DriverVersion()
	t.Logf("driver CUDA version %d, library %s, err %v", v, cuda.LibraryPath(), err)
}

// TestVectorAddBF16 runs the example kernel on fresh random data and checks
// every element against the same sum rounded on the CPU.
func TestVectorAddBF16(t *testing.T) {
	dev, mod := vecadd(t)
	add := fn(t, mod, "add_bf16")
	if p := add.Params(); p != nil && fmt.Sprint(p) != "[8 8 8 4]" {
		t.Errorf("add_bf16 parameter sizes %v, want [8 8 8 4]", p)
	}
	rng, seed := testutil.Rand(t)
	n := 1<<20 + rng.IntN(1000)
	a, b := make([]uint16, n), make([]uint16, n)
	for i := range a {
		a[i] = bf16.FromFloat32(float32(rng.NormFloat64()))
		b[i] = bf16.FromFloat32(float32(rng.NormFloat64() * 4))
	}
	da, db, dout := cudatest.Alloc(t, dev, 2*n), cudatest.Alloc(t, dev, 2*n), cudatest.Alloc(t, dev, 2*n)
	if err := dev.CopyHtoD(da, cuda.Bytes(a)); err != nil {
		t.Fatal(err)
	}
	if err := dev.CopyHtoD(db, cuda.Bytes(b)); err != nil {
		t.Fatal(err)
	}
	if err := add.Launch(cuda.Dim3{uint32((n + 255) / 256), 1, 1}, cuda.Dim3{256, 1, 1}, 0, nil, dout, da, db, n); err != nil {
		t.Fatal(err)
	}
	out := make([]uint16, n)
	if err := dev.CopyDtoH(cuda.Bytes(out), dout); err != nil {
		t.Fatal(err)
	}
	for i := range out {
		want := bf16.FromFloat32(bf16.ToFloat32(a[i]) + bf16.ToFloat32(b[i]))
		if out[i] != want {
			t.Fatalf("seed %d: out[%d] = %#04x, want %#04x (%v + %v)", seed, i, out[i], want, bf16.ToFloat32(a[i]), bf16.ToFloat32(b[i]))
		}
	}
	attrs, err := add.Attributes()
	if err != nil {
		t.Fatal(err)
	}
	prog := mod.Program()
	t.Logf("add_bf16: %d registers, %d B local; compiled for %s in %v (from cache %v), options %v",
		attrs.NumRegs, attrs.LocalBytes, prog.Arch, prog.CompileTime, prog.FromCache, prog.Options)
	if attrs.LocalBytes != 0 {
		t.Errorf("add_bf16 spills %d bytes to local memory", attrs.LocalBytes)
	}
}

// TestLargeDynamicShared launches with more than 48 KiB of dynamic shared
// memory, which Launch opts the kernel into by itself.
func TestLargeDynamicShared(t *testing.T) {
	dev, mod := vecadd(t)
	rev := fn(t, mod, "reverse_blocks")
	rng, seed := testutil.Rand(t)
	shared := 200 << 10
	if opt := dev.Properties().SharedPerBlockOptin; opt < shared {
		shared = opt
	}
	words := shared / 4
	blocks := 8 + rng.IntN(8)
	in := make([]uint32, words*blocks)
	for i := range in {
		in[i] = rng.Uint32()
	}
	din, dout := cudatest.Alloc(t, dev, 4*len(in)), cudatest.Alloc(t, dev, 4*len(in))
	if err := dev.CopyHtoD(din, cuda.Bytes(in)); err != nil {
		t.Fatal(err)
	}
	if err := rev.Launch(cuda.Dim3{uint32(blocks), 1, 1}, cuda.Dim3{512, 1, 1}, shared, nil, dout, din, int32(words)); err != nil {
		t.Fatalf("launch with %d KiB of dynamic shared memory: %v", shared>>10, err)
	}
	out := make([]uint32, len(in))
	if err := dev.CopyDtoH(cuda.Bytes(out), dout); err != nil {
		t.Fatal(err)
	}
	for b := 0; b < blocks; b++ {
		for i := 0; i < words; i++ {
			if got, want := out[b*words+i], in[b*words+words-1-i]; got != want {
				t.Fatalf("seed %d: block %d word %d = %#x, want %#x", seed, b, i, got, want)
			}
		}
	}
	// More than the device allows is an error from the driver.
	err := rev.Launch(cuda.Dim3{1, 1, 1}, cuda.Dim3{32, 1, 1}, dev.Properties().SharedPerBlockOptin+4096, nil, dout, din, int32(1))
	if !errors.Is(err, cuda.ErrorInvalidValue) {
		t.Errorf("launch with more shared memory than the device has: %v, want CUDA_ERROR_INVALID_VALUE", err)
	}
}

// TestClusterLaunch launches thread-block clusters through cuLaunchKernelEx
// and checks each block's rank and a read of its neighbour's shared memory.
func TestClusterLaunch(t *testing.T) {
	dev, mod := vecadd(t)
	if !dev.Properties().ClusterLaunch {
		t.Skip("device has no thread-block clusters")
	}
	k := fn(t, mod, "cluster_info")
	for _, size := range []uint32{2, 4, 8, 16} {
		blocks := size * 6
		out := cudatest.Alloc(t, dev, 4*int(blocks))
		err := k.LaunchEx(cuda.LaunchConfig{Grid: cuda.Dim3{blocks, 1, 1}, Block: cuda.Dim3{32, 1, 1}, Cluster: cuda.Dim3{size, 1, 1}}, out)
		if size == 16 && err != nil {
			t.Logf("non-portable cluster of 16: %v", err)
			continue
		}
		if err != nil {
			t.Fatalf("cluster %d: %v", size, err)
		}
		n, err := k.MaxActiveClusters(cuda.LaunchConfig{Grid: cuda.Dim3{blocks, 1, 1}, Block: cuda.Dim3{32, 1, 1}, Cluster: cuda.Dim3{size, 1, 1}})
		if err != nil || n < 1 || n > dev.Properties().SMs*32/int(size) {
			t.Errorf("cluster %d: MaxActiveClusters = %d, %v; want 1..%d", size, n, err, dev.Properties().SMs*32/int(size))
		}
		got := make([]uint32, blocks)
		if err := dev.CopyDtoH(cuda.Bytes(got), out); err != nil {
			t.Fatal(err)
		}
		for b, v := range got {
			rank, n, peer := v&0xff, (v>>8)&0xff, v>>16
			if rank != uint32(b)%size || n != size || peer != (rank+1)%size {
				t.Fatalf("cluster %d, block %d: rank %d of %d, neighbour's rank %d", size, b, rank, n, peer)
			}
		}
	}
}

// TestTensorMapTMA copies tiles of a random 2D bf16 tensor with the TMA
// engine through a descriptor from EncodeTiled.
func TestTensorMapTMA(t *testing.T) {
	dev, mod := vecadd(t)
	if dev.Properties().Major < 9 {
		t.Skip("TMA needs compute capability 9.0")
	}
	k := fn(t, mod, "tma_tiles")
	rng, seed := testutil.Rand(t)
	const boxX, boxY = 64, 32
	tilesX, tilesY := 3+rng.IntN(3), 2+rng.IntN(3)
	cols, rows := tilesX*boxX, tilesY*boxY
	src := make([]uint16, rows*cols)
	for i := range src {
		src[i] = uint16(rng.Uint32())
	}
	dsrc, dout := cudatest.Alloc(t, dev, 2*len(src)), cudatest.Alloc(t, dev, 2*len(src))
	if err := dev.CopyHtoD(dsrc, cuda.Bytes(src)); err != nil {
		t.Fatal(err)
	}
	tm, err := dev.EncodeTiled(cuda.TiledTensor{
		DataType: cuda.TensorBFloat16, Global: dsrc.Ptr(),
		Dims: []uint64{uint64(cols), uint64(rows)}, Strides: []uint64{uint64(2 * cols)},
		Box: []uint32{boxX, boxY},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := k.Launch(cuda.Dim3{uint32(tilesX), uint32(tilesY), 1}, cuda.Dim3{128, 1, 1}, 0, nil, tm, dout, tilesX); err != nil {
		t.Fatal(err)
	}
	out := make([]uint16, len(src))
	if err := dev.CopyDtoH(cuda.Bytes(out), dout); err != nil {
		t.Fatal(err)
	}
	for ty := 0; ty < tilesY; ty++ {
		for tx := 0; tx < tilesX; tx++ {
			tile := out[(ty*tilesX+tx)*boxX*boxY:]
			for y := 0; y < boxY; y++ {
				for x := 0; x < boxX; x++ {
					if got, want := tile[y*boxX+x], src[(ty*boxY+y)*cols+tx*boxX+x]; got != want {
						t.Fatalf("seed %d: tile (%d,%d) element (%d,%d) = %#x, want %#x", seed, tx, ty, x, y, got, want)
					}
				}
			}
		}
	}
	// A bad descriptor is refused with a message.
	if _, err := dev.EncodeTiled(cuda.TiledTensor{DataType: cuda.TensorBFloat16, Global: dsrc.Ptr() + 2,
		Dims: []uint64{64}, Box: []uint32{64}}); !errors.Is(err, cuda.ErrorInvalidValue) {
		t.Errorf("misaligned global address: %v", err)
	}
}

// TestStreamsEventsAsync runs pinned async copies and a fill on two streams
// ordered by an event, and times the fill with events.
func TestStreamsEventsAsync(t *testing.T) {
	dev, mod := vecadd(t)
	fill := fn(t, mod, "fill_u32")
	rng, seed := testutil.Rand(t)
	s1, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s1.Destroy()
	s2, err := dev.NewUrgentStream() // a priority of its own does not change the ordering
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Destroy()
	start, _ := dev.NewEvent()
	mid, _ := dev.NewEvent()
	end, err := dev.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	defer start.Destroy()
	defer mid.Destroy()
	defer end.Destroy()

	const n = 256 << 20 / 4 // 256 MiB of words
	big := cudatest.Alloc(t, dev, 4*n)
	v := rng.Uint32()
	if err := start.Record(s1); err != nil {
		t.Fatal(err)
	}
	if err := fill.Launch(cuda.Dim3{uint32(4 * dev.Properties().SMs), 1, 1}, cuda.Dim3{256, 1, 1}, 0, s1, big, v, int64(n)); err != nil {
		t.Fatal(err)
	}
	if err := mid.Record(s1); err != nil {
		t.Fatal(err)
	}
	// s2 copies part of the filled buffer out only after the fill.
	if err := s2.Wait(mid); err != nil {
		t.Fatal(err)
	}
	host, err := dev.AllocHost(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer host.Free()
	off := rng.IntN(n-(1<<18)) * 4
	part, err := big.Slice(off, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.CopyDtoHAsync(host.Bytes(), part, s2); err != nil {
		t.Fatal(err)
	}
	if err := end.Record(s2); err != nil {
		t.Fatal(err)
	}
	if err := end.Synchronize(); err != nil {
		t.Fatal(err)
	}
	for i, b := range host.Bytes() {
		if want := byte(v >> (8 * (i % 4))); b != want {
			t.Fatalf("seed %d: byte %d after async copy = %#x, want %#x", seed, i, b, want)
		}
	}
	dt, err := start.Elapsed(mid)
	if err != nil {
		t.Fatal(err)
	}
	gbps := float64(4*n) / dt.Seconds() / 1e9
	t.Logf("fill of %d MiB: %v, %.0f GB/s", 4*n>>20, dt, gbps)
	if dt <= 0 || gbps > 20000 {
		t.Fatalf("implausible fill time %v (%.0f GB/s)", dt, gbps)
	}
	// Round trip through pinned memory with async copies on fresh data.
	in, _ := dev.AllocHost(1 << 20)
	defer in.Free()
	for i := range in.Bytes() {
		in.Bytes()[i] = byte(rng.Uint32())
	}
	d := cudatest.Alloc(t, dev, 1<<20)
	back := make([]byte, 1<<20)
	if err := dev.CopyHtoDAsync(d, in.Bytes(), s1); err != nil {
		t.Fatal(err)
	}
	if err := dev.CopyDtoHAsync(back, d, s1); err != nil {
		t.Fatal(err)
	}
	if err := s1.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if string(back) != string(in.Bytes()) {
		t.Fatalf("seed %d: async round trip changed the data", seed)
	}
}

// TestGraphReplay captures launches on a stream and replays them.
func TestGraphReplay(t *testing.T) {
	dev, mod := vecadd(t)
	add := fn(t, mod, "add_bf16")
	rng, seed := testutil.Rand(t)
	n := 4096
	a := make([]uint16, n)
	for i := range a {
		a[i] = bf16.FromFloat32(float32(rng.IntN(16)))
	}
	da, acc := cudatest.Alloc(t, dev, 2*n), cudatest.Alloc(t, dev, 2*n)
	if err := dev.CopyHtoD(da, cuda.Bytes(a)); err != nil {
		t.Fatal(err)
	}
	if err := dev.Memset8(acc, 0, nil); err != nil {
		t.Fatal(err)
	}
	s, _ := dev.NewStream()
	defer s.Destroy()
	capturing := func(want bool) {
		t.Helper()
		if got, err := s.Capturing(); err != nil || got != want {
			t.Fatalf("Capturing() = %v, %v; want %v", got, err, want)
		}
	}
	capturing(false)
	if err := s.BeginCapture(); err != nil {
		t.Fatal(err)
	}
	capturing(true)
	for i := 0; i < 3; i++ { // acc += a, three times
		if err := add.Launch(cuda.Dim3{uint32(n / 256), 1, 1}, cuda.Dim3{256, 1, 1}, 0, s, acc, acc, da, n); err != nil {
			t.Fatal(err)
		}
	}
	g, err := s.EndCapture()
	if err != nil {
		t.Fatal(err)
	}
	capturing(false)
	if c, err := (*cuda.Stream)(nil).Capturing(); c || err != nil {
		t.Fatalf("default stream: Capturing() = %v, %v; want false, nil", c, err)
	}
	defer g.Destroy()
	for i := 0; i < 2; i++ {
		if err := g.Launch(s); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	out := make([]uint16, n)
	if err := dev.CopyDtoH(cuda.Bytes(out), acc); err != nil {
		t.Fatal(err)
	}
	for i := range out {
		if got, want := bf16.ToFloat32(out[i]), 6*bf16.ToFloat32(a[i]); got != want {
			t.Fatalf("seed %d: after two replays of three adds, out[%d] = %v, want %v", seed, i, got, want)
		}
	}
}

// TestLaunchOverhead measures the host cost of launching an empty kernel
// through the purego hot path, and of replaying it from a graph.
func TestLaunchOverhead(t *testing.T) {
	dev, mod := vecadd(t)
	k := fn(t, mod, "empty")
	const n = 2000
	one := cuda.Dim3{1, 1, 1}
	for i := 0; i < 100; i++ {
		_ = k.Launch(one, one, 0, nil)
	}
	if err := dev.Synchronize(); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	for i := 0; i < n; i++ {
		if err := k.Launch(one, one, 0, nil); err != nil {
			t.Fatal(err)
		}
	}
	host := time.Since(t0) / n
	if err := dev.Synchronize(); err != nil {
		t.Fatal(err)
	}
	all := time.Since(t0) / n
	t.Logf("empty kernel: %v per launch on the host, %v per launch until done", host, all)
	allocs := testing.AllocsPerRun(200, func() { _ = k.Launch(one, one, 0, nil) })
	t.Logf("allocations per launch: %v", allocs)

	// twell's own share: locking the thread and making the context current.
	t0 = time.Now()
	for i := 0; i < n; i++ {
		if err := dev.Do(func() error { return nil }); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("Device.Do (lock thread + cuCtxSetCurrent): %v per call", time.Since(t0)/n)

	// The same launches replayed from a CUDA graph.
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Destroy()
	const perGraph = 100
	if err := s.BeginCapture(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < perGraph; i++ {
		if err := k.Launch(one, one, 0, s); err != nil {
			t.Fatal(err)
		}
	}
	g, err := s.EndCapture()
	if err != nil {
		t.Fatal(err)
	}
	defer g.Destroy()
	_ = g.Launch(s)
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	t0 = time.Now()
	const replays = 20
	for i := 0; i < replays; i++ {
		if err := g.Launch(s); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	t.Logf("graph of %d empty kernels: %v per kernel until done", perGraph, time.Since(t0)/(replays*perGraph))
}

// TestMisuseErrors checks that each misuse returns an error naming the CUDA
// error, and that the device still works afterwards.
func TestMisuseErrors(t *testing.T) {
	dev, mod := vecadd(t)
	fill := fn(t, mod, "fill_u32")
	expect := func(what string, err error, code cuda.Result) {
		t.Helper()
		if !errors.Is(err, code) || !strings.Contains(err.Error(), code.Name()) {
			t.Errorf("%s: got %v, want an error with %s", what, err, code.Name())
		} else {
			t.Logf("%s: %v", what, err)
		}
	}

	// More memory than the card has.
	_, err := dev.Alloc(int(dev.Properties().TotalMemory) * 2)
	expect("allocating twice the card's memory", err, cuda.ErrorOutOfMemory)
	_, err = dev.MemAlloc(int(dev.Properties().TotalMemory) + 1<<30)
	expect("cuMemAlloc of more than the card", err, cuda.ErrorOutOfMemory)

	// A kernel that fails to compile.
	_, err = dev.Compile("broken.cu", []byte("extern \"C\" __global__ void k() {\n  this is not C++;\n}\n"))
	var nerr *cuda.NVRTCError
	if !errors.As(err, &nerr) || nerr.Name != "NVRTC_ERROR_COMPILATION" || !strings.Contains(err.Error(), "broken.cu(2)") {
		t.Errorf("compile error: %v", err)
	} else {
		t.Logf("compile error: %v", err)
	}

	// Launches with invalid dimensions.
	buf := cudatest.Alloc(t, dev, 4096)
	expect("block of 2048 threads", fill.Launch(cuda.Dim3{1, 1, 1}, cuda.Dim3{2048, 1, 1}, 0, nil, buf, uint32(1), int64(1024)), cuda.ErrorInvalidValue)
	expect("grid of 0 blocks", fill.Launch(cuda.Dim3{0, 1, 1}, cuda.Dim3{32, 1, 1}, 0, nil, buf, uint32(1), int64(1024)), cuda.ErrorInvalidValue)
	expect("grid y of 70000", fill.Launch(cuda.Dim3{1, 70000, 1}, cuda.Dim3{32, 1, 1}, 0, nil, buf, uint32(1), int64(1024)), cuda.ErrorInvalidValue)
	if fill.Params() != nil {
		expect("missing argument", fill.Launch(cuda.Dim3{1, 1, 1}, cuda.Dim3{32, 1, 1}, 0, nil, buf, uint32(1)), cuda.ErrorInvalidValue)
		expect("argument of the wrong size", fill.Launch(cuda.Dim3{1, 1, 1}, cuda.Dim3{32, 1, 1}, 0, nil, buf, uint64(1), int64(1024)), cuda.ErrorInvalidValue)
	}
	err = fill.LaunchEx(cuda.LaunchConfig{Grid: cuda.Dim3{3, 1, 1}, Block: cuda.Dim3{32, 1, 1}, Cluster: cuda.Dim3{2, 1, 1}}, buf, uint32(1), int64(1024))
	if err == nil || !strings.Contains(err.Error(), "CUDA_ERROR_") {
		t.Errorf("cluster that does not divide the grid: %v, want a CUDA error", err)
	} else {
		t.Logf("cluster that does not divide the grid: %v", err)
	}

	// Freeing twice: through the cache, and straight to the driver.
	b, err := dev.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	expect("freeing a buffer twice", b.Free(), cuda.ErrorInvalidValue)
	expect("copying into a freed buffer", dev.CopyHtoD(b, make([]byte, 16)), cuda.ErrorInvalidValue)
	p, err := dev.MemAlloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.MemFree(p); err != nil {
		t.Fatal(err)
	}
	if err := dev.MemFree(p); err == nil || !strings.Contains(err.Error(), "CUDA_ERROR_") {
		t.Errorf("cuMemFree twice: %v, want a CUDA error", err)
	} else {
		t.Logf("cuMemFree twice: %v", err)
	}

	// Copies out of bounds.
	expect("copy of 4097 bytes into 4096", dev.CopyHtoD(buf, make([]byte, 4097)), cuda.ErrorInvalidValue)
	expect("copy of 8192 bytes out of 4096", dev.CopyDtoH(make([]byte, 8192), buf), cuda.ErrorInvalidValue)
	other := cudatest.Alloc(t, dev, 1024)
	expect("device copy past the end", dev.CopyDtoD(other, buf, 2048), cuda.ErrorInvalidValue)
	_, err = buf.Slice(4000, 200)
	expect("slice past the end", err, cuda.ErrorInvalidValue)

	// Bad images and names.
	_, err = dev.LoadModule("garbage", []byte("not a cubin at all"))
	if err == nil || !strings.Contains(err.Error(), "CUDA_ERROR_") {
		t.Errorf("loading garbage: %v", err)
	} else {
		t.Logf("loading garbage: %v", err)
	}
	_, err = mod.Function("no_such_kernel")
	expect("unknown kernel name", err, cuda.ErrorNotFound)

	// The context is still healthy.
	if err := fill.Launch(cuda.Dim3{4, 1, 1}, cuda.Dim3{256, 1, 1}, 0, nil, buf, uint32(7), int64(1024)); err != nil {
		t.Fatal(err)
	}
	words := make([]uint32, 1024)
	if err := dev.CopyDtoH(cuda.Bytes(words), buf); err != nil {
		t.Fatal(err)
	}
	for i, w := range words {
		if w != 7 {
			t.Fatalf("after the misuse, word %d = %d, want 7", i, w)
		}
	}
}

// TestCachingAllocator checks block reuse and the counters.
func TestCachingAllocator(t *testing.T) {
	dev := cudatest.Device(t)
	rng, seed := testutil.Rand(t)
	size := 3<<20 + rng.IntN(1<<20)
	before := dev.MemStats()
	a, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	ptr := a.Ptr()
	if err := a.Free(); err != nil {
		t.Fatal(err)
	}
	b, err := dev.Alloc(size - 1000)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	after := dev.MemStats()
	if b.Ptr() != ptr || after.CacheHits != before.CacheHits+1 {
		t.Fatalf("seed %d: a freed block of the same class was not reused (ptr %#x vs %#x, hits %d -> %d)", seed, b.Ptr(), ptr, before.CacheHits, after.CacheHits)
	}
	if err := dev.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	if s := dev.MemStats(); s.Cached != 0 {
		t.Fatalf("after EmptyCache %d bytes are still cached", s.Cached)
	}
}

// TestAvailableCountsCache checks Device.Available: a freed block the
// allocator keeps counts as available, though the driver no longer counts
// it as free, and an allocation of all that is available succeeds.
func TestAvailableCountsCache(t *testing.T) {
	dev := cudatest.Device(t)
	rng, seed := testutil.Rand(t)
	if err := dev.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	size := 256<<20 + rng.IntN(64<<20)
	a, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Free(); err != nil {
		t.Fatal(err)
	}
	free, _, err := dev.MemInfo()
	if err != nil {
		t.Fatal(err)
	}
	avail, err := dev.Available()
	if err != nil {
		t.Fatal(err)
	}
	if cached := dev.MemStats().Cached; avail != free+cached || cached < int64(size) {
		t.Fatalf("seed %d: Available %d, want the driver's free %d plus the %d cached bytes (at least the %d freed)", seed, avail, free, cached, size)
	}
	// Everything available but 512 MiB (left for what else the context
	// allocates) in one block: the cache goes back to the driver first.
	b, err := dev.Alloc(int(avail - 512<<20))
	if err != nil {
		t.Fatalf("seed %d: allocating the %d bytes Available reported, less 512 MiB: %v", seed, avail, err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if err := dev.EmptyCache(); err != nil {
		t.Fatal(err)
	}
}

// TestCompileCacheOnGPU compiles the same source twice and checks the second
// comes from the disk cache.
func TestCompileCacheOnGPU(t *testing.T) {
	dev := cudatest.Device(t)
	t.Setenv(cuda.EnvKernelCache, t.TempDir())
	src := []byte(fmt.Sprintf("extern \"C\" __global__ void k%d(float* x) { x[threadIdx.x] *= 2.0f; }\n", time.Now().UnixNano()))
	p1, err := cuda.CompileProgram("k.cu", src, cuda.WithArch(dev.Properties().Arch))
	if err != nil {
		t.Fatal(err)
	}
	p2, err := cuda.CompileProgram("k.cu", src, cuda.WithArch(dev.Properties().Arch))
	if err != nil {
		t.Fatal(err)
	}
	if p1.FromCache || !p2.FromCache || string(p1.Image) != string(p2.Image) {
		t.Fatalf("first from cache %v, second from cache %v, same image %v", p1.FromCache, p2.FromCache, string(p1.Image) == string(p2.Image))
	}
	t.Logf("NVRTC compile to %s CUBIN: %v, %d bytes", p1.Arch, p1.CompileTime, len(p1.Image))
}
