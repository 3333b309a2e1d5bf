package sample

import (
	"math/rand/v2"
	"testing"
)

// BenchmarkPick times one sampling step over a 32,000-entry vocabulary of
// random logits, greedy and at temperature 0.8 (no top-k or top-p filter).
func BenchmarkPick(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 2))
	logits := make([]float32, 32000)
	for i := range logits {
		logits[i] = float32(r.NormFloat64() * 3)
	}
	for _, temp := range []float64{0, 0.8} {
		s, err := New(opts(temp, 0, 1, 1))
		if err != nil {
			b.Fatal(err)
		}
		name := "greedy"
		if temp > 0 {
			name = "t0.8"
		}
		b.Run(name, func(b *testing.B) {
			for i := range b.N {
				s.Sample(logits, nil, uint64(i))
			}
		})
	}
}
