// Package model is twell's sparse Llama: configuration, weights, forward and backward.
package model

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/twell-ai/twell/internal/atomicfile"
	"github.com/twell-ai/twell/twell"
)

// ConfigFileName is the standard name of a checkpoint's configuration file.
const ConfigFileName = "config.json"

// Gate activations the model implements.
const (
	ActReLU = "relu" // sparse models: exact zeros, the TwELL path
	ActSiLU = "silu" // dense Llama models
)

// TwELL packs MLP activations in tiles of this many columns with 16-bit column indices.
var (
	twellTile    = twell.DefaultLayout.Tile
	twellMaxCols = twell.MaxCols
)

// Config is the shape and hyper-parameters of a model. It reads and writes the Hugging Face
// LlamaConfig config.json: absent fields take LlamaConfig's defaults, JSON null counts as
// absent, and fields twell does not know are kept in Extra and written back by Save.
type Config struct {
	ModelType     string   // "model_type"; only "llama" is supported
	Architectures []string // "architectures", e.g. ["LlamaForCausalLM"]
	NameOrPath    string   // "_name_or_path", where the checkpoint came from (informative)

	HiddenSize            int     // "hidden_size"
	IntermediateSize      int     // "intermediate_size", the MLP width
	NumHiddenLayers       int     // "num_hidden_layers"
	NumAttentionHeads     int     // "num_attention_heads"
	NumKeyValueHeads      int     // "num_key_value_heads" (default NumAttentionHeads)
	HeadDim               int     // "head_dim" (default HiddenSize/NumAttentionHeads)
	VocabSize             int     // "vocab_size"
	MaxPositionEmbeddings int     // "max_position_embeddings"
	RMSNormEps            float64 // "rms_norm_eps"
	RopeTheta             float64 // "rope_theta" (or rope_parameters.rope_theta)
	// RopeScaling is "rope_scaling" (or a non-default "rope_parameters"); nil for plain RoPE.
	RopeScaling *RopeScaling

	// HiddenAct is "hidden_act", the MLP gate activation as the file states it. Use
	// GateActivation for the one the model must apply.
	HiddenAct         string
	TieWordEmbeddings bool   // "tie_word_embeddings": the LM head reuses the embedding
	MLPGated          bool   // "mlp_gated" (twell extension, default true): false for up/down-only MLPs
	AttentionBias     bool   // "attention_bias"; true is not supported
	MLPBias           bool   // "mlp_bias"; true is not supported
	BOSTokenID        *int   // "bos_token_id"; nil when null
	EOSTokenIDs       []int  // "eos_token_id", an integer or a list of them
	TorchDType        string // "torch_dtype" or "dtype", e.g. "bfloat16"

	// TwELLHiddenAct is "twell_hidden_act", a hint in config.json that overrides hidden_act
	// for checkpoints whose hidden_act is wrong.
	TwELLHiddenAct string

	// ActOverride, when set (e.g. from a command-line flag), overrides every other source of
	// the gate activation. It is not read from JSON.
	ActOverride string `json:"-"`
	// Source is the file the config was loaded from ("" if parsed from bytes); it names the
	// config in errors and lets GateActivation recognize SparseLM checkpoints by directory.
	Source string `json:"-"`
	// Extra holds the JSON fields Config does not model, written back unchanged by Save.
	Extra map[string]json.RawMessage `json:"-"`
}

// RopeScaling is Hugging Face's rope_scaling object.
type RopeScaling struct {
	Type                          string  // "rope_type" (or legacy "type"): "linear", "dynamic" or "llama3"
	Factor                        float64 // "factor"
	LowFreqFactor                 float64 // "low_freq_factor" (llama3)
	HighFreqFactor                float64 // "high_freq_factor" (llama3)
	OriginalMaxPositionEmbeddings int     // "original_max_position_embeddings" (llama3, optional for dynamic)
}

// SparseLM1B5 returns the configuration of the 1.5B-parameter sparse Llama of the TwELL
// work (the public SparseLM checkpoints): ReLU gate, tied embeddings, a 49152-token vocabulary.
// The token ids assume that vocabulary's <|endoftext|> (id 0) opens and ends documents; a
// checkpoint's own config.json takes precedence.
func SparseLM1B5() Config {
	bos := 0
	return Config{
		ModelType:             "llama",
		Architectures:         []string{"LlamaForCausalLM"},
		HiddenSize:            2048,
		IntermediateSize:      5632,
		NumHiddenLayers:       28,
		NumAttentionHeads:     32,
		NumKeyValueHeads:      32,
		HeadDim:               64,
		VocabSize:             49152,
		MaxPositionEmbeddings: 2048,
		RMSNormEps:            1e-5,
		RopeTheta:             10000,
		HiddenAct:             ActReLU,
		TieWordEmbeddings:     true,
		MLPGated:              true,
		BOSTokenID:            &bos,
		EOSTokenIDs:           []int{0},
		TorchDType:            "bfloat16",
	}
}

// LoadConfig reads and validates a config.json; path may also be the checkpoint directory.
func LoadConfig(path string) (Config, error) {
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		path = filepath.Join(path, ConfigFileName)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("model: %w", err)
	}
	return parseConfig(path, data)
}

// ParseConfig parses and validates the contents of a config.json.
func ParseConfig(data []byte) (Config, error) { return parseConfig("", data) }

func parseConfig(source string, data []byte) (Config, error) {
	c := Config{Source: source}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(data, &raw); err != nil {
		return Config{}, fmt.Errorf("%s: not a JSON object: %w", c.name(), err)
	}
	// LlamaConfig's defaults.
	c.ModelType, c.HiddenSize, c.IntermediateSize, c.NumHiddenLayers = "llama", 4096, 11008, 32
	c.NumAttentionHeads, c.VocabSize, c.MaxPositionEmbeddings = 32, 32000, 2048
	c.RMSNormEps, c.RopeTheta, c.HiddenAct, c.MLPGated = 1e-6, 10000, ActSiLU, true
	bos := 1
	c.BOSTokenID, c.EOSTokenIDs = &bos, []int{2}

	p := fieldParser{name: c.name(), raw: raw}
	p.str("model_type", &c.ModelType)
	p.strs("architectures", &c.Architectures)
	p.str("_name_or_path", &c.NameOrPath)
	p.int("hidden_size", &c.HiddenSize)
	p.int("intermediate_size", &c.IntermediateSize)
	p.int("num_hidden_layers", &c.NumHiddenLayers)
	p.int("num_attention_heads", &c.NumAttentionHeads)
	c.NumKeyValueHeads = c.NumAttentionHeads
	p.int("num_key_value_heads", &c.NumKeyValueHeads)
	if c.NumAttentionHeads > 0 && c.HiddenSize%c.NumAttentionHeads == 0 {
		c.HeadDim = c.HiddenSize / c.NumAttentionHeads
	}
	p.int("head_dim", &c.HeadDim)
	p.int("vocab_size", &c.VocabSize)
	p.int("max_position_embeddings", &c.MaxPositionEmbeddings)
	p.float("rms_norm_eps", &c.RMSNormEps)
	p.float("rope_theta", &c.RopeTheta)
	if r, ok := p.takeNonNull("rope_scaling"); ok {
		c.RopeScaling = p.rope("rope_scaling", r)
	}
	if r, ok := p.takeNonNull("rope_parameters"); ok { // the transformers 5 layout
		var rp struct {
			Theta *float64 `json:"rope_theta"`
		}
		if json.Unmarshal(r, &rp) != nil {
			p.fail("rope_parameters", "want an object with rope_theta, got %s", clip(r))
		} else if rp.Theta != nil {
			c.RopeTheta = *rp.Theta
		}
		if rs := p.rope("rope_parameters", r); rs != nil {
			c.RopeScaling = rs
		}
	}
	p.str("hidden_act", &c.HiddenAct)
	p.bool("tie_word_embeddings", &c.TieWordEmbeddings)
	p.bool("mlp_gated", &c.MLPGated)
	p.bool("attention_bias", &c.AttentionBias)
	p.bool("mlp_bias", &c.MLPBias)
	if raw, ok := p.take("bos_token_id"); ok {
		c.BOSTokenID = nil
		if string(raw) != "null" {
			var id int
			p.parseInt("bos_token_id", raw, &id)
			c.BOSTokenID = &id
		}
	}
	if raw, ok := p.take("eos_token_id"); ok {
		c.EOSTokenIDs = nil
		if string(raw) != "null" {
			var id int
			if len(raw) > 0 && raw[0] == '[' {
				var list []json.RawMessage
				if err := json.Unmarshal(raw, &list); err != nil {
					p.fail("eos_token_id", "want an integer or a list of integers, got %s", clip(raw))
				}
				for _, r := range list {
					p.parseInt("eos_token_id", r, &id)
					c.EOSTokenIDs = append(c.EOSTokenIDs, id)
				}
			} else {
				p.parseInt("eos_token_id", raw, &id)
				c.EOSTokenIDs = []int{id}
			}
		}
	}
	p.str("dtype", &c.TorchDType)
	p.str("torch_dtype", &c.TorchDType) // older name; wins when both are present, as in transformers 4
	p.str("twell_hidden_act", &c.TwELLHiddenAct)
	if p.err != nil {
		return Config{}, p.err
	}
	if len(p.raw) > 0 {
		c.Extra = p.raw
	}
	if err := c.Validate(); err != nil {
		return Config{}, err
	}
	return c, nil
}

// fieldParser takes known fields out of a JSON object one by one, recording the first error.
// A field that is absent or null leaves its target (the default) alone.
type fieldParser struct {
	name string
	raw  map[string]json.RawMessage
	err  error
}

func (p *fieldParser) take(key string) (json.RawMessage, bool) {
	r, ok := p.raw[key]
	delete(p.raw, key)
	return r, ok
}

func (p *fieldParser) takeNonNull(key string) (json.RawMessage, bool) {
	r, ok := p.take(key)
	return r, ok && string(r) != "null"
}

func (p *fieldParser) fail(key, format string, args ...any) {
	if p.err == nil {
		p.err = fmt.Errorf("%s: %s: %s", p.name, key, fmt.Sprintf(format, args...))
	}
}

func (p *fieldParser) str(key string, dst *string) {
	if r, ok := p.takeNonNull(key); ok && json.Unmarshal(r, dst) != nil {
		p.fail(key, "want a string, got %s", clip(r))
	}
}

func (p *fieldParser) strs(key string, dst *[]string) {
	if r, ok := p.takeNonNull(key); ok && json.Unmarshal(r, dst) != nil {
		p.fail(key, "want a list of strings, got %s", clip(r))
	}
}

func (p *fieldParser) bool(key string, dst *bool) {
	if r, ok := p.takeNonNull(key); ok && json.Unmarshal(r, dst) != nil {
		p.fail(key, "want true or false, got %s", clip(r))
	}
}

func (p *fieldParser) int(key string, dst *int) {
	if r, ok := p.takeNonNull(key); ok {
		p.parseInt(key, r, dst)
	}
}

// parseInt accepts JSON integers, and floats with an integral value (2048.0).
func (p *fieldParser) parseInt(key string, r json.RawMessage, dst *int) {
	var f float64
	if len(r) == 0 || r[0] == '"' || json.Unmarshal(r, &f) != nil {
		p.fail(key, "want an integer, got %s", clip(r))
		return
	}
	if i, err := strconv.ParseInt(string(r), 10, 0); err == nil {
		*dst = int(i)
		return
	}
	if f != math.Trunc(f) || math.Abs(f) > 1<<53 {
		p.fail(key, "want an integer, got %s", clip(r))
		return
	}
	*dst = int(f)
}

func (p *fieldParser) float(key string, dst *float64) {
	if r, ok := p.takeNonNull(key); ok && (r[0] == '"' || json.Unmarshal(r, dst) != nil) {
		p.fail(key, "want a number, got %s", clip(r))
	}
}

// rope parses a rope_scaling-style object; a "default" one (plain RoPE) gives nil.
func (p *fieldParser) rope(key string, r json.RawMessage) *RopeScaling {
	var obj map[string]json.RawMessage
	if json.Unmarshal(r, &obj) != nil {
		p.fail(key, "want an object or null, got %s", clip(r))
		return nil
	}
	q := fieldParser{name: p.name, raw: obj}
	var rs RopeScaling
	q.str("type", &rs.Type)
	q.str("rope_type", &rs.Type) // the current name wins over the legacy one
	q.float("factor", &rs.Factor)
	q.float("low_freq_factor", &rs.LowFreqFactor)
	q.float("high_freq_factor", &rs.HighFreqFactor)
	q.int("original_max_position_embeddings", &rs.OriginalMaxPositionEmbeddings)
	if q.err != nil && p.err == nil {
		p.err = fmt.Errorf("%s: %s.%s", p.name, key, strings.TrimPrefix(q.err.Error(), p.name+": "))
	}
	switch rs.Type {
	case "default":
		return nil
	case "": // plain RoPE, unless scaling parameters come without saying how to apply them
		if rs.Factor != 0 {
			p.fail(key, "has no rope_type")
		}
		return nil
	}
	return &rs
}

func clip(b []byte) string {
	if len(b) > 40 {
		return string(b[:40]) + "..."
	}
	return string(b)
}

func (c Config) name() string {
	if c.Source != "" {
		return c.Source
	}
	return ConfigFileName
}

// Validate checks that the model can be built from the config. Errors name the file and
// the field, e.g. "config.json: num_attention_heads 0 must be positive".
func (c Config) Validate() error {
	name := c.name()
	for _, f := range []struct {
		key string
		v   int
	}{
		{"hidden_size", c.HiddenSize}, {"intermediate_size", c.IntermediateSize},
		{"num_hidden_layers", c.NumHiddenLayers}, {"num_attention_heads", c.NumAttentionHeads},
		{"num_key_value_heads", c.NumKeyValueHeads}, {"vocab_size", c.VocabSize},
		{"max_position_embeddings", c.MaxPositionEmbeddings},
	} {
		if f.v <= 0 {
			return fmt.Errorf("%s: %s %d must be positive", name, f.key, f.v)
		}
	}
	switch {
	case c.HeadDim == 0 && c.HiddenSize%c.NumAttentionHeads != 0:
		return fmt.Errorf("%s: hidden_size %d is not divisible by num_attention_heads %d (and head_dim is not set)", name, c.HiddenSize, c.NumAttentionHeads)
	case c.HeadDim <= 0:
		return fmt.Errorf("%s: head_dim %d must be positive", name, c.HeadDim)
	case c.HeadDim%2 != 0:
		return fmt.Errorf("%s: head_dim %d must be even for rotary embeddings", name, c.HeadDim)
	case c.NumAttentionHeads%c.NumKeyValueHeads != 0:
		return fmt.Errorf("%s: num_attention_heads %d is not divisible by num_key_value_heads %d", name, c.NumAttentionHeads, c.NumKeyValueHeads)
	case !(c.RMSNormEps > 0) || math.IsInf(c.RMSNormEps, 0):
		return fmt.Errorf("%s: rms_norm_eps %v must be positive and finite", name, c.RMSNormEps)
	case !(c.RopeTheta > 0) || math.IsInf(c.RopeTheta, 0):
		return fmt.Errorf("%s: rope_theta %v must be positive and finite", name, c.RopeTheta)
	case c.ModelType != "llama":
		return fmt.Errorf("%s: model_type %q is not supported (want \"llama\")", name, c.ModelType)
	case c.AttentionBias:
		return fmt.Errorf("%s: attention_bias true is not supported (twell models have no attention biases)", name)
	case c.MLPBias:
		return fmt.Errorf("%s: mlp_bias true is not supported (twell models have no MLP biases)", name)
	}
	if err := c.RopeScaling.validate(name); err != nil {
		return err
	}
	if c.BOSTokenID != nil && (*c.BOSTokenID < 0 || *c.BOSTokenID >= c.VocabSize) {
		return fmt.Errorf("%s: bos_token_id %d is outside the vocabulary [0, %d)", name, *c.BOSTokenID, c.VocabSize)
	}
	for _, id := range c.EOSTokenIDs {
		if id < 0 || id >= c.VocabSize {
			return fmt.Errorf("%s: eos_token_id %d is outside the vocabulary [0, %d)", name, id, c.VocabSize)
		}
	}
	for _, a := range []struct{ key, v string }{{"activation override", c.ActOverride}, {"twell_hidden_act", c.TwELLHiddenAct}} {
		if a.v != "" && a.v != ActReLU && a.v != ActSiLU {
			return fmt.Errorf("%s: %s %q is not supported (want %q or %q)", name, a.key, a.v, ActReLU, ActSiLU)
		}
	}
	if act, why := c.GateActivation(); act != ActReLU && act != ActSiLU {
		return fmt.Errorf("%s: hidden_act %q is not supported (want %q or %q; %s)", name, act, ActReLU, ActSiLU, why)
	}
	return nil
}

func (r *RopeScaling) validate(name string) error {
	if r == nil {
		return nil
	}
	switch r.Type {
	case "linear", "dynamic", "llama3":
	default:
		return fmt.Errorf("%s: rope_scaling type %q is not supported (want linear, dynamic or llama3)", name, r.Type)
	}
	if !(r.Factor >= 1) || math.IsInf(r.Factor, 0) {
		return fmt.Errorf("%s: rope_scaling factor %v must be a finite number >= 1", name, r.Factor)
	}
	if r.Type != "llama3" {
		return nil
	}
	switch {
	case !(r.LowFreqFactor > 0) || math.IsInf(r.HighFreqFactor, 0):
		return fmt.Errorf("%s: rope_scaling low_freq_factor %v and high_freq_factor %v must be positive and finite", name, r.LowFreqFactor, r.HighFreqFactor)
	case !(r.HighFreqFactor > r.LowFreqFactor):
		return fmt.Errorf("%s: rope_scaling high_freq_factor %v must exceed low_freq_factor %v", name, r.HighFreqFactor, r.LowFreqFactor)
	case r.OriginalMaxPositionEmbeddings <= 0:
		return fmt.Errorf("%s: rope_scaling original_max_position_embeddings %d must be positive", name, r.OriginalMaxPositionEmbeddings)
	}
	return nil
}

// GateActivation returns the activation the model must apply to the MLP gate, and the
// reason, for the loader to log. The first rule that applies wins:
//
//  1. ActOverride, when set by the caller (e.g. a command-line flag).
//  2. "twell_hidden_act" in config.json.
//  3. A SparseLM checkpoint gets relu whatever hidden_act says: the public SparseLM
//     checkpoints were trained with a ReLU gate but their config.json says "silu". A
//     checkpoint is recognized as SparseLM when "sparselm" (any case) appears in
//     "_name_or_path", in the name of the directory holding the config, or, for the
//     Hugging Face cache layout (models--org--name/snapshots/HASH/config.json), in the
//     repository folder's name.
//  4. "hidden_act".
func (c Config) GateActivation() (act, reason string) {
	switch {
	case c.ActOverride != "":
		return c.ActOverride, "set by override"
	case c.TwELLHiddenAct != "":
		return c.TwELLHiddenAct, "twell_hidden_act in " + c.name()
	}
	if c.HiddenAct != ActReLU {
		if where := c.sparseLMHint(); where != "" {
			return ActReLU, fmt.Sprintf("SparseLM checkpoint (%s); its hidden_act %q is ignored", where, c.HiddenAct)
		}
	}
	return c.HiddenAct, "hidden_act in " + c.name()
}

// sparseLMHint says where the config shows it belongs to a SparseLM checkpoint, or "".
func (c Config) sparseLMHint() string {
	isSparseLM := func(s string) bool { return strings.Contains(strings.ToLower(s), "sparselm") }
	if isSparseLM(c.NameOrPath) {
		return "_name_or_path " + strconv.Quote(c.NameOrPath)
	}
	if c.Source == "" {
		return ""
	}
	dir := filepath.Dir(c.Source)
	if abs, err := filepath.Abs(dir); err == nil {
		dir = abs
	}
	if base := filepath.Base(dir); isSparseLM(base) {
		return "directory " + strconv.Quote(base)
	}
	if parent := filepath.Dir(dir); filepath.Base(parent) == "snapshots" {
		if repo := filepath.Base(filepath.Dir(parent)); strings.HasPrefix(repo, "models--") && isSparseLM(repo) {
			return "cached repository " + strconv.Quote(repo)
		}
	}
	return ""
}

// TwELLCompatible reports whether the MLP can run on the TwELL sparse path; if not, the
// error says why and the model falls back to dense MLP kernels. It is not a validity check.
func (c Config) TwELLCompatible() error {
	var errs []error
	if act, _ := c.GateActivation(); act != ActReLU {
		errs = append(errs, fmt.Errorf("%s: gate activation %q produces no exact zeros (TwELL needs %q); the MLP runs dense", c.name(), act, ActReLU))
	}
	if c.IntermediateSize <= 0 || c.IntermediateSize%twellTile != 0 || c.IntermediateSize > twellMaxCols {
		errs = append(errs, fmt.Errorf("%s: intermediate_size %d is not a multiple of the TwELL tile width %d up to %d; the MLP runs dense", c.name(), c.IntermediateSize, twellTile, twellMaxCols))
	}
	return errors.Join(errs...)
}

// MarshalJSON renders the config as Hugging Face config.json fields (keys sorted), with
// Extra's fields included and hidden_act set to the resolved gate activation, so that
// transformers runs the model the way twell does.
func (c Config) MarshalJSON() ([]byte, error) {
	m := make(map[string]any, len(c.Extra)+30)
	for k, v := range c.Extra {
		m[k] = v
	}
	act, _ := c.GateActivation()
	m["model_type"] = c.ModelType
	if c.Architectures != nil {
		m["architectures"] = c.Architectures
	}
	if c.NameOrPath != "" {
		m["_name_or_path"] = c.NameOrPath
	}
	m["hidden_size"] = c.HiddenSize
	m["intermediate_size"] = c.IntermediateSize
	m["num_hidden_layers"] = c.NumHiddenLayers
	m["num_attention_heads"] = c.NumAttentionHeads
	m["num_key_value_heads"] = c.NumKeyValueHeads
	m["head_dim"] = c.HeadDim
	m["vocab_size"] = c.VocabSize
	m["max_position_embeddings"] = c.MaxPositionEmbeddings
	m["rms_norm_eps"] = pyFloat(c.RMSNormEps)
	m["rope_theta"] = pyFloat(c.RopeTheta)
	if r := c.RopeScaling; r != nil {
		rs := map[string]any{"rope_type": r.Type, "factor": pyFloat(r.Factor)}
		if r.Type == "llama3" {
			rs["low_freq_factor"] = pyFloat(r.LowFreqFactor)
			rs["high_freq_factor"] = pyFloat(r.HighFreqFactor)
		}
		if r.OriginalMaxPositionEmbeddings > 0 {
			rs["original_max_position_embeddings"] = r.OriginalMaxPositionEmbeddings
		}
		m["rope_scaling"] = rs
	} else {
		m["rope_scaling"] = nil
	}
	m["hidden_act"] = act
	m["tie_word_embeddings"] = c.TieWordEmbeddings
	if !c.MLPGated {
		m["mlp_gated"] = false
	}
	m["attention_bias"] = c.AttentionBias
	m["mlp_bias"] = c.MLPBias
	if c.BOSTokenID != nil {
		m["bos_token_id"] = *c.BOSTokenID
	} else {
		m["bos_token_id"] = nil
	}
	switch len(c.EOSTokenIDs) {
	case 0:
		m["eos_token_id"] = nil
	case 1:
		m["eos_token_id"] = c.EOSTokenIDs[0]
	default:
		m["eos_token_id"] = c.EOSTokenIDs
	}
	if c.TorchDType != "" {
		// Both names: transformers 4 reads torch_dtype, transformers 5 dtype.
		m["torch_dtype"] = c.TorchDType
		m["dtype"] = c.TorchDType
	}
	if c.TwELLHiddenAct != "" {
		m["twell_hidden_act"] = c.TwELLHiddenAct
	}
	delete(m, "rope_parameters") // written as rope_theta and rope_scaling above
	return json.Marshal(m)
}

// pyFloat marshals like Python's json module: always with a fraction or exponent (1e-05,
// 10000.0), so that readers see a float where transformers expects one.
type pyFloat float64

// MarshalJSON formats the number as Python's repr does: positional notation for
// exponents in [-4, 16), scientific otherwise.
func (f pyFloat) MarshalJSON() ([]byte, error) {
	v := float64(f)
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return nil, fmt.Errorf("model: cannot write %v to JSON", v)
	}
	s := strconv.FormatFloat(v, 'e', -1, 64) // e.g. 1e-05, like Python
	exp, _ := strconv.Atoi(s[strings.IndexByte(s, 'e')+1:])
	if exp < -4 || exp >= 16 {
		return []byte(s), nil
	}
	s = strconv.FormatFloat(v, 'f', -1, 64)
	if !strings.Contains(s, ".") {
		s += ".0"
	}
	return []byte(s), nil
}

// Save validates the config and writes it to path (a file, or a directory to hold
// config.json) atomically: through a synced temporary file renamed into place.
func (c Config) Save(path string) error {
	if err := c.Validate(); err != nil {
		return err
	}
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		path = filepath.Join(path, ConfigFileName)
	}
	data, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return fmt.Errorf("model: %s: %w", path, err)
	}
	if err := atomicfile.WriteFile(path, append(data, '\n')); err != nil {
		return fmt.Errorf("model: save config: %w", err)
	}
	return nil
}
