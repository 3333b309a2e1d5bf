package train

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// FuzzParseConfig feeds arbitrary bytes to the training-config parser: it
// must return a config or an error, never panic, and an accepted config
// must be valid.
func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(`{"model": {"hidden_size": 8, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10, "hidden_act": "relu"}, "steps": 5, "batch": 2, "seq": 8}`))
	f.Add([]byte(`{"steps": -1}`))
	f.Add([]byte(`{"model": null}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseConfig(data)
		if err != nil {
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("accepted config is invalid: %v", err)
		}
		mc := c.ModelConfig()
		if mc.HiddenSize <= 0 || mc.VocabSize <= 0 || c.Steps <= 0 || !finite(c.LR) || !finite(c.L1) {
			t.Fatalf("accepted config with hidden %d vocab %d steps %d lr %g l1 %g", mc.HiddenSize, mc.VocabSize, c.Steps, c.LR, c.L1)
		}
	})
}

// FuzzResumeState resumes from an arbitrary trainer_state.json beside valid
// weights and optimizer state: the resume must refuse with an error that
// names the file, or succeed and train on without panicking.
func FuzzResumeState(f *testing.F) {
	c := smallConfig(f, 4)
	c.CheckpointEvery, c.EvalEvery = 2, 0
	out := f.TempDir()
	base := newTestRun(f, c, out, 1)
	base.noPlots, base.StopAt = true, 2
	if err := base.Loop(context.Background()); err != nil {
		f.Fatal(err)
	}
	path := filepath.Join(out, checkpointDir, stateFile)
	good, err := os.ReadFile(path)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	for _, edit := range []func(m map[string]any){
		func(m map[string]any) { m["last_fire"] = []any{} },
		func(m map[string]any) { m["fires"] = []any{[]any{}, []any{}} },
		func(m map[string]any) { m["step"] = -1000000 },
		func(m map[string]any) { m["step"], m["tokens"], m["adam_step"] = 4, 64, 4 },
		func(m map[string]any) { m["config"] = map[string]any{"steps": 1} },
	} {
		var m map[string]any
		json.Unmarshal(good, &m)
		edit(m)
		b, _ := json.Marshal(m)
		f.Add(b)
	}
	f.Add([]byte(`{"schema": "twell.train.state/1", "step": 1e999}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
		s, err := LoadCheckpoint(out)
		if err != nil {
			if !strings.Contains(err.Error(), stateFile) && !strings.Contains(err.Error(), "resume") || strings.Contains(err.Error(), "\n") {
				t.Fatalf("error is not one line that says what is wrong: %q", err)
			}
			return
		}
		r := newTestRun(t, c, out, 1)
		if err := r.restore(s); err != nil {
			if !strings.Contains(err.Error(), "resume") {
				t.Fatalf("error does not say what is wrong: %v", err)
			}
			return
		}
		if r.step < c.Steps {
			if _, err := r.trainStep(context.Background()); err != nil {
				t.Fatalf("a step after resuming at step %d: %v", r.step, err)
			}
		}
	})
}
