package safetensors

import (
	"encoding/hex"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// TestReadPythonWritten reads files written by testdata/hf_compat.py with Python safetensors
// 0.8 (torch 2.11) and transformers 5.17: a copy kept in testdata/python, or the script's
// whole output (with a transformers sharded checkpoint) when TWELL_PY_COMPAT_DIR names it.
func TestReadPythonWritten(t *testing.T) {
	dir := os.Getenv("TWELL_PY_COMPAT_DIR")
	if dir == "" {
		dir = filepath.Join("testdata", "python")
	}
	var want map[string]struct {
		DType string    `json:"dtype"`
		Shape []int     `json:"shape"`
		Hex   string    `json:"hex"`
		F32   []float32 `json:"f32"`
	}
	testutil.ReadJSON(t, filepath.Join(dir, "py.json"), &want)
	f, err := Open(filepath.Join(dir, "py.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if f.Metadata()["k"] != "v" {
		t.Errorf("metadata %v", f.Metadata())
	}
	for name, w := range want {
		tt, err := f.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(tt.Shape, w.Shape) || hex.EncodeToString(tt.Data) != w.Hex {
			t.Errorf("%s (torch %s): got %s %v, want shape %v and the same bytes", name, w.DType, tt.DType, tt.Shape, w.Shape)
		}
		if w.F32 != nil {
			got, err := tt.Float32()
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, w.F32) {
				t.Errorf("%s: float32 values %v, want %v", name, got, w.F32)
			}
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "hf_sharded")); err != nil {
		return
	}
	c, err := OpenDir(filepath.Join(dir, "hf_sharded"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if len(c.Files()) < 2 || !c.Has("model.layers.1.mlp.down_proj.weight") {
		t.Errorf("transformers checkpoint: %d files, names %s", len(c.Files()), strings.Join(c.Names(), " "))
	}
	t.Logf("transformers checkpoint: %d shards, %d tensors", len(c.Files()), len(c.Names()))
}
