package generate

import (
	"testing"

	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/sample"
)

// BenchmarkNextLong times Sequence.Next over a 2048-token generation with
// the Llama-2 tokenizer: the per-token cost of sampling, detokenising and
// the stop-string search as the text grows.
func BenchmarkNextLong(b *testing.B) {
	tok, _ := enginetest.Llama2Tokenizer(b)
	const n = 2048
	rows := make([][]float32, 64)
	for i := range rows {
		rows[i] = make([]float32, tok.VocabSize())
		rows[i][500+131*i] = 1
	}
	o := Options{MaxTokens: n, Context: n + 8, Sample: sample.Greedy(), Stop: []string{"never appears here"}}
	b.ResetTimer()
	for range b.N {
		s, err := NewSequence(tok, []int{1, 450}, o)
		if err != nil {
			b.Fatal(err)
		}
		for i := range n {
			if _, err := s.Next(rows[i%len(rows)]); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N*n), "us/token")
}
