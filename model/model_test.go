package model

import (
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
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

func TestLoadErrorsNameTheTensor(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 5))
	c := tinyConfig()
	w := RandomWeights(c, r)
	dir := saveModel(t, c, w)
	// Wrong shape: save a config with a different MLP width over the same weights.
	bad := c
	bad.IntermediateSize = 256
	saveConfig(t, dir, bad)
	_, err := Load(dir)
	if err == nil || !strings.Contains(err.Error(), "model.layers.0.mlp.up_proj.weight") || !strings.Contains(err.Error(), "want [256 64]") {
		t.Fatalf("wrong shape: err = %v", err)
	}
	// Missing tensor: a config with one more layer.
	bad = c
	bad.NumHiddenLayers = 3
	saveConfig(t, dir, bad)
	if _, err := Load(dir); err == nil || !strings.Contains(err.Error(), `"model.layers.2.input_layernorm.weight" missing`) {
		t.Fatalf("missing tensor: err = %v", err)
	}
	// Extra tensor: a config with one layer fewer.
	bad = c
	bad.NumHiddenLayers = 1
	saveConfig(t, dir, bad)
	if _, err := Load(dir); err == nil || !strings.Contains(err.Error(), "model.layers.1.") {
		t.Fatalf("extra tensor: err = %v", err)
	}
	os.Remove(filepath.Join(dir, "model.safetensors"))
	saveConfig(t, dir, c)
	if _, err := Load(dir); err == nil {
		t.Fatal("missing weights file accepted")
	}
}

// TestLoadRefusesNonFiniteWeights: a NaN or infinite weight is an error
// naming the tensor, not a model that prints garbage.
func TestLoadRefusesNonFiniteWeights(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	for _, bad := range []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))} {
		w := RandomWeights(c, r)
		i := r.IntN(len(w.Layers[1].Down))
		w.Layers[1].Down[i] = bad
		dir := saveModel(t, c, w)
		_, err := Load(dir)
		if err == nil || !strings.Contains(err.Error(), "model.layers.1.mlp.down_proj.weight") {
			t.Fatalf("seed %d: weight %d = %v: err = %v, want one naming the tensor", seed, i, bad, err)
		}
	}
}

// TestLoadRefusesWhatCannotFit: a config whose weights could never fit is
// refused before anything is allocated, with both figures.
func TestLoadRefusesWhatCannotFit(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 3))
	c := tinyConfig()
	dir := t.TempDir()
	if err := Save(dir, c, RandomWeights(c, r), safetensors.BF16); err != nil {
		t.Fatal(err)
	}
	huge := c
	huge.NumHiddenLayers = 1e12
	saveConfig(t, dir, huge)
	_, err := Load(dir)
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
