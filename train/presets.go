package train

import (
	"encoding/json"
	"fmt"
	"sort"

	"github.com/twell-ai/twell/model"
)

// preset is a named training configuration. Vocab is filled in from the
// tokenizer at run time.
type preset struct {
	summary string
	model   model.Config
	cfg     Config
}

var presets = map[string]preset{
	"tiny": {
		summary: "~0.2M parameters, under a minute on 2 CPU cores, on the bundled text sample",
		model:   llama(64, 256, 2, 2, 1, 128),
		cfg: Config{Steps: 300, Batch: 16, Seq: 64, LR: 3e-3, MinLR: 3e-4, Warmup: 20, L1: 1e-2,
			EvalEvery: 50, EvalBatches: 4, CheckpointEvery: 50, LogEvery: 10, DeadWindow: 100_000},
	},
	"small": {
		summary: "~25M parameters (hidden 512, 6 layers, MLP 1536), for the GPU or a patient CPU",
		model:   llama(512, 1536, 6, 8, 8, 1024),
		cfg: Config{Steps: 5000, Batch: 32, Seq: 512, LR: 1e-3, MinLR: 1e-4, Warmup: 200, L1: 2e-5,
			EvalEvery: 250, EvalBatches: 16, CheckpointEvery: 500, LogEvery: 10, DeadWindow: 10_000_000},
	},
	"medium": {
		summary: "~100M parameters (hidden 768, 12 layers, MLP 2560), for the GPU",
		model:   llama(768, 2560, 12, 12, 12, 1024),
		cfg: Config{Steps: 20000, Batch: 32, Seq: 1024, LR: 6e-4, MinLR: 6e-5, Warmup: 500, L1: 2e-5,
			EvalEvery: 500, EvalBatches: 16, CheckpointEvery: 1000, LogEvery: 10, DeadWindow: 50_000_000},
	},
}

func llama(hidden, mlp, layers, heads, kvHeads, maxPos int) model.Config {
	return model.Config{
		ModelType: "llama", Architectures: []string{"LlamaForCausalLM"},
		HiddenSize: hidden, IntermediateSize: mlp, NumHiddenLayers: layers,
		NumAttentionHeads: heads, NumKeyValueHeads: kvHeads, HeadDim: hidden / heads,
		MaxPositionEmbeddings: maxPos, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: model.ActReLU, TieWordEmbeddings: true, MLPGated: true, TorchDType: "float32",
	}
}

// PresetNames lists the presets with their summaries, sorted by name.
func PresetNames() []string {
	var out []string
	for n, p := range presets {
		out = append(out, n+": "+p.summary)
	}
	sort.Strings(out)
	return out
}

// CheckPreset reports whether name is a preset, with an error that lists
// the presets when it is not.
func CheckPreset(name string) error {
	if _, ok := presets[name]; ok {
		return nil
	}
	var names []string
	for n := range presets {
		names = append(names, n)
	}
	sort.Strings(names)
	return fmt.Errorf("unknown preset %q (have %v)", name, names)
}

// Preset returns the training config of a preset for a tokenizer with
// vocab tokens, whose end-of-text token is eos (also the model's BOS/EOS).
func Preset(name string, vocab, eos int) (*Config, error) {
	if err := CheckPreset(name); err != nil {
		return nil, err
	}
	p := presets[name]
	c := defaults()
	base := p.cfg
	c.Steps, c.Batch, c.Seq, c.LR, c.MinLR, c.Warmup, c.L1 = base.Steps, base.Batch, base.Seq, base.LR, base.MinLR, base.Warmup, base.L1
	c.EvalEvery, c.EvalBatches, c.CheckpointEvery, c.LogEvery, c.DeadWindow = base.EvalEvery, base.EvalBatches, base.CheckpointEvery, base.LogEvery, base.DeadWindow
	mc := p.model
	mc.VocabSize = vocab
	mc.BOSTokenID = &eos
	mc.EOSTokenIDs = []int{eos}
	b, err := json.Marshal(mc)
	if err != nil {
		return nil, err
	}
	if c.model, err = model.ParseConfig(b); err != nil {
		return nil, err
	}
	c.Model = b
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}
