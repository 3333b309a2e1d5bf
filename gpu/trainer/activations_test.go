package trainer

import (
	"math/rand"
	"testing"
	"time"

	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
)

// TestRecomputeActivationBytes checks that recomputation keeps one layer's
// activations where the plain step keeps every layer's: for random shapes
// the estimate with Recompute is the plain one less L - 1 copies of a
// layer's buffers but its input, plus the discard buffer.
func TestRecomputeActivationBytes(t *testing.T) {
	seed := time.Now().UnixNano()
	rng := rand.New(rand.NewSource(seed))
	for range 200 {
		c := model.SparseLM1B5()
		c.NumHiddenLayers = 1 + rng.Intn(40)
		batch, seq := 1+rng.Intn(16), 1+rng.Intn(4096)
		o := Options{MLP: []mlp.Path{mlp.Dense, mlp.Sparse, mlp.Auto}[rng.Intn(3)]}
		plain := ActivationBytes(c, batch, seq, o)
		perLayer, _, _ := activationSizes(c, batch, seq, o)
		layer := int64(0)
		for _, s := range perLayer[1:] {
			layer += int64(s)
		}
		o.Recompute = true
		if got, want := ActivationBytes(c, batch, seq, o), plain-int64(c.NumHiddenLayers-1)*layer+int64(discardBytes(c)); got != want {
			t.Fatalf("seed %d: %d layers, %d x %d tokens, %v: %d bytes with recomputation, want %d (plain %d)",
				seed, c.NumHiddenLayers, batch, seq, o.MLP, got, want, plain)
		}
	}
	c := model.SparseLM1B5()
	for _, path := range []mlp.Path{mlp.Dense, mlp.Sparse} {
		o := Options{MLP: path}
		plain := ActivationBytes(c, 8, 2048, o)
		o.Recompute = true
		t.Logf("1.5B shape, 8 x 2048 tokens, %v MLP: activations %s, with recomputation %s", path,
			memcheck.Format(float64(plain)), memcheck.Format(float64(ActivationBytes(c, 8, 2048, o))))
	}
}
