package data

import (
	"strings"
	"unicode"

	"golang.org/x/text/unicode/norm"
)

// Normalize returns the form of a document that Build tokenizes: valid UTF-8 (invalid bytes
// become U+FFFD), no byte order marks (U+FEFF, anywhere), LF line ends (CRLF and lone CR become LF), Unicode NFC,
// no trailing white space on any line, and no blank lines at the start or end. A document that
// normalizes to "" is dropped as empty.
func Normalize(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	if strings.Contains(s, "\uFEFF") {
		s = strings.ReplaceAll(s, "\uFEFF", "")
	}
	if strings.IndexByte(s, '\r') >= 0 {
		s = strings.ReplaceAll(s, "\r\n", "\n")
		s = strings.ReplaceAll(s, "\r", "\n")
	}
	s = norm.NFC.String(s)
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		lines[i] = strings.TrimRightFunc(l, unicode.IsSpace)
	}
	start, end := 0, len(lines)
	for start < end && lines[start] == "" {
		start++
	}
	for end > start && lines[end-1] == "" {
		end--
	}
	return strings.Join(lines[start:end], "\n")
}
