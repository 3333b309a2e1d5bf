package tokenizer

import (
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzEncodeDecode checks that byte-level BPE without a normalizer is lossless:
// Decode(Encode(s)) == s for every valid UTF-8 text, and that the other tokenizers encode any
// text without error into ids that decode.
func FuzzEncodeDecode(f *testing.F) {
	for _, s := range readTexts(f) {
		f.Add(s)
	}
	f.Add("\xff invalid")
	f.Fuzz(func(t *testing.T, s string) {
		for _, name := range []string{"gpt2", "llama3", "llama2", "llama2-metaspace-split"} {
			tk := testTokenizer(t, name)
			ids, err := tk.Encode(s, true)
			if !utf8.ValidString(s) {
				if err == nil {
					t.Fatalf("%s: Encode(%q) accepted invalid UTF-8", name, s)
				}
				return
			}
			if err != nil {
				t.Fatalf("%s: Encode(%q): %v", name, s, err)
			}
			text, err := tk.Decode(ids, false)
			if err != nil {
				t.Fatalf("%s: Decode(%v): %v", name, ids, err)
			}
			if (name == "gpt2" || name == "llama3") && text != s {
				t.Fatalf("%s: Decode(Encode(%q)) = %q", name, s, text)
			}
			if _, err := tk.Decode(ids, true); err != nil {
				t.Fatalf("%s: Decode(%v, skip): %v", name, ids, err)
			}
		}
	})
}

// FuzzParse checks that no document makes Parse panic, and that a tokenizer it accepts
// encodes and decodes without panicking.
func FuzzParse(f *testing.F) {
	f.Add([]byte(tinyJSON("")))
	f.Add([]byte(`{}`))
	f.Add([]byte(`null`))
	f.Add([]byte(`{"model": {"vocab": {"a": 0}, "merges": []}}`))
	for _, v := range readVariants(f) {
		if v.Inline != nil {
			f.Add([]byte(v.Inline))
		}
	}
	base := tinyJSON("")
	for _, repl := range []string{
		`"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "MergedWithNext", "invert": true}, {"type": "ByteLevel", "add_prefix_space": true}]}`,
		`"pre_tokenizer": {"type": "Metaspace", "replacement": "a", "prepend_scheme": "first", "split": true}`,
		`"pre_tokenizer": {"type": "Digits", "individual_digits": true}`,
	} {
		f.Add([]byte(strings.Replace(base, `"pre_tokenizer": null`, repl, 1)))
	}
	for _, repl := range []string{
		`"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}, {"type": "Prepend", "prepend": "b"}, {"type": "Replace", "pattern": {"String": "a"}, "content": "bc"}]}`,
		`"normalizer": {"type": "Replace", "pattern": {"Regex": "x*"}, "content": "a"}`,
	} {
		f.Add([]byte(strings.Replace(base, `"normalizer": null`, repl, 1)))
	}
	f.Add([]byte(strings.Replace(base, `"decoder": null`, `"decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Strip", "content": "a", "start": 3, "stop": 9}, {"type": "ByteLevel"}, {"type": "Metaspace", "replacement": "b"}]}`, 1)))
	f.Add([]byte(strings.Replace(base, `"added_tokens": []`, `"added_tokens": [{"id": 9, "content": "ab", "lstrip": true, "rstrip": true, "single_word": true, "special": true, "normalized": true}]`, 1)))
	texts := []string{"", "abc ab\tc", "a\nb  c<s>", "日本 ab", "ab ab ab ab", " ", "cab!"}
	f.Fuzz(func(t *testing.T, data []byte) {
		tk, err := Parse(data)
		if err != nil {
			if tk != nil {
				t.Fatal("Parse returned a tokenizer and an error")
			}
			return
		}
		for _, s := range texts {
			ids, err := tk.Encode(s, true)
			if err != nil {
				t.Fatalf("Encode(%q): %v", s, err)
			}
			for _, id := range ids {
				if id < 0 {
					t.Fatalf("Encode(%q) gave id %d", s, id)
				}
			}
			_, _ = tk.Decode(ids, false)
			_, _ = tk.Decode(ids, true)
		}
		_, _ = tk.Decode([]int{0, 1, 2, 3, 4, 5}, false)
		_, _ = tk.BOS()
		_, _ = tk.EOS()
		_ = slices.Clone(tk.SpecialIDs())
	})
}
