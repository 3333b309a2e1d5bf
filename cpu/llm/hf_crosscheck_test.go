package llm_test

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
)

// TestHFCrossCheck loads checkpoints saved by Hugging Face transformers
// (scripts/hf-crosscheck-model.py) and compares twell's logits and greedy
// tokens with PyTorch's. It needs TWELL_HF_DIR; it is run on the GPU
// machine, which has PyTorch.
func TestHFCrossCheck(t *testing.T) {
	root := os.Getenv("TWELL_HF_DIR")
	if root == "" {
		t.Skip("TWELL_HF_DIR not set: run scripts/hf-crosscheck-model.py to make the checkpoints")
	}
	dirs, _ := filepath.Glob(filepath.Join(root, "*", "expected.json"))
	if len(dirs) == 0 {
		t.Fatalf("no */expected.json under %s", root)
	}
	for _, exp := range dirs {
		dir := filepath.Dir(exp)
		t.Run(filepath.Base(dir), func(t *testing.T) {
			var want struct {
				IDs    []int       `json:"ids"`
				Logits [][]float64 `json:"logits"`
				Greedy []int       `json:"greedy"`
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
			e := newEngine(t, m, llm.Options{})
			for _, path := range []mlp.Path{mlp.Sparse, mlp.Dense} {
				if err := e.SetMLPPath(path); err != nil {
					t.Fatal(err)
				}
				got, _, err := e.Forward(caches(t, e, 1, 64), [][]int{want.IDs}, true)
				if err != nil {
					t.Fatal(err)
				}
				worst := 0.0
				for p := range want.IDs {
					worst = math.Max(worst, maxRelDiff(got[p], want.Logits[p]))
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
			cache := caches(t, e, 1, 64)
			logits, _, err := e.Forward(cache, [][]int{want.IDs}, false)
			if err != nil {
				t.Fatal(err)
			}
			var gen []int
			for len(gen) < len(want.Greedy) {
				best := 0
				for v, l := range logits[0] {
					if l > logits[0][best] {
						best = v
					}
				}
				gen = append(gen, best)
				if logits, _, err = e.Forward(cache, [][]int{{best}}, false); err != nil {
					t.Fatal(err)
				}
			}
			for i := range gen {
				if gen[i] != want.Greedy[i] {
					t.Fatalf("greedy tokens %v, PyTorch %v", gen, want.Greedy)
				}
			}
		})
	}
}
