//go:build twell_noembed

package models

import (
	"path/filepath"
	"testing"

	"github.com/twell-ai/twell/model"
)

// TestDefaultFromTree: without the embedded files, Default finds the
// source tree's models/default from the working folder (the package's).
func TestDefaultFromTree(t *testing.T) {
	dir, err := Default()
	if err != nil {
		t.Fatal(err)
	}
	if want, _ := filepath.Abs("default"); dir != want {
		t.Fatalf("Default() = %q, want %q", dir, want)
	}
	if _, err := model.Load(dir); err != nil {
		t.Fatal(err)
	}
}
