package bpetrain

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/twell-ai/twell/tokenizer"
)

// FuzzTrainRoundTrip trains on arbitrary text (split into documents at
// '\x00', with fuzzed vocabulary size, minimum frequency and special
// tokens), saves tokenizer.json, loads it with package tokenizer, and checks
// that the training text and a second text encode as the reference BPE
// does and decode back unchanged. Training must never panic: a setting it
// cannot honour is an error.
func FuzzTrainRoundTrip(f *testing.F) {
	f.Add("aaabdaaabac", "abc", uint16(10), uint8(0), "")
	f.Add("the cat sat on the mat. The cat's hat!\n\n  the end", " the  cat\t", uint16(50), uint8(1), "<|endoftext|>")
	f.Add("東京 naïve Über 🙂 e\u0301\u00a0x\u2028", "東京🙂", uint16(300), uint8(2), "<s>\x00</s>")
	f.Add("don't we'll they're 123 4567 -- (a)", "'ll 89", uint16(5), uint8(3), "\x00")
	f.Add("ab\x00ab\x00ab", "a<|endoftext|>b", uint16(2), uint8(1), "<|endoftext|>\x00ab")
	f.Add("\xff\xfe invalid", "ok", uint16(3), uint8(1), "")
	f.Add("x<ab y <a<abc", "<ab<a", uint16(20), uint8(0), "<a\x00<ab")
	f.Fuzz(func(t *testing.T, text, other string, extra uint16, minFreq uint8, specials string) {
		if len(text) > 4096 || len(other) > 1024 || len(specials) > 256 {
			return // keep each run short; the reference encoder is quadratic
		}
		var sp []string // nil: the default <|endoftext|>
		if specials != "" {
			sp = strings.Split(specials, "\x00")
		}
		cfg := Config{VocabSize: 256 + len(sp) + int(extra%512), MinFrequency: 1 + int(minFreq%4), SpecialTokens: sp, Workers: 1}
		if sp == nil {
			cfg.VocabSize++
		}
		m, err := Train(strings.Split(text, "\x00"), cfg)
		if err != nil {
			return // bad settings or nothing to train on are errors, not panics
		}
		path := filepath.Join(t.TempDir(), "tokenizer.json")
		if err := m.Save(path); err != nil {
			t.Fatalf("Save: %v", err)
		}
		tk, err := tokenizer.Load(path)
		if err != nil {
			t.Fatalf("trained on %q with %+v: Load: %v", text, cfg, err)
		}
		if tk.VocabSize() != len(m.Tokens) {
			t.Fatalf("loaded vocabulary %d, trained %d", tk.VocabSize(), len(m.Tokens))
		}
		for i, sp := range m.SpecialTokens() {
			want := len(m.Tokens) - m.Special + i
			if ids, err := tk.Encode(sp, false); err != nil || !slices.Equal(ids, []int{want}) {
				t.Fatalf("specials %q: special token %q encodes to %v, %v; want [%d]", m.SpecialTokens(), sp, ids, err, want)
			}
		}
		for _, s := range []string{text, other, text + other} {
			ids, err := tk.Encode(s, false)
			if !utf8.ValidString(s) {
				if err == nil {
					t.Fatalf("Encode(%q) accepted invalid UTF-8", s)
				}
				continue
			}
			if err != nil {
				t.Fatalf("trained on %q with %+v: Encode(%q): %v", text, cfg, s, err)
			}
			if want := referenceEncode(m, s); !slices.Equal(ids, want) {
				t.Fatalf("trained on %q with %+v: Encode(%q) = %v, the reference BPE gives %v", text, cfg, s, ids, want)
			}
			back, err := tk.Decode(ids, false)
			if err != nil || back != s {
				t.Fatalf("trained on %q with %+v: Decode(Encode(%q)) = %q, %v", text, cfg, s, back, err)
			}
		}
	})
}
