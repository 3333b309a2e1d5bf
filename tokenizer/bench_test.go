package tokenizer

import (
	"strings"
	"testing"
)

// BenchmarkEncode measures encoding of the test texts (English prose, code, CJK, emoji, ...),
// with a warm word cache, as when tokenizing a corpus.
func BenchmarkEncode(b *testing.B) {
	benchEncode(b, strings.Join(readTexts(b), "\n"), "gpt2", "llama3", "qwen3", "llama2")
}

// benchEncode measures encoding of text with each of the named test tokenizers.
func benchEncode(b *testing.B, text string, names ...string) {
	for _, name := range names {
		b.Run(name, func(b *testing.B) {
			tk := testTokenizer(b, name)
			var ids []int
			b.SetBytes(int64(len(text)))
			for b.Loop() {
				var err error
				if ids, err = tk.AppendEncode(ids[:0], text); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(len(ids)), "tokens/op")
		})
	}
}

// BenchmarkDecode measures decoding of the test texts' ids.
func BenchmarkDecode(b *testing.B) {
	text := strings.Join(readTexts(b), "\n")
	for _, name := range []string{"gpt2", "llama2"} {
		b.Run(name, func(b *testing.B) {
			tk := testTokenizer(b, name)
			ids, err := tk.Encode(text, false)
			if err != nil {
				b.Fatal(err)
			}
			b.SetBytes(int64(len(text)))
			for b.Loop() {
				if _, err := tk.Decode(ids, false); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkEncodeProse measures encoding of English prose (repeated, so the word cache is warm).
func BenchmarkEncodeProse(b *testing.B) {
	benchEncode(b, strings.Repeat(readTexts(b)[3]+"\n\n", 20), "gpt2", "llama3", "llama2")
}
