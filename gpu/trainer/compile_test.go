package trainer

import (
	"testing"

	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/gpu"
)

func TestMain(m *testing.M) { cudatest.Main(m) }

// TestCompileSASS compiles this package's .cu files to sm_90a machine code
// (NVRTC only, no GPU) and checks ptxas's report for spills.
func TestCompileSASS(t *testing.T) {
	for _, f := range kernelFiles {
		t.Run(f.name, func(t *testing.T) { cudatest.CleanSASS(t, f.name, *f.src, gpu.Headers()...) })
	}
}
