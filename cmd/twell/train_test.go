package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestTrainTinyAndResume(t *testing.T) {
	out := t.TempDir()
	var so, se bytes.Buffer
	if code := run([]string{"train", "-preset", "tiny", "-steps", "12", "-out", out}, &so, &se); code != 0 {
		t.Fatalf("exit %d: %s", code, se.String())
	}
	for _, f := range []string{"metrics.jsonl", "loss.png", "l0.png", "dead.png", "tokenizer.json", "checkpoint/model.safetensors", "checkpoint/tokenizer.json"} {
		if _, err := os.Stat(filepath.Join(out, f)); err != nil {
			t.Errorf("missing %s", f)
		}
	}
	b, _ := os.ReadFile(filepath.Join(out, "metrics.jsonl"))
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	var last map[string]any
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &last); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"step", "tokens", "loss", "l1", "l0", "dead_frac", "val_loss"} {
		if _, ok := last[k]; !ok {
			t.Errorf("metrics line lacks %q: %s", k, lines[len(lines)-1])
		}
	}
	// The trained checkpoint generates text.
	var g bytes.Buffer
	if code := run([]string{"generate", "-model", filepath.Join(out, "checkpoint"), "-prompt", "The fox", "-max-tokens", "5", "-temperature", "0"}, &g, &se); code != 0 {
		t.Fatalf("generate on the trained checkpoint: exit %d: %s", code, se.String())
	}
	// Training into a folder with a checkpoint needs -resume; nothing is overwritten.
	se.Reset()
	if code := run([]string{"train", "-preset", "tiny", "-steps", "12", "-out", out}, &so, &se); code != 1 || !strings.Contains(se.String(), "-resume") {
		t.Errorf("second run without -resume: exit %d, %q", code, se.String())
	}
	// Resuming a finished run extends it when asked for more steps.
	se.Reset()
	if code := run([]string{"train", "-preset", "tiny", "-steps", "14", "-out", out, "-resume"}, &so, &se); code != 0 || !strings.Contains(se.String(), "resuming") {
		t.Errorf("resume: exit %d, %q", code, se.String())
	}
}

func TestTrainBadInput(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.json")
	os.WriteFile(bad, []byte(`{"steps": 5}`), 0o644)
	mismatch := filepath.Join(dir, "mismatch.json")
	os.WriteFile(mismatch, []byte(`{"model": {"hidden_size": 16, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10, "hidden_act": "relu"}, "steps": 5, "batch": 2, "seq": 8}`), 0o644)
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"train", "-out", dir}, 2, "exactly one of -config FILE or -preset NAME"},
		{[]string{"train", "-preset", "tiny"}, 2, "-out is required"},
		{[]string{"train", "-preset", "huge", "-out", filepath.Join(dir, "o1")}, 2, "unknown preset"},
		{[]string{"train", "-config", bad, "-out", filepath.Join(dir, "o2")}, 1, `field "model" missing`},
		{[]string{"train", "-config", mismatch, "-out", filepath.Join(dir, "o3")}, 1, "vocabulary mismatch"},
		{[]string{"train", "-preset", "tiny", "-out", filepath.Join(dir, "o4"), "-resume"}, 1, "no readable checkpoint"},
		{[]string{"train", "-preset", "tiny", "-out", filepath.Join(dir, "o5"), "-data", dir, "-tokenizer", "x.json"}, 1, "x.json"},
	}
	for _, c := range cases {
		var so, se bytes.Buffer
		code := run(c.args, &so, &se)
		if code != c.code || !strings.Contains(se.String(), c.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit %d with %q", c.args, code, se.String(), c.code, c.want)
		}
	}
}
