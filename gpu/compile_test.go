package gpu

import (
	"strings"
	"testing"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
)

// TestCompilePTX compiles the kernels that need no Hopper-only instructions
// to PTX: it needs NVRTC but no GPU, so a machine without one still checks
// that they build and that every kernel the Go side looks up exists. They
// run on every GPU from sm_80 on, so each is also assembled for sm_80
// (ptxas rejects what sm_80 lacks, where the PTX for compute_90 passes).
func TestCompilePTX(t *testing.T) {
	cudatest.Compiler(t)
	for _, c := range []struct {
		name  string
		src   []byte
		exprs []string
		opts  []cuda.CompileOption
		early []string // the kernels launched with early start
	}{
		{"gemv.cu", gemvSrc, gemvExprs(), nil, gemvExprs()},
		// The measuring build stamps the timer before its kernels wait.
		{"gemv.cu_timeline", gemvSrc, gemvExprs(), []cuda.CompileOption{cuda.WithOptions("-DGEMV_TIMELINE")}, nil},
		{"dense.cu", denseSrc, denseExprs, nil, nil},
		{"hot.cu", hotSrc, hotExprs, nil, nil},
		{"t2d.cu", t2dSrc, t2dExprs, []cuda.CompileOption{cuda.WithOptions("-DTW_NCH=8")}, t2dExprs[4:]}, // TailSorted's
		{"d2t_mma.cu", d2tMMASrc, []string{"d2t_mma<32>", "d2t_mma<64>", "d2t_mma<128>"}, nil, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			opts := append(append([]cuda.CompileOption{cuda.WithArch("compute_90"), cuda.WithNameExpressions(c.exprs...)},
				Headers()...), c.opts...)
			prog, err := cuda.CompileProgram(c.name, c.src, opts...)
			if err != nil {
				t.Fatal(err)
			}
			if n := strings.Count(string(prog.Image), ".entry "); n != len(c.exprs) {
				t.Errorf("%d kernels in the PTX, want %d", n, len(c.exprs))
			}
			for _, e := range c.early {
				cudatest.WaitsFirst(t, prog, e)
			}
			opts = append(append([]cuda.CompileOption{cuda.WithArch("sm_80"), cuda.WithNameExpressions(c.exprs...)},
				Headers()...), c.opts...)
			if _, err := cuda.CompileProgram(c.name, c.src, opts...); err != nil {
				t.Errorf("sm_80: %v", err)
			}
		})
	}
}

// TestCompileWGMMAPTX compiles the Hopper D2T kernel for compute_90a,
// which needs NVRTC 12 or later (but no GPU), and checks ptxas's report for
// spills and serialized wgmmas.
func TestCompileWGMMAPTX(t *testing.T) {
	cudatest.Compiler(t)
	if major, minor, _, _ := cuda.NVRTCVersion(); major < 12 {
		t.Skipf("NVRTC %d.%d cannot target compute_90a", major, minor)
	}
	exprs := wgmmaExprs()
	opts := append([]cuda.CompileOption{cuda.WithArch("compute_90a"), cuda.WithNameExpressions(exprs...)}, Headers()...)
	prog, err := cuda.CompileProgram("d2t_wgmma.cu", d2tWGMMASrc, opts...)
	if err != nil {
		t.Fatal(err)
	}
	ptx := string(prog.Image)
	if n := strings.Count(ptx, ".entry "); n != len(exprs) {
		t.Errorf("%d kernels in the PTX, want %d", n, len(exprs))
	}
	if !strings.Contains(ptx, "wgmma.mma_async") {
		t.Errorf("no wgmma.mma_async in the PTX")
	}
	cudatest.CleanSASS(t, "d2t_wgmma.cu", d2tWGMMASrc, append([]cuda.CompileOption{cuda.WithNameExpressions(exprs...)}, Headers()...)...)
}

// TestTailCleanSASS: the tail kernels at d 2048 (8 chunks of 256 columns a
// row) compile to sm_90a machine code without spills: t2u keeps its two
// blocks an SM under 128 registers.
func TestTailCleanSASS(t *testing.T) {
	cudatest.CleanSASS(t, "t2d.cu", t2dSrc, append([]cuda.CompileOption{cuda.WithNameExpressions(t2dExprs...),
		cuda.WithOptions("-DTW_NCH=8")}, Headers()...)...)
}

// TestGEMVCleanSASS: the small-batch kernels, every batch size of gemvRows,
// compile to sm_90a machine code without spills (each token adds
// accumulators per unit in flight).
func TestGEMVCleanSASS(t *testing.T) {
	cudatest.Compiler(t)
	if major, minor, _, _ := cuda.NVRTCVersion(); major < 12 {
		t.Skipf("NVRTC %d.%d cannot target sm_90a", major, minor)
	}
	cudatest.CleanSASS(t, "gemv.cu", gemvSrc, append([]cuda.CompileOption{cuda.WithNameExpressions(gemvExprs()...)}, Headers()...)...)
}
