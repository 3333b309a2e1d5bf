package main

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/model"
)

func TestExportBF16(t *testing.T) {
	src := tinyCheckpoint(t)
	out := filepath.Join(t.TempDir(), "exported")
	var errb bytes.Buffer
	if code := run([]string{"export", "-model", src, "-out", out}, io.Discard, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	a, err := model.Load(src)
	if err != nil {
		t.Fatal(err)
	}
	b, err := model.Load(out)
	if err != nil {
		t.Fatal(err)
	}
	if b.Config.TorchDType != "bfloat16" {
		t.Errorf("torch_dtype %q, want bfloat16", b.Config.TorchDType)
	}
	// Every weight is the bf16 rounding of the source's.
	wa, wb := a.Weights.Embed, b.Weights.Embed
	for i := range wa {
		if want := bf16.ToFloat32(bf16.FromFloat32(wa[i])); wb[i] != want {
			t.Fatalf("embedding %d: %g, want %g", i, wb[i], want)
		}
	}
	for _, n := range []string{"tokenizer.json", "config.json", "model.safetensors"} {
		if _, err := os.Stat(filepath.Join(out, n)); err != nil {
			t.Errorf("%s missing: %v", n, err)
		}
	}
	// A second export into the same folder is refused, and the folder kept.
	errb.Reset()
	if code := run([]string{"export", "-model", src, "-out", out}, io.Discard, &errb); code == 0 || !strings.Contains(errb.String(), "not empty") {
		t.Errorf("export into a full folder: exit %d, %q", code, errb.String())
	}
	if _, err := model.Load(out); err != nil {
		t.Errorf("the refused export damaged the folder: %v", err)
	}
}

func TestExportBadInput(t *testing.T) {
	for _, args := range [][]string{
		{"export", "-model", "x"},
		{"export", "-model", "x", "-out", "y", "-dtype", "f8"},
	} {
		var errb bytes.Buffer
		if code := run(args, io.Discard, &errb); code != 2 {
			t.Errorf("%v: exit %d (%s), want 2", args, code, errb.String())
		}
	}
}
