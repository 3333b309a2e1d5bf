package train

import (
	"math/rand/v2"
	"testing"

	"github.com/twell-ai/twell/model"
)

// BenchmarkCPUStep times one training step (forward and backward, no
// optimizer) of a 6.3M-parameter model (hidden 256, 4 layers, MLP 1024,
// vocabulary 8192) on 16 x 256 tokens.
func BenchmarkCPUStep(b *testing.B) {
	mc := llama(256, 1024, 4, 4, 4, 512)
	mc.VocabSize = 8192
	r := rand.New(rand.NewPCG(3, 4))
	be, err := NewCPU(mc, model.RandomWeights(mc, r))
	if err != nil {
		b.Fatal(err)
	}
	const batch, seq = 16, 256
	toks := make([]int, batch*(seq+1))
	for i := range toks {
		toks[i] = r.IntN(mc.VocabSize)
	}
	for b.Loop() {
		if err := be.BeginStep(1); err != nil {
			b.Fatal(err)
		}
		if err := be.Accumulate(toks, batch, seq, 2e-5); err != nil {
			b.Fatal(err)
		}
		if _, err := be.EndStep(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(batch*seq)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
}
