package train

import (
	"math"
	"testing"

	"github.com/twell-ai/twell/model"
)

// TestFLOPsPerToken: the count is 6 FLOPs per weight of every matrix
// product (LM head included, embedding lookup not) plus causal attention.
func TestFLOPsPerToken(t *testing.T) {
	c := model.SparseLM1B5()
	got := FLOPsPerToken(c, 2048)
	// 28 layers of q,k,v,o (2048x2048 each, 32 heads of 64, no GQA) and a
	// gated MLP (3 x 2048 x 5632), the 49152 x 2048 head; attention
	// 6 x 28 x 2048 x 2048.
	perLayer := 4.0*2048*2048 + 3*2048*5632
	want := 6*(28*perLayer+49152*2048) + 6*28*2048*2048.0
	if math.Abs(got-want) > 1e-9*want {
		t.Fatalf("FLOPsPerToken = %g, want %g", got, want)
	}
	if c.ParamCount() > 0 && got < 6*float64(c.ParamCount()-int64(c.VocabSize*c.HiddenSize)) {
		t.Errorf("FLOPs per token %g below 6 per non-embedding parameter", got)
	}
}
