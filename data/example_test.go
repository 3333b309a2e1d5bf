package data_test

import (
	"fmt"

	"github.com/twell-ai/twell/data"
	"github.com/twell-ai/twell/tokenizer"
	"github.com/twell-ai/twell/tokenizer/bpetrain"
)

// sampleEncoder adapts a tokenizer.Tokenizer to data.Encoder.
type sampleEncoder struct {
	tk  *tokenizer.Tokenizer
	eos int
}

func (e sampleEncoder) Encode(s string) ([]int, error) { return e.tk.AppendEncode(nil, s) }
func (e sampleEncoder) VocabSize() int                 { return e.tk.VocabSize() }
func (e sampleEncoder) EOS() int                       { return e.eos }

// Training data with no download: a tokenizer trained on the bundled sample, the sample
// tokenized in memory, and a loader over it.
func Example_sample() {
	var texts []string
	for _, f := range data.SampleFiles() {
		texts = append(texts, data.Normalize(f.Text))
	}
	m, err := bpetrain.Train(texts, bpetrain.Config{VocabSize: 2048})
	if err != nil {
		panic(err)
	}
	js, _ := m.JSON()
	tk, err := tokenizer.Parse(js)
	if err != nil {
		panic(err)
	}
	eos, _ := tk.EOS()
	ds, err := data.BuildMemory(data.BuildConfig{
		Sources: []data.Source{data.SampleSource()},
		Encoder: sampleEncoder{tk, eos},
		ValFrac: data.DefaultValFrac,
	})
	if err != nil {
		panic(err)
	}
	defer ds.Close()
	l, err := ds.NewLoader(data.LoaderConfig{Batch: 8, SeqLen: 256, Seed: 1})
	if err != nil {
		panic(err)
	}
	batch, _ := l.Next(nil)
	val, _ := ds.Val("sample", 8, 256)
	fmt.Println(len(batch), ds.VocabSize(), ds.ValSources(), val.Windows() > 0)
	// Output: 2056 2048 [sample] true
}
