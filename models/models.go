// Package models holds the model twell runs when none is named: a small
// sparse Llama that twell trained on its public corpus (models/default:
// README.md there says how, and what it scores). It is embedded in the
// binary, so `twell generate` works with no download and no flag. A build
// with the tag twell_noembed leaves it out (14 MB less, for binaries copied
// to a GPU machine with the source tree) and finds models/default in the
// source tree it runs in instead.
package models

import (
	"fmt"
	"os"
	"path/filepath"
)

// DefaultName is the name the default model goes by in messages and in
// served responses.
const DefaultName = "twell-default"

// inTree returns the models/default folder of a twell source tree holding
// one of the given folders (each folder and its parents are searched, in
// order), where it has a config.json and a model.safetensors.
func inTree(starts ...string) (string, error) {
	for _, start := range starts {
		dir, err := filepath.Abs(start)
		if err != nil {
			continue
		}
		for {
			cand := filepath.Join(dir, "models", "default")
			if isFile(filepath.Join(cand, "config.json")) && isFile(filepath.Join(cand, "model.safetensors")) {
				return cand, nil
			}
			up := filepath.Dir(dir)
			if up == dir {
				break
			}
			dir = up
		}
	}
	return "", fmt.Errorf("models: no models/default folder with a checkpoint in %q or a folder above", starts)
}

// isFile reports whether p is a regular file.
func isFile(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular()
}
