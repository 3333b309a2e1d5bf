//go:build !twell_noembed

package models

import (
	"bytes"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/tokenizer"
)

func TestDefaultWritesTheEmbeddedFilesOnce(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	t.Setenv("HOME", t.TempDir())
	var wg sync.WaitGroup
	dirs := make([]string, 4)
	errs := make([]error, 4)
	for i := range dirs {
		wg.Go(func() { dirs[i], errs[i] = Default() })
	}
	wg.Wait()
	for i := range dirs {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if dirs[i] != dirs[0] {
			t.Fatalf("concurrent calls gave %q and %q", dirs[0], dirs[i])
		}
	}
	ents, _ := fs.ReadDir(files, "default")
	for _, e := range ents {
		want, _ := files.ReadFile(path.Join("default", e.Name()))
		got, err := os.ReadFile(filepath.Join(dirs[0], e.Name()))
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%s: written copy differs from the embedded file (%v)", e.Name(), err)
		}
	}
	// A damaged copy is written again.
	victim := filepath.Join(dirs[0], "model.safetensors")
	if err := os.WriteFile(victim, []byte("truncated"), 0o644); err != nil {
		t.Fatal(err)
	}
	again, err := Default()
	if err != nil || again != dirs[0] {
		t.Fatalf("after damage: %q, %v", again, err)
	}
	want, _ := files.ReadFile("default/model.safetensors")
	if got, _ := os.ReadFile(victim); !bytes.Equal(got, want) {
		t.Fatal("damaged model.safetensors not rewritten")
	}
	left, _ := filepath.Glob(filepath.Join(filepath.Dir(dirs[0]), ".default-tmp-*"))
	if len(left) != 0 {
		t.Fatalf("temporary folders left: %v", left)
	}
}

func TestDefaultLoads(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	dir, err := Default()
	if err != nil {
		t.Fatal(err)
	}
	m, err := model.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	if tok.VocabSize() > m.Config.VocabSize {
		t.Fatalf("tokenizer has %d tokens, the model %d", tok.VocabSize(), m.Config.VocabSize)
	}
	if act, _ := m.Config.GateActivation(); act != model.ActReLU {
		t.Fatalf("default model's gate is %v, want ReLU (a sparse model)", act)
	}
}

// TestDefaultFallsBackToTemp: with a cache folder that cannot be written,
// the model goes under the temporary folder.
func TestDefaultFallsBackToTemp(t *testing.T) {
	ro := filepath.Join(t.TempDir(), "ro")
	if err := os.WriteFile(ro, []byte("a file, not a folder"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("XDG_CACHE_HOME", ro) // twell/models under a file: cannot be made
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	dir, err := Default()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(dir, tmp) {
		t.Fatalf("default model written to %q, want under %q", dir, tmp)
	}
	if _, err := model.Load(dir); err != nil {
		t.Fatal(err)
	}
}
