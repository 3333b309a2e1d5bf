package models

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestInTreeSearch(t *testing.T) {
	root := t.TempDir()
	write := func(p string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("{}"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// A tree whose inner models/default lacks its weights: the search goes
	// on up to the complete one.
	want := filepath.Join(root, "models", "default")
	write(filepath.Join(want, "config.json"))
	write(filepath.Join(want, "model.safetensors"))
	inner := filepath.Join(root, "a", "b")
	write(filepath.Join(inner, "models", "default", "config.json"))
	deep := filepath.Join(inner, "c", "d")
	if err := os.MkdirAll(deep, 0o755); err != nil {
		t.Fatal(err)
	}
	nowhere := t.TempDir()
	for _, starts := range [][]string{{deep}, {root}, {nowhere, deep}, {filepath.Join(root, "a")}} {
		got, err := inTree(starts...)
		if err != nil || got != want {
			t.Errorf("inTree(%q) = %q, %v; want %q", starts, got, err, want)
		}
	}
	if got, err := inTree(nowhere); err == nil || !strings.Contains(err.Error(), nowhere) {
		t.Errorf("inTree(%q) = %q, %v; want an error naming the folder", nowhere, got, err)
	}
	// This package sits in the source tree, beside the real models/default.
	if got, err := inTree("."); err != nil || filepath.Base(filepath.Dir(got)) != "models" {
		t.Errorf("inTree(.) from the package = %q, %v", got, err)
	}
}
