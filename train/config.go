package train

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"sort"
	"strings"

	"github.com/twell-ai/twell/model"
)

// Config is a training run's configuration, read from JSON (snake_case
// keys; unknown keys are errors, since they are usually typos). Each field's
// range is checked by Validate; a zero never stands for a default (the
// fields where zero has a meaning say so).
type Config struct {
	Model json.RawMessage `json:"model"` // a Hugging Face LlamaConfig object
	model model.Config

	Steps       int     `json:"steps"`        // optimizer steps, >= 1
	Batch       int     `json:"batch"`        // sequences per micro-batch, >= 1
	Seq         int     `json:"seq"`          // tokens per sequence, in [2, max_position_embeddings]
	Accum       int     `json:"accum"`        // micro-batches per step, >= 1
	LR          float64 `json:"lr"`           // peak learning rate, in (0, 1]
	MinLR       float64 `json:"min_lr"`       // learning rate at the end of the cosine, in [0, lr]
	Warmup      int     `json:"warmup"`       // warmup steps, >= 0 (0: none)
	WeightDecay float64 `json:"weight_decay"` // AdamW decoupled decay, in [0, 1]
	Beta1       float64 `json:"beta1"`        // in [0, 1)
	Beta2       float64 `json:"beta2"`        // in [0, 1)
	Eps         float64 `json:"eps"`          // in (0, 1]
	Clip        float64 `json:"clip"`         // global gradient-norm clip, finite, >= 0 (0: no clipping)
	// L1 is lambda, the weight of the L1 penalty on the MLP hidden
	// activations (mean over tokens of sum |h|, averaged over layers):
	// finite, >= 0 (0: no penalty).
	L1 float64 `json:"l1"`

	EvalEvery       int `json:"eval_every"`       // steps between held-out evaluations, >= 0 (0: only at the end)
	EvalBatches     int `json:"eval_batches"`     // batches per evaluation, >= 1
	CheckpointEvery int `json:"checkpoint_every"` // steps between checkpoints, >= 0 (0: only at the end)
	LogEvery        int `json:"log_every"`        // steps between metrics lines, >= 1

	// DeadWindow is how many tokens a unit may go without firing before it
	// counts as dead, >= 1.
	DeadWindow int64 `json:"dead_window"`
	// ReinitDead re-initialises dead gate units (gate and up rows, down
	// column) when they are detected.
	ReinitDead bool   `json:"reinit_dead"`
	Seed       uint64 `json:"seed"`

	// Data is a token-shard folder built by "twell data"; empty means the
	// bundled text sample. Tokenizer is the tokenizer.json that goes with
	// it; empty means one trained on the sample.
	Data      string `json:"data"`
	Tokenizer string `json:"tokenizer"`
}

// ModelConfig returns the parsed model configuration.
func (c *Config) ModelConfig() model.Config { return c.model }

// SetModelConfig replaces the model configuration, which must be valid.
func (c *Config) SetModelConfig(m model.Config) error {
	if err := m.Validate(); err != nil {
		return fmt.Errorf("training config: model: %w", err)
	}
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	c.Model, c.model = b, m
	return nil
}

// AdamW returns the optimizer hyperparameters of the run.
func (c *Config) AdamW() AdamW {
	return AdamW{Beta1: c.Beta1, Beta2: c.Beta2, Eps: c.Eps, WeightDecay: c.WeightDecay}
}

// Clone returns a deep copy of c.
func (c *Config) Clone() *Config {
	d := *c
	d.Model = append(json.RawMessage(nil), c.Model...)
	if m, err := model.ParseConfig(d.Model); err == nil {
		d.model = m
	}
	return &d
}

// ParseConfig reads a training config and validates it. Absent fields take
// the defaults accum 1, lr 3e-3, min_lr 3e-4, warmup 20, weight_decay 0.1,
// beta1 0.9, beta2 0.95, eps 1e-8, clip 1, l1 2e-5, eval_batches 4,
// log_every 1, dead_window 100000, seed 1; steps, batch, seq and model have
// none. Text after the JSON object is an error.
func ParseConfig(data []byte) (*Config, error) {
	c := defaults()
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(c); err != nil {
		return nil, fmt.Errorf("training config: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("training config: text after the JSON object (at byte %d)", dec.InputOffset())
	}
	if len(c.Model) == 0 {
		return nil, fmt.Errorf("training config: field \"model\" missing (a Hugging Face LlamaConfig object)")
	}
	m, err := model.ParseConfig(c.Model)
	if err != nil {
		return nil, fmt.Errorf("training config: model: %w", err)
	}
	c.model = m
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// LoadConfig reads a training config file.
func LoadConfig(path string) (*Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	c, err := ParseConfig(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

func defaults() *Config {
	return &Config{
		Accum: 1, LR: 3e-3, MinLR: 3e-4, Warmup: 20, WeightDecay: 0.1,
		Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, Clip: 1, L1: 2e-5,
		EvalBatches: 4, LogEvery: 1, DeadWindow: 100_000, Seed: 1,
	}
}

// maxStepTokens bounds batch x seq x accum, the tokens of one step (the
// per-unit firing counts of a step are int32).
const maxStepTokens = math.MaxInt32

// Validate checks every field against its documented range and the model
// (model.Config.Validate, then what training supports), naming each bad
// field.
func (c *Config) Validate() error {
	var bad []string
	check := func(ok bool, format string, a ...any) {
		if !ok {
			bad = append(bad, fmt.Sprintf(format, a...))
		}
	}
	finite := func(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }
	check(c.Steps > 0, "steps %d must be positive", c.Steps)
	check(c.Batch > 0, "batch %d must be positive", c.Batch)
	check(c.Seq > 1, "seq %d must be at least 2", c.Seq)
	check(c.Accum > 0, "accum %d must be positive", c.Accum)
	if c.Steps > 0 && c.Batch > 0 && c.Seq > 1 && c.Accum > 0 {
		step := float64(c.Batch) * float64(c.Seq) * float64(c.Accum)
		check(step <= maxStepTokens, "batch %d x seq %d x accum %d = %.0f tokens per step must be at most %d", c.Batch, c.Seq, c.Accum, step, maxStepTokens)
		check(step*float64(c.Steps) <= 1<<53, "steps %d x %.0f tokens per step must be at most 2^53 tokens", c.Steps, step)
	}
	check(c.LR > 0 && c.LR <= 1, "lr %g must be in (0, 1]", c.LR)
	check(c.MinLR >= 0 && c.MinLR <= c.LR, "min_lr %g must be in [0, lr]", c.MinLR)
	check(c.Warmup >= 0, "warmup %d must be >= 0", c.Warmup)
	check(c.WeightDecay >= 0 && c.WeightDecay <= 1, "weight_decay %g must be in [0, 1]", c.WeightDecay)
	check(c.Beta1 >= 0 && c.Beta1 < 1, "beta1 %g must be in [0, 1)", c.Beta1)
	check(c.Beta2 >= 0 && c.Beta2 < 1, "beta2 %g must be in [0, 1)", c.Beta2)
	check(c.Eps > 0 && c.Eps <= 1, "eps %g must be in (0, 1]", c.Eps)
	check(c.Clip >= 0 && finite(c.Clip), "clip %g must be finite and >= 0", c.Clip)
	check(c.L1 >= 0 && finite(c.L1), "l1 %g must be finite and >= 0", c.L1)
	check(c.EvalEvery >= 0, "eval_every %d must be >= 0", c.EvalEvery)
	check(c.EvalBatches > 0, "eval_batches %d must be positive", c.EvalBatches)
	check(c.CheckpointEvery >= 0, "checkpoint_every %d must be >= 0", c.CheckpointEvery)
	check(c.LogEvery > 0, "log_every %d must be positive", c.LogEvery)
	check(c.DeadWindow > 0, "dead_window %d must be positive", c.DeadWindow)
	m := c.model
	if err := m.Validate(); err != nil {
		bad = append(bad, "model: "+err.Error())
	} else {
		// What training supports beyond what the model package does.
		if act, _ := m.GateActivation(); act != model.ActReLU {
			bad = append(bad, fmt.Sprintf("model hidden_act %q: training supports the ReLU gate only", act))
		}
		if m.RopeScaling != nil {
			bad = append(bad, "model rope_scaling: not supported in training")
		}
		if c.Seq > m.MaxPositionEmbeddings {
			bad = append(bad, fmt.Sprintf("seq %d exceeds the model's max_position_embeddings %d", c.Seq, m.MaxPositionEmbeddings))
		}
	}
	if len(bad) > 0 {
		sort.Strings(bad)
		return fmt.Errorf("training config: %s", strings.Join(bad, "; "))
	}
	return nil
}

// Diff returns the first field (in JSON key order) where c and o differ,
// as "key value (other: value)", or "" when they agree; the JSON keys in
// ignore are skipped. The model configs are compared as they serialise.
func (c *Config) Diff(o *Config, ignore ...string) string {
	a, errA := c.fields()
	b, errB := o.fields()
	if errA != nil || errB != nil {
		return "config (does not serialise)"
	}
	keys := make([]string, 0, len(a))
	for k := range a {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if slices.Contains(ignore, k) || bytes.Equal(a[k], b[k]) {
			continue
		}
		if k == "model" {
			return "model config"
		}
		return fmt.Sprintf("%s %s (other: %s)", k, a[k], b[k])
	}
	return ""
}

func (c *Config) fields() (map[string]json.RawMessage, error) {
	raw, err := json.Marshal(c)
	if err != nil {
		return nil, err
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, err
	}
	if m["model"], err = json.Marshal(c.model); err != nil {
		return nil, err
	}
	return m, nil
}
