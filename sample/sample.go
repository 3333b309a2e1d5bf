// Package sample picks the next token from a model's logits: greedy, or
// random with temperature, top-k, top-p (nucleus) and a repetition penalty,
// in the order Hugging Face's generate applies them.
package sample

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
)

// Options configure a Sampler. The zero value is greedy decoding.
type Options struct {
	// Temperature divides the logits; 0 means greedy (argmax).
	Temperature float64
	// TopK keeps the K most likely tokens; 0 keeps all.
	TopK int
	// TopP keeps the smallest set of most likely tokens whose probability
	// reaches TopP; 0 or 1 keeps all.
	TopP float64
	// RepetitionPenalty (> 1 discourages repeats) divides positive logits
	// and multiplies negative ones of tokens already seen; 0 or 1 is off.
	RepetitionPenalty float64
	// Seed makes random sampling reproducible.
	Seed uint64
}

// Validate reports the first option out of range, naming it.
func (o Options) Validate() error {
	switch {
	case !(o.Temperature >= 0) || math.IsInf(o.Temperature, 0):
		return fmt.Errorf("temperature %g: must be a finite number >= 0", o.Temperature)
	case o.TopK < 0:
		return fmt.Errorf("top-k %d: must be >= 0", o.TopK)
	case !(o.TopP >= 0 && o.TopP <= 1):
		return fmt.Errorf("top-p %g: must be in [0, 1]", o.TopP)
	case !(o.RepetitionPenalty >= 0) || math.IsInf(o.RepetitionPenalty, 0):
		return fmt.Errorf("repetition penalty %g: must be a finite number >= 0", o.RepetitionPenalty)
	}
	return nil
}

// Sampler draws tokens. It is not safe for concurrent use.
type Sampler struct {
	o    Options
	r    *rand.Rand
	idx  []int
	prob []float64
}

// New returns a Sampler for o.
func New(o Options) (*Sampler, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	return &Sampler{o: o, r: rand.New(rand.NewPCG(o.Seed, 0x5a3b1e))}, nil
}

// Sample returns the next token given the logits (one per vocabulary entry,
// left unchanged) and the tokens seen so far (for the repetition penalty).
func (s *Sampler) Sample(logits []float32, history []int) int {
	z := make([]float64, len(logits))
	for i, v := range logits {
		z[i] = float64(v)
	}
	if p := s.o.RepetitionPenalty; p > 0 && p != 1 {
		seen := map[int]bool{}
		for _, id := range history {
			if id < 0 || id >= len(z) || seen[id] {
				continue
			}
			seen[id] = true
			if z[id] > 0 {
				z[id] /= p
			} else {
				z[id] *= p
			}
		}
	}
	if s.o.Temperature == 0 {
		return argmax(z)
	}
	s.idx = s.idx[:0]
	for i, v := range z {
		if !math.IsNaN(v) {
			s.idx = append(s.idx, i)
		}
	}
	if len(s.idx) == 0 {
		return 0
	}
	slices.SortStableFunc(s.idx, func(a, b int) int {
		switch {
		case z[a] > z[b]:
			return -1
		case z[a] < z[b]:
			return 1
		}
		return 0
	})
	if k := s.o.TopK; k > 0 && k < len(s.idx) {
		s.idx = s.idx[:k]
	}
	// Softmax over the kept tokens, at the temperature.
	s.prob = s.prob[:0]
	top := z[s.idx[0]]
	sum := 0.0
	for _, i := range s.idx {
		e := math.Exp((z[i] - top) / s.o.Temperature)
		s.prob = append(s.prob, e)
		sum += e
	}
	n := len(s.idx)
	if p := s.o.TopP; p > 0 && p < 1 {
		acc := 0.0
		for i, e := range s.prob {
			acc += e / sum
			if acc >= p {
				n = i + 1
				break
			}
		}
		sum = 0
		for _, e := range s.prob[:n] {
			sum += e
		}
	}
	u := s.r.Float64() * sum
	for i, e := range s.prob[:n] {
		u -= e
		if u < 0 {
			return s.idx[i]
		}
	}
	return s.idx[n-1]
}

func argmax(z []float64) int {
	best := 0
	for i, v := range z {
		if v > z[best] || math.IsNaN(z[best]) {
			best = i
		}
	}
	return best
}
