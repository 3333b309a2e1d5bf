package trainer

import (
	"fmt"
	"math/rand"
	"strings"
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

// TestFitErrorNamesWhatFits checks the advice of a refused micro-batch at
// the 1.5B shape for free memory from the weights' state alone to past the
// whole estimate: what fits passes, and for what does not, the largest
// smaller micro-batch that fits is named and recomputation is offered
// with the right claim.
func TestFitErrorNamesWhatFits(t *testing.T) {
	c := model.SparseLM1B5()
	state := ParamBytes(c)
	seed := time.Now().UnixNano()
	rng := rand.New(rand.NewSource(seed))
	for range 100 {
		batch, seq := 1+rng.Intn(16), 256*(1+rng.Intn(8))
		o := Options{MLP: []mlp.Path{mlp.Dense, mlp.Sparse}[rng.Intn(2)], Recompute: rng.Intn(4) == 0}
		need := state + ActivationBytes(c, batch, seq, o)
		free := state + rng.Int63n((need-state)*5/4+fitSlack) // a fifth of the cases fit
		err := fitError(need, free, "GPU 0", c, batch, seq, o)
		if need+fitSlack <= free {
			if err != nil {
				t.Fatalf("seed %d: %d x %d with %s free: %v", seed, batch, seq, memcheck.Format(float64(free)), err)
			}
			continue
		}
		if err == nil {
			t.Fatalf("seed %d: %d x %d needs %d bytes, %d free: no error", seed, batch, seq, need, free)
		}
		msg := err.Error()
		fit := 0
		for b := batch - 1; b >= 1; b-- {
			if state+ActivationBytes(c, b, seq, o)+fitSlack <= free {
				fit = b
				break
			}
		}
		if fit > 0 && !strings.Contains(msg, fmt.Sprintf("at most %d x %d tokens would fit", fit, seq)) ||
			fit == 0 && !strings.Contains(msg, "not even one sequence") {
			t.Errorf("seed %d: %d x %d, %d free, largest fit %d: %s", seed, batch, seq, free, fit, msg)
		}
		r := o
		r.Recompute = true
		fitsRecomputed := state+ActivationBytes(c, batch, seq, r)+fitSlack <= free
		switch {
		case o.Recompute && strings.Contains(msg, "-recompute"):
			t.Errorf("seed %d: recomputing already, yet %s", seed, msg)
		case !o.Recompute && fitsRecomputed != strings.Contains(msg, fmt.Sprintf("with -recompute (each layer's forward again in the backward) %d x %d tokens fit", batch, seq)):
			t.Errorf("seed %d: %d x %d fits with recomputation: %v; %s", seed, batch, seq, fitsRecomputed, msg)
		}
	}
}
