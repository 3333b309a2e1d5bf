package tokenizer

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// An addedToken is an entry of added_tokens: a string that is cut out of the text before
// normalization and pre-tokenization and becomes one token (special tokens such as "<s>", and
// tokens added to a vocabulary after training).
type addedToken struct {
	content    string
	id         int
	special    bool // skipped by Decode with skipSpecial
	lstrip     bool // also takes the white space before it
	rstrip     bool // also takes the white space after it
	singleWord bool // only matches when not inside a word
	normalized bool // matched against the normalized text
	// text is what Decode shows for the token: the content, or for a normalized token the
	// content passed through the normalizer, as Hugging Face caches it when the token is added
	// (so GPT-2's "<|endoftext|>" under a normalizer that prepends ">" decodes to
	// "><|endoftext|>").
	text string
}

// trie finds added tokens in text, leftmost first and longest among those starting at the
// same place, like the Aho-Corasick LeftmostLongest matcher of Hugging Face.
type trie struct {
	nodes []trieNode
	first [256]bool // bytes that can start a pattern
}

type trieNode struct {
	next map[byte]int32
	tok  int32 // index into the token list, -1 if no pattern ends here
}

func newTrie() *trie { return &trie{nodes: []trieNode{{tok: -1}}} }

// add inserts a pattern; the first pattern inserted wins over a later identical one.
func (t *trie) add(pattern string, tok int) {
	if pattern == "" {
		return
	}
	n := int32(0)
	for i := 0; i < len(pattern); i++ {
		c := pattern[i]
		nx, ok := t.nodes[n].next[c]
		if !ok {
			if t.nodes[n].next == nil {
				t.nodes[n].next = make(map[byte]int32)
			}
			nx = int32(len(t.nodes))
			t.nodes[n].next[c] = nx
			t.nodes = append(t.nodes, trieNode{tok: -1})
		}
		n = nx
	}
	if t.nodes[n].tok < 0 {
		t.nodes[n].tok = int32(tok)
	}
	t.first[pattern[0]] = true
}

func (t *trie) empty() bool { return len(t.nodes) == 1 }

// find calls fn for each non-overlapping match in s.
func (t *trie) find(s string, fn func(start, end, tok int)) {
	for i := 0; i < len(s); {
		if !t.first[s[i]] {
			i++
			continue
		}
		best, bestEnd := -1, 0
		n := int32(0)
		for j := i; j < len(s); j++ {
			nx, ok := t.nodes[n].next[s[j]]
			if !ok {
				break
			}
			n = nx
			if tok := t.nodes[n].tok; tok >= 0 {
				best, bestEnd = int(tok), j+1
			}
		}
		if best < 0 {
			i++
			continue
		}
		fn(i, bestEnd, best)
		i = bestEnd
	}
}

// A segment is a part of the input text: an added token (id >= 0) or text still to tokenize.
type segment struct {
	text  string
	id    int
	first bool // starts at the beginning of the input
}

// isWordChar is \w of the single_word check: Hugging Face tests the characters around a
// match with the regex crate's \w, so a number such as "½" (No) is no word character.
func isWordChar(r rune) bool { return isRegexCrateWord(r) }

// splitAdded cuts the added tokens found by t out of s and appends the parts to dst,
// following Hugging Face's AddedVocabulary::find_matches: a single_word token next to a word
// character is no match, lstrip and rstrip tokens take the white space around them.
func splitAdded(dst []segment, s string, first bool, t *trie, toks []addedToken) []segment {
	if t.empty() {
		if s != "" {
			dst = append(dst, segment{text: s, id: -1, first: first})
		}
		return dst
	}
	offset := 0
	t.find(s, func(start, stop, k int) {
		tok := &toks[k]
		if start < offset {
			return // inside white space an rstrip token already took
		}
		if tok.singleWord {
			if r, _ := utf8.DecodeLastRuneInString(s[:start]); start > 0 && isWordChar(r) {
				return
			}
			if r, _ := utf8.DecodeRuneInString(s[stop:]); stop < len(s) && isWordChar(r) {
				return
			}
		}
		if tok.lstrip {
			ns := len(strings.TrimRightFunc(s[:start], unicode.IsSpace))
			start = max(ns, offset)
		}
		if tok.rstrip {
			stop = len(s) - len(strings.TrimLeftFunc(s[stop:], unicode.IsSpace))
		}
		if start > offset {
			dst = append(dst, segment{text: s[offset:start], id: -1, first: first && offset == 0})
		}
		dst = append(dst, segment{text: s[start:stop], id: tok.id, first: first && start == 0})
		offset = stop
	})
	if offset < len(s) {
		dst = append(dst, segment{text: s[offset:], id: -1, first: first && offset == 0})
	}
	return dst
}
