package tokenizer

import (
	"strings"
	"unicode"

	"golang.org/x/text/unicode/norm"
)

// A normalizer rewrites text before pre-tokenization (Unicode normalization, lowercasing,
// replacing spaces by "▁", ...).
type normalizer interface {
	normalize(s string) string
}

type normSequence []normalizer

func (n normSequence) normalize(s string) string {
	for _, x := range n {
		s = x.normalize(s)
	}
	return s
}

// normPrepend adds a prefix to non-empty text (Llama 2 prepends "▁").
type normPrepend struct{ prefix string }

func (n normPrepend) normalize(s string) string {
	if s == "" {
		return s
	}
	return n.prefix + s
}

// normReplace replaces every match of a pattern by a fixed string.
type normReplace struct {
	pattern matcher
	content string
}

func (n normReplace) normalize(s string) string {
	return replaceAll(s, n.pattern, n.content)
}

func replaceAll(s string, m matcher, content string) string {
	var sb strings.Builder
	last := 0
	m.matches(s, func(start, end int) {
		if sb.Len() == 0 {
			sb.Grow(len(s))
		}
		sb.WriteString(s[last:start])
		sb.WriteString(content)
		last = end
	})
	if last == 0 && sb.Len() == 0 {
		return s
	}
	sb.WriteString(s[last:])
	return sb.String()
}

// normUnicode applies one of the Unicode normalization forms NFC, NFD, NFKC, NFKD.
type normUnicode struct{ form norm.Form }

func (n normUnicode) normalize(s string) string { return n.form.String(s) }

// normLowercase lowercases character by character, like Rust's char::to_lowercase.
type normLowercase struct{}

func (normLowercase) normalize(s string) string {
	return strings.Map(unicode.ToLower, strings.ReplaceAll(s, "\u0130", "i\u0307"))
}

// normStrip removes white space at the start and/or end.
type normStrip struct{ left, right bool }

func (n normStrip) normalize(s string) string {
	if n.left {
		s = strings.TrimLeftFunc(s, unicode.IsSpace)
	}
	if n.right {
		s = strings.TrimRightFunc(s, unicode.IsSpace)
	}
	return s
}

// normStripAccents removes combining marks (it is meant to follow NFD or NFKD).
type normStripAccents struct{}

func (normStripAccents) normalize(s string) string {
	return strings.Map(func(r rune) rune {
		if unicode.Is(unicode.M, r) {
			return -1
		}
		return r
	}, s)
}

// normByteLevel maps every byte to its GPT-2 character, as the ByteLevel normalizer does.
type normByteLevel struct{}

func (normByteLevel) normalize(s string) string { return byteLevelEncode(s) }
