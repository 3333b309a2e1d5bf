package llm

import (
	"fmt"
	"testing"

	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/model"
)

// TestCompileStep builds step.cu offline (no GPU) for sm_90a and wants no
// spills.
func TestCompileStep(t *testing.T) {
	cudatest.CleanSASS(t, "step.cu", stepSrc, headers()...)
}

// TestStepKernelMatches decodes one sequence past a page boundary, and one
// at about 300 positions, on the whole-step kernel (StepKernel) and on the
// kernel-by-kernel graphs, and wants the same logits to bf16 accuracy,
// logits within the CPU's tolerance, the same bits from a second run, and
// the kernel to have run.
func TestStepKernelMatches(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	if dev.Properties().Major < 9 {
		t.Skip("step_b1 needs sm_90")
	}
	for _, tc := range []struct {
		c             model.Config
		prompt, steps int
	}{
		{testConfig(64, 4, 2, true), 58, 12}, {testConfig(64, 8, 2, false), 58, 12}, {testConfig(64, 4, 4, true), 58, 12},
		{testConfig(64, 4, 2, true), 300, 6}, // runs of one and two key blocks, slots of one and two
	} {
		c := tc.c
		t.Run(fmt.Sprintf("heads%d_kv%d_prompt%d", c.NumAttentionHeads, c.NumKeyValueHeads, tc.prompt), func(t *testing.T) {
			r, seed := testutil.Rand(t)
			m := sparseModel(t, c, r, seed)
			passes := append([][][]int{{enginetest.Tokens(r, tc.prompt, c.VocabSize)}}, decodeSteps(r, tc.steps, 1, c.VocabSize)...)
			run := func(step bool) ([][]float32, *Engine) {
				e := engineOnPath(t, dev, m, seed, "sparse")
				e.StepKernel = step
				return enginetest.Passes(t, e, 320, passes...), e
			}
			base, _ := run(false)
			got, e := run(true)
			if e.stepGraphs == 0 {
				t.Fatalf("seed %d: no decode step ran on step_b1", seed)
			}
			if d, err := enginetest.RelDiff(got, base); err != nil || d > 1e-2 {
				t.Errorf("seed %d: step kernel vs kernel by kernel: rel diff %.3g (err %v)", seed, d, err)
			}
			if d, err := enginetest.RelDiff(got, cpuForward(t, m, "sparse", 320, passes...)); err != nil || d > bf16Tol {
				t.Errorf("seed %d: step kernel vs CPU: rel diff %.3g (err %v)", seed, d, err)
			}
			again, _ := run(true)
			enginetest.SameBits(t, fmt.Sprintf("seed %d: step kernel twice", seed), again, got)
		})
	}
}
