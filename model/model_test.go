package model

import (
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/safetensors"
)

func tinyConfig() Config {
	bos := 1
	return Config{
		ModelType: "llama", Architectures: []string{"LlamaForCausalLM"},
		HiddenSize: 64, IntermediateSize: 512, NumHiddenLayers: 2,
		NumAttentionHeads: 4, NumKeyValueHeads: 2, HeadDim: 16,
		VocabSize: 97, MaxPositionEmbeddings: 128, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: ActReLU, TieWordEmbeddings: true, MLPGated: true,
		BOSTokenID: &bos, EOSTokenIDs: []int{2}, TorchDType: "float32",
	}
}

// loaders are the two ways to load a checkpoint; both check every tensor.
var loaders = map[string]func(string) (*Model, error){"Load": Load, "LoadDeferred": LoadDeferred}

func TestLoadErrorsNameTheTensor(t *testing.T) {
	for name, load := range loaders {
		t.Run(name, func(t *testing.T) { testLoadErrors(t, load) })
	}
}

func testLoadErrors(t *testing.T, load func(string) (*Model, error)) {
	r := rand.New(rand.NewPCG(5, 5))
	c := tinyConfig()
	w := RandomWeights(c, r)
	dir := saveModel(t, c, w)
	// Wrong shape: save a config with a different MLP width over the same weights.
	bad := c
	bad.IntermediateSize = 256
	saveConfig(t, dir, bad)
	_, err := load(dir)
	if err == nil || !strings.Contains(err.Error(), "model.layers.0.mlp.up_proj.weight") || !strings.Contains(err.Error(), "want [256 64]") {
		t.Fatalf("wrong shape: err = %v", err)
	}
	// Missing tensor: a config with one more layer.
	bad = c
	bad.NumHiddenLayers = 3
	saveConfig(t, dir, bad)
	if _, err := load(dir); err == nil || !strings.Contains(err.Error(), `"model.layers.2.input_layernorm.weight" missing`) {
		t.Fatalf("missing tensor: err = %v", err)
	}
	// Extra tensor: a config with one layer fewer.
	bad = c
	bad.NumHiddenLayers = 1
	saveConfig(t, dir, bad)
	if _, err := load(dir); err == nil || !strings.Contains(err.Error(), "model.layers.1.") {
		t.Fatalf("extra tensor: err = %v", err)
	}
	os.Remove(filepath.Join(dir, "model.safetensors"))
	saveConfig(t, dir, c)
	if _, err := load(dir); err == nil {
		t.Fatal("missing weights file accepted")
	}
}

// TestLoadRefusesNonFiniteWeights: a NaN or infinite weight is an error
// naming the tensor, not a model that prints garbage.
func TestLoadRefusesNonFiniteWeights(t *testing.T) {
	for name, load := range loaders {
		t.Run(name, func(t *testing.T) { testNonFinite(t, load) })
	}
}

func testNonFinite(t *testing.T, load func(string) (*Model, error)) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	for _, bad := range []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))} {
		w := RandomWeights(c, r)
		i := r.IntN(len(w.Layers[1].Down))
		w.Layers[1].Down[i] = bad
		dir := saveModel(t, c, w)
		_, err := load(dir)
		if err == nil || !strings.Contains(err.Error(), "model.layers.1.mlp.down_proj.weight") {
			t.Fatalf("seed %d: weight %d = %v: err = %v, want one naming the tensor", seed, i, bad, err)
		}
	}
}

// TestLoadRefusesWhatCannotFit: a config whose weights could never fit is
// refused before anything is allocated, with both figures.
func TestLoadRefusesWhatCannotFit(t *testing.T) {
	for name, load := range loaders {
		t.Run(name, func(t *testing.T) { testCannotFit(t, load) })
	}
}

func testCannotFit(t *testing.T, load func(string) (*Model, error)) {
	r := rand.New(rand.NewPCG(3, 3))
	c := tinyConfig()
	dir := t.TempDir()
	if err := Save(dir, c, RandomWeights(c, r), safetensors.BF16); err != nil {
		t.Fatal(err)
	}
	huge := c
	huge.NumHiddenLayers = 1e12
	saveConfig(t, dir, huge)
	_, err := load(dir)
	if err == nil || !strings.Contains(err.Error(), "memory") {
		t.Fatalf("10^12 layers: err = %v, want a memory estimate", err)
	}
	if got := huge.ParamCount(); got <= 0 {
		t.Errorf("ParamCount overflowed: %d", got)
	}
}

// saveModel saves c and w as a bf16 checkpoint in a fresh folder and
// returns the folder.
func saveModel(t *testing.T, c Config, w *Weights) string {
	t.Helper()
	dir := t.TempDir()
	if err := Save(dir, c, w, safetensors.BF16); err != nil {
		t.Fatal(err)
	}
	return dir
}

// saveConfig writes c over the config.json of the checkpoint in dir.
func saveConfig(t *testing.T, dir string, c Config) {
	t.Helper()
	if err := c.Save(filepath.Join(dir, "config.json")); err != nil {
		t.Fatal(err)
	}
}

// TestLoadDeferred: a deferred model holds its layers' matrices only once
// asked, gives the values Load gives, closes the checkpoint after the last
// layer, and says so when a dropped layer is asked for again.
func TestLoadDeferred(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	c.TieWordEmbeddings = r.IntN(2) == 0
	for _, dt := range []safetensors.DType{safetensors.BF16, safetensors.F32} {
		w := RandomWeights(c, r)
		dir := t.TempDir()
		if err := Save(dir, c, w, dt); err != nil {
			t.Fatal(err)
		}
		full, err := Load(dir)
		if err != nil {
			t.Fatal(err)
		}
		m, err := LoadDeferred(dir)
		if err != nil {
			t.Fatal(err)
		}
		if !m.Deferred() || m.DeferredBF16() != (dt == safetensors.BF16) {
			t.Fatalf("seed %d: %s: deferred %v, bf16 %v", seed, dt, m.Deferred(), m.DeferredBF16())
		}
		if !slices.Equal(m.Weights.Embed, full.Weights.Embed) || !slices.Equal(m.Weights.LMHead, full.Weights.LMHead) || !slices.Equal(m.Weights.Norm, full.Weights.Norm) {
			t.Fatalf("seed %d: %s: embeddings, head or norm differ from Load's", seed, dt)
		}
		for i := range m.Weights.Layers {
			l := &m.Weights.Layers[i]
			if l.Q != nil || l.Up != nil || l.AttnNorm == nil {
				t.Fatalf("seed %d: %s: layer %d read before it was asked for, or its norm not", seed, dt, i)
			}
		}
		order := r.Perm(c.NumHiddenLayers)
		for k, i := range order {
			got, err := m.Layer(i)
			if err != nil {
				t.Fatal(err)
			}
			want := full.Weights.Layers[i]
			for _, p := range [][2][]float32{{got.Q, want.Q}, {got.K, want.K}, {got.V, want.V}, {got.O, want.O}, {got.Gate, want.Gate}, {got.Up, want.Up}, {got.Down, want.Down}, {got.MLPNorm, want.MLPNorm}} {
				if !slices.Equal(p[0], p[1]) {
					t.Fatalf("seed %d: %s: layer %d differs from Load's", seed, dt, i)
				}
			}
			if last := k == len(order)-1; m.Deferred() == last || (m.deferred.ck == nil) != last {
				t.Fatalf("seed %d: %s: after %d layers: deferred %v, checkpoint open %v", seed, dt, k+1, m.Deferred(), m.deferred.ck != nil)
			}
		}
		m.Weights.Layers[0].Q = nil // an engine dropped it
		if _, err := m.Layer(0); err == nil || !strings.Contains(err.Error(), "dropped") {
			t.Fatalf("a dropped layer asked for again: %v", err)
		}
		if _, err := m.Layer(c.NumHiddenLayers); err == nil {
			t.Fatal("a layer past the last one was given")
		}
		m.Close()
	}
	// Closed before reading: an error, not a panic.
	dir := saveModel(t, c, RandomWeights(c, r))
	m, err := LoadDeferred(dir)
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
	if _, err := m.Layer(1); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Fatalf("a layer of a closed deferred model: %v", err)
	}
}
