package bpetrain

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/twell-ai/twell/internal/testutil"
)

func split(s string) []string {
	var out []string
	SplitWords(s, func(w string) { out = append(out, w) })
	return out
}

func TestSplitWords(t *testing.T) {
	cases := []struct {
		in   string
		want []string
	}{
		{"", nil},
		{"Hello world", []string{"Hello", " world"}},
		{"I'm here, aren't you?", []string{"I", "'m", " here", ",", " aren", "'t", " you", "?"}},
		{"DON'T", []string{"DON", "'", "T"}},
		{"we'll 've 're 'd 's", []string{"we", "'ll", " '", "ve", " '", "re", " '", "d", " '", "s"}},
		{"a\n\nb", []string{"a", "\n", "\n", "b"}},
		{"x   y", []string{"x", "  ", " y"}},
		{"end  ", []string{"end", "  "}},
		{"  hi", []string{" ", " hi"}},
		{"\thi", []string{"\t", "hi"}},
		{"3.14 is pi!!! ?", []string{"3", ".", "14", " is", " pi", "!!!", " ?"}},
		{"abc123def", []string{"abc", "123", "def"}},
		{"Über naïve 東京 ½", []string{"Über", " naïve", " 東京", " ½"}},
		{"e\u0301", []string{"e", "\u0301"}}, // a combining mark is neither letter nor number
		{"a\u00a0b", []string{"a", "\u00a0", "b"}},
		{"a \u00a0b", []string{"a", " ", "\u00a0", "b"}},
		{"?'s", []string{"?'", "s"}},
		{"bad\xffbyte", []string{"bad", "\xff", "byte"}},
		{"<|endoftext|>", []string{"<|", "endoftext", "|>"}},
	}
	for _, c := range cases {
		if got := split(c.in); !slices.Equal(got, c.want) {
			t.Errorf("SplitWords(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func FuzzSplitWords(f *testing.F) {
	f.Add("Hello world, it's 2024!\n\n  x")
	f.Add("a\u00a0 \t\n'll")
	f.Fuzz(func(t *testing.T, s string) {
		var sb strings.Builder
		SplitWords(s, func(w string) {
			if w == "" {
				t.Fatalf("empty piece in %q", s)
			}
			sb.WriteString(w)
		})
		if sb.String() != s {
			t.Fatalf("pieces of %q join to %q", s, sb.String())
		}
	})
}

// randText builds text from a pool of fragments likely to stress the pre-tokenizer and BPE.
func randText(r *rand.Rand, n int) string {
	pool := []string{"the", " the", "The", " cat", "'s", "'ll", "'", " ", "  ", "\n", "\n\n", "\t", ",", ".", "!!", "?",
		"123", "4", " 56", "Über", "naïve", "東京", "🙂", "e\u0301", "\u00a0", "don't", "<|endoftext|>", "-", "--", "\"", "(a)",
		"Alice", " said", " and", "x", "QQ", "\u2028", "½"}
	var sb strings.Builder
	for range n {
		sb.WriteString(pool[r.IntN(len(pool))])
	}
	return sb.String()
}

func TestTrainClassic(t *testing.T) {
	// One word; pairs a a (4 times), a b (2 times), ... The first merge is a a; then a b and
	// aa a tie at 2 and the pair with smaller ids (a b) wins; then aa ab.
	m, err := Train([]string{"aaabdaaabac"}, Config{VocabSize: 300, SpecialTokens: []string{}})
	if err != nil {
		t.Fatal(err)
	}
	want := [][2]string{{"a", "a"}, {"a", "b"}, {"aa", "ab"}}
	if !slices.Equal(m.Merges, want) {
		t.Errorf("merges %q, want %q", m.Merges, want)
	}
	if len(m.Tokens) != 256+3 || m.Tokens[256] != "aa" || m.Tokens[258] != "aaab" {
		t.Errorf("tokens %q", m.Tokens[256:])
	}
	if m.Tokens[0] != "!" || m.Tokens[ByteID(' ')] != "Ġ" || m.Tokens[ByteID('\n')] != "Ċ" {
		t.Errorf("byte tokens: 0=%q space=%q newline=%q", m.Tokens[0], m.Tokens[ByteID(' ')], m.Tokens[ByteID('\n')])
	}
}

func TestTrainDeterministicAndValid(t *testing.T) {
	r, seed := testutil.Rand(t)
	var texts []string
	for range 200 {
		texts = append(texts, randText(r, 5+r.IntN(200)))
	}
	vocab := 300 + r.IntN(500)
	var outs [][]byte
	for _, workers := range []int{1, 3} {
		m, err := Train(texts, Config{VocabSize: vocab, Workers: workers, MinFrequency: 1})
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if err := m.validate(); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if len(m.Tokens) > vocab || m.Tokens[len(m.Tokens)-1] != EndOfText {
			t.Fatalf("seed %d: %d tokens (want <= %d), last %q", seed, len(m.Tokens), vocab, m.Tokens[len(m.Tokens)-1])
		}
		for _, tok := range m.Tokens[:len(m.Tokens)-1] {
			if strings.Contains(tok, "endoftext|") {
				t.Errorf("seed %d: learned token %q spans the special token", seed, tok)
			}
		}
		var b bytes.Buffer
		if err := m.WriteJSON(&b); err != nil {
			t.Fatal(err)
		}
		outs = append(outs, b.Bytes())
	}
	if !bytes.Equal(outs[0], outs[1]) {
		t.Errorf("seed %d: 1 and 3 workers trained different tokenizers", seed)
	}
}

func TestTrainMinFrequency(t *testing.T) {
	m, err := Train([]string{strings.Repeat("ab ", 5) + "xy"}, Config{VocabSize: 1000, MinFrequency: 3, SpecialTokens: []string{}})
	if err != nil {
		t.Fatal(err)
	}
	// "ab" x1 + " ab" x4: a b occurs 5 times, Ġ a 4 times, Ġa b 4 times; x y once, Ġ Ġ never.
	if !slices.Equal(m.Merges, [][2]string{{"a", "b"}, {"Ġ", "ab"}}) {
		t.Errorf("merges %q", m.Merges)
	}
}

func TestConfigErrors(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{VocabSize: 256}, "below 257"},
		{Config{MinFrequency: -1}, "min frequency"},
		{Config{SpecialTokens: []string{"<a>", "<a>"}}, "listed twice"},
		{Config{SpecialTokens: []string{""}}, "is empty"},
		{Config{SpecialTokens: []string{"<s>", "\x80"}}, "special token 1 (\"\\x80\") is not valid UTF-8"},
		{Config{VocabSize: 1 << 30}, "too large"},
	} {
		if _, err := NewTrainer(c.cfg); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: want %q, got %v", c.cfg, c.want, err)
		}
	}
	tr, _ := NewTrainer(Config{})
	if _, err := tr.Train(nil); err == nil || !strings.Contains(err.Error(), "no text") {
		t.Errorf("training on nothing: %v", err)
	}
}

func TestByteLevel(t *testing.T) {
	seen := map[string]bool{}
	for b := range 256 {
		c := byteChars[b]
		if utf8.RuneCountInString(c) != 1 || seen[c] || strings.ContainsAny(c, " \t\n") {
			t.Fatalf("byte %d maps to %q", b, c)
		}
		seen[c] = true
	}
	if ByteLevel(" hé\n") != "ĠhÃ©Ċ" {
		t.Errorf("ByteLevel = %q", ByteLevel(" hé\n"))
	}
}

// TestSpecialTokensLeftmostLongest: where two special tokens start at the
// same place, the longer one is cut out, as the tokenizer matches them; the
// shorter one would leave a "b" behind to be counted.
func TestSpecialTokensLeftmostLongest(t *testing.T) {
	tr, err := NewTrainer(Config{SpecialTokens: []string{"<a", "<ab"}, Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	tr.Add("<ab<ab<a")
	if n, _ := tr.Words(); n != 0 {
		t.Fatalf("%d words counted in text made only of special tokens, want 0", n)
	}
}
