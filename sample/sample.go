// Package sample picks the next token from a model's logits: greedy, or
// random with temperature, top-k, top-p (nucleus) and a repetition penalty,
// in the order Hugging Face's generate applies them.
//
// # Logits that are not finite
//
// Every mode treats NaN and infinite logits the same way:
//
//   - NaN is never picked while some token has a logit that is not NaN.
//   - -Inf is never picked while some token has a logit above -Inf: it is a
//     probability of exactly zero.
//   - +Inf is a probability of one: when one or more logits are +Inf, only
//     those tokens are candidates. Greedy picks the lowest index among them;
//     random sampling treats them as equally likely (a uniform draw), and
//     top-k and top-p then act on that uniform distribution, keeping the
//     lowest indices first.
//   - When no logit is above -Inf (all are -Inf or NaN), there is nothing to
//     sample: [Sampler.Pick] returns an error wrapping [ErrNoCandidate], and
//     [Sampler.Sample] returns the lowest index whose logit is not NaN (-Inf),
//     or 0 when every logit is NaN.
//
// Ties between equal finite logits are broken by the lowest index in greedy
// mode and in what top-k keeps.
package sample

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
)

// Options configure a Sampler. Every field has one rule, checked by
// [Options.Validate]; a value outside it is an error, never read as a
// default. The zero value is not valid (TopP and RepetitionPenalty must be
// set): start from [Greedy] and change what you need.
type Options struct {
	// Temperature divides the logits before the softmax. It must be a
	// finite number >= 0; 0 means greedy (argmax).
	Temperature float64
	// TopK keeps the K most likely tokens. It must be >= 0; 0 keeps all.
	TopK int
	// TopP keeps the smallest set of most likely tokens whose probability
	// reaches TopP. It must be in (0, 1]; 1 keeps all.
	TopP float64
	// RepetitionPenalty divides the positive logits and multiplies the
	// negative ones of tokens already seen (> 1 discourages repeats, < 1
	// encourages them). It must be a finite number > 0; 1 is off.
	RepetitionPenalty float64
	// Seed makes random sampling reproducible.
	Seed uint64
}

// Greedy returns the Options of greedy decoding with every filter off:
// temperature 0, top-k 0, top-p 1, repetition penalty 1.
func Greedy() Options {
	return Options{TopP: 1, RepetitionPenalty: 1}
}

// Validate reports the first option out of its range, naming it and the
// range:
//
//	Temperature        finite, >= 0 (0 is greedy)
//	TopK               >= 0 (0 keeps all)
//	TopP               in (0, 1] (1 keeps all)
//	RepetitionPenalty  finite, > 0 (1 is off)
func (o Options) Validate() error {
	switch {
	case !(o.Temperature >= 0) || math.IsInf(o.Temperature, 0):
		return fmt.Errorf("temperature %g: must be a finite number >= 0 (0 is greedy)", o.Temperature)
	case o.TopK < 0:
		return fmt.Errorf("top-k %d: must be >= 0 (0 keeps all tokens)", o.TopK)
	case !(o.TopP > 0 && o.TopP <= 1):
		return fmt.Errorf("top-p %g: must be in (0, 1] (1 keeps all tokens)", o.TopP)
	case !(o.RepetitionPenalty > 0) || math.IsInf(o.RepetitionPenalty, 0):
		return fmt.Errorf("repetition penalty %g: must be a finite number > 0 (1 is off)", o.RepetitionPenalty)
	}
	return nil
}

// ErrNoCandidate is wrapped by the error [Sampler.Pick] returns when there
// is no logit to sample from: none given, or none above -Inf.
var ErrNoCandidate = errors.New("no token to sample")

// Sampler draws tokens. It is not safe for concurrent use.
type Sampler struct {
	o      Options
	r      *rand.Rand
	z      []float64
	seen   []bool
	idx    []int
	prob   []float64
	w      []float32 // drawFast's weights
	ranked []ranked  // Pick's sort buffer
}

// New returns a Sampler for o, or o's validation error.
func New(o Options) (*Sampler, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	return &Sampler{o: o, r: rand.New(rand.NewPCG(o.Seed, 0x5a3b1e))}, nil
}

// Sample returns the next token given the logits (one per vocabulary entry,
// left unchanged) and the tokens seen so far (for the repetition penalty;
// ids outside the vocabulary are ignored). When no logit is above -Inf it
// returns the lowest index whose logit is not NaN, or 0 when all are NaN
// (see the package doc); with no logits at all it returns -1. Use
// [Sampler.Pick] to get an error in those cases instead.
func (s *Sampler) Sample(logits []float32, history []int) int {
	id, err := s.Pick(logits, history)
	if err == nil {
		return id
	}
	if len(logits) == 0 {
		return -1
	}
	for i, v := range logits {
		if !math.IsNaN(float64(v)) {
			return i
		}
	}
	return 0
}

// Pick is [Sampler.Sample] that reports an error wrapping [ErrNoCandidate]
// when logits is empty or none of its values (after the repetition penalty)
// is above -Inf; the error counts the NaN and -Inf logits.
func (s *Sampler) Pick(logits []float32, history []int) (int, error) {
	if len(logits) == 0 {
		return 0, fmt.Errorf("sample: %w: no logits", ErrNoCandidate)
	}
	if s.o.Temperature > 0 && s.o.TopK == 0 && s.o.TopP == 1 && (s.o.RepetitionPenalty == 1 || len(history) == 0) {
		if id, ok := s.drawFast(logits); ok {
			return id, nil
		}
	}
	if s.o.Temperature == 0 && (s.o.RepetitionPenalty == 1 || len(history) == 0) {
		// Greedy without a penalty: one pass over the float32 logits, with
		// the rules below (+Inf first, then the largest finite; the lowest
		// index among equals; never NaN, never -Inf alone).
		if best := argmax(logits); best >= 0 {
			return best, nil
		}
	}
	z := s.logits(logits, history)

	// Restrict to the candidates: the +Inf tokens when there are any, else
	// every token above -Inf. NaN is never a candidate.
	s.idx = s.idx[:0]
	posInf := false
	for i, v := range z {
		switch {
		case math.IsInf(v, 1):
			if !posInf {
				posInf = true
				s.idx = s.idx[:0]
			}
			s.idx = append(s.idx, i)
		case !posInf && v > math.Inf(-1): // false for NaN
			s.idx = append(s.idx, i)
		}
	}
	if len(s.idx) == 0 {
		nan := 0
		for _, v := range z {
			if math.IsNaN(v) {
				nan++
			}
		}
		return 0, fmt.Errorf("sample: %w: of %d logits, %d are NaN and %d are -Inf", ErrNoCandidate, len(z), nan, len(z)-nan)
	}
	if posInf {
		// The +Inf tokens share all the probability equally.
		for _, i := range s.idx {
			z[i] = 0
		}
	}

	if s.o.Temperature == 0 {
		best := s.idx[0]
		for _, i := range s.idx[1:] {
			if z[i] > z[best] {
				best = i
			}
		}
		return best, nil
	}
	if (s.o.TopK == 0 || s.o.TopK >= len(s.idx)) && s.o.TopP == 1 {
		// No filter: draw from the softmax over every candidate, in index
		// order (the same distribution as in rank order, without the sort
		// that would cost most of a small model's decode step).
		return s.draw(z), nil
	}
	// Most likely first; equal logits keep index order. The sort runs over
	// (logit, index) pairs: comparing through z costs twice as much.
	s.ranked = s.ranked[:0]
	for _, i := range s.idx {
		s.ranked = append(s.ranked, ranked{z[i], i})
	}
	slices.SortFunc(s.ranked, func(a, b ranked) int {
		switch {
		case a.z > b.z:
			return -1
		case a.z < b.z:
			return 1
		}
		return a.i - b.i
	})
	for j, r := range s.ranked {
		s.idx[j] = r.i
	}
	if k := s.o.TopK; k > 0 && k < len(s.idx) {
		s.idx = s.idx[:k]
	}
	// Softmax over the kept tokens, at the temperature. Every value is
	// finite here, so each weight is in [0, 1] and the first is 1.
	s.prob = s.prob[:0]
	top := z[s.idx[0]]
	sum := 0.0
	for _, i := range s.idx {
		e := math.Exp((z[i] - top) / s.o.Temperature)
		s.prob = append(s.prob, e)
		sum += e
	}
	n := len(s.idx)
	if p := s.o.TopP; p < 1 {
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
			return s.idx[i], nil
		}
	}
	return s.idx[n-1], nil
}

// argmax returns the index of the largest logit above -Inf (+Inf counts
// as largest), the lowest among equals, never a NaN; -1 when there is
// none. Four running maxima keep the comparisons of the first pass
// independent; the second finds the value's first index.
func argmax(x []float32) int {
	ninf := float32(math.Inf(-1))
	m0, m1, m2, m3 := ninf, ninf, ninf, ninf
	i := 0
	for ; i+4 <= len(x); i += 4 {
		if x[i] > m0 { // false for NaN
			m0 = x[i]
		}
		if x[i+1] > m1 {
			m1 = x[i+1]
		}
		if x[i+2] > m2 {
			m2 = x[i+2]
		}
		if x[i+3] > m3 {
			m3 = x[i+3]
		}
	}
	for ; i < len(x); i++ {
		if x[i] > m0 {
			m0 = x[i]
		}
	}
	m := max(m0, m1, m2, m3) // no NaN among them
	if m == ninf {
		return -1
	}
	for i, v := range x {
		if v == m {
			return i
		}
	}
	return -1
}

// drawFast is the draw over every logit above -Inf, without a filter or a
// penalty, straight from the float32 logits: weights exp((z-max)/T) in
// float32 (expNeg, relative error below 1e-6), summed in float64. It
// reports false, leaving the general path to decide, when the maximum is
// +Inf or no logit is a candidate.
func (s *Sampler) drawFast(logits []float32) (int, bool) {
	top := argmax(logits)
	if top < 0 || math.IsInf(float64(logits[top]), 1) {
		return 0, false
	}
	m, inv := logits[top], float32(1/s.o.Temperature)
	if math.IsInf(float64(inv), 1) { // a temperature below float32's range: the top token
		return top, true
	}
	w := slices.Grow(s.w[:0], len(logits))[:len(logits)]
	s.w = w
	sum := 0.0
	for i, v := range logits {
		e := float32(0)
		if v > float32(math.Inf(-1)) { // false for NaN
			e = expNeg((v - m) * inv)
		}
		w[i] = e
		sum += float64(e)
	}
	u := s.r.Float64() * sum
	last := top
	for i, e := range w {
		if e == 0 {
			continue
		}
		last = i
		if u -= float64(e); u < 0 {
			return i, true
		}
	}
	return last, true // rounding left u at or above 0
}

// expNeg returns e^x for x <= 0 in float32 (0 below float32's smallest
// normal): x = k ln 2 + r with |r| <= ln2/2, e^r by a degree-6 Taylor
// polynomial (relative error below 2e-7 there), scaled by 2^k through the
// exponent bits.
func expNeg(x float32) float32 {
	if x < -87.3 || x != x {
		return 0
	}
	const log2e, ln2hi, ln2lo = 1.44269504088896341, 0.693359375, -2.12194440e-4
	k := float32(math.Floor(float64(x*log2e + 0.5)))
	r := x - k*ln2hi - k*ln2lo
	p := 1 + r*(1+r*(1.0/2+r*(1.0/6+r*(1.0/24+r*(1.0/120+r*(1.0/720))))))
	return p * math.Float32frombits(uint32(int32(k)+127)<<23)
}

// draw samples one of the candidates s.idx from the softmax of z at the
// temperature.
func (s *Sampler) draw(z []float64) int {
	top := z[s.idx[0]]
	for _, i := range s.idx[1:] {
		top = max(top, z[i])
	}
	s.prob = s.prob[:0]
	sum := 0.0
	for _, i := range s.idx {
		e := math.Exp((z[i] - top) / s.o.Temperature)
		s.prob = append(s.prob, e)
		sum += e
	}
	u := s.r.Float64() * sum
	for j, e := range s.prob {
		u -= e
		if u < 0 {
			return s.idx[j]
		}
	}
	// Rounding left u at or above 0: the last candidate with weight.
	for j := len(s.prob) - 1; j > 0; j-- {
		if s.prob[j] > 0 {
			return s.idx[j]
		}
	}
	return s.idx[0]
}

// ranked is a candidate token and its logit, as Pick sorts them.
type ranked struct {
	z float64
	i int
}

// logits returns the logits in float64 with the repetition penalty applied,
// in a buffer the Sampler reuses. A penalised finite logit stays finite
// (clamped to ±MaxFloat64), so the penalty never makes a token certain or
// impossible; NaN and ±Inf are left as they are.
func (s *Sampler) logits(logits []float32, history []int) []float64 {
	z := slices.Grow(s.z[:0], len(logits))[:len(logits)]
	s.z = z
	for i, v := range logits {
		z[i] = float64(v)
	}
	p := s.o.RepetitionPenalty
	if p == 1 || len(history) == 0 {
		return z
	}
	s.seen = slices.Grow(s.seen[:0], len(z))[:len(z)]
	clear(s.seen)
	for _, id := range history {
		if id < 0 || id >= len(z) || s.seen[id] {
			continue
		}
		s.seen[id] = true
		v := z[id]
		if math.IsNaN(v) || math.IsInf(v, 0) {
			continue
		}
		if v > 0 {
			v /= p
		} else {
			v *= p
		}
		z[id] = max(-math.MaxFloat64, min(v, math.MaxFloat64))
	}
	return z
}
