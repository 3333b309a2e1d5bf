package main

import (
	"bytes"
	"compress/gzip"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/safetensors"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/synth/sparsify"
	"github.com/twell-ai/twell/tokenizer"
)

// tinyCheckpoint writes a small random sparse model with the Llama-2
// tokenizer from the tokenizer tests into a temporary folder.
func tinyCheckpoint(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	f, err := os.Open("../../tokenizer/testdata/llama2.json.gz")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), raw, 0o644); err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	bos, eos := 1, 2
	c := model.Config{
		ModelType: "llama", Architectures: []string{"LlamaForCausalLM"},
		HiddenSize: 32, IntermediateSize: 256, NumHiddenLayers: 2, NumAttentionHeads: 4, NumKeyValueHeads: 2, HeadDim: 8,
		VocabSize: tok.VocabSize(), MaxPositionEmbeddings: 64, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: model.ActReLU, TieWordEmbeddings: true, MLPGated: true, BOSTokenID: &bos, EOSTokenIDs: []int{eos},
	}
	r := rand.New(rand.NewPCG(rand.Uint64(), 1))
	m, err := model.New(c, model.RandomWeights(c, r))
	if err != nil {
		t.Fatal(err)
	}
	if err := sparsify.Gates(m, 0.02, synth.Skewed, r); err != nil {
		t.Fatal(err)
	}
	if err := model.Save(dir, c, m.Weights, safetensors.BF16); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestGenerateRunsOnCPU(t *testing.T) {
	dir := tinyCheckpoint(t)
	var out, errb bytes.Buffer
	code := run([]string{"generate", "-model", dir, "-prompt", "Once upon a time", "-max-tokens", "12", "-temperature", "0", "-device", "cpu"}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if !strings.Contains(errb.String(), "decode:") || !strings.Contains(errb.String(), "MLP active units") {
		t.Errorf("statistics missing from stderr: %q", errb.String())
	}
	if strings.Contains(out.String(), "decode:") {
		t.Errorf("statistics leaked into stdout: %q", out.String())
	}
	// Greedy decoding is deterministic.
	var out2 bytes.Buffer
	run([]string{"generate", "-model", dir, "-prompt", "Once upon a time", "-max-tokens", "12", "-temperature", "0"}, &out2, io.Discard)
	if out.String() != out2.String() {
		t.Errorf("greedy runs differ: %q vs %q", out.String(), out2.String())
	}
}

func TestGenerateBadInput(t *testing.T) {
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"generate", "-prompt", "x"}, 2, "-model is required"},
		{[]string{"generate", "-model", "/nonexistent", "-prompt", "x"}, 1, "nonexistent"},
		{[]string{"generate", "-model", ".", "-temperature", "-1"}, 2, "temperature"},
		{[]string{"generate", "-model", ".", "-top-p", "2"}, 2, "top-p"},
		{[]string{"generate", "-model", ".", "-max-tokens", "0"}, 2, "-max-tokens 0"},
	}
	for _, c := range cases {
		var out, errb bytes.Buffer
		code := run(c.args, &out, &errb)
		if code != c.code || !strings.Contains(errb.String(), c.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit %d mentioning %q", c.args, code, errb.String(), c.code, c.want)
		}
	}
}
