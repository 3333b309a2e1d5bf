package model

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// sparseLMJSON is shaped like the public SparseLM config.json, including its wrong
// hidden_act and fields twell does not model.
const sparseLMJSON = `{
  "_name_or_path": "SakanaAI/SparseLM-1.5B",
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 0,
  "eos_token_id": 0,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 5632,
  "max_position_embeddings": 2048,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 28,
  "num_key_value_heads": 32,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 10000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.44.2",
  "use_cache": true,
  "vocab_size": 49152
}`

func TestParseSparseLM(t *testing.T) {
	c := mustParse(t, sparseLMJSON)
	want := SparseLM1B5()
	want.HiddenAct = ActSiLU // as the file says
	want.NameOrPath = "SakanaAI/SparseLM-1.5B"
	extra := c.Extra
	c.Extra = nil
	if !reflect.DeepEqual(c, want) {
		t.Errorf("parsed\n%+v\nwant\n%+v", c, want)
	}
	for _, k := range []string{"initializer_range", "pretraining_tp", "transformers_version", "use_cache", "attention_dropout"} {
		if _, ok := extra[k]; !ok {
			t.Errorf("Extra lacks %q", k)
		}
	}
	if act, why := c.GateActivation(); act != ActReLU || !strings.Contains(why, "_name_or_path") {
		t.Errorf("GateActivation = %q (%s), want relu because of _name_or_path", act, why)
	}
	if err := c.TwELLCompatible(); err != nil {
		t.Error(err)
	}
}

// transformers5JSON is what transformers 5.17 save_pretrained wrote for a tiny model whose
// config twell had saved: rope_parameters and dtype replace rope_theta and torch_dtype.
const transformers5JSON = `{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 0,
  "dtype": "float32",
  "eos_token_id": 0,
  "head_dim": 16,
  "hidden_act": "relu",
  "hidden_size": 64,
  "initializer_range": 0.02,
  "intermediate_size": 256,
  "max_position_embeddings": 64,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 4,
  "num_hidden_layers": 2,
  "num_key_value_heads": 2,
  "pad_token_id": null,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
  "tie_word_embeddings": true,
  "transformers_version": "5.17.0",
  "use_cache": true,
  "vocab_size": 128
}`

func TestParseTransformers5(t *testing.T) {
	c := mustParse(t, transformers5JSON)
	if c.RopeTheta != 10000 || c.RopeScaling != nil || c.TorchDType != "float32" || c.HeadDim != 16 || c.NumKeyValueHeads != 2 || !c.TieWordEmbeddings {
		t.Errorf("parsed %+v", c)
	}
	if act, _ := c.GateActivation(); act != ActReLU {
		t.Errorf("activation %q", act)
	}
	if _, ok := c.Extra["rope_parameters"]; ok {
		t.Error("rope_parameters kept in Extra")
	}
}

func TestDefaultsFollowLlamaConfig(t *testing.T) {
	for _, in := range []string{`{}`, `{"num_key_value_heads": null, "head_dim": null, "rope_theta": null, "hidden_act": null}`} {
		c := mustParse(t, in)
		if c.HiddenSize != 4096 || c.IntermediateSize != 11008 || c.NumHiddenLayers != 32 || c.NumAttentionHeads != 32 ||
			c.NumKeyValueHeads != 32 || c.HeadDim != 128 || c.VocabSize != 32000 || c.MaxPositionEmbeddings != 2048 ||
			c.RMSNormEps != 1e-6 || c.RopeTheta != 10000 || c.HiddenAct != ActSiLU || c.TieWordEmbeddings ||
			!c.MLPGated || c.RopeScaling != nil || *c.BOSTokenID != 1 || !reflect.DeepEqual(c.EOSTokenIDs, []int{2}) || c.ModelType != "llama" {
			t.Errorf("%s: defaults %+v", in, c)
		}
	}
	c := mustParse(t, `{"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "bos_token_id": null, "eos_token_id": [5, 7], "mlp_gated": false}`)
	if c.HeadDim != 128 || c.NumKeyValueHeads != 2 || c.BOSTokenID != nil || !reflect.DeepEqual(c.EOSTokenIDs, []int{5, 7}) || c.MLPGated {
		t.Errorf("parsed %+v", c)
	}
}

func TestRopeScaling(t *testing.T) {
	llama3 := `{"rope_theta": 500000.0, "max_position_embeddings": 131072, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}`
	want := &RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositionEmbeddings: 8192}
	for _, in := range []string{
		llama3,
		// transformers 5 writes rope_parameters instead of rope_theta + rope_scaling.
		`{"max_position_embeddings": 131072, "rope_parameters": {"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}`,
	} {
		c := mustParse(t, in)
		if !reflect.DeepEqual(c.RopeScaling, want) || c.RopeTheta != 500000 {
			t.Errorf("%s: rope %+v theta %v", in, c.RopeScaling, c.RopeTheta)
		}
	}
	for in, want := range map[string]*RopeScaling{
		`{"rope_scaling": {"type": "linear", "factor": 2.0}}`:                                          {Type: "linear", Factor: 2},
		`{"rope_scaling": {"type": "linear", "rope_type": "dynamic", "factor": 4}}`:                    {Type: "dynamic", Factor: 4},
		`{"rope_scaling": {"rope_type": "default"}}`:                                                   nil,
		`{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}`:                         nil,
		`{"rope_scaling": {"rope_type": "linear", "factor": 2}, "rope_parameters": {"rope_theta": 7}}`: {Type: "linear", Factor: 2},
	} {
		c, err := ParseConfig([]byte(in))
		if err != nil {
			t.Errorf("%s: %v", in, err)
			continue
		}
		if !reflect.DeepEqual(c.RopeScaling, want) {
			t.Errorf("%s: rope %+v, want %+v", in, c.RopeScaling, want)
		}
	}
}

func TestConfigErrors(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{`[]`, "config.json: not a JSON object"},
		{`{"num_attention_heads": 0}`, "config.json: num_attention_heads 0 must be positive"},
		{`{"hidden_size": -1}`, "hidden_size -1 must be positive"},
		{`{"intermediate_size": 0}`, "intermediate_size 0 must be positive"},
		{`{"num_hidden_layers": 0}`, "num_hidden_layers 0 must be positive"},
		{`{"vocab_size": 0}`, "vocab_size 0 must be positive"},
		{`{"num_key_value_heads": 0}`, "num_key_value_heads 0 must be positive"},
		{`{"max_position_embeddings": 0}`, "max_position_embeddings 0 must be positive"},
		{`{"hidden_size": 100, "num_attention_heads": 3}`, "hidden_size 100 is not divisible by num_attention_heads 3"},
		{`{"num_attention_heads": 32, "num_key_value_heads": 5}`, "num_attention_heads 32 is not divisible by num_key_value_heads 5"},
		{`{"head_dim": 0}`, "head_dim 0 must be positive"},
		{`{"head_dim": 63}`, "head_dim 63 must be even"},
		{`{"rms_norm_eps": 0}`, "rms_norm_eps 0 must be positive"},
		{`{"rope_theta": -1}`, "rope_theta -1 must be positive"},
		{`{"mlp_bias": true}`, "mlp_bias true is not supported"},
		{`{"attention_bias": true}`, "attention_bias true is not supported"},
		{`{"hidden_act": "gelu"}`, `hidden_act "gelu" is not supported`},
		{`{"twell_hidden_act": "tanh"}`, `twell_hidden_act "tanh" is not supported`},
		{`{"model_type": "qwen2"}`, `model_type "qwen2" is not supported`},
		{`{"eos_token_id": 32000}`, "eos_token_id 32000 is outside the vocabulary"},
		{`{"bos_token_id": -1}`, "bos_token_id -1 is outside the vocabulary"},
		{`{"hidden_size": "2048"}`, `hidden_size: want an integer, got "2048"`},
		{`{"hidden_size": 2048.5}`, "hidden_size: want an integer, got 2048.5"},
		{`{"hidden_size": 1e300}`, "hidden_size: want an integer"},
		{`{"rms_norm_eps": "tiny"}`, "rms_norm_eps: want a number"},
		{`{"tie_word_embeddings": 1}`, "tie_word_embeddings: want true or false"},
		{`{"eos_token_id": [1, "x"]}`, "eos_token_id: want an integer"},
		{`{"eos_token_id": {}}`, "eos_token_id: want an integer"},
		{`{"architectures": "LlamaForCausalLM"}`, "architectures: want a list of strings"},
		{`{"rope_scaling": 2}`, "rope_scaling: want an object or null"},
		{`{"rope_scaling": {"factor": 2}}`, "rope_scaling: has no rope_type"},
		{`{"rope_scaling": {"rope_type": "yarn", "factor": 2}}`, `rope_scaling type "yarn" is not supported`},
		{`{"rope_scaling": {"rope_type": "linear", "factor": 0.5}}`, "rope_scaling factor 0.5 must be"},
		{`{"rope_scaling": {"rope_type": "linear", "factor": "2"}}`, "rope_scaling.factor: want a number"},
		{`{"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1, "original_max_position_embeddings": 8192}}`, "high_freq_factor 1 must exceed low_freq_factor 4"},
		{`{"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}}`, "original_max_position_embeddings 0 must be positive"},
		{`{"rope_parameters": []}`, "rope_parameters: want an object"},
	} {
		_, err := ParseConfig([]byte(c.in))
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.HasPrefix(err.Error(), "config.json: ") {
			t.Errorf("%s: error %v, want %q", c.in, err, c.want)
		}
	}
	dir := t.TempDir()
	p := filepath.Join(dir, "config.json")
	if err := os.WriteFile(p, []byte(`{"num_attention_heads": 0}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadConfig(dir); err == nil || !strings.HasPrefix(err.Error(), p+": num_attention_heads 0") {
		t.Errorf("LoadConfig error %v, want it to start with the path", err)
	}
	if _, err := LoadConfig(filepath.Join(dir, "missing.json")); err == nil || !strings.Contains(err.Error(), "missing.json") {
		t.Errorf("LoadConfig of a missing file: %v", err)
	}
}

// randomConfig returns a valid config with random sizes and options.
func randomConfig(rng *rand.Rand) Config {
	c := SparseLM1B5()
	kv := 1 + rng.IntN(4)
	c.NumKeyValueHeads = kv
	c.NumAttentionHeads = kv * (1 + rng.IntN(4))
	c.HeadDim = 2 * (1 + rng.IntN(64))
	c.HiddenSize = c.NumAttentionHeads * c.HeadDim
	if rng.IntN(4) == 0 {
		c.HiddenSize = 8 * (1 + rng.IntN(300)) // head_dim independent of hidden_size
	}
	c.IntermediateSize = 1 + rng.IntN(20000)
	c.NumHiddenLayers = 1 + rng.IntN(40)
	c.VocabSize = 1 + rng.IntN(200000)
	c.MaxPositionEmbeddings = 1 + rng.IntN(1<<17)
	c.RMSNormEps = rng.Float64() * 1e-4
	if c.RMSNormEps == 0 {
		c.RMSNormEps = 1e-6
	}
	c.RopeTheta = 1 + rng.Float64()*1e7
	c.TieWordEmbeddings = rng.IntN(2) == 0
	c.MLPGated = rng.IntN(2) == 0
	c.HiddenAct = []string{ActReLU, ActSiLU}[rng.IntN(2)]
	c.BOSTokenID = nil
	if rng.IntN(2) == 0 {
		b := rng.IntN(c.VocabSize)
		c.BOSTokenID = &b
	}
	c.EOSTokenIDs = nil
	for range rng.IntN(3) {
		c.EOSTokenIDs = append(c.EOSTokenIDs, rng.IntN(c.VocabSize))
	}
	switch rng.IntN(4) {
	case 1:
		c.RopeScaling = &RopeScaling{Type: "linear", Factor: 1 + rng.Float64()*7}
	case 2:
		c.RopeScaling = &RopeScaling{Type: "dynamic", Factor: 1 + rng.Float64()*7}
	case 3:
		c.RopeScaling = &RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 1 + rng.Float64()*4, OriginalMaxPositionEmbeddings: 1 + rng.IntN(8192)}
	}
	c.TorchDType = []string{"", "bfloat16", "float32"}[rng.IntN(3)]
	c.Extra = map[string]json.RawMessage{"use_cache": json.RawMessage(`true`), "transformers_version": json.RawMessage(`"4.44.2"`)}
	return c
}

func TestSaveLoadRoundTrip(t *testing.T) {
	rng, seed := testutil.Rand(t)
	dir := t.TempDir()
	for i := range 200 {
		c := randomConfig(rng)
		if err := c.Validate(); err != nil {
			t.Fatalf("seed %d: random config invalid: %v", seed, err)
		}
		if err := c.Save(dir); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		got, err := LoadConfig(dir)
		if err != nil {
			t.Fatalf("seed %d: config %d: %v", seed, i, err)
		}
		c.Source = filepath.Join(dir, ConfigFileName)
		if !reflect.DeepEqual(normalize(got), normalize(c)) {
			t.Fatalf("seed %d: config %d round trip:\n got %+v\nwant %+v", seed, i, got, c)
		}
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Errorf("directory holds %d entries, want only config.json", len(ents))
	}
}

// normalize makes configs comparable: Extra values compared as compact JSON, nil slices.
func normalize(c Config) Config {
	extra := map[string]json.RawMessage{}
	for k, v := range c.Extra {
		var x any
		json.Unmarshal(v, &x)
		b, _ := json.Marshal(x)
		extra[k] = b
	}
	c.Extra = extra
	if len(c.EOSTokenIDs) == 0 {
		c.EOSTokenIDs = nil
	}
	return c
}

func TestSaveFormat(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.json")
	c := SparseLM1B5()
	c.MLPGated = false
	if err := c.Save(p); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"rms_norm_eps": 1e-05,`, `"rope_theta": 10000.0,`, `"hidden_act": "relu",`, `"mlp_gated": false,`,
		`"architectures": [`, `"eos_token_id": 0,`, `"rope_scaling": null,`, `"tie_word_embeddings": true,`, `"torch_dtype": "bfloat16"`} {
		if !strings.Contains(string(b), want) {
			t.Errorf("saved config lacks %s:\n%s", want, b)
		}
	}
	c.NumAttentionHeads = 0
	if err := c.Save(p); err == nil {
		t.Error("Save of an invalid config succeeded")
	}
	if got, _ := os.ReadFile(p); string(got) != string(b) {
		t.Error("failed Save changed the file")
	}
	for v, want := range map[float64]string{1e-5: "1e-05", 1e-6: "1e-06", 0.0001: "0.0001", 500000: "500000.0", 1e6: "1000000.0", 1e16: "1e+16", 0.5: "0.5"} {
		if got, _ := pyFloat(v).MarshalJSON(); string(got) != want {
			t.Errorf("pyFloat(%v) = %s, want %s", v, got, want)
		}
	}
}

func TestSaveMakesSparseLMExplicit(t *testing.T) {
	// A SparseLM config that says silu is saved with the activation the model really uses.
	c := mustParse(t, sparseLMJSON)
	p := filepath.Join(t.TempDir(), "config.json")
	if err := c.Save(p); err != nil {
		t.Fatal(err)
	}
	c2, err := LoadConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	if c2.HiddenAct != ActReLU {
		t.Errorf("saved hidden_act %q, want relu", c2.HiddenAct)
	}
}

func TestGateActivation(t *testing.T) {
	root := t.TempDir()
	mk := func(rel, body string) string {
		p := filepath.Join(root, rel, ConfigFileName)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return filepath.Dir(p)
	}
	silu := `{"hidden_act": "silu"}`
	for _, c := range []struct {
		dir, override, want, why string
	}{
		{mk("plain", silu), "", ActSiLU, "hidden_act"},
		{mk("relu-model", `{"hidden_act": "relu"}`), "", ActReLU, "hidden_act"},
		{mk("SparseLM-1.5B", silu), "", ActReLU, `directory "SparseLM-1.5B"`},
		{mk("hub/models--Org--sparselm-1.5b/snapshots/0123abcd", silu), "", ActReLU, "cached repository"},
		// Only the checkpoint's own directory counts, not the folders above it.
		{mk("sparselm-experiments/dense-baseline", silu), "", ActSiLU, "hidden_act"},
		{mk("hinted", `{"hidden_act": "silu", "twell_hidden_act": "relu"}`), "", ActReLU, "twell_hidden_act"},
		{mk("SparseLM-override", silu), ActSiLU, ActSiLU, "override"},
	} {
		cfg, err := LoadConfig(c.dir)
		if err != nil {
			t.Fatal(err)
		}
		cfg.ActOverride = c.override
		act, why := cfg.GateActivation()
		if act != c.want || !strings.Contains(why, c.why) {
			t.Errorf("%s: GateActivation = %q (%s), want %q (%s)", c.dir, act, why, c.want, c.why)
		}
	}
	c := SparseLM1B5()
	c.ActOverride = "gelu"
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), `activation override "gelu"`) {
		t.Errorf("bad override: %v", err)
	}
}

func TestTwELLCompatible(t *testing.T) {
	c := SparseLM1B5()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if err := c.TwELLCompatible(); err != nil {
		t.Fatal(err)
	}
	c.IntermediateSize = 5000
	if err := c.Validate(); err != nil {
		t.Errorf("intermediate_size 5000 should be valid (dense fallback): %v", err)
	}
	if err := c.TwELLCompatible(); err == nil || !strings.Contains(err.Error(), "intermediate_size 5000 is not a multiple of the TwELL tile width 256") {
		t.Errorf("TwELLCompatible = %v", err)
	}
	c = SparseLM1B5()
	c.HiddenAct = ActSiLU
	if err := c.TwELLCompatible(); err == nil || !strings.Contains(err.Error(), `gate activation "silu"`) {
		t.Errorf("TwELLCompatible = %v", err)
	}
}

func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(sparseLMJSON))
	f.Add([]byte(`{}`))
	f.Add([]byte(`{"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}, "eos_token_id": [1, 2]}`))
	f.Add([]byte(`{"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "head_dim": 64, "bos_token_id": null}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseConfig(data)
		if err != nil {
			return
		}
		// An accepted config survives Save and a re-parse unchanged.
		b, err := json.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		c2, err := ParseConfig(b)
		if err != nil {
			t.Fatalf("re-parse of %s: %v", b, err)
		}
		a1, _ := c.GateActivation()
		c.HiddenAct = a1 // Save writes the resolved activation
		if !reflect.DeepEqual(normalize(c), normalize(c2)) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", c2, c)
		}
	})
}

func ExampleParseConfig() {
	c, err := ParseConfig([]byte(`{"_name_or_path": "org/SparseLM-1.5B", "hidden_act": "silu", "hidden_size": 2048,
		"intermediate_size": 5632, "num_attention_heads": 32, "num_hidden_layers": 28, "vocab_size": 49152}`))
	if err != nil {
		fmt.Println(err)
		return
	}
	act, why := c.GateActivation()
	fmt.Println(c.HeadDim, c.NumKeyValueHeads, act)
	fmt.Println(why)
	fmt.Println(c.TwELLCompatible())
	_, err = ParseConfig([]byte(`{"num_attention_heads": 0}`))
	fmt.Println(err)
	// Output:
	// 64 32 relu
	// SparseLM checkpoint (_name_or_path "org/SparseLM-1.5B"); its hidden_act "silu" is ignored
	// <nil>
	// config.json: num_attention_heads 0 must be positive
}

// mustParse is ParseConfig, failing the test on an error.
func mustParse(t *testing.T, js string) Config {
	t.Helper()
	c, err := ParseConfig([]byte(js))
	if err != nil {
		t.Fatal(err)
	}
	return c
}
