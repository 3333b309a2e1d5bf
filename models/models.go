// Package models holds the model twell runs when none is named: a small
// sparse Llama that twell trained on its public corpus (models/default:
// README.md there says how, and what it scores). It is embedded in the
// binary, so `twell generate` works with no download and no flag. A build
// with the tag twell_noembed leaves it out (14 MB less, for binaries copied
// to a GPU machine with the source tree) and finds models/default in the
// tree instead (InTree).
package models

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
)

// DefaultName is the name the default model goes by in messages and in
// served responses.
const DefaultName = "twell-default"

// materializeDefault returns a folder holding the embedded files, written
// once into the user's cache folder (under twell/models, named by a hash of
// their contents) and reused from there; a damaged copy is written again.
func materializeDefault() (string, error) {
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

// InTree returns the models/default folder of a twell source tree holding
// one of the given folders (each folder and its parents are searched, in
// order), where it has a config.json and a model.safetensors.
func InTree(starts ...string) (string, error) {
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
