package tokenizer

import (
	"bytes"
	"compress/gzip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/twell-ai/twell/tokenizer/bpetrain"
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
	for _, doc := range parseSeeds(f) {
		f.Add(doc)
	}
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

// parseSeeds returns tokenizer.json documents that exercise the parser: the tiny BPE of
// the tests with each kind of normalizer, pre-tokenizer, decoder and added token, the
// inline variants of testdata, and a byte-level BPE trained by package bpetrain.
func parseSeeds(f *testing.F) [][]byte {
	var seeds [][]byte
	add := func(b []byte) { seeds = append(seeds, b) }
	add([]byte(tinyJSON("")))
	add([]byte(`{}`))
	add([]byte(`null`))
	add([]byte(`{"model": {"vocab": {"a": 0}, "merges": []}}`))
	for _, v := range readVariants(f) {
		if v.Inline != nil {
			add([]byte(v.Inline))
		}
	}
	base := tinyJSON("")
	for _, repl := range []string{
		`"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "MergedWithNext", "invert": true}, {"type": "ByteLevel", "add_prefix_space": true}]}`,
		`"pre_tokenizer": {"type": "Metaspace", "replacement": "a", "prepend_scheme": "first", "split": true}`,
		`"pre_tokenizer": {"type": "Digits", "individual_digits": true}`,
	} {
		add([]byte(strings.Replace(base, `"pre_tokenizer": null`, repl, 1)))
	}
	for _, repl := range []string{
		`"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}, {"type": "Prepend", "prepend": "b"}, {"type": "Replace", "pattern": {"String": "a"}, "content": "bc"}]}`,
		`"normalizer": {"type": "Replace", "pattern": {"Regex": "x*"}, "content": "a"}`,
	} {
		add([]byte(strings.Replace(base, `"normalizer": null`, repl, 1)))
	}
	add([]byte(strings.Replace(base, `"decoder": null`, `"decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Strip", "content": "a", "start": 3, "stop": 9}, {"type": "ByteLevel"}, {"type": "Metaspace", "replacement": "b"}]}`, 1)))
	add([]byte(strings.Replace(base, `"added_tokens": []`, `"added_tokens": [{"id": 9, "content": "ab", "lstrip": true, "rstrip": true, "single_word": true, "special": true, "normalized": true}]`, 1)))
	m, err := bpetrain.Train([]string{"the cat sat on the mat; the cat's hat <|endoftext|> 東京 🙂"}, bpetrain.Config{VocabSize: 280, MinFrequency: 1, Workers: 1})
	if err != nil {
		f.Fatal(err)
	}
	doc, err := m.JSON()
	if err != nil {
		f.Fatal(err)
	}
	add(doc)
	return seeds
}

// FuzzLoadEncode loads an arbitrary tokenizer.json from a file (gzip-compressed when gz is
// set, as Load recognizes) and encodes and decodes an arbitrary text with it: Load and Parse
// may refuse the document but never panic, and an accepted tokenizer must encode any valid
// UTF-8 text into ids inside its vocabulary, refuse invalid UTF-8 with an error, and decode
// any ids, in range or not, without panicking.
func FuzzLoadEncode(f *testing.F) {
	texts := []string{"", "abc ab\tc", "a\nb  c<s>", "日本 ab", "the cat <|endoftext|> hat", "\xff\xfe"}
	for i, doc := range parseSeeds(f) {
		f.Add(doc, texts[i%len(texts)], i%3 == 0)
	}
	f.Fuzz(func(t *testing.T, doc []byte, text string, gz bool) {
		if gz {
			var b bytes.Buffer
			zw := gzip.NewWriter(&b)
			zw.Write(doc)
			zw.Close()
			doc = b.Bytes()
		}
		path := filepath.Join(t.TempDir(), "tokenizer.json")
		if err := os.WriteFile(path, doc, 0o644); err != nil {
			t.Fatal(err)
		}
		tk, err := Load(path)
		if err != nil {
			if tk != nil {
				t.Fatal("Load returned a tokenizer and an error")
			}
			return
		}
		for _, special := range []bool{false, true} {
			ids, err := tk.Encode(text, special)
			if !utf8.ValidString(text) {
				if err == nil {
					t.Fatalf("Encode(%q) accepted invalid UTF-8", text)
				}
				continue
			}
			if err != nil {
				t.Fatalf("Encode(%q, %v): %v", text, special, err)
			}
			for _, id := range ids {
				if id < 0 || id >= tk.VocabSize() {
					t.Fatalf("Encode(%q) gave id %d, vocabulary %d", text, id, tk.VocabSize())
				}
			}
			_, _ = tk.Decode(ids, false)
			_, _ = tk.Decode(ids, true)
		}
		var junk []int
		for i := 0; i+1 < len(text); i += 2 {
			junk = append(junk, int(int8(text[i]))*int(text[i+1]))
		}
		_, _ = tk.Decode(junk, false)
		_, _ = tk.Decode(junk, true)
	})
}
