package model

import (
	"fmt"
	"path/filepath"

	"github.com/twell-ai/twell/safetensors"
)

// Model is what a Llama-style model is: its configuration and its float32
// weights. It holds no engine state; an engine (package cpu/llm or gpu/llm)
// runs it.
type Model struct {
	Config  Config
	Weights *Weights
}

// New pairs config c with weights w, checking that the config is valid and
// that w has the config's layers and tensor sizes.
func New(c Config, w *Weights) (*Model, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if w == nil {
		return nil, fmt.Errorf("model: %s: no weights", c.name())
	}
	if len(w.Layers) != c.NumHiddenLayers {
		return nil, fmt.Errorf("model: weights have %d layers, config says %d", len(w.Layers), c.NumHiddenLayers)
	}
	if c.TieWordEmbeddings != (w.LMHead == nil) {
		return nil, fmt.Errorf("model: tie_word_embeddings is %v but the weights %s an lm_head", c.TieWordEmbeddings, map[bool]string{true: "have", false: "lack"}[w.LMHead != nil])
	}
	for _, s := range w.specs(c) {
		if n := product(s.shape); len(*s.dst) != n {
			return nil, fmt.Errorf("model: tensor %q holds %d values, want %d (shape %v)", s.name, len(*s.dst), n, s.shape)
		}
	}
	return &Model{Config: c, Weights: w}, nil
}

func product(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

// Load reads a Hugging Face style checkpoint directory: config.json and
// model.safetensors (or a sharded index).
func Load(dir string) (*Model, error) {
	c, err := LoadConfig(filepath.Join(dir, ConfigFileName))
	if err != nil {
		return nil, err
	}
	ck, err := safetensors.OpenDir(dir)
	if err != nil {
		return nil, err
	}
	defer ck.Close()
	w, err := LoadWeights(c, ck)
	if err != nil {
		return nil, err
	}
	return New(c, w)
}
