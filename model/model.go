package model

import (
	"fmt"
	"path/filepath"
	"sync"

	"github.com/twell-ai/twell/safetensors"
)

// Model is what a Llama-style model is: its configuration and its float32
// weights. It holds no engine state; an engine (package cpu/llm or gpu/llm)
// runs it. A model from LoadDeferred holds its layers' matrices only once
// Layer has read them: engines read each layer through Layer.
type Model struct {
	Config  Config
	Weights *Weights
	// deferred is the checkpoint that the layers' matrices are still in,
	// for a model from LoadDeferred; nil otherwise.
	deferred *deferredLayers
}

// deferredLayers is the checkpoint a model from LoadDeferred reads its
// layers' matrices from, one layer at a time.
type deferredLayers struct {
	mu   sync.Mutex
	ck   *safetensors.Checkpoint // nil once every layer was read (or Close)
	read []bool                  // which layers were read
	left int                     // layers not read yet
	bf16 bool                    // every matrix left is stored in bf16
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

// LoadDeferred is Load for a job that only runs the model: it checks every
// tensor as Load does (names, shapes, finite values) and reads the
// embeddings, norms and LM head, but leaves each layer's projection and MLP
// matrices in the memory-mapped checkpoint until Layer asks for that layer
// (an engine packing it), so that an engine that converts and then drops
// them (cpu/llm's ReleaseWeights) never holds the whole model in float32.
// Until then Weights.Layers hold the norms only. The checkpoint is closed
// once every layer was read, or by Close.
func LoadDeferred(dir string) (*Model, error) {
	c, ck, err := openCheckpoint(dir)
	if err != nil {
		return nil, err
	}
	w, layersBF16, err := loadWeights(c, ck, true)
	if err != nil {
		ck.Close()
		return nil, err
	}
	if err := c.Validate(); err != nil {
		ck.Close()
		return nil, err
	}
	d := &deferredLayers{ck: ck, read: make([]bool, c.NumHiddenLayers), left: c.NumHiddenLayers, bf16: layersBF16}
	if d.left == 0 {
		ck.Close()
		d.ck = nil
	}
	return &Model{Config: c, Weights: w, deferred: d}, nil
}

// Layer returns layer i's weights, reading its matrices from the checkpoint
// first when LoadDeferred left them there. An engine may drop them after
// use (set them to nil); a deferred layer is read once, so asking again
// then is an error.
func (m *Model) Layer(i int) (*LayerWeights, error) {
	if i < 0 || i >= len(m.Weights.Layers) {
		return nil, fmt.Errorf("model: layer %d of %d", i, len(m.Weights.Layers))
	}
	d := m.deferred
	if d == nil {
		return &m.Weights.Layers[i], nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.read[i] {
		if m.Weights.Layers[i].Q == nil {
			return nil, fmt.Errorf("model: layer %d was read from the checkpoint once and dropped since", i)
		}
		return &m.Weights.Layers[i], nil
	}
	if d.ck == nil {
		return nil, fmt.Errorf("model: layer %d: the checkpoint was closed before it was read", i)
	}
	for _, s := range m.Weights.specs(m.Config) {
		if s.layer != i {
			continue
		}
		t, err := d.ck.Tensor(s.name) // checked by LoadDeferred
		if err != nil {
			return nil, err
		}
		if *s.dst, err = t.Float32(); err != nil {
			return nil, err
		}
	}
	d.read[i] = true
	if d.left--; d.left == 0 {
		err := d.ck.Close()
		d.ck = nil
		if err != nil {
			return nil, err
		}
	}
	return &m.Weights.Layers[i], nil
}

// Deferred reports whether some layer is still in the checkpoint that
// LoadDeferred left it in.
func (m *Model) Deferred() bool {
	d := m.deferred
	if d == nil {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.left > 0
}

// DeferredBF16 reports whether every layer matrix LoadDeferred left in the
// checkpoint is stored in bf16 (true when none was left).
func (m *Model) DeferredBF16() bool { return m.deferred == nil || m.deferred.bf16 }

// Close releases the checkpoint of a model from LoadDeferred whose layers
// were not all read; it does nothing for others.
func (m *Model) Close() error {
	d := m.deferred
	if d == nil {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ck == nil {
		return nil
	}
	err := d.ck.Close()
	d.ck = nil
	return err
}

// openCheckpoint reads the config of the checkpoint folder dir and opens
// its weights.
func openCheckpoint(dir string) (Config, *safetensors.Checkpoint, error) {
	c, err := LoadConfig(filepath.Join(dir, ConfigFileName))
	if err != nil {
		return c, nil, err
	}
	ck, err := safetensors.OpenDir(dir)
	return c, ck, err
}

// Load reads a Hugging Face style checkpoint directory: config.json and
// model.safetensors (or a sharded index).
func Load(dir string) (*Model, error) {
	c, ck, err := openCheckpoint(dir)
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
