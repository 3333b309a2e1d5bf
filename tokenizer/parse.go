package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"
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
	if t.normalizer, err = parseOptional(f.Normalizer, "normalizer", parseNormalizer); err != nil {
		return nil, err
	}
	if t.pre, err = parseOptional(f.PreTokenizer, "pre_tokenizer", parsePreTokenizer); err != nil {
		return nil, err
	}
	if t.post, err = parseOptional(f.PostProcessor, "post_processor", parsePostProcessor); err != nil {
		return nil, err
	}
	if t.decoder, err = parseOptional(f.Decoder, "decoder", parseDecoder); err != nil {
		return nil, err
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

// field reads the value of key, or def when it is missing or null.
func field[T any](o jobj, key string, def T) (T, error) {
	if _, ok := o.get(key); !ok {
		return def, nil
	}
	var v T
	return v, o.decode(key, &v)
}

func (o jobj) str(key, def string) (string, error)        { return field(o, key, def) }
func (o jobj) boolean(key string, def bool) (bool, error) { return field(o, key, def) }
func (o jobj) integer(key string, def int) (int, error)   { return field(o, key, def) }

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

// parseOptional parses the component at path with parse, or returns the zero value (no
// component) when raw is missing or null.
func parseOptional[T any](raw json.RawMessage, path string, parse func(json.RawMessage, string) (T, error)) (T, error) {
	if isNull(raw) {
		var none T
		return none, nil
	}
	return parse(raw, path)
}

// component reads the object of a component at path and its "type".
func component(raw json.RawMessage, path string) (jobj, string, error) {
	o, err := object(raw, path)
	if err != nil {
		return jobj{}, "", err
	}
	typ, err := o.typ()
	return o, typ, err
}

// parseList parses each element of the array at key (the parts of a Sequence component).
func parseList[T any](o jobj, key string, parse func(json.RawMessage, string) (T, error)) ([]T, error) {
	items, err := o.array(key)
	if err != nil {
		return nil, err
	}
	list := make([]T, 0, len(items))
	for i, it := range items {
		x, err := parse(it, elemPath(o.at(key), i))
		if err != nil {
			return nil, err
		}
		list = append(list, x)
	}
	return list, nil
}

// parseReplace reads the pattern and the replacement of a Replace normalizer or decoder.
func parseReplace(o jobj) (matcher, string, error) {
	m, err := parsePattern(o, "pattern")
	if err != nil {
		return nil, "", err
	}
	var content string
	return m, content, o.decode("content", &content)
}
