package llm_test

import (
	"math"
	"testing"

	"github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/mlp"
)

// TestHFCrossCheck loads checkpoints saved by Hugging Face transformers
// (scripts/hf-crosscheck-model.py) and compares twell's logits and greedy
// tokens with PyTorch's. It needs TWELL_HF_DIR; it is run on the GPU
// machine, which has PyTorch.
func TestHFCrossCheck(t *testing.T) {
	enginetest.HFCrossCheck(t, func(t *testing.T, want *enginetest.HFCase) {
		e := newEngine(t, want.Model, llm.Options{})
		for _, path := range []mlp.Path{mlp.Sparse, mlp.Dense} {
			if err := e.SetMLPPath(path); err != nil {
				t.Fatal(err)
			}
			got, _ := enginetest.Forward(t, e, enginetest.Caches(t, e, 1, 64), [][]int{want.IDs}, true)
			worst := 0.0
			for p := range want.IDs {
				worst = math.Max(worst, enginetest.MaxRelDiff(got[p], want.Logits[p]))
			}
			// TwELL stores the gate in bf16; the dense path is float32 throughout.
			tol := 1e-4
			if path == mlp.Sparse {
				tol = 1e-2
			}
			t.Logf("%s path: max |logit diff| / max |logit| = %.2e", path, worst)
			if worst > tol {
				t.Errorf("%s path: logits differ from PyTorch by %.3g (relative to max), tolerance %g", path, worst, tol)
			}
		}
		if err := e.SetMLPPath(mlp.Auto); err != nil {
			t.Fatal(err)
		}
		cache := enginetest.Caches(t, e, 1, 64)
		logits, _ := enginetest.Forward(t, e, cache, [][]int{want.IDs}, false)
		var gen []int
		for len(gen) < len(want.Greedy) {
			best := enginetest.Argmax(logits[0])
			gen = append(gen, best)
			logits, _ = enginetest.Forward(t, e, cache, [][]int{{best}}, false)
		}
		for i := range gen {
			if gen[i] != want.Greedy[i] {
				t.Fatalf("greedy tokens %v, PyTorch %v", gen, want.Greedy)
			}
		}
	})
}
