package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/safetensors"
)

func init() {
	register(command{name: "export", summary: "write a checkpoint for inference: weights only, in bf16 or f32", run: runExport})
}

// exportFiles are the files of a checkpoint, besides the weights and
// config.json, that an exported copy keeps when present.
var exportFiles = []string{"tokenizer.json", "tokenizer_config.json", "generation_config.json"}

func runExport(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("export", stderr)
	dir := fs.String("model", "", "checkpoint folder to read (config.json, model.safetensors, tokenizer.json); required")
	out := fs.String("out", "", "folder to write; must not exist or be empty; required")
	dtype := fs.String("dtype", "bf16", "weight type of the copy: bf16 or f32")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	var dt safetensors.DType
	var torch string
	switch *dtype {
	case "bf16":
		dt, torch = safetensors.BF16, "bfloat16"
	case "f32":
		dt, torch = safetensors.F32, "float32"
	default:
		return usagef("-dtype %q: want bf16 or f32", *dtype)
	}
	if *dir == "" || *out == "" {
		return usagef("-model and -out are required")
	}
	if ents, err := os.ReadDir(*out); err == nil && len(ents) > 0 {
		return fmt.Errorf("-out %s: folder is not empty; nothing written", *out)
	}
	m, _, err := loadCheckpoint(*dir, false)
	if err != nil {
		return err
	}
	parent := filepath.Dir(filepath.Clean(*out))
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return err
	}
	tmp, err := os.MkdirTemp(parent, ".export-tmp-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	if err := os.Chmod(tmp, 0o755); err != nil { // MkdirTemp makes it private
		return err
	}
	c := m.Config
	c.TorchDType = torch
	if err := model.Save(tmp, c, m.Weights, dt); err != nil {
		return err
	}
	for _, n := range exportFiles {
		b, err := os.ReadFile(filepath.Join(*dir, n))
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(tmp, n), b, 0o644); err != nil {
			return err
		}
	}
	os.Remove(*out) // an empty folder given as -out
	if err := os.Rename(tmp, *out); err != nil {
		return err
	}
	st, _ := os.Stat(filepath.Join(*out, "model.safetensors"))
	fmt.Fprintf(stderr, "export: %s: %d parameters in %s (%.1f MB)\n", *out, c.ParamCount(), *dtype, float64(st.Size())/1e6)
	return nil
}
