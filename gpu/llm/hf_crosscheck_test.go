package llm

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/model"
)

// TestHFCrossCheckGPU runs the checkpoints that Hugging Face transformers
// saved (scripts/hf-crosscheck-model.py, TWELL_HF_DIR) on the GPU engine:
// the logits of every prompt position must match PyTorch's float32 logits
// within bf16 tolerance on each MLP path, and greedy decoding with the KV
// cache must pick PyTorch's tokens wherever PyTorch's top two logits are
// further apart than that tolerance (the engine is fed PyTorch's tokens,
// so one near-tie does not derail the rest).
func TestHFCrossCheckGPU(t *testing.T) {
	root := os.Getenv("TWELL_HF_DIR")
	if root == "" {
		t.Skip("TWELL_HF_DIR not set: run scripts/hf-crosscheck-model.py to make the checkpoints")
	}
	dev := cudatest.Device(t)
	exps, _ := filepath.Glob(filepath.Join(root, "*", "expected.json"))
	if len(exps) == 0 {
		t.Fatalf("no */expected.json under %s", root)
	}
	for _, exp := range exps {
		dir := filepath.Dir(exp)
		t.Run(filepath.Base(dir), func(t *testing.T) {
			var want struct {
				IDs          []int       `json:"ids"`
				Logits       [][]float32 `json:"logits"`
				Greedy       []int       `json:"greedy"`
				GreedyMargin []float64   `json:"greedy_margin"`
			}
			b, err := os.ReadFile(exp)
			if err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(b, &want); err != nil {
				t.Fatal(err)
			}
			m, err := model.Load(dir)
			if err != nil {
				t.Fatal(err)
			}
			e := newEngine(t, dev, m, 0)
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
				got, _, err := e.Forward(gpuCaches(t, e, 1, 64), [][]int{want.IDs}, true)
				if err != nil {
					t.Fatal(err)
				}
				d, err := relDiff(got, want.Logits)
				t.Logf("%s path: max |logit diff| / max |logit| = %.2e", path, d)
				if err != nil || d > bf16Tol {
					t.Errorf("%s path: logits differ from PyTorch by %.3g of the largest (tolerance %g) %v", path, d, bf16Tol, err)
				}
			}
			if err := e.SetMLPPath(pathOf(t, "auto")); err != nil {
				t.Fatal(err)
			}
			cache := gpuCaches(t, e, 1, 64)
			logits, _, err := e.Forward(cache, [][]int{want.IDs}, false)
			if err != nil {
				t.Fatal(err)
			}
			same, checked := 0, 0
			for i, tok := range want.Greedy {
				best := 0
				for v, l := range logits[0] {
					if l > logits[0][best] {
						best = v
					}
				}
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
				if logits, _, err = e.Forward(cache, [][]int{{tok}}, false); err != nil {
					t.Fatal(err)
				}
			}
			t.Logf("greedy: %d of %d tokens as PyTorch's (%d steps with a clear margin checked)", same, len(want.Greedy), checked)
		})
	}
}
