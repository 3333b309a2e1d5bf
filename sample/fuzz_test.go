package sample

import (
	"encoding/binary"
	"math"
	"slices"
	"testing"
)

// FuzzSample feeds any logits (NaN and ±Inf included, read as float32 bits
// from the bytes), any history and any settings. New must reject exactly
// the settings Validate rejects; with valid settings (the raw ones, or ones
// folded into range) Sample must not panic, must return an index in range,
// never a NaN or -Inf token while a token above -Inf exists, always a +Inf
// token when one exists, and Pick must fail exactly when no token is above
// -Inf, else pick one of Distribution's tokens, whose probabilities sum to 1.
func FuzzSample(f *testing.F) {
	le := func(vs ...float32) []byte {
		b := make([]byte, 4*len(vs))
		for i, v := range vs {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
		}
		return b
	}
	inf, nan := float32(math.Inf(1)), float32(math.NaN())
	f.Add(le(inf, 2, 0), []byte{1}, 0.8, 0, 1.0, 1.0, uint64(1))
	f.Add(le(inf, 2, 0), []byte{}, 0.8, 0, 0.5, 1.0, uint64(2))
	f.Add(le(nan, nan, -inf), []byte{0, 2}, 0.0, 3, 0.0, 0.0, uint64(3))
	f.Add(le(1, 2, 3, 4, 5), []byte{4, 4, 3}, 1.5, 2, 0.9, 1.2, uint64(4))
	f.Add(le(-3e38, 3e38), []byte{0, 1}, 1e-300, 0, 1e-9, 1e300, uint64(5))
	f.Fuzz(func(t *testing.T, raw []byte, hist []byte, temp float64, topK int, topP, rep float64, seed uint64) {
		logits := make([]float32, len(raw)/4)
		for i := range logits {
			logits[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
		}
		history := make([]int, len(hist))
		for i, b := range hist {
			history[i] = int(int8(b)) // negative and out-of-range ids too
		}
		o := Options{Temperature: temp, TopK: topK, TopP: topP, RepetitionPenalty: rep, Seed: seed}
		s, err := New(o)
		if (err == nil) != (o.Validate() == nil) {
			t.Fatalf("New(%+v) error %v disagrees with Validate %v", o, err, o.Validate())
		}
		if err != nil {
			o = fold(o)
			if s, err = New(o); err != nil {
				t.Fatalf("folded options %+v rejected: %v", o, err)
			}
		}
		check(t, s, o, logits, history)
	})
}

// fold maps any settings into their valid ranges.
func fold(o Options) Options {
	finite := func(x float64) float64 {
		if math.IsNaN(x) || math.IsInf(x, 0) {
			return 1
		}
		return math.Abs(x)
	}
	o.Temperature = finite(o.Temperature)
	if o.TopK < 0 {
		o.TopK = -(o.TopK + 1)
	}
	o.TopP = finite(o.TopP)
	if o.TopP > 1 {
		o.TopP = 1 / o.TopP
	}
	if o.TopP == 0 {
		o.TopP = 1
	}
	o.RepetitionPenalty = finite(o.RepetitionPenalty)
	if o.RepetitionPenalty == 0 {
		o.RepetitionPenalty = 1
	}
	return o
}

func check(t *testing.T, s *Sampler, o Options, logits []float32, history []int) {
	t.Helper()
	anyPosInf, anyCandidate, anyNumber := false, false, false
	for _, v := range logits {
		x := float64(v)
		anyPosInf = anyPosInf || math.IsInf(x, 1)
		anyCandidate = anyCandidate || x > math.Inf(-1)
		anyNumber = anyNumber || !math.IsNaN(x)
	}
	id, err := s.Pick(logits, history, 7)
	if (err != nil) == anyCandidate {
		t.Fatalf("%+v, logits %v: Pick error %v, but a token above -Inf exists: %v", o, logits, err, anyCandidate)
	}
	got := s.Sample(logits, history, 7)
	if len(logits) == 0 {
		if got != -1 {
			t.Fatalf("Sample(no logits) = %d, want -1", got)
		}
		return
	}
	if got < 0 || got >= len(logits) {
		t.Fatalf("%+v, logits %v: Sample = %d, out of range", o, logits, got)
	}
	if err == nil && (id < 0 || id >= len(logits)) {
		t.Fatalf("%+v, logits %v: Pick = %d, out of range", o, logits, id)
	}
	if err == nil {
		ids, probs, derr := s.Distribution(logits, history)
		if derr != nil || !slices.Contains(ids, id) {
			t.Fatalf("%+v, logits %v: Pick = %d, not among Distribution's %v (error %v)", o, logits, id, ids, derr)
		}
		sum := 0.0
		for _, p := range probs {
			sum += p
		}
		if math.Abs(sum-1) > 1e-9 {
			t.Fatalf("%+v, logits %v: Distribution's probabilities sum to %g", o, logits, sum)
		}
	}
	v := float64(logits[got])
	switch {
	case anyPosInf && !math.IsInf(v, 1):
		t.Fatalf("%+v, logits %v: Sample = %d (logit %g), but a +Inf logit exists", o, logits, got, v)
	case anyCandidate && !(v > math.Inf(-1)):
		t.Fatalf("%+v, logits %v: Sample = %d (logit %g), but a token above -Inf exists", o, logits, got, v)
	case anyNumber && math.IsNaN(v):
		t.Fatalf("%+v, logits %v: Sample = %d, a NaN logit, but a number exists", o, logits, got)
	}
}
