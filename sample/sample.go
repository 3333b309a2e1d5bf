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
//
// # How a token is drawn
//
// A draw is defined in integers, so that an engine can make the same draw
// on its device bit for bit (package gpu/llm's pick_rows makes it from the
// same float32 logits; see [Draw]):
//
//   - Each candidate's weight is exp((v - m) / T) in fixed point, [One] for
//     the largest candidate m: [Weight], with T and 1/T rounded to float32
//     and the exponential computed in float32 operations that every IEEE
//     machine rounds alike. Each +Inf candidate weighs One.
//   - Candidates rank by logit, the larger first, equal logits by index.
//     Top-k keeps the first k; top-p then keeps the first n whose weight
//     reaches ceil(p * S), with p rounded to float32 and S the weight kept
//     so far.
//   - A draw's 64 random bits u are Philox4x32-10 of its place in the
//     stream (index) under Seed; the token is the first kept candidate in
//     index order at which the running sum of weights passes u * S / 2^64,
//     S being the kept weight.
//
// So a draw depends on the options, the logits, the history (for the
// penalty) and its index alone: a sequence's n-th token is drawn at index n
// whatever else runs.
package sample

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
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

// Draw is one token drawn where an engine runs (engine.DeviceSampling)
// instead of by a Sampler on the host: the temperature, top-k and top-p of
// Options (temperature 0 is the greedy pick), and the draw's place in the
// random stream of Seed. The engine draws as a Sampler's Pick does (the
// package doc says how), so the same logits, Seed and Index give the same
// token on the device and on the host.
type Draw struct {
	Temperature float64
	TopK        int
	TopP        float64
	Seed        uint64
	// Index is the draw's place in Seed's stream: a sequence's n-th token
	// is drawn at Index n (from 0), so that its draws do not depend on the
	// other sequences of a step.
	Index uint64
}

// Draw returns o's draw at place index of its seed's stream, and false
// when o has a repetition penalty (it needs the history, which a Draw does
// not carry).
func (o Options) Draw(index uint64) (Draw, bool) {
	if o.RepetitionPenalty != 1 {
		return Draw{}, false
	}
	return Draw{Temperature: o.Temperature, TopK: o.TopK, TopP: o.TopP, Seed: o.Seed, Index: index}, true
}

// ErrNoCandidate is wrapped by the error [Sampler.Pick] returns when there
// is no logit to sample from: none given, or none above -Inf.
var ErrNoCandidate = errors.New("no token to sample")

// Sampler draws tokens. Its draws depend on its Options and on the
// arguments of each call alone; it holds only scratch space, and is not
// safe for concurrent use.
type Sampler struct {
	o      Options
	z      []float32 // logits with the repetition penalty
	seen   []bool
	idx    []int    // candidates
	w      []uint64 // their weights
	kept   []int    // the kept candidates' places in idx, in index order
	ranked []ranked // the sort buffer of top-k and top-p
}

// New returns a Sampler for o, or o's validation error.
func New(o Options) (*Sampler, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	return &Sampler{o: o}, nil
}

// Sample returns the token drawn at place index of the seed's stream given
// the logits (one per vocabulary entry, left unchanged) and the tokens seen
// so far (for the repetition penalty; ids outside the vocabulary are
// ignored). When no logit is above -Inf it returns the lowest index whose
// logit is not NaN (-Inf), or 0 when all are NaN (see the package doc);
// with no logits at all it returns -1. Use [Sampler.Pick] to get an error
// in those cases instead.
func (s *Sampler) Sample(logits []float32, history []int, index uint64) int {
	id, err := s.Pick(logits, history, index)
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
func (s *Sampler) Pick(logits []float32, history []int, index uint64) (int, error) {
	if len(logits) == 0 {
		return 0, fmt.Errorf("sample: %w: no logits", ErrNoCandidate)
	}
	z := s.logits(logits, history)
	inv, random := s.inverse()
	if !random {
		// Greedy: one pass with the rules below (+Inf first, then the
		// largest finite; the lowest index among equals; never NaN,
		// never -Inf alone).
		if best := argmax(z); best >= 0 {
			return best, nil
		}
		return 0, noCandidate(z)
	}
	if err := s.candidates(z, inv); err != nil {
		return 0, err
	}
	sum, filtered := s.filter(z)
	hi, _ := bits.Mul64(philox(s.o.Seed, index), sum)
	if !filtered {
		for j, w := range s.w {
			if hi < w {
				return s.idx[j], nil
			}
			hi -= w
		}
	}
	for _, j := range s.kept {
		if hi < s.w[j] {
			return s.idx[j], nil
		}
		hi -= s.w[j]
	}
	return s.idx[len(s.idx)-1], nil // not reached: hi < sum
}

// Distribution returns the tokens Pick draws among for these logits and
// history, most likely first (equal logits in index order), and the
// probability Pick gives each: the greedy pick alone at temperature 0. Its
// errors are Pick's.
func (s *Sampler) Distribution(logits []float32, history []int) (ids []int, probs []float64, err error) {
	if len(logits) == 0 {
		return nil, nil, fmt.Errorf("sample: %w: no logits", ErrNoCandidate)
	}
	z := s.logits(logits, history)
	inv, random := s.inverse()
	if !random {
		best := argmax(z)
		if best < 0 {
			return nil, nil, noCandidate(z)
		}
		return []int{best}, []float64{1}, nil
	}
	if err := s.candidates(z, inv); err != nil {
		return nil, nil, err
	}
	sum, filtered := s.filter(z)
	if !filtered {
		s.ranked = s.ranked[:0]
		for j, i := range s.idx {
			s.ranked = append(s.ranked, ranked{z[i], j})
		}
		s.rank()
	}
	for _, r := range s.ranked {
		ids = append(ids, s.idx[r.j])
		probs = append(probs, float64(s.w[r.j])/float64(sum))
	}
	return ids, probs, nil
}

// inverse returns 1/T in float32, and false when the draw is greedy:
// temperature 0, or one so small that T or 1/T is not a finite float32
// above 0. A temperature past 1e30 draws as 1e30 does (as uniformly as
// float32 logits allow).
func (s *Sampler) inverse() (float32, bool) {
	t := float32(min(s.o.Temperature, 1e30))
	if t == 0 {
		return 0, false
	}
	inv := 1 / t
	return inv, !math.IsInf(float64(inv), 1)
}

// noCandidate is Pick's error when no value of z is above -Inf.
func noCandidate(z []float32) error {
	nan := 0
	for _, v := range z {
		if v != v {
			nan++
		}
	}
	return fmt.Errorf("sample: %w: of %d logits, %d are NaN and %d are -Inf", ErrNoCandidate, len(z), nan, len(z)-nan)
}

// candidates puts into s.idx the tokens that may be drawn from z, in index
// order, and their weights into s.w: the +Inf ones when there are any, each
// weighing One, else every token above -Inf, weighing Weight(v, max, inv).
// NaN never is one. With none it returns an error wrapping ErrNoCandidate.
func (s *Sampler) candidates(z []float32, inv float32) error {
	s.idx, s.w = s.idx[:0], s.w[:0]
	inf := float32(math.Inf(1))
	m := float32(math.Inf(-1))
	for i, v := range z {
		if v > m { // false for NaN
			m = v
		}
		if v == inf || (m < inf && v > float32(math.Inf(-1))) {
			s.idx = append(s.idx, i)
		}
	}
	if len(s.idx) == 0 {
		return noCandidate(z)
	}
	if m == inf {
		// Only the +Inf tokens, equally likely.
		kept := s.idx[:0]
		for _, i := range s.idx {
			if z[i] == inf {
				kept = append(kept, i)
				s.w = append(s.w, One)
			}
		}
		s.idx = kept
		return nil
	}
	for _, i := range s.idx {
		s.w = append(s.w, Weight(z[i], m, inv))
	}
	return nil
}

// filter applies top-k and top-p to the candidates and returns the weight
// of those it keeps, and whether it left any out: then their places in
// s.idx are in s.kept in index order and in s.ranked (with their logits)
// in rank order.
func (s *Sampler) filter(z []float32) (uint64, bool) {
	var sum uint64
	for _, w := range s.w {
		sum += w
	}
	k, p := s.o.TopK, float32(s.o.TopP)
	if (k == 0 || k >= len(s.idx)) && p >= 1 {
		return sum, false
	}
	s.ranked = s.ranked[:0]
	for j, i := range s.idx {
		s.ranked = append(s.ranked, ranked{z[i], j})
	}
	s.rank()
	if k > 0 && k < len(s.ranked) {
		s.ranked = s.ranked[:k]
	}
	sum = 0
	for _, r := range s.ranked {
		sum += s.w[r.j]
	}
	if p < 1 {
		target := max(1, uint64(math.Ceil(float64(p)*float64(sum))))
		var acc uint64
		for n, r := range s.ranked {
			acc += s.w[r.j]
			if acc >= target {
				s.ranked = s.ranked[:n+1]
				break
			}
		}
		sum = acc
	}
	s.kept = s.kept[:0]
	for _, r := range s.ranked {
		s.kept = append(s.kept, r.j)
	}
	slices.Sort(s.kept)
	return sum, true
}

// rank sorts s.ranked most likely first, equal logits (the +Inf ones
// among them) by index.
func (s *Sampler) rank() {
	slices.SortFunc(s.ranked, func(a, b ranked) int {
		switch {
		case a.z > b.z:
			return -1
		case a.z < b.z:
			return 1
		}
		return a.j - b.j
	})
}

// One is the weight of the most likely candidate, 2^40 (see [Weight]).
const One = 1 << 40

// Weight is a candidate's weight in a draw: exp((v - m) * inv) in fixed
// point, One for v = m, where m is the largest candidate and inv is 1/T in
// float32. v - m and its product with inv are float32 operations, and the
// exponential is [ExpNeg]'s, so every IEEE machine computes the same
// weight; pick.cu computes it so too.
func Weight(v, m, inv float32) uint64 {
	x := float32(v-m) * inv
	return uint64(int64(float64(ExpNeg(x))*One + 0.5))
}

// ExpNeg returns e^x for x <= 0 in float32, 0 below -32 (where a weight
// rounds to 0 anyway) and for NaN: x = k ln 2 + r with |r| <= ln2/2, e^r
// by a degree-6 Taylor polynomial (relative error below 2e-7 there),
// scaled by 2^k through the exponent bits. Every operation is a float32
// operation rounded on its own (the conversions keep a compiler from
// fusing a multiply and an add), so the result is the same bits wherever
// it runs; pick.cu has the same steps.
func ExpNeg(x float32) float32 {
	if !(x >= -32) {
		return 0
	}
	const log2e, ln2hi, ln2lo = float32(1.44269504088896341), float32(0.693359375), float32(-2.12194440e-4)
	const c2, c3, c4, c5, c6 = float32(1.0 / 2), float32(1.0 / 6), float32(1.0 / 24), float32(1.0 / 120), float32(1.0 / 720)
	k := float32(math.Floor(float64(float32(x*log2e) + 0.5)))
	r := float32(x-float32(k*ln2hi)) - float32(k*ln2lo)
	p := float32(r*c6) + c5
	p = float32(r*p) + c4
	p = float32(r*p) + c3
	p = float32(r*p) + c2
	p = float32(r*p) + 1
	p = float32(r*p) + 1
	return p * math.Float32frombits(uint32(int32(k)+127)<<23)
}

// philox returns the draw's 64 random bits: the first two words of
// Philox4x32-10 of the counter (index, "pick") under the key seed, the
// first the low half. pick.cu computes the same.
func philox(seed, index uint64) uint64 {
	c := philox4x32([4]uint32{uint32(index), uint32(index >> 32), 0, 0x7069636b}, [2]uint32{uint32(seed), uint32(seed >> 32)})
	return uint64(c[0]) | uint64(c[1])<<32
}

// philox4x32 is Philox4x32-10 (Salmon et al., "Parallel random numbers: as
// easy as 1, 2, 3", 2011) of counter c under key k.
func philox4x32(c [4]uint32, k [2]uint32) [4]uint32 {
	for range 10 {
		p0 := uint64(0xD2511F53) * uint64(c[0])
		p1 := uint64(0xCD9E8D57) * uint64(c[2])
		c = [4]uint32{uint32(p1>>32) ^ c[1] ^ k[0], uint32(p1), uint32(p0>>32) ^ c[3] ^ k[1], uint32(p0)}
		k[0] += 0x9E3779B9
		k[1] += 0xBB67AE85
	}
	return c
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

// ranked is a candidate's logit and its place in Sampler.idx, as filter
// sorts them.
type ranked struct {
	z float32
	j int
}

// logits returns the logits with the repetition penalty applied, in a
// buffer the Sampler reuses (the caller's slice when there is no penalty).
// A penalised finite logit stays finite (clamped to ±MaxFloat32), so the
// penalty never makes a token certain or impossible; NaN and ±Inf are left
// as they are.
func (s *Sampler) logits(logits []float32, history []int) []float32 {
	p := s.o.RepetitionPenalty
	if p == 1 || len(history) == 0 {
		return logits
	}
	z := append(s.z[:0], logits...)
	s.z = z
	s.seen = slices.Grow(s.seen[:0], len(z))[:len(z)]
	clear(s.seen)
	for _, id := range history {
		if id < 0 || id >= len(z) || s.seen[id] {
			continue
		}
		s.seen[id] = true
		v := float64(z[id])
		if math.IsNaN(v) || math.IsInf(v, 0) {
			continue
		}
		if v > 0 {
			v /= p
		} else {
			v *= p
		}
		z[id] = float32(max(-math.MaxFloat32, min(v, math.MaxFloat32)))
	}
	return z
}
