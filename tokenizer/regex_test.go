package tokenizer

import (
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

func allMatches(m matcher, s string) [][2]int {
	var out [][2]int
	m.matches(s, func(a, b int) { out = append(out, [2]int{a, b}) })
	return out
}

func pieces(s string, spans [][2]int) []string {
	out := make([]string, len(spans))
	for i, sp := range spans {
		out[i] = s[sp[0]:sp[1]]
	}
	return out
}

// The hand-written scanners must find exactly what the general regex engine finds. (One
// known difference is left out of the comparison: Oniguruma's (?i) matches "ſ" for "s" by
// Unicode case folding, regexp2's does not; the scanner follows Oniguruma.)
func TestFastMatchersAgreeWithRegexp2(t *testing.T) {
	for _, pat := range []string{gpt2Pattern, llama3Pattern, qwenPattern} {
		fast, err := compileRegex(pat)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := fast.(fastMatcher); !ok {
			t.Fatalf("compileRegex(%q) is %T, want the fast scanner", pat, fast)
		}
		slow, err := compileRegexp2(pat)
		if err != nil {
			t.Fatal(err)
		}
		check := func(s string) {
			t.Helper()
			if strings.Contains(s, "'ſ") {
				return
			}
			got, want := allMatches(fast, s), allMatches(slow, s)
			if !slices.Equal(got, want) {
				t.Fatalf("pattern %.30q… on %q:\n fast   %q\n regexp2 %q", pat, s, pieces(s, got), pieces(s, want))
			}
		}
		for _, s := range readTexts(t) {
			check(s)
		}
		rng, seed := testutil.Rand(t)
		alphabet := []string{"a", "Z", "é", "世", "ß", "1", "٣", "½", "'", "'s", "'T", "'ll", "'RE", "!", "..", "$", "_",
			" ", "  ", "\t", "\n", "\r", "\r\n", "\u00a0", "\u3000", "\u0085", "\u2028", "\u200b", "\ufeff",
			"\U0001F600", "\u200d", "\u0301", "\x00", "Ġ", "▁"}
		for n := 0; n < 3000; n++ {
			var sb strings.Builder
			for k := rng.IntN(12); k >= 0; k-- {
				sb.WriteString(alphabet[rng.IntN(len(alphabet))])
			}
			s := sb.String()
			got, want := allMatches(fast, s), allMatches(slow, s)
			if !slices.Equal(got, want) {
				t.Fatalf("seed %d, pattern %.30q… on %q:\n fast    %q\n regexp2 %q", seed, pat, s, pieces(s, got), pieces(s, want))
			}
		}
	}
}

func TestPreTokenizerRegexExamples(t *testing.T) {
	for _, tc := range []struct {
		pattern, text string
		want          []string
	}{
		{gpt2Pattern, "Hello world's  end!!\n\n", []string{"Hello", " world", "'s", " ", " end", "!!", "\n\n"}},
		{gpt2Pattern, "x   y", []string{"x", "  ", " y"}},
		{gpt2Pattern, "I'M 12345", []string{"I", "'", "M", " 12345"}},
		{llama3Pattern, "I'M 12345", []string{"I", "'M", " ", "123", "45"}},
		{llama3Pattern, "\tfoo(bar)\n\n  x", []string{"\tfoo", "(bar", ")\n\n", " ", " x"}},
		{llama3Pattern, "It'ſ", []string{"It", "'ſ"}},
		{qwenPattern, "2024", []string{"2", "0", "2", "4"}},
	} {
		m, err := compileRegex(tc.pattern)
		if err != nil {
			t.Fatal(err)
		}
		if got := pieces(tc.text, allMatches(m, tc.text)); !slices.Equal(got, tc.want) {
			t.Errorf("%.20q… on %q = %q, want %q", tc.pattern, tc.text, got, tc.want)
		}
	}
}

func TestOnigWordRewrite(t *testing.T) {
	// regexp2's \w lacks Mc; Oniguruma's has it. Oniguruma's \w outside a class takes "½" (No)
	// by its Latin-1 table, its \w inside a class (CR_Word) does not, so "[^\w\s]" takes it too;
	// Hugging Face 0.23.2 splits "=½3" as "=½", "3" and "½1" as one word.
	m, err := compileRegex(`\w+|[^\w\s]+`)
	if err != nil {
		t.Fatal(err)
	}
	for s, want := range map[string][]string{
		"a½b ॐक्ष!?": {"a½b", "ॐक्ष", "!?"},
		"=½3TN":      {"=½", "3TN"},
		"½1カ ⅷ٣":     {"½1カ", "ⅷ٣"},
		"x ٣¼ Ⓐb ²":  {"x", "٣¼", "Ⓐb", "²"},
		"←½→ ⅓":      {"←½→", "⅓"},
	} {
		if got := pieces(s, allMatches(m, s)); !slices.Equal(got, want) {
			t.Errorf("%q: got %q, want %q", s, got, want)
		}
	}
}

// HF's documentation of SplitDelimiterBehavior uses "the-final--countdown" split on "-".
func TestSplitBehaviors(t *testing.T) {
	s := "the-final--countdown"
	for _, tc := range []struct {
		b    string
		want []string
	}{
		{"Removed", []string{"the", "final", "countdown"}},
		{"Isolated", []string{"the", "-", "final", "-", "-", "countdown"}},
		{"MergedWithPrevious", []string{"the-", "final-", "-", "countdown"}},
		{"MergedWithNext", []string{"the", "-final", "-", "-countdown"}},
		{"Contiguous", []string{"the", "-", "final", "--", "countdown"}},
	} {
		p := preSplit{pattern: literalMatcher{"-"}, behavior: splitBehaviors[tc.b]}
		var got []string
		for _, q := range p.split(nil, piece{text: s}) {
			got = append(got, q.text)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: %q, want %q", tc.b, got, tc.want)
		}
	}
	// invert: the matches are kept and the rest is the delimiter.
	p := preSplit{pattern: literalMatcher{"-"}, behavior: splitRemoved, invert: true}
	var got []string
	for _, q := range p.split(nil, piece{text: s}) {
		got = append(got, q.text)
	}
	if want := []string{"-", "-", "-"}; !slices.Equal(got, want) {
		t.Errorf("inverted Removed: %q, want %q", got, want)
	}
}

func splitTexts(p preTokenizer, s string) []string {
	var out []string
	for _, q := range p.split(nil, piece{text: s, first: true}) {
		out = append(out, q.str())
	}
	return out
}

func TestPreTokenizers(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    preTokenizer
		text string
		want []string
	}{
		// \w of Rust's regex crate: "½" (No) is not a word character, ZWJ is.
		{"Whitespace", preWhitespace{}, "a½b  c\u200dd!? x", []string{"a", "½", "b", "c\u200dd", "!?", "x"}},
		{"WhitespaceSplit", preWhitespaceSplit{}, " a½b\t\u00a0c!? ", []string{"a½b", "c!?"}},
		{"Digits", preDigits{individual: false}, "a12b3", []string{"a", "12", "b", "3"}},
		{"Digits individual", preDigits{individual: true}, "a12b3", []string{"a", "1", "2", "b", "3"}},
		{"Metaspace", preMetaspace{replacement: '▁', prepend: prependAlways, splitWords: true}, "Hey  friend!", []string{"▁Hey", "▁", "▁friend!"}},
		{"Metaspace no split", preMetaspace{replacement: '▁', prepend: prependNever}, "Hey friend", []string{"Hey▁friend"}},
		{"ByteLevel", preByteLevel{addPrefixSpace: true, useRegex: true}, "Hi  there\n", []string{"ĠHi", "Ġ", "Ġthere", "Ċ"}},
		{"ByteLevel no regex", preByteLevel{addPrefixSpace: false, useRegex: false}, "Hi there", []string{"HiĠthere"}},
	} {
		if got := splitTexts(tc.p, tc.text); !slices.Equal(got, tc.want) {
			t.Errorf("%s on %q: %q, want %q", tc.name, tc.text, got, tc.want)
		}
	}
}
