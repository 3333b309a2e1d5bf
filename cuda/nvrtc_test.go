package cuda_test

import (
	_ "embed"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
)

//go:embed testdata/selfcontained.cu
var selfContainedSrc []byte

// These tests need libnvrtc but no GPU: they compile to PTX for compute_90,
// which every NVRTC since 11.8 supports.

func TestCompileProgramPTX(t *testing.T) {
	cudatest.Compiler(t)
	t.Setenv(cuda.EnvKernelCache, t.TempDir())
	dumpDir := t.TempDir()
	t.Setenv(cuda.EnvCUBINDump, dumpDir)
	opts := []cuda.CompileOption{cuda.WithArch("compute_90"), cuda.WithNameExpressions("add_const<3>")}
	// a source of its own, so that this process's cache (go test -count N)
	// has not seen it
	src := fmt.Appendf(slices.Clone(selfContainedSrc), "\n// run %d\n", rand.Uint64())
	prog, err := cuda.CompileProgram("selfcontained.cu", src, opts...)
	if err != nil {
		t.Fatalf("compile: %v", err)
	}
	if !prog.PTX || prog.FromCache || !strings.Contains(string(prog.Image), ".entry scale_bf16") {
		t.Fatalf("PTX %v, from cache %v, image has scale_bf16: %v", prog.PTX, prog.FromCache, strings.Contains(string(prog.Image), "scale_bf16"))
	}
	lowered := prog.LoweredNames["add_const<3>"]
	if lowered == "" || !strings.Contains(string(prog.Image), lowered) {
		t.Fatalf("lowered name of add_const<3> = %q, not found in the PTX", lowered)
	}
	again, err := cuda.CompileProgram("selfcontained.cu", src, opts...)
	if err != nil || !again.FromCache || string(again.Image) != string(prog.Image) || again.LoweredNames["add_const<3>"] != lowered {
		t.Fatalf("second compile: err %v, from cache %v", err, again != nil && again.FromCache)
	}
	dumped, _ := filepath.Glob(filepath.Join(dumpDir, "selfcontained.compute_90.*.ptx"))
	if len(dumped) != 1 {
		t.Fatalf("TWELL_CUBIN_DUMP wrote %v", dumped)
	}
	major, minor, path, _ := cuda.NVRTCVersion()
	t.Logf("NVRTC %d.%d at %s; compile took %v; include dir %q", major, minor, path, prog.CompileTime, cuda.CUDAIncludeDir())
}

// TestCompileError checks that a compile error names NVRTC_ERROR_COMPILATION
// and shows the compiler log with file and line.
func TestCompileError(t *testing.T) {
	cudatest.Compiler(t)
	t.Setenv(cuda.EnvKernelCache, "off")
	src := []byte("extern \"C\" __global__ void k(int* x) {\n  x[0] = undefined_name;\n}\n")
	_, err := cuda.CompileProgram("bad.cu", src, cuda.WithArch("compute_90"))
	var nerr *cuda.NVRTCError
	if !errors.As(err, &nerr) {
		t.Fatalf("got %v (%T), want *cuda.NVRTCError", err, err)
	}
	msg := err.Error()
	if nerr.Name != "NVRTC_ERROR_COMPILATION" || !strings.Contains(msg, "bad.cu(2)") || !strings.Contains(msg, "undefined_name") {
		t.Fatalf("compile error message lacks the name, file:line or identifier:\n%s", msg)
	}
	if _, err := cuda.CompileProgram("k.cu", src); err == nil {
		t.Fatal("CompileProgram without WithArch succeeded")
	}
}

func TestMain(m *testing.M) { cudatest.Main(m) }
