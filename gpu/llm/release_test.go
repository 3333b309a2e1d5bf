package llm

import (
	"testing"

	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/safetensors"
)

// TestDeferredReleased builds an engine from a model.LoadDeferred model
// with ReleaseWeights (each layer read from the checkpoint, uploaded and
// dropped): its logits must be those of an engine built from the model
// loaded whole, bit for bit, and the model must hold no weights after.
func TestDeferredReleased(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	r, seed := testutil.Rand(t)
	c := testConfig(64, 4, 2, r.IntN(2) == 0)
	full, lazy := enginetest.SavedTwice(t, c, sparseModel(t, c, r, seed).Weights, safetensors.BF16)
	opts, err := OptionsFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	opts.ReleaseWeights = true
	e2, err := NewEngineWith(dev, lazy, opts)
	if err != nil {
		t.Fatalf("seed %d: NewEngineWith (deferred, released): %v", seed, err)
	}
	defer e2.Close()
	e1 := newEngine(t, dev, full, seed)
	ids := enginetest.Tokens(r, 37, c.VocabSize)
	want, _ := enginetest.Forward(t, e1, enginetest.Caches(t, e1, 1, 64), [][]int{ids}, true)
	got, _ := enginetest.Forward(t, e2, enginetest.Caches(t, e2, 1, 64), [][]int{ids}, true)
	enginetest.SameBits(t, "deferred and released vs loaded whole", got, want)
	if lazy.Weights != nil || lazy.Deferred() {
		t.Errorf("seed %d: the model still holds weights (%v) or layers in the checkpoint (%v)", seed, lazy.Weights != nil, lazy.Deferred())
	}
}
