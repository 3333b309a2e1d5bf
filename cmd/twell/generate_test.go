package main

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/safetensors"
)

// tinyCheckpoint writes a small random sparse model with the Llama-2
// tokenizer from the tokenizer tests into a temporary folder (64 positions;
// see enginetest.TinyModel).
func tinyCheckpoint(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	m, _ := enginetest.TinyModel(t, 64)
	_, raw := enginetest.Llama2Tokenizer(t)
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), raw, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := model.Save(dir, m.Config, m.Weights, safetensors.BF16); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestGenerateRunsOnCPU(t *testing.T) {
	dir := tinyCheckpoint(t)
	var out, errb bytes.Buffer
	code := run([]string{"generate", "-model", dir, "-prompt", "Once upon a time", "-max-tokens", "12", "-temperature", "0", "-device", "cpu"}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if !strings.Contains(errb.String(), "decode:") || !strings.Contains(errb.String(), "MLP active units") {
		t.Errorf("statistics missing from stderr: %q", errb.String())
	}
	if strings.Contains(out.String(), "decode:") {
		t.Errorf("statistics leaked into stdout: %q", out.String())
	}
	// Greedy decoding is deterministic.
	var out2 bytes.Buffer
	run([]string{"generate", "-model", dir, "-prompt", "Once upon a time", "-max-tokens", "12", "-temperature", "0"}, &out2, io.Discard)
	if out.String() != out2.String() {
		t.Errorf("greedy runs differ: %q vs %q", out.String(), out2.String())
	}
}

// TestGenerateDefaultModel: with no -model, generate runs the embedded
// default model and says so.
func TestGenerateDefaultModel(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	var out, errb bytes.Buffer
	code := run([]string{"generate", "-prompt", "The", "-max-tokens", "8", "-temperature", "0", "-device", "cpu"}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if !strings.Contains(errb.String(), "default model") || strings.TrimSpace(out.String()) == "" {
		t.Errorf("stdout %q, stderr %q: want generated text and a note naming the default model", out.String(), errb.String())
	}
}

func TestGenerateBadInput(t *testing.T) {
	empty := t.TempDir()
	file := filepath.Join(empty, "config.json")
	if err := os.WriteFile(file, []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"generate", "-model", "/nonexistent", "-prompt", "x"}, 1, "model /nonexistent: stat /nonexistent: no such file"},
		{[]string{"generate", "-model", file, "-prompt", "x"}, 1, "not a folder"},
		{[]string{"generate", "-model", empty, "-prompt", "x"}, 1, "no tokenizer.json"},
		{[]string{"generate", "-model", ".", "-temperature", "-1"}, 2, "temperature"},
		{[]string{"generate", "-model", ".", "-top-p", "2"}, 2, "top-p"},
		{[]string{"generate", "-model", ".", "-max-tokens", "0"}, 2, "-max-tokens 0"},
	}
	for _, c := range cases {
		var out, errb bytes.Buffer
		code := run(c.args, &out, &errb)
		if code != c.code || !strings.Contains(errb.String(), c.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit %d mentioning %q", c.args, code, errb.String(), c.code, c.want)
		}
	}
}

// TestGeneratePromptFromStdin: a piped prompt (no -prompt, or -prompt -)
// gives the same greedy text as the flag.
func TestGeneratePromptFromStdin(t *testing.T) {
	dir := tinyCheckpoint(t)
	base := []string{"generate", "-model", dir, "-max-tokens", "6", "-temperature", "0", "-device", "cpu"}
	var want, errb bytes.Buffer
	if code := run(append(base, "-prompt", "Once upon a time"), &want, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	defer func(r io.Reader) { stdin = r }(stdin)
	for _, extra := range [][]string{nil, {"-prompt", "-"}} {
		stdin = strings.NewReader("Once upon a time\n")
		var out bytes.Buffer
		errb.Reset()
		if code := run(append(base, extra...), &out, &errb); code != 0 {
			t.Fatalf("%v: exit %d: %s", extra, code, errb.String())
		}
		if out.String() != want.String() {
			t.Errorf("%v: stdin prompt gave %q, -prompt gave %q", extra, out.String(), want.String())
		}
	}
}

// TestGenerateSaysContextFull: a generation cut by the model's context
// reports "context full" with the token count, not "max tokens".
func TestGenerateSaysContextFull(t *testing.T) {
	dir := tinyCheckpoint(t) // 64 positions
	prompt := strings.Repeat("a b ", 28)
	var out, errb bytes.Buffer
	if code := run([]string{"generate", "-model", dir, "-prompt", prompt, "-max-tokens", "100", "-temperature", "0", "-device", "cpu"}, &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if !strings.Contains(errb.String(), "stopped: context full (64 tokens") {
		t.Errorf("stderr %q: want the context-full stop with 64 tokens", errb.String())
	}
}
