//go:build !twell_noembed

package models

import (
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
)

// files holds models/default, embedded in the binary.
//
//go:embed default
var files embed.FS

// Default returns a folder holding the default model's checkpoint
// (config.json, model.safetensors, tokenizer.json and the rest), as
// model.Load and tokenizer.Load read it. The embedded files are written once
// into the user's cache folder (under twell/models, named by a hash of their
// contents) and reused from there; a damaged copy is written again.
func Default() (string, error) {
	names, sum, err := inventory()
	if err != nil {
		return "", err
	}
	// The user's cache folder, else the temporary folder when that one
	// cannot be written (a read-only home, no HOME at all).
	var roots []string
	if base, err := os.UserCacheDir(); err == nil && base != "" {
		roots = append(roots, filepath.Join(base, "twell", "models"))
	}
	roots = append(roots, filepath.Join(os.TempDir(), "twell-models"))
	var firstErr error
	for _, root := range roots {
		dir, err := materialize(root, names, sum)
		if err == nil {
			return dir, nil
		}
		if firstErr == nil {
			firstErr = err
		}
	}
	return "", fmt.Errorf("models: writing the default model: %w", firstErr)
}

// materialize writes the embedded files into root/default-HASH, unless a
// complete copy is there already, and returns that folder.
func materialize(root string, names []string, sum string) (string, error) {
	dir := filepath.Join(root, "default-"+sum[:16])
	if complete(dir, names) {
		return dir, nil
	}
	if err := os.MkdirAll(root, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(root, ".default-tmp-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	for _, n := range names {
		b, err := files.ReadFile(path.Join("default", n))
		if err != nil {
			return "", err
		}
		if err := os.WriteFile(filepath.Join(tmp, n), b, 0o644); err != nil {
			return "", err
		}
	}
	if err := os.Chmod(tmp, 0o755); err != nil { // MkdirTemp makes it private
		return "", err
	}
	if complete(dir, names) { // another process finished first
		return dir, nil
	}
	os.RemoveAll(dir) // a damaged copy
	if err := os.Rename(tmp, dir); err != nil {
		if complete(dir, names) {
			return dir, nil
		}
		return "", err
	}
	return dir, nil
}

// inventory lists the embedded files and returns a hash of their names and
// contents.
func inventory() ([]string, string, error) {
	ents, err := fs.ReadDir(files, "default")
	if err != nil {
		return nil, "", err
	}
	h := sha256.New()
	var names []string
	for _, e := range ents {
		if e.IsDir() {
			continue
		}
		b, err := files.ReadFile(path.Join("default", e.Name()))
		if err != nil {
			return nil, "", err
		}
		fmt.Fprintf(h, "%s %d\n", e.Name(), len(b))
		h.Write(b)
		names = append(names, e.Name())
	}
	if len(names) == 0 {
		return nil, "", errors.New("models: no default model embedded")
	}
	return names, hex.EncodeToString(h.Sum(nil)), nil
}

// complete reports whether dir holds every embedded file with its size.
func complete(dir string, names []string) bool {
	for _, n := range names {
		want, err := fs.Stat(files, path.Join("default", n))
		if err != nil {
			return false
		}
		got, err := os.Stat(filepath.Join(dir, n))
		if err != nil || got.Size() != want.Size() {
			return false
		}
	}
	return true
}
