package bench

import (
	"encoding/binary"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/safetensors"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/twell"
)

// TestFFNDumpInputs: a run with DumpDir writes exactly the inputs it timed,
// rounded to bf16: the same numbers a second generator with the run's seed
// gives, in the documented files, tensors and metadata.
func TestFFNDumpInputs(t *testing.T) {
	dir := t.TempDir()
	o := FFNOptions{D: 16, F: 256, M: 24, Densities: []float64{0.05, 0.2}, Dist: synth.Skewed, Gated: true,
		Reps: 1, Layout: twell.Layout{Tile: 256, C: 8}, Seed: 42, RefRows: 5, DumpDir: dir}
	if _, err := FFNCPU(o, nil); err != nil {
		t.Fatal(err)
	}

	// What FFNCPU drew, in its order.
	r := rand.New(rand.NewPCG(o.Seed, 0x7e11))
	x := synth.Tokens(r, o.M, o.D)
	synth.Tokens(r, o.M, o.D)
	rows := synth.SampleRows(r, o.M, o.RefRows)

	xf, err := safetensors.Open(filepath.Join(dir, "x.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer xf.Close()
	meta := xf.Metadata()
	for k, want := range map[string]string{"schema": FFNInputsSchema, "m": "24", "d": "16", "f": "256", "seed": "42", "dist": "skewed", "gated": "true"} {
		if meta[k] != want {
			t.Errorf("x.safetensors metadata %s = %q, want %q", k, meta[k], want)
		}
	}
	expectBF16(t, xf, "x", x, o.M, o.D)
	rt, err := xf.Expect("ref_rows", safetensors.I64, len(rows))
	if err != nil {
		t.Fatal(err)
	}
	for i, row := range rows {
		if got := int(binary.LittleEndian.Uint64(rt.Data[8*i:])); got != row {
			t.Fatalf("ref_rows[%d] = %d, want %d", i, got, row)
		}
	}

	for _, density := range o.Densities {
		sl, err := synth.NewLayer(r, o.D, o.F, density, o.Dist, o.Gated)
		if err != nil {
			t.Fatal(err)
		}
		lf, err := safetensors.Open(filepath.Join(dir, FFNLayerFile(density)))
		if err != nil {
			t.Fatal(err)
		}
		if got := lf.Metadata()["density"]; got != map[float64]string{0.05: "0.05", 0.2: "0.2"}[density] {
			t.Errorf("%s: density metadata %q", FFNLayerFile(density), got)
		}
		expectBF16(t, lf, "gate", sl.Gate, o.F, o.D)
		expectBF16(t, lf, "up", sl.Up, o.F, o.D)
		expectBF16(t, lf, "down", sl.Down, o.D, o.F)
		lf.Close()
	}
}

func expectBF16(t *testing.T, f *safetensors.File, name string, want []float32, shape ...int) {
	t.Helper()
	tn, err := f.Expect(name, safetensors.BF16, shape...)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tn.Float32()
	if err != nil {
		t.Fatal(err)
	}
	for i, w := range want {
		if got[i] != bf16.Round(w) {
			t.Fatalf("%s[%d] = %g, want bf16(%g)", name, i, got[i], w)
		}
	}
}

// TestFFNDumpDirMustExist: a missing folder is refused before any work.
func TestFFNDumpDirMustExist(t *testing.T) {
	o := FFNOptions{D: 16, F: 256, M: 4, Densities: []float64{0.1}, Dist: synth.Uniform, Gated: true,
		Reps: 1, Layout: twell.Layout{Tile: 256, C: 8}, Seed: 1, DumpDir: filepath.Join(t.TempDir(), "nope")}
	if _, err := FFNCPU(o, nil); err == nil {
		t.Fatal("no error for a missing -dump-inputs folder")
	}
	if _, err := os.Stat(o.DumpDir); err == nil {
		t.Fatal("the missing folder was created")
	}
}
