package tokenizer

import (
	"strings"
	"unicode/utf8"
)

// A decoder turns the token strings of ids back into text pieces; a chain of decoders runs
// in order and the final pieces are concatenated.
type decoder interface {
	decodeChain(toks []string) []string
}

type decSequence []decoder

// eachPiece returns f(i, toks[i]) for each piece.
func eachPiece(toks []string, f func(i int, t string) string) []string {
	out := make([]string, len(toks))
	for i, t := range toks {
		out[i] = f(i, t)
	}
	return out
}

func (d decSequence) decodeChain(toks []string) []string {
	for _, x := range d {
		toks = x.decodeChain(toks)
	}
	return toks
}

// decByteLevel maps GPT-2 characters back to bytes and reads them as UTF-8 (invalid bytes
// become U+FFFD). It yields a single piece.
type decByteLevel struct{}

func (decByteLevel) decodeChain(toks []string) []string {
	var b []byte
	for _, t := range toks {
		b = byteLevelDecode(b, t)
	}
	return []string{lossyUTF8(b)}
}

// decByteFallback turns runs of byte tokens "<0xNN>" into the text they encode; a run that is
// not valid UTF-8 becomes one U+FFFD per byte.
type decByteFallback struct{}

func parseByteToken(t string) (byte, bool) {
	if len(t) != 6 || !strings.HasPrefix(t, "<0x") || t[5] != '>' {
		return 0, false
	}
	var v byte
	for _, c := range []byte(t[3:5]) {
		switch {
		case '0' <= c && c <= '9':
			v = v<<4 | (c - '0')
		case 'a' <= c && c <= 'f':
			v = v<<4 | (c - 'a' + 10)
		case 'A' <= c && c <= 'F':
			v = v<<4 | (c - 'A' + 10)
		default:
			return 0, false
		}
	}
	return v, true
}

func (decByteFallback) decodeChain(toks []string) []string {
	out := make([]string, 0, len(toks))
	var pending []byte
	flush := func() {
		if len(pending) == 0 {
			return
		}
		if utf8.Valid(pending) {
			out = append(out, string(pending))
		} else {
			for range pending {
				out = append(out, "\uFFFD")
			}
		}
		pending = pending[:0]
	}
	for _, t := range toks {
		if b, ok := parseByteToken(t); ok {
			pending = append(pending, b)
			continue
		}
		flush()
		out = append(out, t)
	}
	flush()
	return out
}

// decFuse joins all pieces into one.
type decFuse struct{}

func (decFuse) decodeChain(toks []string) []string { return []string{strings.Join(toks, "")} }

// decStrip removes up to start leading and stop trailing copies of a character from each piece.
type decStrip struct {
	content     rune
	start, stop int
}

func (d decStrip) decodeChain(toks []string) []string {
	return eachPiece(toks, func(_ int, t string) string {
		r := []rune(t)
		lo := 0
		for lo < d.start && lo < len(r) && r[lo] == d.content {
			lo++
		}
		hi := len(r)
		for k := 0; k < d.stop && hi > lo && r[hi-1] == d.content; k++ {
			hi--
		}
		return string(r[lo:hi])
	})
}

// decReplace replaces a pattern in each piece.
type decReplace struct {
	pattern matcher
	content string
}

func (d decReplace) decodeChain(toks []string) []string {
	return eachPiece(toks, func(_ int, t string) string { return replaceAll(t, d.pattern, d.content) })
}

// decMetaspace turns the meta character back into spaces; in the first piece it is dropped
// instead, unless the prepend scheme is "never".
type decMetaspace struct {
	replacement rune
	prepend     prependScheme
}

func (d decMetaspace) decodeChain(toks []string) []string {
	return eachPiece(toks, func(i int, t string) string {
		drop := i == 0 && d.prepend != prependNever
		return strings.Map(func(r rune) rune {
			if r != d.replacement {
				return r
			}
			if drop {
				return -1
			}
			return ' '
		}, t)
	})
}

// decBPE replaces the end-of-word suffix by a space (by nothing in the last piece).
type decBPE struct{ suffix string }

func (d decBPE) decodeChain(toks []string) []string {
	return eachPiece(toks, func(i int, t string) string {
		rep := " "
		if i == len(toks)-1 {
			rep = ""
		}
		return strings.ReplaceAll(t, d.suffix, rep)
	})
}
