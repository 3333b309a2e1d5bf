package tokenizer

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// Ids that are widely published for these tokenizers.
func TestEncodeKnownIDs(t *testing.T) {
	for _, tc := range []struct {
		tok        string
		text       string
		addSpecial bool
		want       []int
	}{
		{"llama2", "Hello world", true, []int{1, 15043, 3186}},
		{"llama2", "Hello world", false, []int{15043, 3186}},
		{"llama2", "", true, []int{1}},
		{"llama2", "\n", false, []int{29871, 13}},
		{"llama2", "𠀀", false, []int{29871, 243, 163, 131, 131}}, // not in the vocabulary: byte fallback
		{"llama3", "Hello world", true, []int{9906, 1917}},       // this file's post-processor adds no BOS
		{"llama3-template", "Hello world", true, []int{128000, 9906, 1917}},
		{"llama3", "<|begin_of_text|>Hi", false, []int{128000, 13347}},
		{"qwen3", "Hello world", true, []int{9707, 1879}},
		{"qwen3", "<|im_start|>user", false, []int{151644, 872}},
		{"gpt2", "Hello, world!", true, []int{15496, 11, 995, 0}},
		{"gpt2", "<|endoftext|>", false, []int{50256}},
	} {
		got, err := testTokenizer(t, tc.tok).Encode(tc.text, tc.addSpecial)
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("%s: Encode(%q, %v) = %v, %v; want %v", tc.tok, tc.text, tc.addSpecial, got, err, tc.want)
		}
	}
}

func TestDecodeSpacing(t *testing.T) {
	for _, tc := range []struct {
		tok         string
		ids         []int
		skipSpecial bool
		want        string
	}{
		{"llama2", []int{1, 15043, 3186}, false, "<s> Hello world"},
		{"llama2", []int{1, 15043, 3186}, true, "Hello world"},
		{"llama2", []int{29871, 13}, false, "\n"},
		{"llama2", []int{243, 163, 131, 131}, false, "𠀀"},
		{"llama2", []int{243, 163}, false, "\uFFFD\uFFFD"}, // a cut-off byte sequence
		{"gpt2", []int{15496, 11, 995, 0, 50256}, true, "Hello, world!"},
		{"gpt2", []int{15496, 11, 995, 0, 50256}, false, "Hello, world!<|endoftext|>"},
		{"qwen3", []int{151644, 872}, false, "<|im_start|>user"},
		{"qwen3", []int{151644, 872}, true, "user"},
	} {
		got, err := testTokenizer(t, tc.tok).Decode(tc.ids, tc.skipSpecial)
		if err != nil || got != tc.want {
			t.Errorf("%s: Decode(%v, %v) = %q, %v; want %q", tc.tok, tc.ids, tc.skipSpecial, got, err, tc.want)
		}
	}
}

func TestDecodeUnknownID(t *testing.T) {
	tk := testTokenizer(t, "gpt2")
	for _, id := range []int{-1, 50257, 1 << 40} {
		_, err := tk.Decode([]int{15496, id}, false)
		if err == nil || !strings.Contains(err.Error(), fmt.Sprint(id)) {
			t.Errorf("Decode with id %d: error %v, want one naming the id", id, err)
		}
	}
}

func TestEncodeRejectsInvalidUTF8(t *testing.T) {
	_, err := testTokenizer(t, "gpt2").Encode("ok\xffno", false)
	if err == nil || !strings.Contains(err.Error(), "offset 2") {
		t.Errorf("error %v, want one about invalid UTF-8 at offset 2", err)
	}
}

// Byte-level BPE without a normalizer is lossless: decoding the ids gives the text back.
func TestByteLevelRoundTrip(t *testing.T) {
	texts := readTexts(t)
	for _, name := range []string{"gpt2", "llama3", "qwen3"} {
		tk := testTokenizer(t, name)
		for _, s := range texts {
			if name == "qwen3" && !norm.NFC.IsNormalString(s) {
				continue // qwen3 normalizes to NFC first
			}
			ids, err := tk.Encode(s, false)
			if err != nil {
				t.Fatal(err)
			}
			if got, err := tk.Decode(ids, false); err != nil || got != s {
				t.Errorf("%s: Decode(Encode(%q)) = %q, %v", name, s, got, err)
			}
		}
	}
}

func TestSpecialTokenIDs(t *testing.T) {
	for _, tc := range []struct {
		tok      string
		bos, eos int // -1: none
	}{
		{"llama2", 1, 2},
		{"llama2-metaspace-first", 1, 2},
		{"llama3", 128000, 128001},
		{"qwen3", -1, 151643},
		{"qwen3-bytelevel-prefix", 151644, 151645},
		{"gpt2", -1, 50256},
	} {
		tk := testTokenizer(t, tc.tok)
		bos, okB := tk.BOS()
		eos, okE := tk.EOS()
		if (tc.bos >= 0) != okB || (okB && bos != tc.bos) || (tc.eos >= 0) != okE || (okE && eos != tc.eos) {
			t.Errorf("%s: BOS() = %d, %v; EOS() = %d, %v; want %d, %d", tc.tok, bos, okB, eos, okE, tc.bos, tc.eos)
		}
	}
	tk := testTokenizer(t, "llama2")
	if !tk.IsSpecial(1) || tk.IsSpecial(15043) {
		t.Error("IsSpecial: <s> should be special, Hello not")
	}
	if got := tk.SpecialIDs(); !slices.Equal(got, []int{0, 1, 2}) {
		t.Errorf("SpecialIDs() = %v", got)
	}
}

func TestVocabLookups(t *testing.T) {
	tk := testTokenizer(t, "llama3")
	if n := tk.VocabSize(); n != 128256 {
		t.Errorf("VocabSize() = %d, want 128256", n)
	}
	if id, ok := tk.TokenID("Ġthe"); !ok || id != 279 {
		t.Errorf(`TokenID("Ġthe") = %d, %v; want 279`, id, ok)
	}
	if id, ok := tk.TokenID("<|eot_id|>"); !ok || id != 128009 {
		t.Errorf(`TokenID("<|eot_id|>") = %d, %v; want 128009`, id, ok)
	}
	if s, ok := tk.IDToken(279); !ok || s != "Ġthe" {
		t.Errorf("IDToken(279) = %q, %v", s, ok)
	}
	if _, ok := tk.IDToken(128256); ok {
		t.Error("IDToken(128256) exists")
	}
}

// A tiny tokenizer.json to test components one at a time.
func tinyJSON(extra string) string {
	return `{"added_tokens": [], "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
	 "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5, " ": 6, "<unk>": 7},
	           "merges": ["b c", "a b", "ab c"], "unk_token": "<unk>"}` + extra + `}`
}

func mustParse(t *testing.T, doc string) *Tokenizer {
	t.Helper()
	tk, err := Parse([]byte(doc))
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	return tk
}

func TestBPEMergeOrder(t *testing.T) {
	tk := mustParse(t, tinyJSON(""))
	for text, want := range map[string][]int{
		"abc":  {0, 4},    // "b c" has rank 0: a + bc, and there is no merge "a bc"
		"ab":   {3},       //
		"abab": {3, 3},    //
		"cab":  {2, 3},    //
		"axb":  {0, 7, 1}, // unknown character
		"axxb": {0, 7, 7, 1},
	} {
		if got, _ := tk.Encode(text, false); !slices.Equal(got, want) {
			t.Errorf("Encode(%q) = %v, want %v", text, got, want)
		}
	}
	fused := mustParse(t, strings.Replace(tinyJSON(""), `"unk_token"`, `"fuse_unk": true, "unk_token"`, 1))
	if got, _ := fused.Encode("axxb", false); !slices.Equal(got, []int{0, 7, 1}) {
		t.Errorf("with fuse_unk: Encode(axxb) = %v, want [0 7 1]", got)
	}
	// No decoder: tokens are joined by spaces.
	if got, _ := tk.Decode([]int{0, 4}, false); got != "a bc" {
		t.Errorf("Decode = %q, want %q", got, "a bc")
	}
}

func TestAddedTokenOptions(t *testing.T) {
	doc := strings.Replace(tinyJSON(""), `"added_tokens": []`, `"added_tokens": [
		{"id": 8, "content": "[L]", "lstrip": true, "special": true, "normalized": false},
		{"id": 9, "content": "[R]", "rstrip": true, "special": true, "normalized": false},
		{"id": 10, "content": "cab", "single_word": true, "special": false, "normalized": false},
		{"id": 11, "content": "[LONG]", "special": true, "normalized": false},
		{"id": 12, "content": "[LONG", "special": true, "normalized": false}]`, 1)
	tk := mustParse(t, doc)
	for text, want := range map[string][]int{
		"a  [L]b":  {0, 8, 1},        // the spaces before [L] belong to it
		"a[R]  b":  {0, 9, 1},        // the spaces after [R] belong to it
		"cab":      {10},             //
		" cab c":   {6, 10, 6, 2},    //
		"acab":     {0, 2, 3},        // inside a word: no match
		"cabc":     {2, 0, 4},        // c a bc: "b c" is the first merge
		"[LONG]a":  {11, 0},          // the longest match wins
		"[LONG a":  {12, 6, 0},       //
		"a [L][R]": {0, 8, 9},        //
		"[R] [L]":  {9, 8},           // rstrip took the space, lstrip finds none left
		"x[L]":     {7, 8},           //
		"[l]":      {7, 7, 7},        // case matters ("l" is not in the vocabulary)
		"cab cab":  {10, 6, 10},      //
		"":         nil,              //
		"   ":      {6, 6, 6},        //
		"ab[R]\n":  {3, 9},           //
		"[L]\n\t[": {8, 7, 7, 7},     //
		"ca b":     {2, 0, 6, 1},     //
		"b[R]cab":  {1, 9, 10},       // "]" is no word character
		"[R]cab":   {9, 10},          //
		"_cab":     {7, 2, 3},        // '_' counts as a word character
		"é cab!":   {7, 6, 10, 7},    //
		"cab1":     {2, 3, 7},        //
		"(cab)":    {7, 10, 7},       //
		"cab cabs": {10, 6, 2, 3, 7}, //
	} {
		got, err := tk.Encode(text, false)
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("Encode(%q) = %v, %v; want %v", text, got, err, want)
		}
	}
	// single_word looks at the neighbours with the regex crate's \w: "½" (No) is no word
	// character, a combining mark is one.
	for text, want := range map[string][]int{"½cab": {7, 10}, "cab\u0301": {2, 3, 7}} {
		got, err := tk.Encode(text, false)
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("Encode(%q) = %v, %v; want %v", text, got, err, want)
		}
	}
}

func TestNormalizedAddedToken(t *testing.T) {
	doc := `{"added_tokens": [{"id": 3, "content": "ＡＢ", "normalized": true, "special": false},
	  {"id": 4, "content": "ＣＤ", "normalized": true, "special": true},
	  {"id": 5, "content": "<e>", "normalized": true, "special": true},
	  {"id": 6, "content": "ＥＦ", "normalized": false, "special": true}],
	 "normalizer": {"type": "NFKC"}, "pre_tokenizer": null, "post_processor": null, "decoder": null,
	 "model": {"type": "BPE", "vocab": {"A": 0, "B": 1, "x": 2}, "merges": []}}`
	tk := mustParse(t, doc)
	// The token's pattern is its normalized form "AB", found in the normalized text.
	for text, want := range map[string][]int{"xABx": {2, 3, 2}, "xＡＢ": {2, 3}, "AxB": {0, 2, 1}} {
		if got, _ := tk.Encode(text, false); !slices.Equal(got, want) {
			t.Errorf("Encode(%q) = %v, want %v", text, got, want)
		}
	}
	// Decoding shows a normalized token as its normalized form, and skipSpecial looks that form
	// up among the special contents: "CD" is not "ＣＤ", so it stays, as in Hugging Face.
	ids := []int{2, 3, 4, 5, 6}
	for skip, want := range map[bool]string{false: "x AB CD <e> ＥＦ", true: "x AB CD"} {
		if got, err := tk.Decode(ids, skip); err != nil || got != want {
			t.Errorf("Decode(%v, %v) = %q, %v; want %q", ids, skip, got, err, want)
		}
	}
	if tok, _ := tk.IDToken(3); tok != "ＡＢ" {
		t.Errorf("IDToken(3) = %q, want the content ＡＢ", tok)
	}
}

func TestMetaspacePrependFirst(t *testing.T) {
	tk := testTokenizer(t, "llama2-metaspace-first")
	// Only the text at the very start gets "▁"; after <s> it does not.
	a, _ := tk.Encode("Hello", false)
	b, _ := tk.Encode("<s>Hello", false)
	if len(a) == 0 || len(b) < 2 || b[0] != 1 || slices.Equal(a, b[1:]) {
		t.Errorf("Encode(Hello) = %v, Encode(<s>Hello) = %v: want different pieces for Hello", a, b)
	}
	full, _ := tk.Encode("Hello", true)
	if full[0] != 1 || full[len(full)-1] != 2 {
		t.Errorf("template <s> $A </s>: %v", full)
	}
}

func TestLossyUTF8(t *testing.T) {
	for in, want := range map[string]string{
		"abc":              "abc",
		"\xff":             "\uFFFD",
		"\xe4\xbd":         "\uFFFD", // one maximal subpart
		"\xe4\xbd\xa0":     "你",
		"a\xe4\xbdb":       "a\uFFFDb",
		"\xf0\x9f\x98":     "\uFFFD",
		"\xed\xa0\x80":     "\uFFFD\uFFFD\uFFFD", // surrogates are not a subpart
		"\xc0\xaf":         "\uFFFD\uFFFD",
		"\xf4\x90\x80\x80": "\uFFFD\uFFFD\uFFFD\uFFFD",
		"\xe0\x80":         "\uFFFD\uFFFD",
		"\xe0\xa0":         "\uFFFD",
	} {
		if got := lossyUTF8([]byte(in)); got != want {
			t.Errorf("lossyUTF8(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestByteLevelTable(t *testing.T) {
	seen := map[rune]bool{}
	for b := 0; b < 256; b++ {
		r := byteToRune[b]
		if seen[r] {
			t.Fatalf("rune %U used twice", r)
		}
		seen[r] = true
		if got := byteLevelDecode(nil, string(r)); len(got) != 1 || got[0] != byte(b) {
			t.Fatalf("byte %d does not round-trip", b)
		}
	}
	if byteLevelEncode(" \n!") != "ĠĊ!" {
		t.Errorf("byteLevelEncode(\" \\n!\") = %q", byteLevelEncode(" \n!"))
	}
}

func TestDecoders(t *testing.T) {
	toks := []string{"▁Hello", "<0xE4>", "<0xBD>", "<0xA0>", "▁", "<0xE4>", "x"}
	for _, tc := range []struct {
		name string
		d    decoder
		want []string
	}{
		{"ByteFallback", decByteFallback{}, []string{"▁Hello", "你", "▁", "\uFFFD", "x"}},
		{"Metaspace", decMetaspace{'▁', prependAlways}, []string{"Hello", "<0xE4>", "<0xBD>", "<0xA0>", " ", "<0xE4>", "x"}},
		{"Strip", decStrip{'▁', 1, 0}, []string{"Hello", "<0xE4>", "<0xBD>", "<0xA0>", "", "<0xE4>", "x"}},
		{"Fuse", decFuse{}, []string{strings.Join(toks, "")}},
		{"BPEDecoder", decBPE{"▁"}, []string{" Hello", "<0xE4>", "<0xBD>", "<0xA0>", " ", "<0xE4>", "x"}},
	} {
		if got := tc.d.decodeChain(slices.Clone(toks)); !slices.Equal(got, tc.want) {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
	// Strip must not fail on short or empty pieces (Hugging Face panics on an empty one).
	if got := (decStrip{' ', 2, 3}).decodeChain([]string{"", " ", "  a  "}); !slices.Equal(got, []string{"", "", "a"}) {
		t.Errorf("Strip on short pieces: %q", got)
	}
}

func TestConcurrentEncode(t *testing.T) {
	tk := testTokenizer(t, "llama3")
	texts := readTexts(t)
	want := make([][]int, len(texts))
	for i, s := range texts {
		want[i], _ = tk.Encode(s, true)
	}
	var wg sync.WaitGroup
	errs := make(chan string, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for k := range texts {
				i := (k + g*7) % len(texts)
				if got, _ := tk.Encode(texts[i], true); !slices.Equal(got, want[i]) {
					errs <- fmt.Sprintf("goroutine %d, text %d: %v, want %v", g, i, got, want[i])
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

func TestParseErrorsNamePath(t *testing.T) {
	base := tinyJSON("")
	for _, tc := range []struct {
		doc  string
		want []string // substrings of the error
	}{
		{`[]`, []string{"tokenizer.json"}},
		{`{}`, []string{"model: missing"}},
		{strings.Replace(base, `"pre_tokenizer": null`, `"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Digits"}, {"type": "BertPreTokenizer"}]}`, 1),
			[]string{"pre_tokenizer.pretokenizers[1]", `"BertPreTokenizer"`}},
		{strings.Replace(base, `"normalizer": null`, `{"normalizer": {"type": "Precompiled", "precompiled_charsmap": ""}}`[1:len(`{"normalizer": {"type": "Precompiled", "precompiled_charsmap": ""}}`)-1], 1),
			[]string{"normalizer", `"Precompiled"`}},
		{strings.Replace(base, `"decoder": null`, `"decoder": {"type": "WordPiece"}`, 1), []string{"decoder", `"WordPiece"`}},
		{strings.Replace(base, `"post_processor": null`, `"post_processor": {"type": "Sequence", "processors": [{"type": "Nope"}]}`, 1),
			[]string{"post_processor.processors[0]", `"Nope"`}},
		{strings.Replace(base, `"type": "BPE"`, `"type": "Unigram"`, 1), []string{"model", `"Unigram"`}},
		{strings.Replace(base, `"b c"`, `"b q"`, 1), []string{"model.merges[0]", `"q"`}},
		{strings.Replace(base, `"b c"`, `"bc"`, 1), []string{"model.merges[0]"}},
		{strings.Replace(base, `"unk_token": "<unk>"`, `"unk_token": "<nope>"`, 1), []string{"model.unk_token"}},
		{strings.Replace(base, `"a": 0`, `"a": -5`, 1), []string{"model.vocab", "-5"}},
		{strings.Replace(base, `"a": 0`, `"a": 99999999`, 1), []string{"model.vocab"}},
		{strings.Replace(base, `"type": "BPE"`, `"type": "BPE", "dropout": 0.1`, 1), []string{"model.dropout"}},
		{strings.Replace(base, `"pre_tokenizer": null`, `"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"}`, 1),
			[]string{"pre_tokenizer.pattern.Regex"}},
		{strings.Replace(base, `"pre_tokenizer": null`, `"pre_tokenizer": {"type": "Split", "pattern": {"String": "x"}, "behavior": "Sideways"}`, 1),
			[]string{"pre_tokenizer.behavior", "Sideways"}},
		{strings.Replace(base, `"post_processor": null`, `"post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}}, {"Sequence": {"id": "A"}}], "special_tokens": {}}`, 1),
			[]string{"post_processor.single[0]", "<s>"}},
		{strings.Replace(base, `"added_tokens": []`, `"added_tokens": [{"content": "x"}]`, 1), []string{"added_tokens[0]"}},
		{strings.Replace(base, `"normalizer": null`, `"normalizer": 7`, 1), []string{"normalizer: want a JSON object"}},
		{strings.Replace(base, `"normalizer": null`, `"normalizer": {}`, 1), []string{"normalizer.type: missing"}},
		{strings.Replace(base, `"decoder": null`, `"decoder": {"type": "Strip", "content": "ab"}`, 1), []string{"decoder.content"}},
		{`{"truncation": {"max_length": 5}, "model": {}}`, []string{"truncation"}},
	} {
		_, err := Parse([]byte(tc.doc))
		if err == nil {
			t.Errorf("Parse(%.80s…) succeeded, want an error", tc.doc)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("Parse error %q does not mention %q", err, w)
			}
		}
	}
}

func TestLoadGzipAndPlain(t *testing.T) {
	dir := t.TempDir()
	path := dir + "/tokenizer.json"
	if err := writeFile(path, tinyJSON("")); err != nil {
		t.Fatal(err)
	}
	tk, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := tk.Encode("ab", false); !slices.Equal(got, []int{3}) {
		t.Errorf("Encode = %v", got)
	}
	if _, err := Load(dir + "/missing.json"); err == nil || !strings.Contains(err.Error(), "missing.json") {
		t.Errorf("Load of a missing file: %v", err)
	}
}

func TestPieceCounts(t *testing.T) {
	// Encoding never produces ids outside the vocabulary.
	for _, name := range []string{"llama2", "gpt2", "qwen3"} {
		tk := testTokenizer(t, name)
		for _, s := range readTexts(t) {
			ids, _ := tk.Encode(s, true)
			for _, id := range ids {
				if _, ok := tk.IDToken(id); !ok || id >= tk.VocabSize() {
					t.Fatalf("%s: id %d from %q is not a token", name, id, s)
				}
			}
		}
	}
	if !utf8.ValidString(byteLevelEncode("\xff\xfe")) {
		t.Error("byteLevelEncode gives invalid UTF-8")
	}
}

func writeFile(path, s string) error { return os.WriteFile(path, []byte(s), 0o644) }

// Cutting SentencePiece-style words before "▁" (bpe.chunkSep) must not change any id.
func TestChunkingIsExact(t *testing.T) {
	texts := readTexts(t)
	for _, s := range texts {
		texts = append(texts, strings.Repeat(s+" ", 3))
	}
	for _, name := range []string{"llama2", "mistral", "llama2-unk-fuse", "llama2-unk-nofuse"} {
		tk := testTokenizer(t, name)
		if tk.model.chunkSep == "" {
			t.Fatalf("%s: words are not cut", name)
		}
		var plain *Tokenizer
		for _, v := range readVariants(t) {
			if v.Name == name {
				plain, _ = Parse(variantJSON(t, v))
			}
		}
		plain.model.chunkSep = ""
		for _, s := range texts {
			want, _ := plain.Encode(s, true)
			if got, _ := tk.Encode(s, true); !slices.Equal(got, want) {
				t.Fatalf("%s: %q: cut %v, whole %v", name, s, got, want)
			}
		}
	}
	if testTokenizer(t, "gpt2").model.chunkSep != "" {
		t.Error("gpt2 has no ▁ and must not be cut")
	}
}
