package tokenizer

import (
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
)

// A matcher finds the non-overlapping matches of a pattern in s, left to right, and calls fn
// with the byte offsets of each.
type matcher interface {
	matches(s string, fn func(start, end int))
}

// The pre-tokenizer regexes of the common byte-level tokenizers. They are matched by hand-written
// scanners (fastMatcher), which give the same matches as Oniguruma, the engine Hugging Face uses.
const (
	// gpt2Pattern is the regex of GPT-2's ByteLevel pre-tokenizer (use_regex true).
	gpt2Pattern = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
	// llama3Pattern is the Split regex of Llama 3 (and OpenAI's cl100k).
	llama3Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// qwenPattern is the Split regex of Qwen 2 and 3: Llama 3's with single digits.
	qwenPattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
)

// compileRegex returns a matcher for a Hugging Face (Oniguruma) regex: a hand-written scanner
// for the well-known pre-tokenizer patterns, regexp2 for anything else.
func compileRegex(pattern string) (matcher, error) {
	switch pattern {
	case gpt2Pattern:
		return fastMatcher{kind: scanGPT2}, nil
	case llama3Pattern:
		return fastMatcher{kind: scanLlama3, maxDigits: 3}, nil
	case qwenPattern:
		return fastMatcher{kind: scanLlama3, maxDigits: 1}, nil
	}
	return compileRegexp2(pattern)
}

func compileRegexp2(pattern string) (*regexMatcher, error) {
	re, err := regexp2.Compile(onigToRegexp2(pattern), regexp2.None)
	if err != nil {
		return nil, err
	}
	return &regexMatcher{re: re}, nil
}

// onigWordClass is Oniguruma's \w inside a character class (as in `[^\w\s]`), written for
// the inside of a regexp2 class: Oniguruma's CR_Word, that is Alphabetic, marks, decimal
// digits and connector punctuation. Other numbers such as "½" (No) are not in it. regexp2's
// \w (the .NET one) differs, so \w is spelled out.
var onigWordClass = `\p{L}\p{Nl}\p{M}\p{Nd}\p{Pc}` + otherAlphabeticSymbols()

// onigWordLatin1 are the characters that Oniguruma's \w outside a character class matches
// beyond onigWordClass. Outside a class, Oniguruma tests a character below U+0100 with its
// ISO-8859-1 ctype table, whose word bit is also set for the superscript digits and the
// vulgar fractions (No); at U+0100 and above it uses CR_Word. So `\w+|[^\w\s]+` takes
// "½1" as one word but "=½" as one run of punctuation, and Hugging Face's Split with that
// regex does the same.
const onigWordLatin1 = "\u00b2\u00b3\u00b9\u00bc-\u00be"

// otherAlphabeticSymbols returns, as character class ranges, the Alphabetic characters that
// are not letters, marks or numbers (circled and squared Latin letters, which are symbols).
func otherAlphabeticSymbols() string {
	var sb strings.Builder
	lo, hi := rune(-1), rune(-2)
	flush := func() {
		if lo >= 0 {
			sb.WriteRune(lo)
			if hi > lo {
				sb.WriteByte('-')
				sb.WriteRune(hi)
			}
		}
	}
	add := func(r rune) {
		if unicode.In(r, unicode.L, unicode.Nl, unicode.M, unicode.Nd, unicode.Pc) {
			return
		}
		if r != hi+1 {
			flush()
			lo = r
		}
		hi = r
	}
	for _, rg := range unicode.Other_Alphabetic.R16 {
		for r := rune(rg.Lo); r <= rune(rg.Hi); r += rune(rg.Stride) {
			add(r)
		}
	}
	for _, rg := range unicode.Other_Alphabetic.R32 {
		for r := rune(rg.Lo); r <= rune(rg.Hi); r += rune(rg.Stride) {
			add(r)
		}
	}
	flush()
	return sb.String()
}

// onigToRegexp2 rewrites the parts of an Oniguruma pattern whose meaning differs in regexp2.
func onigToRegexp2(p string) string {
	if !strings.Contains(p, `\w`) && !strings.Contains(p, `\W`) {
		return p
	}
	var sb strings.Builder
	inClass := false
	for i := 0; i < len(p); i++ {
		c := p[i]
		switch {
		case c == '\\' && i+1 < len(p):
			switch n := p[i+1]; {
			case n == 'w' && inClass:
				sb.WriteString(onigWordClass)
			case n == 'w':
				sb.WriteString("[" + onigWordClass + onigWordLatin1 + "]")
			case n == 'W' && !inClass:
				sb.WriteString("[^" + onigWordClass + onigWordLatin1 + "]")
			default:
				sb.WriteByte(c)
				sb.WriteByte(n)
			}
			i++
		case c == '[' && !inClass:
			inClass = true
			sb.WriteByte(c)
		case c == ']' && inClass:
			inClass = false
			sb.WriteByte(c)
		default:
			sb.WriteByte(c)
		}
	}
	return sb.String()
}

// regexMatcher runs a regexp2 regex. regexp2 works on runes; offsets are converted to bytes.
type regexMatcher struct {
	re *regexp2.Regexp
}

func (m *regexMatcher) matches(s string, fn func(start, end int)) {
	if s == "" {
		// Oniguruma reports an empty match on empty text; no pattern used here cares.
		return
	}
	runes := []rune(s)
	offs := make([]int, len(runes)+1)
	off := 0
	for i, r := range runes {
		offs[i] = off
		off += utf8.RuneLen(r)
	}
	offs[len(runes)] = off
	m1, err := m.re.FindRunesMatch(runes)
	lastEnd := -1
	for m1 != nil && err == nil {
		a, b := offs[m1.Index], offs[m1.Index+m1.Length]
		// Like the onig crate, skip an empty match right where the previous match ended.
		if !(a == b && a == lastEnd) {
			fn(a, b)
			lastEnd = b
		}
		m1, err = m.re.FindNextMatch(m1)
	}
}

// literalMatcher finds a fixed string.
type literalMatcher struct{ lit string }

func (m literalMatcher) matches(s string, fn func(start, end int)) {
	if m.lit == "" {
		return
	}
	for i := 0; ; {
		j := strings.Index(s[i:], m.lit)
		if j < 0 {
			return
		}
		fn(i+j, i+j+len(m.lit))
		i += j + len(m.lit)
	}
}

// Character classes of the fast scanners.
const (
	clsL  uint8 = 1 << iota // \p{L}
	clsN                    // \p{N}
	clsS                    // \s: Unicode White_Space
	clsNL                   // \r or \n (also clsS)
)

var asciiClass [utf8.RuneSelf]uint8

func init() {
	for c := 0; c < utf8.RuneSelf; c++ {
		r := rune(c)
		switch {
		case r == '\r' || r == '\n':
			asciiClass[c] = clsS | clsNL
		case unicode.IsSpace(r):
			asciiClass[c] = clsS
		case unicode.IsLetter(r):
			asciiClass[c] = clsL
		case unicode.IsNumber(r):
			asciiClass[c] = clsN
		}
	}
}

// classOf returns r's class: clsL, clsN, clsS (with clsNL for \r and \n) or 0 for anything
// else ("other": punctuation, symbols, marks, controls, emoji).
func classOf(r rune) uint8 {
	if r < utf8.RuneSelf {
		return asciiClass[r]
	}
	switch {
	case unicode.IsLetter(r):
		return clsL
	case unicode.IsNumber(r):
		return clsN
	case unicode.IsSpace(r):
		return clsS
	}
	return 0
}

// runeAt decodes the rune at s[i], with a fast path for ASCII.
func runeAt(s string, i int) (rune, int) {
	if c := s[i]; c < utf8.RuneSelf {
		return rune(c), 1
	}
	return utf8.DecodeRuneInString(s[i:])
}

type scanKind uint8

const (
	scanGPT2   scanKind = iota // gpt2Pattern
	scanLlama3                 // llama3Pattern and qwenPattern (maxDigits 3 or 1)
)

// fastMatcher matches one of the well-known pre-tokenizer regexes without a regex engine.
// Every character is covered by one of their alternatives, so the matches tile the text.
type fastMatcher struct {
	kind      scanKind
	maxDigits int
}

func (m fastMatcher) matches(s string, fn func(start, end int)) {
	for i := 0; i < len(s); {
		var j int
		if m.kind == scanGPT2 {
			j = nextGPT2(s, i)
		} else {
			j = nextLlama3(s, i, m.maxDigits)
		}
		fn(i, j)
		i = j
	}
}

// scanRun returns the end of the run of characters of class cls that starts at i.
func scanRun(s string, i int, cls uint8) int {
	for i < len(s) {
		r, n := runeAt(s, i)
		if classOf(r) != cls {
			break
		}
		i += n
	}
	return i
}

// spaceEnd matches `\s+(?!\S)|\s+` at i, where s[i] is white space: the whole run when it
// ends the text or is one character long, else the run without its last character.
func spaceEnd(s string, i int) int {
	j, last := i, i
	for j < len(s) {
		r, n := runeAt(s, j)
		if classOf(r)&clsS == 0 {
			break
		}
		last = j
		j += n
	}
	if j == len(s) || last == i {
		return j
	}
	return last
}

// contraction returns the length of the contraction suffix ('s 't 're 've 'm 'll 'd without the
// apostrophe) at the start of s, or 0. With fold, letters match case-insensitively under
// Unicode case folding, as Oniguruma's (?i) does (so "ſ", U+017F, matches "s").
func contraction(s string, fold bool) int {
	if s == "" {
		return 0
	}
	eq := func(i int, lower byte) bool {
		if i >= len(s) {
			return false
		}
		c := s[i]
		return c == lower || (fold && c == lower-'a'+'A')
	}
	switch {
	case eq(0, 's'), eq(0, 't'), eq(0, 'm'), eq(0, 'd'):
		return 1
	case eq(0, 'r') && eq(1, 'e'), eq(0, 'v') && eq(1, 'e'), eq(0, 'l') && eq(1, 'l'):
		return 2
	case fold && strings.HasPrefix(s, "\u017f"):
		return len("\u017f")
	}
	return 0
}

// nextGPT2 returns the end of the gpt2Pattern match that starts at i.
func nextGPT2(s string, i int) int {
	r0, n0 := runeAt(s, i)
	if r0 == '\'' {
		if n := contraction(s[i+1:], false); n > 0 {
			return i + 1 + n
		}
	}
	if r0 == ' ' && i+1 < len(s) { // ` ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+`
		r1, _ := runeAt(s, i+1)
		if c := classOf(r1); c&clsS == 0 {
			return scanRun(s, i+1, c)
		}
	}
	c0 := classOf(r0)
	if c0&clsS == 0 {
		return scanRun(s, i+n0, c0)
	}
	return spaceEnd(s, i)
}

// nextLlama3 returns the end of the llama3Pattern (or, with maxDigits 1, qwenPattern) match
// that starts at i.
func nextLlama3(s string, i, maxDigits int) int {
	r0, n0 := runeAt(s, i)
	c0 := classOf(r0)
	if r0 == '\'' {
		if n := contraction(s[i+1:], true); n > 0 {
			return i + 1 + n
		}
	}
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if c0 == clsL {
		return scanRun(s, i+n0, clsL)
	}
	if c0&(clsNL|clsN) == 0 && i+n0 < len(s) {
		if r1, n1 := runeAt(s, i+n0); classOf(r1) == clsL {
			return scanRun(s, i+n0+n1, clsL)
		}
	}
	// \p{N}{1,maxDigits}
	if c0 == clsN {
		j := i + n0
		for k := 1; k < maxDigits && j < len(s); k++ {
			r, n := runeAt(s, j)
			if classOf(r) != clsN {
				break
			}
			j += n
		}
		return j
	}
	// ` ?[^\s\p{L}\p{N}]+[\r\n]*`
	j := i
	if r0 == ' ' {
		j++
	}
	if j < len(s) {
		if r, _ := runeAt(s, j); classOf(r) == 0 {
			j = scanRun(s, j, 0)
			for j < len(s) && (s[j] == '\r' || s[j] == '\n') {
				j++
			}
			return j
		}
	}
	// Here r0 is white space. `\s*[\r\n]+`: up to and including the run's last \r or \n.
	end, lastNL := i, -1
	for end < len(s) {
		r, n := runeAt(s, end)
		c := classOf(r)
		if c&clsS == 0 {
			break
		}
		if c&clsNL != 0 {
			lastNL = end
		}
		end += n
	}
	if lastNL >= 0 {
		return lastNL + 1
	}
	return spaceEnd(s, i)
}
