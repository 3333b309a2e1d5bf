package nccl

import (
	"errors"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
)

func TestMain(m *testing.M) { cudatest.Main(m) }

// TestMissingLibrary: without libnccl every entry point says so, naming
// the library and where it was looked for.
func TestMissingLibrary(t *testing.T) {
	_, _, err := Version()
	if err == nil {
		t.Skip("libnccl is installed here")
	}
	if !errors.Is(err, ErrNoNCCL) || !strings.Contains(err.Error(), "libnccl") || !strings.Contains(err.Error(), "TWELL_CUDA_LIB_DIR") {
		t.Errorf("Version: %v", err)
	}
	if _, err := NewUniqueID(); !errors.Is(err, ErrNoNCCL) {
		t.Errorf("NewUniqueID: %v", err)
	}
	if err := Group(func() error { return nil }); !errors.Is(err, ErrNoNCCL) {
		t.Errorf("Group: %v", err)
	}
}

func TestDataTypeSize(t *testing.T) {
	want := map[DataType]int{Int8: 1, Uint8: 1, Int32: 4, Uint32: 4, Int64: 8, Uint64: 8, Float16: 2, Float32: 4, Float64: 8, BFloat16: 2, 10: 0, -1: 0}
	for dt, n := range want {
		if got := dt.Size(); got != n {
			t.Errorf("DataType(%d).Size() = %d, want %d", dt, got, n)
		}
	}
}

// nccl returns GPU 0 and skips (or, with TWELL_REQUIRE_GPU=1, fails) when
// there is no GPU or no libnccl.
func ncclDevice(t *testing.T) *cuda.Device {
	dev := cudatest.Device(t)
	if _, _, err := Version(); err != nil {
		if os.Getenv(cudatest.EnvRequireGPU) == "1" {
			t.Fatalf("GPU present but %v", err)
		}
		t.Skip(err)
	}
	return dev
}

// TestOneRank: a communicator of one rank on GPU 0 runs every collective
// (each then a copy of its input) and refuses bad arguments.
func TestOneRank(t *testing.T) {
	dev := ncclDevice(t)
	v, path, _ := Version()
	t.Logf("NCCL %d from %s", v, path)
	id, err := NewUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewComm(dev, id, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Destroy()
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 3))
	const n = 1000
	in := make([]float32, n)
	for i := range in {
		in[i] = float32(r.NormFloat64())
	}
	send, err := dev.Alloc(4 * n)
	if err != nil {
		t.Fatal(err)
	}
	defer send.Free()
	recv, err := dev.Alloc(4 * n)
	if err != nil {
		t.Fatal(err)
	}
	defer recv.Free()
	if err := dev.CopyHtoD(send, cuda.Bytes(in)); err != nil {
		t.Fatal(err)
	}
	for name, run := range map[string]func() error{
		"AllReduce":     func() error { return c.AllReduce(send, recv, n, Float32, Sum, s) },
		"ReduceScatter": func() error { return c.ReduceScatter(send, recv, n, Float32, Sum, s) },
		"AllGather":     func() error { return c.AllGather(send, recv, n, Float32, s) },
		"Broadcast":     func() error { return c.Broadcast(send, recv, n, Float32, 0, s) },
	} {
		if err := dev.Memset8(recv, 0, s); err != nil {
			t.Fatal(err)
		}
		if err := Group(run); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := c.Wait(s, 30*time.Second); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		out := make([]float32, n)
		if err := dev.CopyDtoH(cuda.Bytes(out), recv); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(out, in) {
			t.Errorf("seed %d: %s over one rank changed the data", seed, name)
		}
	}
	if err := c.AsyncError(); err != nil {
		t.Error(err)
	}
	for name, err := range map[string]error{
		"count past the buffer": c.AllReduce(send, recv, n+1, Float32, Sum, s),
		"unknown type":          c.AllReduce(send, recv, n, DataType(42), Sum, s),
		"bad root":              c.Broadcast(send, recv, n, Float32, 1, s),
		"nil buffer":            c.AllGather(nil, recv, n, Float32, s),
	} {
		if err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := NewComm(dev, id, 1, 1); err == nil {
		t.Error("rank 1 of 1: accepted")
	}
}
