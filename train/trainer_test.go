package train

import (
	"bufio"
	"context"
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twell-ai/twell/model"
)

// patternTokens returns a learnable stream: short random "words" drawn from
// a small lexicon, so the next token is often predictable.
func patternTokens(r *rand.Rand, n, vocab int) []int {
	words := make([][]int, 12)
	for i := range words {
		words[i] = make([]int, 2+r.IntN(4))
		for j := range words[i] {
			words[i][j] = 1 + r.IntN(vocab-1)
		}
	}
	var out []int
	for len(out) < n {
		out = append(out, words[r.IntN(len(words))]...)
		out = append(out, 0)
	}
	return out[:n]
}

func testConfig(t testing.TB, steps int, l1 float64) *Config {
	t.Helper()
	mc := model.Config{
		ModelType: "llama", HiddenSize: 32, IntermediateSize: 128, NumHiddenLayers: 2,
		NumAttentionHeads: 4, NumKeyValueHeads: 2, HeadDim: 8, VocabSize: 40,
		MaxPositionEmbeddings: 64, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: model.ActReLU, TieWordEmbeddings: true, MLPGated: true,
	}
	b, _ := json.Marshal(mc)
	raw, _ := json.Marshal(map[string]any{
		"model": json.RawMessage(b), "steps": steps, "batch": 4, "seq": 16, "lr": 1e-2, "min_lr": 1e-3,
		"warmup": 5, "l1": l1, "eval_every": 10, "eval_batches": 2, "checkpoint_every": 10, "dead_window": 5000, "seed": 7,
	})
	c, err := ParseConfig(raw)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func readMetrics(t *testing.T, dir string) []Metrics {
	t.Helper()
	f, err := os.Open(filepath.Join(dir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []Metrics
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var m Metrics
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}

func newTestRun(t testing.TB, c *Config, out string, seed uint64) *Run {
	r := rand.New(rand.NewPCG(seed, 1))
	toks := patternTokens(r, 20000, c.ModelConfig().VocabSize)
	w := model.RandomWeights(c.ModelConfig(), rand.New(rand.NewPCG(c.Seed, 2)))
	b, err := NewCPU(c.ModelConfig(), w)
	if err != nil {
		t.Fatal(err)
	}
	return NewRun(c, out, b, NewStreamSource(toks[:18000], c.Seed), Windows(toks[18000:], c.Seq, 100))
}

func TestLossFallsAndResumeIsExact(t *testing.T) {
	seed := rand.Uint64()
	c := testConfig(t, 30, 1e-3)
	full := t.TempDir()
	run := newTestRun(t, c, full, seed)
	if err := run.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	ms := readMetrics(t, full)
	if len(ms) != 30 || ms[29].ValLoss == nil {
		t.Fatalf("seed %d: %d metrics lines, want 30 with a final val_loss", seed, len(ms))
	}
	if !(ms[29].Loss < ms[0].Loss-0.5) {
		t.Fatalf("seed %d: loss did not fall: first %g, last %g", seed, ms[0].Loss, ms[29].Loss)
	}
	for _, f := range []string{"loss.png", "l0.png", "dead.png", "checkpoint/model.safetensors", "checkpoint/config.json", "checkpoint/optimizer.safetensors"} {
		if _, err := os.Stat(filepath.Join(full, f)); err != nil {
			t.Errorf("missing output %s: %v", f, err)
		}
	}
	// The checkpoint loads as a model.
	if _, err := model.Load(filepath.Join(full, "checkpoint")); err != nil {
		t.Fatalf("checkpoint does not load: %v", err)
	}

	// Interrupted at step 13 (last checkpoint at 10), then resumed.
	part := t.TempDir()
	r1 := newTestRun(t, c, part, seed)
	r1.StopAt = 13
	if err := r1.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	r2 := newTestRun(t, c, part, seed)
	if err := r2.Resume(); err != nil {
		t.Fatal(err)
	}
	if r2.Step() != 10 {
		t.Fatalf("resumed at step %d, want 10", r2.Step())
	}
	if err := r2.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	ms2 := readMetrics(t, part)
	if len(ms2) != len(ms) {
		t.Fatalf("resumed run has %d metrics lines, want %d", len(ms2), len(ms))
	}
	for i := range ms {
		if ms[i].Loss != ms2[i].Loss || ms[i].L1 != ms2[i].L1 {
			t.Fatalf("seed %d: step %d: resumed loss %v (l1 %v), uninterrupted %v (l1 %v)", seed, ms[i].Step, ms2[i].Loss, ms2[i].L1, ms[i].Loss, ms[i].L1)
		}
	}
}

func TestConfigErrorsNameTheField(t *testing.T) {
	cases := map[string]string{
		`{"steps": 10}`: `field "model" missing`,
		`{"model": {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10, "hidden_act": "relu"}, "steps": 0, "batch": 1, "seq": 4}`:           "steps 0 must be positive",
		`{"model": {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10, "hidden_act": "silu"}, "steps": 1, "batch": 1, "seq": 4}`:           "ReLU gate only",
		`{"model": {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10, "hidden_act": "relu"}, "steps": 1, "batch": 1, "seq": 4, "lrr": 1}`: `unknown field "lrr"`,
		`{"model": {"hidden_size": 8}}`: "model",
		`not json`:                      "invalid character",
	}
	for in, want := range cases {
		_, err := ParseConfig([]byte(in))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseConfig(%s) = %v, want an error containing %q", in, err, want)
		}
	}
}

func TestResumeWithoutCheckpointFails(t *testing.T) {
	c := testConfig(t, 5, 0)
	r := newTestRun(t, c, t.TempDir(), 1)
	if err := r.Resume(); err == nil || !strings.Contains(err.Error(), "no readable checkpoint") {
		t.Fatalf("Resume on an empty folder: %v", err)
	}
}

func TestPresetsAreValid(t *testing.T) {
	for _, name := range []string{"tiny", "small", "medium"} {
		c, err := Preset(name, 8192, 0)
		if err != nil {
			t.Fatalf("preset %s: %v", name, err)
		}
		mc := c.ModelConfig()
		if err := mc.TwELLCompatible(); err != nil {
			t.Errorf("preset %s: %v", name, err)
		}
		params := mc.VocabSize * mc.HiddenSize
		params += mc.NumHiddenLayers * (4*mc.HiddenSize*mc.HiddenSize + 3*mc.HiddenSize*mc.IntermediateSize)
		t.Logf("preset %s: %.1fM parameters", name, float64(params)/1e6)
		if name == "small" && (params < 20e6 || params > 30e6) || name == "medium" && (params < 85e6 || params > 120e6) {
			t.Errorf("preset %s has %d parameters", name, params)
		}
	}
	if _, err := Preset("huge", 100, 0); err == nil {
		t.Error("unknown preset accepted")
	}
}

func TestDeadUnitsAreTrackedAndReinitialised(t *testing.T) {
	seed := rand.Uint64()
	c := testConfig(t, 6, 0)
	c.DeadWindow = 64 // one step of 4 x 16 tokens
	c.EvalEvery = 0
	c.CheckpointEvery = 0
	run := newTestRun(t, c, t.TempDir(), seed)
	// Kill unit 5 of layer 0: a gate row that can never fire on normalised inputs.
	l := &run.Backend.(*CPU).Params().Layers[0]
	h := c.ModelConfig().HiddenSize
	for k := 0; k < h; k++ {
		l.Gate[5*h+k] = 0
	}
	run.Cfg.ReinitDead = false
	run.StopAt = 3
	if err := run.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if run.Fires()[0][5] != 0 {
		t.Fatalf("seed %d: zero gate row fired %d times", seed, run.Fires()[0][5])
	}
	ms := readMetrics(t, run.Out)
	if ms[len(ms)-1].DeadFrac <= 0 {
		t.Fatalf("seed %d: dead fraction %g with a dead unit", seed, ms[len(ms)-1].DeadFrac)
	}
	total := int64(0)
	for _, n := range run.Fires()[1] {
		total += n
	}
	if total == 0 {
		t.Fatalf("seed %d: no firing recorded in layer 1", seed)
	}
	// With re-initialisation the unit gets a fresh, nonzero gate row.
	run.Cfg.ReinitDead = true
	run.StopAt = 0
	if err := run.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	nonzero := false
	for k := 0; k < h; k++ {
		nonzero = nonzero || l.Gate[5*h+k] != 0
	}
	if !nonzero {
		t.Fatalf("seed %d: dead unit was not re-initialised", seed)
	}
}
