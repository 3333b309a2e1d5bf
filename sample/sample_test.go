package sample

import (
	"cmp"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// opts returns Greedy() with the given temperature, top-k and top-p.
func opts(temp float64, topK int, topP float64, seed uint64) Options {
	o := Greedy()
	o.Temperature, o.TopK, o.TopP, o.Seed = temp, topK, topP, seed
	return o
}

func mustNew(t testing.TB, o Options) *Sampler {
	t.Helper()
	s, err := New(o)
	if err != nil {
		t.Fatalf("New(%+v): %v", o, err)
	}
	return s
}

// modes are the sampling settings every non-finite test runs through.
func modes(seed uint64) map[string]Options {
	rep := Greedy()
	rep.RepetitionPenalty = 1.3
	repT := opts(0.8, 0, 1, seed)
	repT.RepetitionPenalty = 0.7
	return map[string]Options{
		"greedy":             Greedy(),
		"greedy+penalty":     rep,
		"temperature 0.8":    opts(0.8, 0, 1, seed),
		"temperature 1e-300": opts(1e-300, 0, 1, seed),
		"temperature 1e300":  opts(1e300, 0, 1, seed),
		"top-k 1":            opts(0.8, 1, 1, seed),
		"top-k 2":            opts(0.8, 2, 1, seed),
		"top-p 0.9":          opts(0.8, 0, 0.9, seed),
		"top-p 1e-9":         opts(0.8, 0, 1e-9, seed),
		"top-k 3 top-p 0.5":  opts(1.5, 3, 0.5, seed),
		"temperature+pen0.7": repT,
	}
}

func TestGreedyPicksArgmax(t *testing.T) {
	r, seed := testutil.Rand(t)
	s := mustNew(t, Greedy())
	for i := 0; i < 100; i++ {
		logits := make([]float32, 1+r.IntN(50))
		best := 0
		for j := range logits {
			logits[j] = float32(r.NormFloat64())
			if logits[j] > logits[best] {
				best = j
			}
		}
		if got := s.Sample(logits, nil, uint64(i)); got != best {
			t.Fatalf("seed %d: greedy picked %d, argmax is %d", seed, got, best)
		}
	}
}

func TestTemperatureMatchesSoftmax(t *testing.T) {
	seed := rand.Uint64()
	logits := []float32{1, 2, 0.5, -1}
	for _, temp := range []float64{0.5, 1, 2} {
		s := mustNew(t, opts(temp, 0, 1, seed))
		counts := make([]int, len(logits))
		const n = 40000
		for i := 0; i < n; i++ {
			counts[s.Sample(logits, nil, uint64(i))]++
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
	s := mustNew(t, opts(1, 2, 1, seed))
	for i := 0; i < 2000; i++ {
		if got := s.Sample(logits, nil, uint64(i)); got > 1 {
			t.Fatalf("seed %d: top-k 2 sampled token %d", seed, got)
		}
	}
	// Softmax of logits: p0 ~ 0.49, p1 ~ 0.44; top-p 0.5 keeps tokens 0 and 1.
	s = mustNew(t, opts(1, 0, 0.5, seed))
	seen := map[int]bool{}
	for i := 0; i < 2000; i++ {
		seen[s.Sample(logits, nil, uint64(i))] = true
	}
	if len(seen) != 2 || !seen[0] || !seen[1] {
		t.Fatalf("seed %d: top-p 0.5 sampled %v, want exactly {0, 1}", seed, seen)
	}
}

func TestRepetitionPenalty(t *testing.T) {
	o := Greedy()
	o.RepetitionPenalty = 2
	s := mustNew(t, o)
	logits := []float32{2, 1.5, -1}
	if got := s.Sample(logits, []int{0}, 0); got != 1 {
		t.Fatalf("penalised token 0 (2/2=1 < 1.5) still chosen: got %d", got)
	}
	if logits[0] != 2 {
		t.Fatal("Sample changed the caller's logits")
	}
	// Ids outside the vocabulary and repeats in the history are ignored.
	if got := s.Sample(logits, []int{-1, 3, 99, 0, 0, 0}, 1); got != 1 {
		t.Fatalf("penalty applied more than once or out-of-range id used: got %d", got)
	}
}

func TestSeedReproducible(t *testing.T) {
	logits := make([]float32, 100)
	for i := range logits {
		logits[i] = float32(i%7) * 0.3
	}
	a := mustNew(t, opts(1, 0, 1, 42))
	b := mustNew(t, opts(1, 0, 1, 42))
	for i := 0; i < 50; i++ {
		if x, y := a.Sample(logits, nil, uint64(i)), b.Sample(logits, nil, uint64(i)); x != y {
			t.Fatalf("same seed diverged at draw %d: %d vs %d", i, x, y)
		}
	}
}

// TestValidate checks one rule per field: each bad value is rejected with
// an error naming the field, each boundary value that is allowed passes.
func TestValidate(t *testing.T) {
	nan, inf := math.NaN(), math.Inf(1)
	bad := []struct {
		name string
		edit func(*Options)
	}{
		{"temperature", func(o *Options) { o.Temperature = -1 }},
		{"temperature", func(o *Options) { o.Temperature = nan }},
		{"temperature", func(o *Options) { o.Temperature = inf }},
		{"top-k", func(o *Options) { o.TopK = -2 }},
		{"top-p", func(o *Options) { o.TopP = 0 }},
		{"top-p", func(o *Options) { o.TopP = -0.1 }},
		{"top-p", func(o *Options) { o.TopP = 1.5 }},
		{"top-p", func(o *Options) { o.TopP = nan }},
		{"repetition penalty", func(o *Options) { o.RepetitionPenalty = 0 }},
		{"repetition penalty", func(o *Options) { o.RepetitionPenalty = -1 }},
		{"repetition penalty", func(o *Options) { o.RepetitionPenalty = nan }},
		{"repetition penalty", func(o *Options) { o.RepetitionPenalty = inf }},
	}
	for _, c := range bad {
		o := Greedy()
		c.edit(&o)
		_, err := New(o)
		if err == nil || !strings.Contains(err.Error(), c.name) {
			t.Errorf("%+v: error %v, want one naming %q", o, err, c.name)
		}
	}
	if err := (Options{}).Validate(); err == nil {
		t.Error("the zero Options (top-p 0, repetition penalty 0) validated; neither may stand for a default")
	}
	good := []func(*Options){
		func(o *Options) {},
		func(o *Options) { o.Temperature = 1e-300 },
		func(o *Options) { o.TopK = 1 << 40 },
		func(o *Options) { o.TopP = 1e-300 },
		func(o *Options) { o.RepetitionPenalty = 1e-300 },
		func(o *Options) { o.RepetitionPenalty = 1e300 },
	}
	for _, edit := range good {
		o := Greedy()
		edit(&o)
		if err := o.Validate(); err != nil {
			t.Errorf("%+v: %v", o, err)
		}
	}
}

// TestPosInfWins: a +Inf logit has all the probability in every mode.
func TestPosInfWins(t *testing.T) {
	seed := rand.Uint64()
	inf := float32(math.Inf(1))
	for name, o := range modes(seed) {
		s := mustNew(t, o)
		for _, logits := range [][]float32{
			{inf, 2, 0},
			{2, 0, inf},
			{float32(math.NaN()), 1e30, inf, float32(math.Inf(-1))},
		} {
			want := 0
			for i, v := range logits {
				if math.IsInf(float64(v), 1) {
					want = i
				}
			}
			for i := 0; i < 200; i++ {
				if got := s.Sample(logits, []int{0, 1, 2}, uint64(i)); got != want {
					t.Fatalf("seed %d, %s: Sample(%v) = %d, want the +Inf token %d", seed, name, logits, got, want)
				}
			}
		}
	}
}

// TestPosInfTies: several +Inf logits are drawn uniformly in random modes,
// and greedy takes the lowest index.
func TestPosInfTies(t *testing.T) {
	seed := rand.Uint64()
	inf := float32(math.Inf(1))
	logits := []float32{1, inf, 5, inf, inf, 3}
	if got := mustNew(t, Greedy()).Sample(logits, nil, 0); got != 1 {
		t.Fatalf("greedy with +Inf at 1, 3, 4 picked %d, want 1", got)
	}
	s := mustNew(t, opts(0.8, 0, 1, seed))
	counts := map[int]int{}
	const n = 30000
	for i := 0; i < n; i++ {
		counts[s.Sample(logits, nil, uint64(i))]++
	}
	for _, id := range []int{1, 3, 4} {
		if f := float64(counts[id]) / n; math.Abs(f-1.0/3) > 0.02 {
			t.Errorf("seed %d: +Inf token %d drawn with frequency %.3f, want 1/3 (counts %v)", seed, id, f, counts)
		}
	}
	if len(counts) != 3 {
		t.Errorf("seed %d: drew %v, want only the +Inf tokens 1, 3, 4", seed, counts)
	}
	// Top-k acts on the uniform distribution of the +Inf tokens, lowest index first.
	s = mustNew(t, opts(0.8, 2, 1, seed))
	for i := 0; i < 1000; i++ {
		if got := s.Sample(logits, nil, uint64(i)); got != 1 && got != 3 {
			t.Fatalf("seed %d: top-k 2 over +Inf tokens 1, 3, 4 drew %d", seed, got)
		}
	}
}

// TestNaNNeverSampled: random logits with NaN, -Inf and huge values, in every
// mode: the result is never a NaN or -Inf token while a token above -Inf
// exists, and greedy picks the argmax of the rest.
func TestNaNNeverSampled(t *testing.T) {
	r, seed := testutil.Rand(t)
	specials := []float32{float32(math.NaN()), float32(math.Inf(-1)), math.MaxFloat32, -math.MaxFloat32, 0}
	for name, o := range modes(seed) {
		s := mustNew(t, o)
		for trial := 0; trial < 300; trial++ {
			logits := make([]float32, 1+r.IntN(20))
			for j := range logits {
				if r.IntN(3) == 0 {
					logits[j] = specials[r.IntN(len(specials))]
				} else {
					logits[j] = float32(r.NormFloat64() * 10)
				}
			}
			logits[r.IntN(len(logits))] = float32(r.NormFloat64()) // at least one finite
			got := s.Sample(logits, nil, uint64(trial))
			if got < 0 || got >= len(logits) {
				t.Fatalf("seed %d, %s: Sample(%v) = %d, out of range", seed, name, logits, got)
			}
			v := float64(logits[got])
			if math.IsNaN(v) || math.IsInf(v, -1) {
				t.Fatalf("seed %d, %s: Sample(%v) = %d, whose logit is %g", seed, name, logits, got, v)
			}
			if o.Temperature == 0 && o.RepetitionPenalty == 1 {
				for j, w := range logits {
					if float64(w) > v || (float64(w) == v && j < got) {
						t.Fatalf("seed %d, %s: Sample(%v) = %d, but token %d has logit %g", seed, name, logits, got, j, w)
					}
				}
			}
		}
	}
}

// TestNoCandidate: with every logit -Inf or NaN, Pick returns ErrNoCandidate
// and Sample the lowest index whose logit is not NaN (0 when all are NaN).
func TestNoCandidate(t *testing.T) {
	nan, ninf := float32(math.NaN()), float32(math.Inf(-1))
	cases := []struct {
		logits []float32
		want   int
	}{
		{[]float32{nan, ninf, ninf}, 1},
		{[]float32{ninf, nan}, 0},
		{[]float32{nan, nan, nan}, 0},
		{[]float32{ninf}, 0},
		{nil, -1},
	}
	for name, o := range modes(1) {
		s := mustNew(t, o)
		for _, c := range cases {
			if _, err := s.Pick(c.logits, []int{0, 1}, 0); !errors.Is(err, ErrNoCandidate) {
				t.Errorf("%s: Pick(%v) error %v, want ErrNoCandidate", name, c.logits, err)
			}
			if got := s.Sample(c.logits, []int{0, 1}, 0); got != c.want {
				t.Errorf("%s: Sample(%v) = %d, want %d", name, c.logits, got, c.want)
			}
		}
	}
}

// TestPenaltyKeepsFinite: a penalty large or small enough to overflow never
// turns a finite logit into ±Inf (which would make it impossible or certain).
func TestPenaltyKeepsFinite(t *testing.T) {
	o := Greedy()
	o.RepetitionPenalty = 1e300
	s := mustNew(t, o)
	// -3e38 * 1e300 overflows; the token must stay a candidate.
	if id, err := s.Pick([]float32{-3e38, float32(math.NaN())}, []int{0}, 0); err != nil || id != 0 {
		t.Fatalf("penalty 1e300 on the only finite logit: Pick = %d, %v; want 0, nil", id, err)
	}
	o.RepetitionPenalty = 1e-300
	s = mustNew(t, o)
	// 3e38 / 1e-300 overflows; the token must not become +Inf and tie with a true +Inf.
	inf := float32(math.Inf(1))
	if id := s.Sample([]float32{3e38, inf}, []int{0}, 0); id != 1 {
		t.Fatalf("penalty 1e-300 made a finite logit +Inf: Sample = %d, want 1", id)
	}
}

// TestArgmaxMatchesScan: the four-lane greedy scan picks what a plain scan
// with the package's rules picks (+Inf first, the lowest index among
// equals, never NaN, nothing when every value is -Inf or NaN), on random
// rows of every short length with special values and ties mixed in.
func TestArgmaxMatchesScan(t *testing.T) {
	r, seed := testutil.Rand(t)
	special := []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1)), 0, 1, -1}
	for trial := range 20000 {
		x := make([]float32, r.IntN(40))
		for i := range x {
			switch r.IntN(5) {
			case 0:
				x[i] = special[r.IntN(len(special))]
			case 1:
				x[i] = float32(r.IntN(3)) // ties
			default:
				x[i] = float32(r.NormFloat64())
			}
		}
		want := -1
		for i, v := range x {
			if v > float32(math.Inf(-1)) && (want < 0 || v > x[want]) {
				want = i
			}
		}
		if got := argmax(x); got != want {
			t.Fatalf("seed %d trial %d: argmax(%v) = %d, want %d", seed, trial, x, got, want)
		}
	}
}

// TestExpNeg: the float32 exponential of the weights is within 1e-6 of
// math.Exp, relatively, over its range, and 0 below it.
func TestExpNeg(t *testing.T) {
	r, seed := testutil.Rand(t)
	for range 200000 {
		x := float32(-r.Float64() * 32)
		want := math.Exp(float64(x))
		if got := float64(ExpNeg(x)); math.Abs(got-want) > 1e-6*want {
			t.Fatalf("seed %d: ExpNeg(%g) = %g, want %g", seed, x, got, want)
		}
	}
	for _, x := range []float32{0, -1e-30} {
		if got := ExpNeg(x); got != 1 {
			t.Errorf("ExpNeg(%g) = %g, want 1", x, got)
		}
	}
	for _, x := range []float32{-32.001, -88, -1e30, float32(math.Inf(-1)), float32(math.NaN())} {
		if got := ExpNeg(x); got != 0 {
			t.Errorf("ExpNeg(%g) = %g, want 0", x, got)
		}
	}
}

// TestPhiloxKnownAnswers checks philox4x32 against the known answers of
// Random123's kat_vectors for Philox4x32-10.
func TestPhiloxKnownAnswers(t *testing.T) {
	for _, c := range []struct {
		ctr  [4]uint32
		key  [2]uint32
		want [4]uint32
	}{
		{[4]uint32{}, [2]uint32{}, [4]uint32{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
		{[4]uint32{^uint32(0), ^uint32(0), ^uint32(0), ^uint32(0)}, [2]uint32{^uint32(0), ^uint32(0)},
			[4]uint32{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
		{[4]uint32{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, [2]uint32{0xa4093822, 0x299f31d0},
			[4]uint32{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
	} {
		if got := philox4x32(c.ctr, c.key); got != c.want {
			t.Errorf("philox4x32(%08x, %08x) = %08x, want %08x", c.ctr, c.key, got, c.want)
		}
	}
}

// reference is the distribution Pick draws from, computed apart from the
// package's code: float64 softmax at the temperature over the candidates
// ranked by logit, top-k, then top-p on the renormalized rest.
func reference(logits []float32, o Options) (ids []int, probs []float64) {
	type cand struct {
		z float64
		i int
	}
	var cs []cand
	for i, v := range logits {
		if !math.IsNaN(float64(v)) && !math.IsInf(float64(v), -1) {
			cs = append(cs, cand{float64(v), i})
		}
	}
	slices.SortStableFunc(cs, func(a, b cand) int { return cmp.Compare(b.z, a.z) })
	if o.TopK > 0 && o.TopK < len(cs) {
		cs = cs[:o.TopK]
	}
	w := make([]float64, len(cs))
	sum := 0.0
	for j, c := range cs {
		w[j] = math.Exp((c.z - cs[0].z) / o.Temperature)
		sum += w[j]
	}
	n := len(cs)
	if o.TopP < 1 {
		acc := 0.0
		for j := range cs {
			acc += w[j] / sum
			if acc >= o.TopP {
				n = j + 1
				break
			}
		}
	}
	sum = 0
	for j := range n {
		sum += w[j]
	}
	for j := range n {
		ids = append(ids, cs[j].i)
		probs = append(probs, w[j]/sum)
	}
	return ids, probs
}

// TestDistributionMatchesReference: on random rows of finite logits and
// random settings, Distribution keeps the tokens the float64 reference
// keeps (but where the top-p cut falls within 1e-5 of a token's edge) with
// probabilities within 1e-5, and Pick's draws over 20000 indices follow
// them (each frequency within five standard deviations).
func TestDistributionMatchesReference(t *testing.T) {
	r, seed := testutil.Rand(t)
	for trial := range 40 {
		logits := make([]float32, 5+r.IntN(60))
		scale := []float64{0.1, 1, 4}[r.IntN(3)]
		for i := range logits {
			logits[i] = float32(r.NormFloat64() * scale)
		}
		if r.IntN(3) == 0 { // ties
			logits[r.IntN(len(logits))] = logits[0]
		}
		o := opts([]float64{0.3, 0.8, 1.5}[r.IntN(3)], []int{0, 1, 3, 10}[r.IntN(4)], []float64{1, 0.5, 0.9, 0.99}[r.IntN(4)], r.Uint64())
		s := mustNew(t, o)
		ids, probs, err := s.Distribution(logits, nil)
		if err != nil {
			t.Fatal(err)
		}
		wantIDs, wantP := reference(logits, o)
		if !slices.Equal(ids, wantIDs) {
			// Allowed only where the reference's cumulative probability
			// meets top-p within 1e-5 of a token's edge.
			if !nearCut(logits, o) {
				t.Fatalf("seed %d trial %d %+v: kept %v, the reference %v", seed, trial, o, ids, wantIDs)
			}
			continue
		}
		for j := range probs {
			if math.Abs(probs[j]-wantP[j]) > 1e-5 {
				t.Fatalf("seed %d trial %d %+v: token %d probability %g, the reference %g", seed, trial, o, ids[j], probs[j], wantP[j])
			}
		}
		const n = 20000
		counts := map[int]int{}
		for i := range n {
			counts[s.Sample(logits, nil, uint64(i))]++
		}
		for j, id := range ids {
			want := probs[j] * n
			if d := math.Abs(float64(counts[id]) - want); d > 5*math.Sqrt(want*(1-probs[j]))+1 {
				t.Fatalf("seed %d trial %d %+v: token %d drawn %d times in %d, want about %.0f", seed, trial, o, id, counts[id], n, want)
			}
			delete(counts, id)
		}
		if len(counts) > 0 {
			t.Fatalf("seed %d trial %d %+v: drew tokens that are not kept: %v", seed, trial, o, counts)
		}
	}
}

// nearCut reports whether top-p's cut for these logits falls within 1e-5
// of a token's edge in the reference.
func nearCut(logits []float32, o Options) bool {
	if o.TopP >= 1 {
		return false
	}
	all := o
	all.TopP = 1
	_, probs := reference(logits, all)
	acc := 0.0
	for _, p := range probs {
		acc += p
		if math.Abs(acc-o.TopP) < 1e-5 {
			return true
		}
	}
	return false
}

// TestDrawsDependOnIndexAlone: a draw depends on the seed, the index and
// the logits, not on the draws before it or the Sampler that makes it.
func TestDrawsDependOnIndexAlone(t *testing.T) {
	r, seed := testutil.Rand(t)
	logits := make([]float32, 500)
	for i := range logits {
		logits[i] = float32(r.NormFloat64())
	}
	o := opts(1, 50, 0.95, r.Uint64())
	a, b := mustNew(t, o), mustNew(t, o)
	first := make([]int, 100)
	for i := range first {
		first[i] = a.Sample(logits, nil, uint64(i))
	}
	distinct := map[int]bool{}
	for i := len(first) - 1; i >= 0; i-- {
		if got := b.Sample(logits, nil, uint64(i)); got != first[i] {
			t.Fatalf("seed %d: index %d drew %d, then %d from another Sampler in another order", seed, i, first[i], got)
		}
		distinct[first[i]] = true
	}
	if len(distinct) < 10 {
		t.Fatalf("seed %d: 100 indices drew only %d distinct tokens of 50 kept", seed, len(distinct))
	}
	o.Seed++
	c, same := mustNew(t, o), 0
	for i := range first {
		if c.Sample(logits, nil, uint64(i)) == first[i] {
			same++
		}
	}
	if same > 50 {
		t.Fatalf("seed %d: another seed drew the same token at %d of 100 indices", seed, same)
	}
}
