package generate

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/sample"
	"github.com/twell-ai/twell/tokenizer"
	"github.com/twell-ai/twell/tokenizer/bpetrain"
)

// pieces is a toy vocabulary: token i decodes to pieces[i].
type pieces []string

func (p pieces) Decode(ids []int, _ bool) (string, error) {
	var b strings.Builder
	for _, id := range ids {
		if id < 0 || id >= len(p) {
			return "", errors.New("unknown id")
		}
		b.WriteString(p[id])
	}
	return b.String(), nil
}

// script is an engine whose logits make greedy decoding follow a fixed
// token sequence: after n tokens of a sequence, it favours next[n-prompt].
type script struct {
	vocab, layers, ctx int
	next               []int
	prompt             int
	calls              int
}

type scriptCache struct{ n, cap int }

func (c *scriptCache) Len() int      { return c.n }
func (c *scriptCache) Capacity() int { return c.cap }
func (c *scriptCache) Truncate(n int) error {
	c.n = n
	return nil
}
func (c *scriptCache) Free() error { return nil }

func (s *script) Config() model.Config {
	return model.Config{NumHiddenLayers: s.layers, VocabSize: s.vocab, MaxPositionEmbeddings: s.ctx}
}
func (s *script) NewCache(capacity int) (engine.Cache, error) {
	return &scriptCache{cap: capacity}, nil
}
func (s *script) SetMLPPath(mlp.Path) error { return nil }
func (s *script) Close() error              { return nil }
func (s *script) Forward(cs []engine.Cache, toks [][]int, _ bool) ([][]float32, *engine.Stats, error) {
	s.calls++
	c := cs[0].(*scriptCache)
	if c.n+len(toks[0]) > c.cap {
		return nil, nil, errors.New("past the cache")
	}
	c.n += len(toks[0])
	logits := make([]float32, s.vocab)
	if i := c.n - s.prompt; i < len(s.next) {
		logits[s.next[i]] = 10
	}
	st := engine.NewStats(len(toks[0]), s.layers)
	for i := range st.MeanActive {
		st.MeanActive[i] = float64(i + 1)
	}
	return [][]float32{logits}, st, nil
}

func greedy(max, ctx int) Options {
	return Options{MaxTokens: max, Context: ctx, Sample: sample.Greedy()}
}

func TestStopReasons(t *testing.T) {
	voc := pieces{"<eos>", "a", "b", "c", "\n", "EN", "D", "x"}
	prompt := []int{1, 2, 3}
	for _, k := range []struct {
		name   string
		next   []int
		o      Options
		text   string
		reason StopReason
	}{
		{"max tokens", []int{1, 2, 1, 2, 1, 2}, greedy(4, 100), "abab", MaxTokens},
		{"context full", []int{1, 2, 1, 2, 1, 2}, greedy(10, 6), "aba", ContextFull},
		{"max tokens when both bind", []int{1, 2, 1, 2}, greedy(3, 6), "aba", MaxTokens},
		{"end of sequence", []int{1, 2, 0, 1}, Options{MaxTokens: 10, Context: 100, Sample: sample.Greedy(), EOS: []int{0}}, "ab", EndOfSequence},
		{"stop string over two tokens", []int{1, 5, 6, 2}, Options{MaxTokens: 10, Context: 100, Sample: sample.Greedy(), Stop: []string{"END"}}, "a", StopString},
		{"stop string inside a token", []int{1, 4, 2}, Options{MaxTokens: 10, Context: 100, Sample: sample.Greedy(), Stop: []string{"\n"}}, "a", StopString},
	} {
		t.Run(k.name, func(t *testing.T) {
			e := &script{vocab: len(voc), layers: 2, ctx: k.o.Context, next: k.next, prompt: len(prompt)}
			var streamed strings.Builder
			res, err := Run(e, voc, prompt, k.o, func(s string) error { streamed.WriteString(s); return nil })
			if err != nil {
				t.Fatal(err)
			}
			if res.Text != k.text || res.Reason != k.reason {
				t.Errorf("got %q (%v), want %q (%v)", res.Text, res.Reason, k.text, k.reason)
			}
			if streamed.String() != res.Text {
				t.Errorf("streamed %q, result text %q", streamed.String(), res.Text)
			}
			if res.MeanActive[0] != 1 || res.MeanActive[1] != 2 {
				t.Errorf("mean active %v, want [1 2]", res.MeanActive)
			}
		})
	}
}

// TestStreamNeverShowsAStopString: whatever the tokens, the streamed text
// is exactly the final text, and never contains a stop string.
func TestStreamNeverShowsAStopString(t *testing.T) {
	r, seed := testutil.Rand(t)
	voc := pieces{"<eos>", "a", "b", "ab", "ba", "\n", "é"[:1], "é"[1:], "c"}
	stops := []string{"abba", "b\n", "cc"}
	for i := 0; i < 500; i++ {
		next := make([]int, 20)
		for j := range next {
			next[j] = 1 + r.IntN(len(voc)-1)
		}
		o := Options{MaxTokens: 1 + r.IntN(20), Context: 100, Sample: sample.Greedy(), Stop: stops}
		e := &script{vocab: len(voc), layers: 1, ctx: 100, next: next, prompt: 1}
		var streamed strings.Builder
		res, err := Run(e, voc, []int{1}, o, func(s string) error { streamed.WriteString(s); return nil })
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if streamed.String() != res.Text {
			t.Fatalf("seed %d, tokens %v: streamed %q, final %q", seed, next, streamed.String(), res.Text)
		}
		for _, s := range stops {
			if strings.Contains(res.Text, s) {
				t.Fatalf("seed %d: text %q contains stop %q", seed, res.Text, s)
			}
		}
		if res.Reason == NotDone {
			t.Fatalf("seed %d: no stop reason", seed)
		}
	}
}

func TestCacheCapacityFitsEveryFedToken(t *testing.T) {
	voc := pieces{"<eos>", "a"}
	for ctx := 2; ctx < 12; ctx++ {
		for max := 1; max < 12; max++ {
			e := &script{vocab: 2, layers: 1, ctx: ctx, next: []int{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, prompt: 1}
			res, err := Run(e, voc, []int{1}, greedy(max, ctx), nil)
			if err != nil {
				t.Fatalf("context %d, max %d: %v", ctx, max, err)
			}
			if want := min(max, ctx-1); len(res.Tokens) != want {
				t.Fatalf("context %d, max %d: %d tokens, want %d", ctx, max, len(res.Tokens), want)
			}
		}
	}
}

func TestBadInput(t *testing.T) {
	voc := pieces{"a"}
	e := &script{vocab: 1, layers: 1, ctx: 4}
	if _, err := Run(e, voc, nil, greedy(2, 4), nil); err == nil {
		t.Error("empty prompt accepted")
	}
	if _, err := Run(e, voc, []int{0, 0, 0, 0}, greedy(2, 4), nil); err == nil || !strings.Contains(err.Error(), "4 tokens") {
		t.Errorf("prompt filling the context: %v", err)
	}
	if _, err := Run(e, voc, []int{0}, greedy(0, 4), nil); err == nil {
		t.Error("max tokens 0 accepted")
	}
	// A pick made elsewhere with nothing to sample.
	s, err := NewSequence(voc, []int{0}, greedy(2, 4))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Accept(-1); !errors.Is(err, sample.ErrNoCandidate) {
		t.Errorf("Accept(-1): %v, want an error wrapping sample.ErrNoCandidate", err)
	}
	if st, err := s.Accept(0); err != nil || st.Token != 0 {
		t.Errorf("Accept(0) after the failed one: %+v, %v", st, err)
	}
}

// TestVocabLimitsSampling: ids past a smaller tokenizer's vocabulary are
// never sampled, even when the model favours them.
func TestVocabLimitsSampling(t *testing.T) {
	voc := pieces{"<eos>", "a", "b"}
	e := &script{vocab: 8, layers: 1, ctx: 100, next: []int{7, 7, 7}, prompt: 1}
	res, err := Run(e, voc, []int{1}, Options{MaxTokens: 3, Context: 100, Sample: sample.Greedy(), Vocab: len(voc)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range res.Tokens {
		if id >= len(voc) {
			t.Fatalf("sampled id %d past the vocabulary of %d", id, len(voc))
		}
	}
}

// TestIncrementalTextMatchesWholeDecode: the text a sequence builds step by
// step, decoding short windows, equals the decode of all its tokens at
// once, for random token sequences of a SentencePiece tokenizer with byte
// fallback (characters split over byte tokens, leading spaces) and a
// byte-level BPE; and, where the bytes are valid UTF-8, every step's
// released text adds up to it.
func TestIncrementalTextMatchesWholeDecode(t *testing.T) {
	r, seed := testutil.Rand(t)
	llama, _ := enginetest.Llama2Tokenizer(t)
	bm, err := bpetrain.Train([]string{"the quick brown fox jumps over the lazy dog; naïve café — ünïcödé ✓ 日本語 テキスト",
		strings.Repeat("sparse transformers skip the zeros. ", 20)}, bpetrain.Config{VocabSize: 400})
	if err != nil {
		t.Fatal(err)
	}
	raw, err := bm.JSON()
	if err != nil {
		t.Fatal(err)
	}
	bpe, err := tokenizer.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	for name, tok := range map[string]*tokenizer.Tokenizer{"llama-2": llama, "byte-level": bpe} {
		for trial := range 200 {
			n := 1 + r.IntN(60)
			ids := make([]int, n)
			for i := range ids {
				ids[i] = r.IntN(tok.VocabSize())
				if name == "llama-2" && r.IntN(3) == 0 {
					ids[i] = 3 + r.IntN(256) // byte-fallback tokens: split characters
				}
			}
			s, err := NewSequence(tok, []int{1}, Options{MaxTokens: n, Context: n + 2, Sample: sample.Greedy()})
			if err != nil {
				t.Fatal(err)
			}
			var released strings.Builder
			for i, id := range ids {
				logits := make([]float32, tok.VocabSize())
				logits[id] = 1
				st, err := s.Next(logits)
				if err != nil {
					t.Fatal(err)
				}
				released.WriteString(st.Text)
				if st.Done != (i == n-1) {
					t.Fatalf("%s seed %d trial %d: step %d of %d: done %v", name, seed, trial, i, n, st.Done)
				}
			}
			want, err := tok.Decode(ids, true)
			if err != nil {
				t.Fatal(err)
			}
			// Where bytes form no valid UTF-8, later tokens can change how
			// earlier ones decode: text already released then stands.
			stable := !strings.ContainsRune(want, utf8.RuneError)
			if s.Text() != want || (stable && released.String() != want) {
				got := s.Text()
				if got == want {
					got = released.String()
				}
				i := 0
				for i < len(got) && i < len(want) && got[i] == want[i] {
					i++
				}
				t.Fatalf("%s seed %d trial %d: ids %v: text (or released text) differs from the whole decode at byte %d: %q against %q",
					name, seed, trial, ids, i, got[max(0, i-8):min(len(got), i+12)], want[max(0, i-8):min(len(want), i+12)])
			}
		}
	}
}

// noisy is an engine whose logits are a hash of the sequence's length, its
// last token and the vocabulary entry: random-looking, but the same for the
// same sequence.
type noisy struct {
	script
	last map[*scriptCache]int
}

func (e *noisy) Forward(cs []engine.Cache, toks [][]int, _ bool) ([][]float32, *engine.Stats, error) {
	out := make([][]float32, len(cs))
	for s, c := range cs {
		sc := c.(*scriptCache)
		if sc.n+len(toks[s]) > sc.cap {
			return nil, nil, errors.New("past the cache")
		}
		sc.n += len(toks[s])
		e.last[sc] = toks[s][len(toks[s])-1]
		out[s] = make([]float32, e.vocab)
		for i := range out[s] {
			h := uint64(sc.n)*0x9e3779b97f4a7c15 ^ uint64(e.last[sc])*0xbf58476d1ce4e5b9 ^ uint64(i)*0x94d049bb133111eb
			h ^= h >> 31
			h *= 0xd6e8feb86659fd93
			h ^= h >> 32
			out[s][i] = float32(h%10000)/1000 - 5
		}
	}
	return out, engine.NewStats(len(toks[0]), e.layers), nil
}

// TestPicksOnEngineMatchHost generates through an engine that makes its
// own picks (engine.DeviceSampling, here package sample's picks from the
// engine's logits) and through the same engine picking on the host,
// greedily and drawn at temperatures with top-k and top-p: the same tokens,
// text and stop reason, the engine's picks used whenever there is no
// repetition penalty (the first token's too), the host's otherwise.
func TestPicksOnEngineMatchHost(t *testing.T) {
	r, seed := testutil.Rand(t)
	voc := make(pieces, 300)
	for i := range voc {
		voc[i] = string(rune('a' + i%26))
	}
	prompt := []int{1, 2, 3}
	for trial := range 12 {
		o := Options{MaxTokens: 1 + r.IntN(40), Context: 100, Sample: sample.Greedy(), Vocab: []int{0, 250}[r.IntN(2)]}
		if trial%3 > 0 {
			o.Sample = sample.Options{Temperature: 0.5 + r.Float64(), TopK: r.IntN(3) * 20, TopP: []float64{1, 0.9}[r.IntN(2)], RepetitionPenalty: 1, Seed: r.Uint64()}
		}
		if trial%4 == 3 {
			o.Sample.RepetitionPenalty = 1.3
		}
		if r.IntN(2) == 0 {
			o.EOS = []int{r.IntN(len(voc))}
		}
		run := func(e engine.Engine) *Result {
			res, err := Run(e, voc, prompt, o, nil)
			if err != nil {
				t.Fatalf("seed %d trial %d: %v", seed, trial, err)
			}
			return res
		}
		newNoisy := func() *noisy {
			return &noisy{script: script{vocab: len(voc), layers: 2, ctx: o.Context}, last: map[*scriptCache]int{}}
		}
		want := run(newNoisy())
		hp := &enginetest.HostPicks{Engine: newNoisy()}
		got := run(hp)
		if fmt.Sprint(got.Tokens, got.Text, got.Reason) != fmt.Sprint(want.Tokens, want.Text, want.Reason) {
			t.Fatalf("seed %d trial %d %+v: picks on the engine %v %q (%v), on the host %v %q (%v)", seed, trial, o,
				got.Tokens, got.Text, got.Reason, want.Tokens, want.Text, want.Reason)
		}
		// A decoder runs the steps after the first token, unless that ended
		// the generation.
		onEngine := o.Sample.RepetitionPenalty == 1
		decoded := onEngine && (len(got.Tokens) > 1 || len(got.Tokens) == 1 && got.Reason == EndOfSequence)
		if (hp.Passes > 0) != onEngine || (hp.Decoders > 0) != decoded {
			t.Errorf("seed %d trial %d %+v: %d passes and %d decoders picked on the engine", seed, trial, o, hp.Passes, hp.Decoders)
		}
	}
}

// nanEngine is a script whose logits are all NaN: nothing to sample.
type nanEngine struct{ script }

func (e *nanEngine) Forward(cs []engine.Cache, toks [][]int, all bool) ([][]float32, *engine.Stats, error) {
	logits, st, err := e.script.Forward(cs, toks, all)
	for _, l := range logits {
		for i := range l {
			l[i] = float32(math.NaN())
		}
	}
	return logits, st, err
}

// TestNoCandidateIsAnError: where no logit is above -Inf, Run fails with
// an error wrapping sample.ErrNoCandidate, with the picks on the host and
// on the engine.
func TestNoCandidateIsAnError(t *testing.T) {
	voc := pieces{"a", "b", "c"}
	for _, onEngine := range []bool{false, true} {
		var e engine.Engine = &nanEngine{script{vocab: len(voc), layers: 1, ctx: 50}}
		if onEngine {
			e = &enginetest.HostPicks{Engine: e}
		}
		if _, err := Run(e, voc, []int{1}, greedy(5, 50), nil); !errors.Is(err, sample.ErrNoCandidate) {
			t.Errorf("picks on the engine %v: error %v, want one wrapping ErrNoCandidate", onEngine, err)
		}
	}
}
