package bpetrain

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/twell-ai/twell/data"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/tokenizer"
)

// referenceEncode is a plain BPE encoder for the trained model, written from the definition:
// split with SplitWords, map bytes to their tokens, and merge the pair of lowest rank until
// none is left. Special tokens in the text become their ids (the leftmost, and the longest
// of those starting there).
func referenceEncode(m *Model, text string) []int {
	ids := map[string]int{}
	for i, s := range m.Tokens {
		ids[s] = i
	}
	rank := map[[2]string]int{}
	for r, mg := range m.Merges {
		rank[mg] = r
	}
	var out []int
	encodeWords := func(s string) {
		SplitWords(s, func(w string) {
			var syms []string
			for i := 0; i < len(w); i++ {
				syms = append(syms, byteChars[w[i]])
			}
			for {
				best, bestRank := -1, len(m.Merges)
				for i := 0; i+1 < len(syms); i++ {
					if r, ok := rank[[2]string{syms[i], syms[i+1]}]; ok && r < bestRank {
						best, bestRank = i, r
					}
				}
				if best < 0 {
					break
				}
				pair := [2]string{syms[best], syms[best+1]}
				var next []string
				for i := 0; i < len(syms); i++ {
					if i+1 < len(syms) && syms[i] == pair[0] && syms[i+1] == pair[1] {
						next = append(next, pair[0]+pair[1])
						i++
						continue
					}
					next = append(next, syms[i])
				}
				syms = next
			}
			for _, s := range syms {
				out = append(out, ids[s])
			}
		})
	}
	specials := m.SpecialTokens()
	for len(text) > 0 {
		cut, which := len(text), -1
		for k, sp := range specials {
			if i := bytes.Index([]byte(text), []byte(sp)); i >= 0 && (i < cut || i == cut && len(sp) > len(specials[which])) {
				cut, which = i, k
			}
		}
		encodeWords(text[:cut])
		if which < 0 {
			break
		}
		out = append(out, len(m.Tokens)-m.Special+which)
		text = text[cut+len(specials[which]):]
	}
	return out
}

func TestTrainedTokenizerLoadsAndRoundTrips(t *testing.T) {
	var texts []string
	for _, f := range data.SampleFiles() {
		texts = append(texts, f.Text)
	}
	m, err := Train(texts, Config{VocabSize: 2048})
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Tokens) != 2048 {
		t.Fatalf("%d tokens, want 2048", len(m.Tokens))
	}
	path := filepath.Join(t.TempDir(), "tokenizer.json")
	if err := m.Save(path); err != nil {
		t.Fatal(err)
	}
	tk, err := tokenizer.Load(path)
	if err != nil {
		t.Fatalf("package tokenizer cannot load the trained file: %v", err)
	}
	if tk.VocabSize() != 2048 {
		t.Errorf("VocabSize %d", tk.VocabSize())
	}
	if eos, ok := tk.EOS(); !ok || eos != 2047 {
		t.Errorf("EOS %d %v, want 2047", eos, ok)
	}
	// Common words are single tokens.
	for _, w := range []string{" the", " and", " said", " was", " Alice", " little", "The"} {
		ids, err := tk.Encode(w, false)
		if err != nil || len(ids) != 1 {
			t.Errorf("%q encodes to %v (%v), want one token", w, ids, err)
		}
	}
	r, seed := testutil.Rand(t)
	sample := data.Sample()
	for trial := range 300 {
		var text string
		if trial%2 == 0 {
			i := r.IntN(len(sample) - 2000)
			j := i + r.IntN(2000)
			for i > 0 && sample[i]&0xC0 == 0x80 {
				i--
			}
			for j < len(sample) && sample[j]&0xC0 == 0x80 {
				j++
			}
			text = sample[i:j]
		} else {
			text = randText(r, r.IntN(100))
		}
		ids, err := tk.Encode(text, false)
		if err != nil {
			t.Fatalf("seed %d: Encode(%q): %v", seed, text, err)
		}
		if want := referenceEncode(m, text); !slices.Equal(ids, want) {
			t.Fatalf("seed %d: package tokenizer and the reference BPE disagree on %q:\n%v\n%v", seed, text, ids, want)
		}
		back, err := tk.Decode(ids, false)
		if err != nil || back != text {
			t.Fatalf("seed %d: Decode(Encode(%q)) = %q, %v", seed, text, back, err)
		}
	}
	// The whole sample round-trips and compresses.
	ids, err := tk.Encode(sample, false)
	if err != nil {
		t.Fatal(err)
	}
	if back, _ := tk.Decode(ids, false); back != sample {
		t.Fatalf("the sample does not round-trip")
	}
	if ratio := float64(len(sample)) / float64(len(ids)); ratio < 3 {
		t.Errorf("%.2f bytes per token on the training text, want >= 3", ratio)
	}
	os.Remove(path)
}
