package train

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"

	"github.com/twell-ai/twell/model"
)

// Config is a training run's configuration, read from JSON (snake_case
// keys; unknown keys are errors, since they are usually typos).
type Config struct {
	Model json.RawMessage `json:"model"` // a Hugging Face LlamaConfig object
	model model.Config

	Steps       int     `json:"steps"`
	Batch       int     `json:"batch"`        // sequences per micro-batch
	Seq         int     `json:"seq"`          // tokens per sequence
	Accum       int     `json:"accum"`        // micro-batches per step
	LR          float64 `json:"lr"`           // peak learning rate
	MinLR       float64 `json:"min_lr"`       // learning rate at the end of the cosine
	Warmup      int     `json:"warmup"`       // warmup steps
	WeightDecay float64 `json:"weight_decay"` // AdamW decoupled decay
	Beta1       float64 `json:"beta1"`
	Beta2       float64 `json:"beta2"`
	Eps         float64 `json:"eps"`
	Clip        float64 `json:"clip"` // global gradient-norm clip; 0 disables
	// L1 is lambda, the weight of the L1 penalty on the MLP hidden
	// activations (mean over tokens of sum |h|, averaged over layers).
	L1 float64 `json:"l1"`

	EvalEvery       int `json:"eval_every"`       // steps between held-out evaluations; 0 = only at the end
	EvalBatches     int `json:"eval_batches"`     // batches per evaluation
	CheckpointEvery int `json:"checkpoint_every"` // steps between checkpoints; 0 = only at the end
	LogEvery        int `json:"log_every"`        // steps between metrics lines

	// DeadWindow is how many tokens a unit may go without firing before it
	// counts as dead.
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

// SetModelConfig replaces the model configuration.
func (c *Config) SetModelConfig(m model.Config) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	c.Model, c.model = b, m
	return nil
}

// ParseConfig reads a training config, fills defaults and validates it.
func ParseConfig(data []byte) (*Config, error) {
	c := defaults()
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(c); err != nil {
		return nil, fmt.Errorf("training config: %w", err)
	}
	if len(c.Model) == 0 {
		return nil, fmt.Errorf("training config: field \"model\" missing (a Hugging Face LlamaConfig object)")
	}
	m, err := model.ParseConfig(c.Model)
	if err != nil {
		return nil, fmt.Errorf("training config: model: %w", err)
	}
	c.model = m
	return c, c.Validate()
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

// Validate reports the first bad field, naming it.
func (c *Config) Validate() error {
	var bad []string
	check := func(ok bool, format string, a ...any) {
		if !ok {
			bad = append(bad, fmt.Sprintf(format, a...))
		}
	}
	check(c.Steps > 0, "steps %d must be positive", c.Steps)
	check(c.Batch > 0, "batch %d must be positive", c.Batch)
	check(c.Seq > 1, "seq %d must be at least 2", c.Seq)
	check(c.Accum > 0, "accum %d must be positive", c.Accum)
	check(c.LR > 0, "lr %g must be positive", c.LR)
	check(c.MinLR >= 0 && c.MinLR <= c.LR, "min_lr %g must be in [0, lr]", c.MinLR)
	check(c.Warmup >= 0, "warmup %d must be >= 0", c.Warmup)
	check(c.WeightDecay >= 0, "weight_decay %g must be >= 0", c.WeightDecay)
	check(c.Beta1 >= 0 && c.Beta1 < 1 && c.Beta2 >= 0 && c.Beta2 < 1, "beta1 %g and beta2 %g must be in [0, 1)", c.Beta1, c.Beta2)
	check(c.Eps > 0, "eps %g must be positive", c.Eps)
	check(c.Clip >= 0, "clip %g must be >= 0", c.Clip)
	check(c.L1 >= 0, "l1 %g must be >= 0", c.L1)
	check(c.EvalEvery >= 0 && c.EvalBatches > 0, "eval_every %d must be >= 0 and eval_batches %d positive", c.EvalEvery, c.EvalBatches)
	check(c.CheckpointEvery >= 0 && c.LogEvery > 0, "checkpoint_every %d must be >= 0 and log_every %d positive", c.CheckpointEvery, c.LogEvery)
	check(c.DeadWindow > 0, "dead_window %d must be positive", c.DeadWindow)
	m := c.model
	if act, _ := m.GateActivation(); act != model.ActReLU {
		bad = append(bad, fmt.Sprintf("model hidden_act %q: training supports the ReLU gate only", act))
	}
	if m.RopeScaling != nil {
		bad = append(bad, "model rope_scaling: not supported in training")
	}
	if c.Seq > m.MaxPositionEmbeddings {
		bad = append(bad, fmt.Sprintf("seq %d exceeds the model's max_position_embeddings %d", c.Seq, m.MaxPositionEmbeddings))
	}
	if len(bad) > 0 {
		sort.Strings(bad)
		return fmt.Errorf("training config: %s", strings.Join(bad, "; "))
	}
	return nil
}
