package enginetest

import (
	"compress/gzip"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/synth/sparsify"
	"github.com/twell-ai/twell/tokenizer"
)

var llama2 struct {
	once sync.Once
	raw  []byte
	tok  *tokenizer.Tokenizer
	err  error
}

// Llama2Tokenizer returns the Llama-2 tokenizer of the tokenizer tests
// (tokenizer/testdata/llama2.json.gz) and its tokenizer.json bytes, read
// once per test binary.
func Llama2Tokenizer(tb testing.TB) (*tokenizer.Tokenizer, []byte) {
	tb.Helper()
	llama2.once.Do(func() {
		_, here, _, _ := runtime.Caller(0)
		f, err := os.Open(filepath.Join(filepath.Dir(here), "..", "..", "tokenizer", "testdata", "llama2.json.gz"))
		if err != nil {
			llama2.err = err
			return
		}
		defer f.Close()
		zr, err := gzip.NewReader(f)
		if err != nil {
			llama2.err = err
			return
		}
		if llama2.raw, err = io.ReadAll(zr); err != nil {
			llama2.err = err
			return
		}
		llama2.tok, llama2.err = tokenizer.Parse(llama2.raw)
	})
	if llama2.err != nil {
		tb.Fatal(llama2.err)
	}
	return llama2.tok, llama2.raw
}

// TinyModel returns a small random sparse model (2 layers, hidden 32, MLP
// 256, gates calibrated to 2% skewed density) over the Llama-2 tokenizer's
// vocabulary, with maxPos positions, and the tokenizer. EOS (id 2) has a
// zero embedding row, so with the tied head its logit is 0: never the
// greedy choice among 32000 random logits, and greedy runs are not cut
// short by chance.
func TinyModel(tb testing.TB, maxPos int) (*model.Model, *tokenizer.Tokenizer) {
	tb.Helper()
	tok, _ := Llama2Tokenizer(tb)
	bos, eos := 1, 2
	c := model.Config{
		ModelType: "llama", Architectures: []string{"LlamaForCausalLM"},
		HiddenSize: 32, IntermediateSize: 256, NumHiddenLayers: 2, NumAttentionHeads: 4, NumKeyValueHeads: 2, HeadDim: 8,
		VocabSize: tok.VocabSize(), MaxPositionEmbeddings: maxPos, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: model.ActReLU, TieWordEmbeddings: true, MLPGated: true, BOSTokenID: &bos, EOSTokenIDs: []int{eos},
	}
	r, _ := testutil.Rand(tb)
	m, err := model.New(c, model.RandomWeights(c, r))
	if err != nil {
		tb.Fatal(err)
	}
	if err := sparsify.Gates(m, 0.02, synth.Skewed, r); err != nil {
		tb.Fatal(err)
	}
	clear(m.Weights.Embed[eos*c.HiddenSize : (eos+1)*c.HiddenSize])
	return m, tok
}
