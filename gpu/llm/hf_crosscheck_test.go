package llm

import (
	"math"
	"testing"

	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/engine/enginetest"
)

// TestHFCrossCheckGPU runs the checkpoints that Hugging Face transformers
// saved (scripts/hf-crosscheck-model.py, TWELL_HF_DIR) on the GPU engine:
// the logits of every prompt position must match PyTorch's float32 logits
// within bf16 tolerance on each MLP path, and greedy decoding with the KV
// cache must pick PyTorch's tokens wherever PyTorch's top two logits are
// further apart than that tolerance (the engine is fed PyTorch's tokens,
// so one near-tie does not derail the rest).
func TestHFCrossCheckGPU(t *testing.T) {
	enginetest.HFCrossCheck(t, func(t *testing.T, want *enginetest.HFCase) {
		e := newEngine(t, cudatest.Device(t), want.Model, 0)
		scale := 0.0
		for _, row := range want.Logits {
			for _, v := range row {
				scale = max(scale, math.Abs(float64(v)))
			}
		}
		for _, path := range []string{"sparse", "dense", "auto"} {
			if err := e.SetMLPPath(pathOf(t, path)); err != nil {
				t.Fatal(err)
			}
			got, _ := enginetest.Forward(t, e, enginetest.Caches(t, e, 1, 64), [][]int{want.IDs}, true)
			d, err := enginetest.RelDiff(got, want.Logits)
			t.Logf("%s path: max |logit diff| / max |logit| = %.2e", path, d)
			if err != nil || d > bf16Tol {
				t.Errorf("%s path: logits differ from PyTorch by %.3g of the largest (tolerance %g) %v", path, d, bf16Tol, err)
			}
		}
		if err := e.SetMLPPath(pathOf(t, "auto")); err != nil {
			t.Fatal(err)
		}
		cache := enginetest.Caches(t, e, 1, 64)
		logits, _ := enginetest.Forward(t, e, cache, [][]int{want.IDs}, false)
		same, checked := 0, 0
		for i, tok := range want.Greedy {
			best := enginetest.Argmax(logits[0])
			if best == tok {
				same++
			}
			clear := i >= len(want.GreedyMargin) || want.GreedyMargin[i] > 2*bf16Tol*scale
			if clear {
				checked++
				if best != tok {
					t.Errorf("greedy step %d: token %d, PyTorch %d (its top-2 margin %.3g)", i, best, tok, want.GreedyMargin[i])
				}
			}
			logits, _ = enginetest.Forward(t, e, cache, [][]int{{tok}}, false)
		}
		t.Logf("greedy: %d of %d tokens as PyTorch's (%d steps with a clear margin checked)", same, len(want.Greedy), checked)
	})
}
