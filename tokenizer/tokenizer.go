package tokenizer

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"unicode/utf8"
)

// Tokenizer encodes text to token ids and decodes ids to text, as described by a Hugging
// Face tokenizer.json file. It is safe for concurrent use.
type Tokenizer struct {
	model      *bpe
	normalizer normalizer    // nil: none
	pre        preTokenizer  // nil: none
	post       postProcessor // nil: none
	decoder    decoder       // nil: tokens joined by spaces

	added          []addedToken
	rawTrie        *trie          // added tokens matched before normalization
	normTrie       *trie          // added tokens matched in normalized text
	addedByID      map[int]int    // id -> index into added
	addedByContent map[string]int // content -> index into added
	special        map[string]bool

	vocabSize int
	bos, eos  int // -1 when unknown
}

// Load reads a tokenizer.json file (gzip-compressed files are recognized and read too).
func Load(path string) (*Tokenizer, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	if len(data) >= 2 && data[0] == 0x1f && data[1] == 0x8b {
		zr, err := gzip.NewReader(bytes.NewReader(data))
		if err != nil {
			return nil, fmt.Errorf("tokenizer: %s: %w", path, err)
		}
		data, err = io.ReadAll(zr)
		if err != nil {
			return nil, fmt.Errorf("tokenizer: %s: %w", path, err)
		}
	}
	t, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return t, nil
}

// Encode returns the token ids of text. With addSpecial, the special tokens of the
// post-processor's template are added (Llama 2's leading <s>, for example), as Hugging Face's
// encode does by default. Special tokens written in the text itself ("<|endoftext|>") are
// always recognized and become their ids. Text must be valid UTF-8.
func (t *Tokenizer) Encode(text string, addSpecial bool) ([]int, error) {
	ids, err := t.AppendEncode(make([]int, 0, len(text)/3+4), text)
	if err != nil {
		return nil, err
	}
	if addSpecial && t.post != nil {
		ids = t.post.process(ids)
	}
	return ids, nil
}

// AppendEncode appends the ids of text to dst, without special tokens from the
// post-processor (like Encode with addSpecial false). It allocates less than Encode when
// dst is reused, which suits tokenizing a corpus.
func (t *Tokenizer) AppendEncode(dst []int, text string) ([]int, error) {
	if !utf8.ValidString(text) {
		return dst, fmt.Errorf("tokenizer: text is not valid UTF-8 (byte offset %d)", invalidOffset(text))
	}
	st := encodePool.Get().(*encodeState)
	st.segs = splitAdded(st.segs[:0], text, true, t.rawTrie, t.added)
	for _, sg := range st.segs {
		if sg.id >= 0 {
			dst = append(dst, sg.id)
			continue
		}
		s := sg.text
		if t.normalizer != nil {
			s = t.normalizer.normalize(s)
		}
		st.normSegs = splitAdded(st.normSegs[:0], s, sg.first, t.normTrie, t.added)
		for _, ns := range st.normSegs {
			if ns.id >= 0 {
				dst = append(dst, ns.id)
				continue
			}
			p := piece{text: ns.text, first: ns.first}
			if t.pre == nil {
				dst = t.model.tokenize(dst, p)
				continue
			}
			st.pieces = t.pre.split(st.pieces[:0], p)
			for _, w := range st.pieces {
				dst = t.model.tokenize(dst, w)
			}
		}
	}
	st.release()
	return dst, nil
}

// encodeState holds the buffers of one AppendEncode call.
type encodeState struct {
	segs, normSegs []segment
	pieces         []piece
}

var encodePool = sync.Pool{New: func() any { return new(encodeState) }}

// release returns st to the pool, dropping references into the text and oversized buffers.
func (st *encodeState) release() {
	if cap(st.pieces) > 1<<16 || cap(st.segs) > 1<<12 || cap(st.normSegs) > 1<<12 {
		return
	}
	clear(st.segs[:cap(st.segs)])
	clear(st.normSegs[:cap(st.normSegs)])
	clear(st.pieces[:cap(st.pieces)])
	encodePool.Put(st)
}

func invalidOffset(s string) int {
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			return i
		}
		i += n
	}
	return len(s)
}

// Decode returns the text of ids. With skipSpecial, special tokens are left out (Hugging
// Face's skip_special_tokens; its default, and Decode's usual use, is false). An id that is
// neither in the vocabulary nor an added token is an error.
//
// An added token with "normalized": true is decoded as its content after the normalizer, as
// Hugging Face does. Like Hugging Face, skipSpecial compares that text with the contents of
// the special tokens, so a special token that the normalizer changes is kept.
func (t *Tokenizer) Decode(ids []int, skipSpecial bool) (string, error) {
	toks := make([]string, 0, len(ids))
	for i, id := range ids {
		tok, ok := t.decodeToken(id)
		if !ok {
			return "", fmt.Errorf("tokenizer: unknown token id %d at position %d (vocabulary size %d)", id, i, t.vocabSize)
		}
		if skipSpecial && t.special[tok] {
			continue
		}
		toks = append(toks, tok)
	}
	if t.decoder == nil {
		return strings.Join(toks, " "), nil
	}
	return strings.Join(t.decoder.decodeChain(toks), ""), nil
}

// VocabSize returns the number of token ids: one more than the largest id of the vocabulary
// and the added tokens (the number of rows an embedding table needs).
func (t *Tokenizer) VocabSize() int { return t.vocabSize }

// TokenID returns the id of a token given as it is stored in the vocabulary (for byte-level
// tokenizers that is the GPT-2 character form, e.g. "Ġthe") or of an added token.
func (t *Tokenizer) TokenID(token string) (int, bool) {
	if k, ok := t.addedByContent[token]; ok {
		return t.added[k].id, true
	}
	id, ok := t.model.vocab[token]
	return int(id), ok
}

// IDToken returns the token string of id: the added token's content or the vocabulary entry.
func (t *Tokenizer) IDToken(id int) (string, bool) {
	if k, ok := t.addedByID[id]; ok {
		return t.added[k].content, true
	}
	if id < 0 || id >= len(t.model.tokens) || !t.model.present[id] {
		return "", false
	}
	return t.model.tokens[id], true
}

// decodeToken returns the string that Decode passes to the decoder for id: IDToken's, except
// that a normalized added token gives its normalized content.
func (t *Tokenizer) decodeToken(id int) (string, bool) {
	if k, ok := t.addedByID[id]; ok {
		return t.added[k].text, true
	}
	return t.IDToken(id)
}

// IsSpecial reports whether id is a special token: an added token marked special, or a
// vocabulary entry with the same content. Decode with skipSpecial drops these, unless the
// normalizer changes the token (see Decode).
func (t *Tokenizer) IsSpecial(id int) bool {
	tok, ok := t.IDToken(id)
	return ok && t.special[tok]
}

// SpecialIDs returns the ids of the special added tokens, in file order.
func (t *Tokenizer) SpecialIDs() []int {
	var ids []int
	for _, a := range t.added {
		if a.special {
			ids = append(ids, a.id)
		}
	}
	return ids
}

// BOS returns the beginning-of-sequence token: the special token that the post-processor puts
// before the text, or else a special added token named <s>, <|begin_of_text|>, <bos> or
// <|startoftext|>.
func (t *Tokenizer) BOS() (int, bool) { return t.bos, t.bos >= 0 }

// EOS returns the end-of-sequence token: the special token that the post-processor puts after
// the text, or else a special added token named </s>, <|end_of_text|>, <|endoftext|> or <eos>
// (the first of these that exists).
func (t *Tokenizer) EOS() (int, bool) { return t.eos, t.eos >= 0 }

var (
	bosNames = []string{"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"}
	eosNames = []string{"</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"}
)

// findSpecialEnds sets bos and eos.
func (t *Tokenizer) findSpecialEnds() {
	t.bos, t.eos = -1, -1
	if t.post != nil {
		before, after := t.post.ends()
		if len(before) > 0 {
			t.bos = before[0]
		}
		if len(after) > 0 {
			t.eos = after[len(after)-1]
		}
	}
	byName := func(names []string) int {
		for _, n := range names {
			for _, a := range t.added {
				if a.special && a.content == n {
					return a.id
				}
			}
		}
		return -1
	}
	if t.bos < 0 {
		t.bos = byName(bosNames)
	}
	if t.eos < 0 {
		t.eos = byName(eosNames)
	}
}
