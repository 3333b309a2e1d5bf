package sample

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestGreedyPicksArgmax(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 1))
	s, _ := New(Options{})
	for i := 0; i < 100; i++ {
		logits := make([]float32, 1+r.IntN(50))
		best := 0
		for j := range logits {
			logits[j] = float32(r.NormFloat64())
			if logits[j] > logits[best] {
				best = j
			}
		}
		if got := s.Sample(logits, nil); got != best {
			t.Fatalf("seed %d: greedy picked %d, argmax is %d", seed, got, best)
		}
	}
}

func TestTemperatureMatchesSoftmax(t *testing.T) {
	seed := rand.Uint64()
	logits := []float32{1, 2, 0.5, -1}
	for _, temp := range []float64{0.5, 1, 2} {
		s, _ := New(Options{Temperature: temp, Seed: seed})
		counts := make([]int, len(logits))
		const n = 40000
		for i := 0; i < n; i++ {
			counts[s.Sample(logits, nil)]++
		}
		sum := 0.0
		for _, l := range logits {
			sum += math.Exp(float64(l) / temp)
		}
		for i, l := range logits {
			want := math.Exp(float64(l)/temp) / sum
			got := float64(counts[i]) / n
			if math.Abs(got-want) > 0.015 {
				t.Errorf("seed %d: temperature %g token %d: frequency %.3f, want %.3f", seed, temp, i, got, want)
			}
		}
	}
}

func TestTopKAndTopPRestrict(t *testing.T) {
	seed := rand.Uint64()
	logits := []float32{3, 2.9, 1, 0, -1, -2}
	s, _ := New(Options{Temperature: 1, TopK: 2, Seed: seed})
	for i := 0; i < 2000; i++ {
		if got := s.Sample(logits, nil); got > 1 {
			t.Fatalf("seed %d: top-k 2 sampled token %d", seed, got)
		}
	}
	// Softmax of logits: p0 ~ 0.49, p1 ~ 0.44; top-p 0.5 keeps tokens 0 and 1.
	s, _ = New(Options{Temperature: 1, TopP: 0.5, Seed: seed})
	seen := map[int]bool{}
	for i := 0; i < 2000; i++ {
		seen[s.Sample(logits, nil)] = true
	}
	if len(seen) != 2 || !seen[0] || !seen[1] {
		t.Fatalf("seed %d: top-p 0.5 sampled %v, want exactly {0, 1}", seed, seen)
	}
}

func TestRepetitionPenalty(t *testing.T) {
	s, _ := New(Options{RepetitionPenalty: 2})
	logits := []float32{2, 1.5, -1}
	if got := s.Sample(logits, []int{0}); got != 1 {
		t.Fatalf("penalised token 0 (2/2=1 < 1.5) still chosen: got %d", got)
	}
	if logits[0] != 2 {
		t.Fatal("Sample changed the caller's logits")
	}
}

func TestSeedReproducible(t *testing.T) {
	logits := make([]float32, 100)
	for i := range logits {
		logits[i] = float32(i%7) * 0.3
	}
	a, _ := New(Options{Temperature: 1, Seed: 42})
	b, _ := New(Options{Temperature: 1, Seed: 42})
	for i := 0; i < 50; i++ {
		if x, y := a.Sample(logits, nil), b.Sample(logits, nil); x != y {
			t.Fatalf("same seed diverged at draw %d: %d vs %d", i, x, y)
		}
	}
}

func TestValidate(t *testing.T) {
	for _, o := range []Options{{Temperature: -1}, {TopK: -2}, {TopP: 1.5}, {Temperature: math.NaN()}, {RepetitionPenalty: -1}} {
		if _, err := New(o); err == nil {
			t.Errorf("%+v accepted", o)
		}
	}
}
