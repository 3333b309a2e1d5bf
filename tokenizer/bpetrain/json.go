package bpetrain

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strconv"

	"github.com/twell-ai/twell/internal/atomicfile"
)

// jsonString returns s as a JSON string literal, without HTML escaping ("<|endoftext|>" stays
// readable).
func jsonString(s string) string {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	enc.Encode(s) // a string always encodes
	return string(bytes.TrimRight(b.Bytes(), "\n"))
}

// WriteJSON writes the model as a Hugging Face tokenizer.json: a BPE model with the
// vocabulary in id order and the merges by rank, the ByteLevel pre-tokenizer (GPT-2 pattern,
// no prefix space), post-processor and decoder, and the special tokens as added tokens that
// are also in the vocabulary (as in GPT-2's file).
func (m *Model) WriteJSON(w io.Writer) error {
	if err := m.validate(); err != nil {
		return err
	}
	bw := bufio.NewWriter(w)
	p := func(s string) { bw.WriteString(s) }
	p("{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n  \"added_tokens\": [")
	first := len(m.Tokens) - m.Special
	for i, s := range m.SpecialTokens() {
		if i > 0 {
			p(",")
		}
		p("\n    {\"id\": " + strconv.Itoa(first+i) + ", \"content\": " + jsonString(s) +
			", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}")
	}
	if m.Special > 0 {
		p("\n  ")
	}
	p(`],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
  "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
  "model": {
    "type": "BPE",
    "dropout": null,
    "unk_token": null,
    "continuing_subword_prefix": "",
    "end_of_word_suffix": "",
    "fuse_unk": false,
    "byte_fallback": false,
    "ignore_merges": false,
    "vocab": {`)
	for id, s := range m.Tokens {
		if id > 0 {
			p(",")
		}
		p("\n      " + jsonString(s) + ": " + strconv.Itoa(id))
	}
	p("\n    },\n    \"merges\": [")
	for r, mg := range m.Merges {
		if r > 0 {
			p(",")
		}
		p("\n      " + jsonString(mg[0]+" "+mg[1]))
	}
	p("\n    ]\n  }\n}\n")
	return bw.Flush()
}

// JSON returns the model's tokenizer.json (see WriteJSON), e.g. for tokenizer.Parse.
func (m *Model) JSON() ([]byte, error) {
	var b bytes.Buffer
	if err := m.WriteJSON(&b); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// Save writes the model as a tokenizer.json file at path. The file is written under a
// temporary name and renamed, so path holds either the old file or the complete new one.
func (m *Model) Save(path string) error {
	if err := atomicfile.Write(path, 0o644, m.WriteJSON); err != nil {
		return fmt.Errorf("bpetrain: writing %s: %w", path, err)
	}
	return nil
}
