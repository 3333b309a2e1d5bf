package tokenizer

import (
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"
)

// A piece is a stretch of text on its way through the pre-tokenizers.
type piece struct {
	text string
	// first is set when the piece starts at the beginning of the input text (what Hugging
	// Face tests as offsets_original().0 == 0, for Metaspace's prepend_scheme "first").
	first bool
	// raw is set when text still holds raw bytes that the ByteLevel pre-tokenizer has mapped
	// to GPT-2 characters only in principle: the text the model sees is byteLevelEncode(text).
	// Keeping the bytes lets a byte-level BPE model skip the mapping.
	raw bool
}

// str returns the text of p as the next stage sees it.
func (p piece) str() string {
	if p.raw {
		return byteLevelEncode(p.text)
	}
	return p.text
}

// A preTokenizer splits pieces into smaller pieces (words). It appends the non-empty pieces
// that p splits into to dst.
type preTokenizer interface {
	split(dst []piece, p piece) []piece
}

type preSequence []preTokenizer

// seqBuffers holds the two piece lists a preSequence alternates between.
type seqBuffers struct{ cur, next []piece }

var seqPool = sync.Pool{New: func() any { return new(seqBuffers) }}

func (s preSequence) split(dst []piece, p piece) []piece {
	if len(s) == 0 {
		return append(dst, p)
	}
	buf := seqPool.Get().(*seqBuffers)
	cur := append(buf.cur[:0], p)
	next := buf.next[:0]
	for _, pt := range s[:len(s)-1] {
		next = next[:0]
		for _, q := range cur {
			next = pt.split(next, q)
		}
		cur, next = next, cur
	}
	last := s[len(s)-1]
	for _, q := range cur {
		dst = last.split(dst, q)
	}
	if cap(cur)+cap(next) < 1<<16 {
		clear(cur)
		clear(next)
		buf.cur, buf.next = cur[:0], next[:0]
		seqPool.Put(buf)
	}
	return dst
}

// splitBehavior says what happens to the matches (delimiters) when text is split.
type splitBehavior uint8

const (
	splitRemoved            splitBehavior = iota // delimiters are dropped
	splitIsolated                                // delimiters become pieces of their own
	splitMergedWithPrevious                      // a delimiter joins the piece before it
	splitMergedWithNext                          // a delimiter joins the piece after it
	splitContiguous                              // consecutive delimiters form one piece
)

var splitBehaviors = map[string]splitBehavior{
	"Removed":            splitRemoved,
	"Isolated":           splitIsolated,
	"MergedWithPrevious": splitMergedWithPrevious,
	"MergedWithNext":     splitMergedWithNext,
	"Contiguous":         splitContiguous,
}

// A span is a byte range of a text and whether it is a match of the split pattern.
type span struct {
	start, end int
	match      bool
}

// matchSpans covers s with alternating non-match and match spans, as Hugging Face's
// Pattern::find_matches does (an empty text gives one empty non-match).
func matchSpans(s string, m matcher, invert bool) []span {
	if s == "" {
		return []span{{0, 0, invert}}
	}
	var spans []span
	prev := 0
	m.matches(s, func(start, end int) {
		if prev != start {
			spans = append(spans, span{prev, start, invert})
		}
		spans = append(spans, span{start, end, !invert})
		prev = end
	})
	if prev != len(s) {
		spans = append(spans, span{prev, len(s), invert})
	}
	return spans
}

// charSpans is matchSpans for a pattern that matches single characters.
func charSpans(s string, pred func(rune) bool) []span {
	if s == "" {
		return []span{{0, 0, false}}
	}
	var spans []span
	last := 0
	for i, r := range s {
		if pred(r) {
			if last < i {
				spans = append(spans, span{last, i, false})
			}
			end := i + utf8.RuneLen(r)
			spans = append(spans, span{i, end, true})
			last = end
		}
	}
	if last < len(s) {
		spans = append(spans, span{last, len(s), false})
	}
	return spans
}

// applyBehavior turns the spans of matchSpans into the ranges to keep, following Hugging
// Face's NormalizedString::split exactly (including its handling of adjacent matches).
func applyBehavior(spans []span, b splitBehavior) []span {
	out := spans[:0:0]
	switch b {
	case splitIsolated:
		return spans
	case splitRemoved:
		for _, sp := range spans {
			if !sp.match {
				out = append(out, sp)
			}
		}
	case splitContiguous, splitMergedWithPrevious:
		// Contiguous joins a span to the one before when both match or
		// neither does; MergedWithPrevious joins a match to the non-match
		// before it.
		prev := false
		for _, sp := range spans {
			join := sp.match == prev
			if b == splitMergedWithPrevious {
				join = sp.match && !prev
			}
			if join && len(out) > 0 {
				out[len(out)-1].end = sp.end
			} else {
				out = append(out, sp)
			}
			prev = sp.match
		}
	case splitMergedWithNext:
		prev := false
		for i := len(spans) - 1; i >= 0; i-- {
			sp := spans[i]
			if sp.match && !prev && len(out) > 0 {
				out[len(out)-1].start = sp.start
			} else {
				out = append(out, sp)
			}
			prev = sp.match
		}
		for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
			out[i], out[j] = out[j], out[i]
		}
	}
	return out
}

// appendSpans appends the non-empty ranges of s as pieces; only one that starts at 0 keeps
// the first flag of the parent.
func appendSpans(dst []piece, s string, first bool, spans []span) []piece {
	for _, sp := range spans {
		if sp.end > sp.start {
			dst = append(dst, piece{text: s[sp.start:sp.end], first: first && sp.start == 0})
		}
	}
	return dst
}

// preSplit is the Split pre-tokenizer: a regex or string pattern and a behavior.
type preSplit struct {
	pattern  matcher
	behavior splitBehavior
	invert   bool
}

func (p preSplit) split(dst []piece, in piece) []piece {
	s := in.str()
	if p.behavior == splitIsolated {
		// Every match and every gap is a piece: no need for the span list.
		prev := 0
		p.pattern.matches(s, func(start, end int) {
			if prev < start {
				dst = append(dst, piece{text: s[prev:start], first: in.first && prev == 0})
			}
			if start < end {
				dst = append(dst, piece{text: s[start:end], first: in.first && start == 0})
			}
			prev = end
		})
		if prev < len(s) {
			dst = append(dst, piece{text: s[prev:], first: in.first && prev == 0})
		}
		return dst
	}
	return appendSpans(dst, s, in.first, applyBehavior(matchSpans(s, p.pattern, p.invert), p.behavior))
}

// preByteLevel is the ByteLevel pre-tokenizer: optionally a leading space, optionally the
// GPT-2 regex split, then every byte mapped to its GPT-2 character (lazily, see piece.raw).
type preByteLevel struct {
	addPrefixSpace bool
	useRegex       bool
}

var gpt2Matcher = fastMatcher{kind: scanGPT2}

func (p preByteLevel) split(dst []piece, in piece) []piece {
	s := in.str()
	if p.addPrefixSpace && !strings.HasPrefix(s, " ") {
		s = " " + s
	}
	if !p.useRegex {
		if s != "" {
			dst = append(dst, piece{text: s, first: in.first, raw: true})
		}
		return dst
	}
	gpt2Matcher.matches(s, func(start, end int) {
		dst = append(dst, piece{text: s[start:end], first: in.first && start == 0, raw: true})
	})
	return dst
}

// preDigits splits digits from the rest: each digit alone, or runs of digits.
type preDigits struct{ individual bool }

func (p preDigits) split(dst []piece, in piece) []piece {
	s := in.str()
	b := splitContiguous
	if p.individual {
		b = splitIsolated
	}
	return appendSpans(dst, s, in.first, applyBehavior(charSpans(s, unicode.IsNumber), b))
}

// preMetaspace replaces spaces by a meta character ("▁"), optionally prepends one, and
// optionally splits before each meta character.
type preMetaspace struct {
	replacement rune
	prepend     prependScheme
	splitWords  bool
}

type prependScheme uint8

const (
	prependAlways prependScheme = iota
	prependNever
	prependFirst
)

func (p preMetaspace) split(dst []piece, in piece) []piece {
	rep := string(p.replacement)
	s := strings.ReplaceAll(in.str(), " ", rep)
	switch p.prepend {
	case prependAlways:
		if !strings.HasPrefix(s, rep) {
			s = rep + s
		}
	case prependFirst:
		if !strings.HasPrefix(s, rep) && in.first {
			s = rep + s
		}
	}
	if !p.splitWords {
		if s != "" {
			dst = append(dst, piece{text: s, first: in.first})
		}
		return dst
	}
	r := p.replacement
	spans := charSpans(s, func(c rune) bool { return c == r })
	return appendSpans(dst, s, in.first, applyBehavior(spans, splitMergedWithNext))
}

// isRegexCrateWord is \w of Rust's regex crate, which Hugging Face's Whitespace
// pre-tokenizer uses (unlike Split, which uses Oniguruma): Alphabetic, marks, decimal
// digits, connector punctuation and the join controls (ZWNJ, ZWJ).
func isRegexCrateWord(r rune) bool {
	return unicode.IsLetter(r) || unicode.Is(unicode.M, r) || unicode.Is(unicode.Nd, r) ||
		unicode.Is(unicode.Pc, r) || unicode.Is(unicode.Nl, r) ||
		unicode.Is(unicode.Other_Alphabetic, r) || r == 0x200C || r == 0x200D
}

// preWhitespace keeps the matches of `\w+|[^\w\s]+` and drops the rest.
type preWhitespace struct{}

func (preWhitespace) split(dst []piece, in piece) []piece {
	s := in.str()
	for i := 0; i < len(s); {
		r, n := runeAt(s, i)
		if unicode.IsSpace(r) {
			i += n
			continue
		}
		word := isRegexCrateWord(r)
		j := i + n
		for j < len(s) {
			r2, n2 := runeAt(s, j)
			if unicode.IsSpace(r2) || isRegexCrateWord(r2) != word {
				break
			}
			j += n2
		}
		dst = append(dst, piece{text: s[i:j], first: in.first && i == 0})
		i = j
	}
	return dst
}

// preWhitespaceSplit splits on white space and drops it.
type preWhitespaceSplit struct{}

func (preWhitespaceSplit) split(dst []piece, in piece) []piece {
	s := in.str()
	return appendSpans(dst, s, in.first, applyBehavior(charSpans(s, unicode.IsSpace), splitRemoved))
}
