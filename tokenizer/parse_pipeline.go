package tokenizer

// Parsing of the pipeline around the model: normalizers, pre-tokenizers, decoders and
// post-processors.

import (
	"encoding/json"
	"fmt"
	"strings"

	"golang.org/x/text/unicode/norm"
)

func parseNormalizer(raw json.RawMessage, path string) (normalizer, error) {
	o, typ, err := component(raw, path)
	if err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		seq, err := parseList(o, "normalizers", parseNormalizer)
		if err != nil {
			return nil, err
		}
		return normSequence(seq), nil
	case "Prepend":
		var s string
		if err := o.decode("prepend", &s); err != nil {
			return nil, err
		}
		return normPrepend{s}, nil
	case "Replace":
		m, content, err := parseReplace(o)
		if err != nil {
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
	o, typ, err := component(raw, path)
	if err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		seq, err := parseList(o, "pretokenizers", parsePreTokenizer)
		if err != nil {
			return nil, err
		}
		if len(seq) == 1 {
			return seq[0], nil
		}
		return preSequence(seq), nil
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
		r, scheme, err := parseMetaspace(o)
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

// parseMetaspace reads the replacement character and prepend scheme that the Metaspace
// pre-tokenizer and decoder share.
func parseMetaspace(o jobj) (rune, prependScheme, error) {
	r, err := o.char("replacement", '▁')
	if err != nil {
		return 0, 0, err
	}
	scheme, err := parsePrependScheme(o)
	return r, scheme, err
}

func parseDecoder(raw json.RawMessage, path string) (decoder, error) {
	o, typ, err := component(raw, path)
	if err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		seq, err := parseList(o, "decoders", parseDecoder)
		if err != nil {
			return nil, err
		}
		return decSequence(seq), nil
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
		m, content, err := parseReplace(o)
		if err != nil {
			return nil, err
		}
		return decReplace{m, content}, nil
	case "Metaspace":
		r, scheme, err := parseMetaspace(o)
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
	o, typ, err := component(raw, path)
	if err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		seq, err := parseList(o, "processors", parsePostProcessor)
		if err != nil {
			return nil, err
		}
		return postSequence(seq), nil
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
