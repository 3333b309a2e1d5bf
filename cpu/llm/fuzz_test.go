package llm_test

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/safetensors"
	"github.com/twell-ai/twell/tokenizer"
)

// FuzzCheckpointFolder feeds arbitrary config.json, model.safetensors and
// tokenizer.json files through loading and one forward pass: every input
// either loads and runs or is refused with an error, never a panic.
func FuzzCheckpointFolder(f *testing.F) {
	r := rand.New(rand.NewPCG(1, 2))
	c := tinyConfig()
	c.NumHiddenLayers = 1
	dir := f.TempDir()
	if err := model.Save(dir, c, model.RandomWeights(c, r), safetensors.BF16); err != nil {
		f.Fatal(err)
	}
	cfg, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		f.Fatal(err)
	}
	st, err := os.ReadFile(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		f.Fatal(err)
	}
	tok := []byte(`{"version":"1.0","model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":["a b"]},` +
		`"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false},"decoder":{"type":"ByteLevel"}}`)
	f.Add(cfg, st, tok, "abba")
	f.Add(cfg, st[:len(st)/2], tok, "a")
	f.Add([]byte(`{"model_type":"llama","num_hidden_layers":1e12}`), st, tok, "b")
	f.Fuzz(func(t *testing.T, cfg, st, tokJSON []byte, text string) {
		dir := t.TempDir()
		for name, b := range map[string][]byte{"config.json": cfg, "model.safetensors": st, "tokenizer.json": tokJSON} {
			if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		c, err := model.LoadConfig(filepath.Join(dir, "config.json"))
		if err != nil || c.WeightBytes() > 64<<20 {
			return // refused, or too large to load here (memcheck covers that path)
		}
		m, err := model.Load(dir)
		if err != nil {
			return
		}
		tk, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
		if err != nil {
			return
		}
		ids, err := tk.Encode(text, true)
		if err != nil || len(ids) == 0 {
			return
		}
		e, err := llm.New(m, llm.Options{})
		if err != nil {
			return
		}
		cache, err := e.NewCache(len(ids))
		if err != nil {
			return
		}
		// Ids the model's vocabulary lacks are refused by Forward.
		logits, _, err := e.Forward([]engine.Cache{cache}, [][]int{ids}, false)
		if err == nil && len(logits[0]) != m.Config.VocabSize {
			t.Fatalf("%d logits for a vocabulary of %d", len(logits[0]), m.Config.VocabSize)
		}
	})
}
