package tokenizer

import (
	"strings"
	"unicode/utf8"
)

// byteToRune is GPT-2's byte-to-character table: printable Latin-1 bytes map to themselves
// and the others to code points from U+0100 up, so that every byte string becomes a string
// of visible characters (a space becomes "Ġ", a newline "Ċ").
var byteToRune [256]rune

// runeToByte inverts byteToRune; runeIsByte says which runes are in the table.
var (
	runeToByte [324]byte
	runeIsByte [324]bool
)

// byteToString caches the UTF-8 encoding of byteToRune.
var byteToString [256]string

func init() {
	n := 0
	for b := 0; b < 256; b++ {
		if ('!' <= b && b <= '~') || (0xA1 <= b && b <= 0xAC) || (0xAE <= b && b <= 0xFF) {
			byteToRune[b] = rune(b)
		} else {
			byteToRune[b] = rune(256 + n)
			n++
		}
		r := byteToRune[b]
		runeToByte[r] = byte(b)
		runeIsByte[r] = true
		byteToString[b] = string(r)
	}
}

// byteLevelEncode maps every byte of s to its GPT-2 character.
func byteLevelEncode(s string) string {
	var sb strings.Builder
	sb.Grow(2 * len(s))
	for i := 0; i < len(s); i++ {
		sb.WriteString(byteToString[s[i]])
	}
	return sb.String()
}

// byteLevelDecode appends to dst the bytes that the characters of tok stand for. A token with
// a character outside the table is appended as it is, the way Hugging Face's ByteLevel decoder
// treats it.
func byteLevelDecode(dst []byte, tok string) []byte {
	start := len(dst)
	for _, r := range tok {
		if r < 0 || int(r) >= len(runeIsByte) || !runeIsByte[r] {
			return append(dst[:start], tok...)
		}
		dst = append(dst, runeToByte[r])
	}
	return dst
}

// lossyUTF8 converts b to a string, replacing each maximal ill-formed subsequence by one
// U+FFFD, as Rust's String::from_utf8_lossy (and the Unicode standard's recommended practice)
// does. Go's own conversions replace byte by byte instead.
func lossyUTF8(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	var sb strings.Builder
	sb.Grow(len(b) + 8)
	for i := 0; i < len(b); {
		r, size := utf8.DecodeRune(b[i:])
		if r != utf8.RuneError || size > 1 {
			sb.Write(b[i : i+size])
			i += size
			continue
		}
		sb.WriteRune(utf8.RuneError)
		i += invalidPrefixLen(b[i:])
	}
	return sb.String()
}

// invalidPrefixLen returns the length of the maximal prefix of b that could start a
// well-formed UTF-8 sequence but is not one (at least 1). b[0] starts an invalid sequence.
func invalidPrefixLen(b []byte) int {
	c := b[0]
	var need int
	lo, hi := byte(0x80), byte(0xBF) // bounds for the second byte
	switch {
	case 0xC2 <= c && c <= 0xDF:
		need = 1
	case c == 0xE0:
		need, lo = 2, 0xA0
	case 0xE1 <= c && c <= 0xEC, c == 0xEE, c == 0xEF:
		need = 2
	case c == 0xED:
		need, hi = 2, 0x9F
	case c == 0xF0:
		need, lo = 3, 0x90
	case 0xF1 <= c && c <= 0xF3:
		need = 3
	case c == 0xF4:
		need, hi = 3, 0x8F
	default:
		return 1
	}
	n := 1
	for k := 0; k < need && n < len(b); k++ {
		x := b[n]
		if k == 0 {
			if x < lo || x > hi {
				break
			}
		} else if x < 0x80 || x > 0xBF {
			break
		}
		n++
	}
	return n
}
