package eval

import (
	"math"
	"math/rand/v2"
	"testing"

	cpullm "github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/model"
)

// tinyConfig is a small ReLU model: 2 layers, a vocabulary of 97 and a
// context of 16 positions.
func tinyConfig(tied bool) model.Config {
	return model.Config{
		ModelType: "llama", Architectures: []string{"LlamaForCausalLM"},
		HiddenSize: 32, IntermediateSize: 64, NumHiddenLayers: 2, NumAttentionHeads: 4, NumKeyValueHeads: 2, HeadDim: 8,
		VocabSize: 97, MaxPositionEmbeddings: 16, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: model.ActReLU, TieWordEmbeddings: tied, MLPGated: true,
	}
}

// newEngine returns a CPU engine over a model of config c and weights w
// (random when nil), closed at the end of the test.
func newEngine(t *testing.T, c model.Config, w *model.Weights, r *rand.Rand) engine.Engine {
	t.Helper()
	if w == nil {
		w = model.RandomWeights(c, r)
	}
	m, err := model.New(c, w)
	if err != nil {
		t.Fatal(err)
	}
	e, err := cpullm.New(m, cpullm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// TestWindowsScoreEachTokenOnce: for any length, context and stride, the
// rolling windows score every token but the first exactly once, each
// window fits the context, and each scored token has a token before it in
// its window.
func TestWindowsScoreEachTokenOnce(t *testing.T) {
	r, seed := testutil.Rand(t)
	for range 2000 {
		n, ctx := 1+r.IntN(200), 2+r.IntN(40)
		stride := 1 + r.IntN(ctx-1)
		count := make([]int, n)
		ws := Windows(n, ctx, stride)
		for i, w := range ws {
			if w.End-w.Start > ctx || w.Score <= w.Start || w.Score > w.End || w.End > n {
				t.Fatalf("seed %d: n %d ctx %d stride %d: window %d = %+v", seed, n, ctx, stride, i, w)
			}
			if i == 0 && (w.Start != 0 || w.Score != 1) {
				t.Fatalf("seed %d: n %d ctx %d stride %d: first window %+v", seed, n, ctx, stride, w)
			}
			for p := w.Score; p < w.End; p++ {
				count[p]++
			}
		}
		for p, k := range count {
			if want := min(p, 1); k != want {
				t.Fatalf("seed %d: n %d ctx %d stride %d: token %d scored %d times, want %d", seed, n, ctx, stride, p, k, want)
			}
		}
	}
}

// TestPerplexityMatchesTokenByToken: the perplexity of random sequences
// equals exp of the mean cross-entropy computed directly, window by window,
// with one Forward call per token (decode steps) and a float64 log-softmax.
//
// Tolerance: the two sides see float32 logits from different passes (a
// batched prefill against single-token steps). The CPU engine's kernels
// give the same logits for most rows and differ by a float32 ulp or so
// where they do not; measured, the mean CE agrees to about 1e-9 relative
// (logged with -v). 1e-7 allows a few ulps of logit difference (an ulp
// of a logit near 1 moves a token's CE by about 1e-7) yet catches any token
// scored twice, missed or scored from the wrong position, each of which
// changes the mean by about 1/n of a few nats.
func TestPerplexityMatchesTokenByToken(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig(true)
	e := newEngine(t, c, nil, r)
	worst := 0.0
	defer func() { t.Logf("largest relative CE difference: %.3g", worst) }()
	for trial := range 4 {
		var seqs []Sequence
		for i := range 1 + r.IntN(3) {
			seqs = append(seqs, Sequence{Name: string(rune('a' + i)), Tokens: enginetest.Tokens(r, 2+r.IntN(40), c.VocabSize)})
		}
		ctx := 2 + r.IntN(c.MaxPositionEmbeddings-1)
		o := Options{Context: ctx, Stride: 1 + r.IntN(ctx-1), Batch: 1 + r.IntN(5)}
		ev, err := New(e, o)
		if err != nil {
			t.Fatal(err)
		}
		got, err := ev.Perplexity(seqs)
		ev.Close()
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		for i, s := range seqs {
			var nats float64
			scored := 0
			for _, w := range Windows(len(s.Tokens), o.Context, o.Stride) {
				cache := enginetest.Caches(t, e, 1, o.Context)
				for p := w.Start; p < w.End-1; p++ {
					l, _ := enginetest.Forward(t, e, cache, [][]int{{s.Tokens[p]}}, false)
					if p+1 >= w.Score {
						nats -= LogProb(l[0], s.Tokens[p+1])
						scored++
					}
				}
			}
			if got[i].Tokens != int64(len(s.Tokens)-1) || scored != len(s.Tokens)-1 {
				t.Fatalf("seed %d trial %d seq %d: scored %d tokens (direct %d), want %d", seed, trial, i, got[i].Tokens, scored, len(s.Tokens)-1)
			}
			ce := nats / float64(scored)
			worst = max(worst, math.Abs(got[i].CE-ce)/ce)
			if d := math.Abs(got[i].CE-ce) / ce; d > 1e-7 || math.Abs(got[i].Perplexity-math.Exp(ce))/math.Exp(ce) > 1e-6 {
				t.Errorf("seed %d trial %d seq %d (%d tokens, %+v): CE %.9f ppl %.6f, direct CE %.9f ppl %.6f (rel diff %.2g)",
					seed, trial, i, len(s.Tokens), o, got[i].CE, got[i].Perplexity, ce, math.Exp(ce), d)
			}
		}
	}
}

// TestPerplexityBitsPerByte: bits per byte is nats / ln 2 / bytes, and the
// pooled total weights each sequence by its tokens.
func TestPerplexityBitsPerByte(t *testing.T) {
	r, _ := testutil.Rand(t)
	c := tinyConfig(true)
	e := newEngine(t, c, nil, r)
	ev, err := New(e, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	seqs := []Sequence{{Name: "a", Tokens: enginetest.Tokens(r, 30, c.VocabSize), Bytes: 100}, {Name: "b", Tokens: enginetest.Tokens(r, 5, c.VocabSize), Bytes: 7}}
	res, err := ev.Perplexity(seqs)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range res {
		if want := p.Nats / math.Ln2 / float64(p.Bytes); math.Abs(p.BitsPerByte-want) > 1e-12*want {
			t.Errorf("%s: bits per byte %v, want %v", p.Name, p.BitsPerByte, want)
		}
	}
	tot := Total("all", res)
	if tot.Tokens != 33 || tot.Bytes != 107 || math.Abs(tot.Nats-res[0].Nats-res[1].Nats) > 1e-9 {
		t.Errorf("total %+v", tot)
	}
	if _, err := ev.Perplexity([]Sequence{{Name: "short", Tokens: []int{1}}}); err == nil {
		t.Error("a 1-token sequence: no error")
	}
}

// randomItems returns n items of random token ids with 1 to 5 choices of
// 1 to 6 tokens, fitting a window of ctx.
func randomItems(r *rand.Rand, n, vocab, ctx int) []Encoded {
	items := make([]Encoded, n)
	for i := range items {
		k := 1 + r.IntN(5)
		it := Encoded{Line: i + 1, Gold: r.IntN(k)}
		longest := 0
		for range k {
			cont := enginetest.Tokens(r, 1+r.IntN(6), vocab)
			longest = max(longest, len(cont))
			it.Conts = append(it.Conts, cont)
			it.Chars = append(it.Chars, 1+r.IntN(20))
		}
		it.Context = enginetest.Tokens(r, 1+r.IntN(ctx-longest+1), vocab)
		items[i] = it
	}
	return items
}

// directLogLik scores one choice in a fresh cache: context and
// continuation (less its last token) in one pass, every logit returned.
func directLogLik(t *testing.T, e engine.Engine, ctx int, context, cont []int) float64 {
	cache := enginetest.Caches(t, e, 1, ctx)
	in := append(append([]int(nil), context...), cont[:len(cont)-1]...)
	l, _ := enginetest.Forward(t, e, cache, [][]int{in}, true)
	var s float64
	for j, tok := range cont {
		s += LogProb(l[len(context)-1+j], tok)
	}
	return s
}

// TestScoreMatchesSeparatePasses: the log-likelihood of every choice, with
// the context's cache shared across choices and several items per call,
// equals the sum of per-token log-probabilities of a separate pass per
// choice (within 1e-4 nats: float32 logits of differently shaped passes).
func TestScoreMatchesSeparatePasses(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig(false)
	e := newEngine(t, c, nil, r)
	items := randomItems(r, 13, c.VocabSize, c.MaxPositionEmbeddings)
	for _, batch := range []int{1, 4, 13} {
		ev, err := New(e, Options{Batch: batch})
		if err != nil {
			t.Fatal(err)
		}
		_, scores, err := ev.Score("random", items)
		ev.Close()
		if err != nil {
			t.Fatalf("seed %d batch %d: %v", seed, batch, err)
		}
		for i, it := range items {
			for j, cont := range it.Conts {
				want := directLogLik(t, e, c.MaxPositionEmbeddings, it.Context, cont)
				if got := scores[i].LogLik[j]; math.Abs(got-want) > 1e-4 {
					t.Errorf("seed %d batch %d item %d choice %d: log-likelihood %.6f, separate pass %.6f", seed, batch, i, j, got, want)
				}
			}
		}
	}
}

// modelWeights returns random weights for c.
func modelWeights(c model.Config, r *rand.Rand) *model.Weights { return model.RandomWeights(c, r) }
