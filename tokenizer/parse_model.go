package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// maxVocab bounds token ids, so that a corrupt file cannot ask for a huge table.
const maxVocab = 1 << 24

func parseModel(raw json.RawMessage, path string) (*bpe, error) {
	o, err := object(raw, path)
	if err != nil {
		return nil, err
	}
	typ, err := o.str("type", "")
	if err != nil {
		return nil, err
	}
	if typ == "" {
		if _, ok := o.m["merges"]; !ok {
			return nil, fmt.Errorf("%s: missing", o.at("type"))
		}
		typ = "BPE" // files from older versions have no type; a BPE model has merges
	}
	if typ != "BPE" {
		return nil, unsupported(path, "model", typ, "BPE")
	}
	m := &bpe{unk: -1}
	if raw, ok := o.get("dropout"); ok {
		var d float64
		if err := json.Unmarshal(raw, &d); err != nil {
			return nil, fmt.Errorf("%s: %v", o.at("dropout"), err)
		}
		if d != 0 {
			return nil, fmt.Errorf("%s: BPE dropout %v is not supported (it makes tokenization random)", o.at("dropout"), d)
		}
	}
	if m.prefix, err = o.str("continuing_subword_prefix", ""); err != nil {
		return nil, err
	}
	if m.suffix, err = o.str("end_of_word_suffix", ""); err != nil {
		return nil, err
	}
	if m.fuseUnk, err = o.boolean("fuse_unk", false); err != nil {
		return nil, err
	}
	if m.byteFallback, err = o.boolean("byte_fallback", false); err != nil {
		return nil, err
	}
	if m.ignoreMerges, err = o.boolean("ignore_merges", false); err != nil {
		return nil, err
	}
	if err := o.decode("vocab", &m.vocab); err != nil {
		return nil, err
	}
	maxID := int32(-1)
	for tok, id := range m.vocab {
		if id < 0 || id >= maxVocab {
			return nil, fmt.Errorf("%s: token %q has id %d, outside [0, %d)", o.at("vocab"), tok, id, maxVocab)
		}
		maxID = max(maxID, id)
	}
	if int(maxID) >= 2*len(m.vocab)+1024 {
		return nil, fmt.Errorf("%s: ids are too sparse (%d tokens, largest id %d)", o.at("vocab"), len(m.vocab), maxID)
	}
	m.tokens = make([]string, maxID+1)
	m.present = make([]bool, maxID+1)
	for tok, id := range m.vocab {
		// Two tokens with one id: keep the smaller string, so the choice does not depend on
		// map order.
		if !m.present[id] || tok < m.tokens[id] {
			m.tokens[id] = tok
		}
		m.present[id] = true
	}
	unk, err := o.str("unk_token", "")
	if err != nil {
		return nil, err
	}
	if _, ok := o.get("unk_token"); ok {
		id, ok := m.vocab[unk]
		if !ok {
			return nil, fmt.Errorf("%s: %q is not in the vocabulary", o.at("unk_token"), unk)
		}
		m.unk = id
	}
	if err := m.parseMerges(o); err != nil {
		return nil, err
	}
	m.finish()
	return m, nil
}

// parseMerges reads merges as "a b" strings or as [a, b] pairs; a merge's rank is its index.
func (m *bpe) parseMerges(o jobj) error {
	raw, ok := o.get("merges")
	if !ok {
		m.merges = map[uint64]mergeRule{}
		return nil
	}
	path := o.at("merges")
	var pairs [][2]string
	var strs []string
	var err error
	if err = json.Unmarshal(raw, &strs); err == nil {
		pairs = make([][2]string, len(strs))
		for i, s := range strs {
			if pairs[i], err = splitMerge(s, elemPath(path, i)); err != nil {
				return err
			}
		}
	} else if err := json.Unmarshal(raw, &pairs); err != nil {
		// Mixed forms, or something else: go one by one for a precise error.
		var items []json.RawMessage
		if err := json.Unmarshal(raw, &items); err != nil {
			return fmt.Errorf("%s: want a list of merges", path)
		}
		pairs = make([][2]string, len(items))
		for i, it := range items {
			var s string
			if json.Unmarshal(it, &s) == nil {
				if pairs[i], err = splitMerge(s, elemPath(path, i)); err != nil {
					return err
				}
				continue
			}
			var p []string
			if err := json.Unmarshal(it, &p); err != nil || len(p) != 2 {
				return fmt.Errorf("%s: want \"a b\" or [\"a\", \"b\"]", elemPath(path, i))
			}
			pairs[i] = [2]string{p[0], p[1]}
		}
	}
	m.merges = make(map[uint64]mergeRule, len(pairs))
	for i, p := range pairs {
		a, ok := m.vocab[p[0]]
		if !ok {
			return fmt.Errorf("%s: token %q is not in the vocabulary", elemPath(path, i), p[0])
		}
		b, ok := m.vocab[p[1]]
		if !ok {
			return fmt.Errorf("%s: token %q is not in the vocabulary", elemPath(path, i), p[1])
		}
		if len(p[1]) < len(m.prefix) {
			return fmt.Errorf("%s: token %q is shorter than the continuing_subword_prefix", elemPath(path, i), p[1])
		}
		merged := p[0] + p[1][len(m.prefix):]
		id, ok := m.vocab[merged]
		if !ok {
			return fmt.Errorf("%s: merged token %q is not in the vocabulary", elemPath(path, i), merged)
		}
		m.merges[pairKey(a, b)] = mergeRule{rank: int32(i), id: id} // a repeated pair keeps its last rank
	}
	return nil
}

// splitMerge reads a merge written as one string, "a b".
func splitMerge(s, path string) ([2]string, error) {
	a, b, ok := strings.Cut(s, " ")
	if !ok || strings.Contains(b, " ") {
		return [2]string{}, fmt.Errorf("%s: %q is not two tokens separated by one space", path, s)
	}
	return [2]string{a, b}, nil
}

type addedJSON struct {
	ID         *int    `json:"id"`
	Content    *string `json:"content"`
	Special    bool    `json:"special"`
	LStrip     bool    `json:"lstrip"`
	RStrip     bool    `json:"rstrip"`
	SingleWord bool    `json:"single_word"`
	Normalized *bool   `json:"normalized"`
}

func (t *Tokenizer) parseAddedTokens(raw json.RawMessage) error {
	t.addedByID = map[int]int{}
	t.special = map[string]bool{}
	t.rawTrie, t.normTrie = newTrie(), newTrie()
	if isNull(raw) {
		return nil
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return errors.New("added_tokens: want a list")
	}
	seen := map[string]bool{}
	for i, it := range items {
		path := elemPath("added_tokens", i)
		var a addedJSON
		if err := json.Unmarshal(it, &a); err != nil {
			return fmt.Errorf("%s: %v", path, err)
		}
		if a.ID == nil || a.Content == nil {
			return fmt.Errorf("%s: want an object with id and content", path)
		}
		if *a.ID < 0 || *a.ID >= maxVocab {
			return fmt.Errorf("%s: id %d outside [0, %d)", path, *a.ID, maxVocab)
		}
		if *a.Content == "" || seen[*a.Content] {
			continue // Hugging Face ignores empty and repeated added tokens
		}
		seen[*a.Content] = true
		tok := addedToken{
			content: *a.Content, id: *a.ID, special: a.Special,
			lstrip: a.LStrip, rstrip: a.RStrip, singleWord: a.SingleWord,
			normalized: !a.Special,
		}
		if a.Normalized != nil {
			tok.normalized = *a.Normalized
		}
		if id, ok := t.model.vocab[tok.content]; ok {
			tok.id = int(id) // Hugging Face uses the model's id for a token it already has
		}
		tok.text = tok.content
		if tok.normalized && t.normalizer != nil {
			tok.text = t.normalizer.normalize(tok.content)
		}
		t.added = append(t.added, tok)
	}
	if len(t.added) > 2*len(t.model.tokens)+1024 {
		return fmt.Errorf("added_tokens: %d entries for a vocabulary of %d", len(t.added), len(t.model.tokens))
	}
	maxID := len(t.model.tokens)
	for _, a := range t.added {
		maxID = max(maxID, a.id)
	}
	if maxID >= 2*(len(t.model.tokens)+len(t.added))+1024 {
		return fmt.Errorf("added_tokens: ids are too sparse (largest id %d)", maxID)
	}
	// Special tokens are matched first, as Hugging Face orders them.
	for pass := 0; pass < 2; pass++ {
		for k, a := range t.added {
			if a.special != (pass == 0) {
				continue
			}
			if a.normalized {
				t.normTrie.add(a.text, k)
			} else {
				t.rawTrie.add(a.content, k)
			}
		}
	}
	t.addedByContent = make(map[string]int, len(t.added))
	for k, a := range t.added {
		t.addedByContent[a.content] = k
		if _, dup := t.addedByID[a.id]; !dup {
			t.addedByID[a.id] = k
		}
		if a.special {
			t.special[a.content] = true
		}
	}
	return nil
}
