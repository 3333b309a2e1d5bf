package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// Parse reads a tokenizer.json document. Components of a type this package does not implement
// are an error naming the type and its JSON path (e.g. `pre_tokenizer.pretokenizers[1]`).
func Parse(data []byte) (*Tokenizer, error) {
	t, err := parse(data)
	if err != nil {
		return nil, fmt.Errorf("tokenizer.json: %w", err)
	}
	return t, nil
}

type fileJSON struct {
	AddedTokens   json.RawMessage `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Decoder       json.RawMessage `json:"decoder"`
	Model         json.RawMessage `json:"model"`
	Truncation    json.RawMessage `json:"truncation"`
	Padding       json.RawMessage `json:"padding"`
}

func parse(data []byte) (*Tokenizer, error) {
	var f fileJSON
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	if !isNull(f.Truncation) {
		return nil, errors.New("truncation: truncation is not supported (it must be null)")
	}
	if !isNull(f.Padding) {
		return nil, errors.New("padding: padding is not supported (it must be null)")
	}
	if isNull(f.Model) {
		return nil, errors.New("model: missing")
	}
	t := &Tokenizer{}
	var err error
	if t.model, err = parseModel(f.Model, "model"); err != nil {
		return nil, err
	}
	if !isNull(f.Normalizer) {
		if t.normalizer, err = parseNormalizer(f.Normalizer, "normalizer"); err != nil {
			return nil, err
		}
	}
	if !isNull(f.PreTokenizer) {
		if t.pre, err = parsePreTokenizer(f.PreTokenizer, "pre_tokenizer"); err != nil {
			return nil, err
		}
	}
	if !isNull(f.PostProcessor) {
		if t.post, err = parsePostProcessor(f.PostProcessor, "post_processor"); err != nil {
			return nil, err
		}
	}
	if !isNull(f.Decoder) {
		if t.decoder, err = parseDecoder(f.Decoder, "decoder"); err != nil {
			return nil, err
		}
	}
	if err := t.parseAddedTokens(f.AddedTokens); err != nil {
		return nil, err
	}
	t.vocabSize = len(t.model.tokens)
	for _, a := range t.added {
		t.vocabSize = max(t.vocabSize, a.id+1)
	}
	t.findSpecialEnds()
	return t, nil
}

func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || string(raw) == "null"
}

// jobj is a JSON object with its path in the document, for error messages.
type jobj struct {
	path string
	m    map[string]json.RawMessage
}

func object(raw json.RawMessage, path string) (jobj, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil || m == nil {
		return jobj{}, fmt.Errorf("%s: want a JSON object", path)
	}
	return jobj{path, m}, nil
}

func (o jobj) at(key string) string { return o.path + "." + key }

// get returns the value of key, or false when it is missing or null.
func (o jobj) get(key string) (json.RawMessage, bool) {
	v, ok := o.m[key]
	if !ok || isNull(v) {
		return nil, false
	}
	return v, true
}

func (o jobj) decode(key string, v any) error {
	raw, ok := o.get(key)
	if !ok {
		return fmt.Errorf("%s: missing", o.at(key))
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return fmt.Errorf("%s: %v", o.at(key), err)
	}
	return nil
}

func (o jobj) str(key, def string) (string, error) {
	if _, ok := o.get(key); !ok {
		return def, nil
	}
	var s string
	return s, o.decode(key, &s)
}

func (o jobj) boolean(key string, def bool) (bool, error) {
	if _, ok := o.get(key); !ok {
		return def, nil
	}
	var b bool
	return b, o.decode(key, &b)
}

func (o jobj) integer(key string, def int) (int, error) {
	if _, ok := o.get(key); !ok {
		return def, nil
	}
	var n int
	return n, o.decode(key, &n)
}

func (o jobj) array(key string) ([]json.RawMessage, error) {
	var a []json.RawMessage
	return a, o.decode(key, &a)
}

func (o jobj) typ() (string, error) {
	s, err := o.str("type", "")
	if err != nil {
		return "", err
	}
	if s == "" {
		return "", fmt.Errorf("%s: missing", o.at("type"))
	}
	return s, nil
}

func unsupported(path, kind, typ, supported string) error {
	return fmt.Errorf("%s: unsupported %s type %q (supported: %s)", path, kind, typ, supported)
}

// parsePattern reads {"String": s} or {"Regex": r}.
func parsePattern(o jobj, key string) (matcher, error) {
	raw, ok := o.get(key)
	if !ok {
		return nil, fmt.Errorf("%s: missing", o.at(key))
	}
	p, err := object(raw, o.at(key))
	if err != nil {
		return nil, err
	}
	if s, ok := p.get("String"); ok {
		var lit string
		if err := json.Unmarshal(s, &lit); err != nil {
			return nil, fmt.Errorf("%s: %v", p.at("String"), err)
		}
		return literalMatcher{lit}, nil
	}
	if r, ok := p.get("Regex"); ok {
		var src string
		if err := json.Unmarshal(r, &src); err != nil {
			return nil, fmt.Errorf("%s: %v", p.at("Regex"), err)
		}
		m, err := compileRegex(src)
		if err != nil {
			return nil, fmt.Errorf("%s: regex %q: %v", p.at("Regex"), src, err)
		}
		return m, nil
	}
	return nil, fmt.Errorf("%s: want {\"String\": ...} or {\"Regex\": ...}", o.at(key))
}

// char reads a string field that must hold exactly one character.
func (o jobj) char(key string, def rune) (rune, error) {
	s, err := o.str(key, string(def))
	if err != nil {
		return 0, err
	}
	if utf8.RuneCountInString(s) != 1 {
		return 0, fmt.Errorf("%s: want one character, got %q", o.at(key), s)
	}
	r, _ := utf8.DecodeRuneInString(s)
	return r, nil
}

func elemPath(path string, i int) string { return fmt.Sprintf("%s[%d]", path, i) }

func parseNormalizer(raw json.RawMessage, path string) (normalizer, error) {
	o, err := object(raw, path)
	if err != nil {
		return nil, err
	}
	typ, err := o.typ()
	if err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		items, err := o.array("normalizers")
		if err != nil {
			return nil, err
		}
		seq := make(normSequence, 0, len(items))
		for i, it := range items {
			n, err := parseNormalizer(it, elemPath(o.at("normalizers"), i))
			if err != nil {
				return nil, err
			}
			seq = append(seq, n)
		}
		return seq, nil
	case "Prepend":
		var s string
		if err := o.decode("prepend", &s); err != nil {
			return nil, err
		}
		return normPrepend{s}, nil
	case "Replace":
		m, err := parsePattern(o, "pattern")
		if err != nil {
			return nil, err
		}
		var content string
		if err := o.decode("content", &content); err != nil {
			return nil, err
		}
		return normReplace{m, content}, nil
	case "NFC":
		return normUnicode{norm.NFC}, nil
	case "NFD":
		return normUnicode{norm.NFD}, nil
	case "NFKC":
		return normUnicode{norm.NFKC}, nil
	case "NFKD":
		return normUnicode{norm.NFKD}, nil
	case "Lowercase":
		return normLowercase{}, nil
	case "Strip":
		l, err := o.boolean("strip_left", true)
		if err != nil {
			return nil, err
		}
		r, err := o.boolean("strip_right", true)
		if err != nil {
			return nil, err
		}
		return normStrip{l, r}, nil
	case "StripAccents":
		return normStripAccents{}, nil
	case "ByteLevel":
		return normByteLevel{}, nil
	}
	return nil, unsupported(path, "normalizer", typ,
		"Sequence, Prepend, Replace, NFC, NFD, NFKC, NFKD, Lowercase, Strip, StripAccents, ByteLevel")
}

func parsePrependScheme(o jobj) (prependScheme, error) {
	s, err := o.str("prepend_scheme", "always")
	if err != nil {
		return 0, err
	}
	var scheme prependScheme
	switch s {
	case "always":
		scheme = prependAlways
	case "never":
		scheme = prependNever
	case "first":
		scheme = prependFirst
	default:
		return 0, fmt.Errorf("%s: unknown prepend scheme %q (want always, never or first)", o.at("prepend_scheme"), s)
	}
	// Files from before prepend_scheme existed have add_prefix_space instead; like Hugging
	// Face, false must come with prepend_scheme "never" (whose default is "always").
	add, err := o.boolean("add_prefix_space", true)
	if err != nil {
		return 0, err
	}
	if !add {
		if scheme != prependNever {
			return 0, fmt.Errorf("%s: add_prefix_space false contradicts prepend_scheme %q", o.path, s)
		}
	}
	return scheme, nil
}

func parsePreTokenizer(raw json.RawMessage, path string) (preTokenizer, error) {
	o, err := object(raw, path)
	if err != nil {
		return nil, err
	}
	typ, err := o.typ()
	if err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		items, err := o.array("pretokenizers")
		if err != nil {
			return nil, err
		}
		seq := make(preSequence, 0, len(items))
		for i, it := range items {
			p, err := parsePreTokenizer(it, elemPath(o.at("pretokenizers"), i))
			if err != nil {
				return nil, err
			}
			seq = append(seq, p)
		}
		if len(seq) == 1 {
			return seq[0], nil
		}
		return seq, nil
	case "Split":
		m, err := parsePattern(o, "pattern")
		if err != nil {
			return nil, err
		}
		var b string
		if err := o.decode("behavior", &b); err != nil {
			return nil, err
		}
		behavior, ok := splitBehaviors[b]
		if !ok {
			return nil, fmt.Errorf("%s: unknown split behavior %q", o.at("behavior"), b)
		}
		invert, err := o.boolean("invert", false)
		if err != nil {
			return nil, err
		}
		return preSplit{m, behavior, invert}, nil
	case "ByteLevel":
		add, err := o.boolean("add_prefix_space", true)
		if err != nil {
			return nil, err
		}
		re, err := o.boolean("use_regex", true)
		if err != nil {
			return nil, err
		}
		return preByteLevel{addPrefixSpace: add, useRegex: re}, nil
	case "Digits":
		ind, err := o.boolean("individual_digits", false)
		if err != nil {
			return nil, err
		}
		return preDigits{ind}, nil
	case "Metaspace":
		r, err := o.char("replacement", '▁')
		if err != nil {
			return nil, err
		}
		scheme, err := parsePrependScheme(o)
		if err != nil {
			return nil, err
		}
		split, err := o.boolean("split", true)
		if err != nil {
			return nil, err
		}
		return preMetaspace{replacement: r, prepend: scheme, splitWords: split}, nil
	case "Whitespace":
		return preWhitespace{}, nil
	case "WhitespaceSplit":
		return preWhitespaceSplit{}, nil
	}
	return nil, unsupported(path, "pre-tokenizer", typ,
		"Sequence, Split, ByteLevel, Digits, Metaspace, Whitespace, WhitespaceSplit")
}

func parseDecoder(raw json.RawMessage, path string) (decoder, error) {
	o, err := object(raw, path)
	if err != nil {
		return nil, err
	}
	typ, err := o.typ()
	if err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		items, err := o.array("decoders")
		if err != nil {
			return nil, err
		}
		seq := make(decSequence, 0, len(items))
		for i, it := range items {
			d, err := parseDecoder(it, elemPath(o.at("decoders"), i))
			if err != nil {
				return nil, err
			}
			seq = append(seq, d)
		}
		return seq, nil
	case "ByteLevel":
		return decByteLevel{}, nil
	case "ByteFallback":
		return decByteFallback{}, nil
	case "Fuse":
		return decFuse{}, nil
	case "Strip":
		c, err := o.char("content", ' ')
		if err != nil {
			return nil, err
		}
		start, err := o.integer("start", 0)
		if err != nil {
			return nil, err
		}
		stop, err := o.integer("stop", 0)
		if err != nil {
			return nil, err
		}
		if start < 0 || stop < 0 {
			return nil, fmt.Errorf("%s: start and stop must not be negative", path)
		}
		return decStrip{content: c, start: start, stop: stop}, nil
	case "Replace":
		m, err := parsePattern(o, "pattern")
		if err != nil {
			return nil, err
		}
		var content string
		if err := o.decode("content", &content); err != nil {
			return nil, err
		}
		return decReplace{m, content}, nil
	case "Metaspace":
		r, err := o.char("replacement", '▁')
		if err != nil {
			return nil, err
		}
		scheme, err := parsePrependScheme(o)
		if err != nil {
			return nil, err
		}
		return decMetaspace{replacement: r, prepend: scheme}, nil
	case "BPEDecoder":
		s, err := o.str("suffix", "</w>")
		if err != nil {
			return nil, err
		}
		return decBPE{s}, nil
	}
	return nil, unsupported(path, "decoder", typ,
		"Sequence, ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace, BPEDecoder")
}

func parsePostProcessor(raw json.RawMessage, path string) (postProcessor, error) {
	o, err := object(raw, path)
	if err != nil {
		return nil, err
	}
	typ, err := o.typ()
	if err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		items, err := o.array("processors")
		if err != nil {
			return nil, err
		}
		seq := make(postSequence, 0, len(items))
		for i, it := range items {
			p, err := parsePostProcessor(it, elemPath(o.at("processors"), i))
			if err != nil {
				return nil, err
			}
			seq = append(seq, p)
		}
		return seq, nil
	case "ByteLevel":
		return postTemplate{}, nil // changes offsets only
	case "TemplateProcessing":
		return parseTemplate(o)
	case "BertProcessing", "RobertaProcessing":
		var sep, cls [2]json.RawMessage
		if err := o.decode("sep", &sep); err != nil {
			return nil, err
		}
		if err := o.decode("cls", &cls); err != nil {
			return nil, err
		}
		var sepID, clsID int
		if err := json.Unmarshal(sep[1], &sepID); err != nil {
			return nil, fmt.Errorf("%s: want [token, id]", o.at("sep"))
		}
		if err := json.Unmarshal(cls[1], &clsID); err != nil {
			return nil, fmt.Errorf("%s: want [token, id]", o.at("cls"))
		}
		return postTemplate{before: []int{clsID}, after: []int{sepID}}, nil
	}
	return nil, unsupported(path, "post-processor", typ,
		"Sequence, ByteLevel, TemplateProcessing, BertProcessing, RobertaProcessing")
}

// parseTemplate reads TemplateProcessing's "single" template and its special tokens.
func parseTemplate(o jobj) (postProcessor, error) {
	specials := map[string][]int{}
	if raw, ok := o.get("special_tokens"); ok {
		var m map[string]struct {
			IDs []int `json:"ids"`
		}
		if err := json.Unmarshal(raw, &m); err != nil {
			return nil, fmt.Errorf("%s: %v", o.at("special_tokens"), err)
		}
		for k, v := range m {
			specials[k] = v.IDs
		}
	}
	raw, ok := o.get("single")
	if !ok {
		return nil, fmt.Errorf("%s: missing", o.at("single"))
	}
	var pieces []json.RawMessage
	var text string
	if json.Unmarshal(raw, &text) == nil {
		for _, f := range strings.Fields(text) {
			b, _ := json.Marshal(f)
			pieces = append(pieces, b)
		}
	} else if err := json.Unmarshal(raw, &pieces); err != nil {
		return nil, fmt.Errorf("%s: want a list of pieces", o.at("single"))
	}
	var p postTemplate
	seenA := false
	for i, pr := range pieces {
		path := elemPath(o.at("single"), i)
		special, seq, err := parseTemplatePiece(pr, path)
		if err != nil {
			return nil, err
		}
		if seq != "" {
			if seq != "A" || seenA {
				return nil, fmt.Errorf("%s: the single template must hold sequence A once, found %q", path, seq)
			}
			seenA = true
			continue
		}
		ids, ok := specials[special]
		if !ok {
			return nil, fmt.Errorf("%s: special token %q is not in %s", path, special, o.at("special_tokens"))
		}
		if seenA {
			p.after = append(p.after, ids...)
		} else {
			p.before = append(p.before, ids...)
		}
	}
	if !seenA {
		return nil, fmt.Errorf("%s: the template has no sequence $A", o.at("single"))
	}
	return p, nil
}

// parseTemplatePiece reads {"SpecialToken": {"id": name}}, {"Sequence": {"id": "A"}} or the
// string forms "$A", "$B:1", "<s>", "<s>:0". It returns the special token name or the sequence.
func parseTemplatePiece(raw json.RawMessage, path string) (special, seq string, err error) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		if i := strings.LastIndexByte(s, ':'); i > 0 {
			s = s[:i]
		}
		if strings.HasPrefix(s, "$") {
			switch s {
			case "$", "$A", "$0":
				return "", "A", nil
			case "$B", "$1":
				return "", "B", nil
			}
			return "", "", fmt.Errorf("%s: unknown sequence %q", path, s)
		}
		return s, "", nil
	}
	var m map[string]struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal(raw, &m); err != nil || len(m) != 1 {
		return "", "", fmt.Errorf("%s: want {\"SpecialToken\": ...} or {\"Sequence\": ...}", path)
	}
	if v, ok := m["SpecialToken"]; ok {
		return v.ID, "", nil
	}
	if v, ok := m["Sequence"]; ok {
		if v.ID != "A" && v.ID != "B" {
			return "", "", fmt.Errorf("%s: unknown sequence %q", path, v.ID)
		}
		return "", v.ID, nil
	}
	return "", "", fmt.Errorf("%s: want {\"SpecialToken\": ...} or {\"Sequence\": ...}", path)
}

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
	if err := json.Unmarshal(raw, &strs); err == nil {
		pairs = make([][2]string, len(strs))
		for i, s := range strs {
			a, b, ok := strings.Cut(s, " ")
			if !ok || strings.Contains(b, " ") {
				return fmt.Errorf("%s: %q is not two tokens separated by one space", elemPath(path, i), s)
			}
			pairs[i] = [2]string{a, b}
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
				a, b, ok := strings.Cut(s, " ")
				if !ok || strings.Contains(b, " ") {
					return fmt.Errorf("%s: %q is not two tokens separated by one space", elemPath(path, i), s)
				}
				pairs[i] = [2]string{a, b}
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
