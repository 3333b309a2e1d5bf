package bench

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/twell-ai/twell/safetensors"
	"github.com/twell-ai/twell/synth"
)

// The files FFNOptions.DumpDir receives, so that another implementation can
// be timed on exactly the inputs of a run:
//
//	x.safetensors          "x" [M, D] BF16: input batch 0, the batch every
//	                       output check uses; "ref_rows" [n] I64: the tokens
//	                       checked against the float64 reference
//	layer-<density>.safetensors
//	                       "gate" [F, D] (gated only), "up" [F, D], "down"
//	                       [D, F], all BF16 in nn.Linear layout: the layer
//	                       of that density (<density> as strconv 'g' writes
//	                       it, e.g. layer-0.005.safetensors)
//
// Both carry __metadata__ with the shape, seed, density, distribution and
// the schema FFNInputsSchema. The values are the bf16 model the GPU run
// holds (weights and x rounded to bf16 once); a CPU run computes on the
// float32 values they were rounded from.
const FFNInputsSchema = "twell.bench.ffn.inputs/1"

// FFNLayerFile returns the name of the layer file of density in DumpDir.
func FFNLayerFile(density float64) string {
	return "layer-" + strconv.FormatFloat(density, 'g', -1, 64) + ".safetensors"
}

func ffnDumpMeta(o FFNOptions) map[string]string {
	return map[string]string{
		"schema": FFNInputsSchema,
		"m":      strconv.Itoa(o.M),
		"d":      strconv.Itoa(o.D),
		"f":      strconv.Itoa(o.F),
		"seed":   strconv.FormatUint(o.Seed, 10),
		"dist":   string(o.Dist),
		"gated":  strconv.FormatBool(o.Gated),
	}
}

// dumpFFNInputs writes x.safetensors: input batch x (M x D) and the
// reference rows.
func dumpFFNInputs(o FFNOptions, x []float32, refRows []int) error {
	w, err := safetensors.Create(filepath.Join(o.DumpDir, "x.safetensors"))
	if err != nil {
		return err
	}
	for k, v := range ffnDumpMeta(o) {
		w.SetMetadata(k, v)
	}
	rows := make([]byte, 0, 8*len(refRows))
	for _, r := range refRows {
		rows = binary.LittleEndian.AppendUint64(rows, uint64(r))
	}
	if err := w.AddFloat32("x", safetensors.BF16, []int{o.M, o.D}, x); err != nil {
		w.Abort()
		return err
	}
	if err := w.Add("ref_rows", safetensors.I64, []int{len(refRows)}, rows); err != nil {
		w.Abort()
		return err
	}
	return w.Close()
}

// dumpFFNLayer writes the layer of density to FFNLayerFile(density).
func dumpFFNLayer(o FFNOptions, density float64, sl *synth.Layer) error {
	w, err := safetensors.Create(filepath.Join(o.DumpDir, FFNLayerFile(density)))
	if err != nil {
		return err
	}
	for k, v := range ffnDumpMeta(o) {
		w.SetMetadata(k, v)
	}
	w.SetMetadata("density", strconv.FormatFloat(density, 'g', -1, 64))
	add := func(name string, shape []int, v []float32) error {
		if v == nil {
			return nil
		}
		return w.AddFloat32(name, safetensors.BF16, shape, v)
	}
	for _, t := range []struct {
		name  string
		shape []int
		v     []float32
	}{
		{"gate", []int{sl.F, sl.D}, sl.Gate},
		{"up", []int{sl.F, sl.D}, sl.Up},
		{"down", []int{sl.D, sl.F}, sl.Down},
	} {
		if err := add(t.name, t.shape, t.v); err != nil {
			w.Abort()
			return err
		}
	}
	return w.Close()
}

// checkDumpDir makes sure DumpDir, when set, is a folder that exists.
func (o FFNOptions) checkDumpDir() error {
	if o.DumpDir == "" {
		return nil
	}
	if st, err := os.Stat(o.DumpDir); err != nil || !st.IsDir() {
		return fmt.Errorf("-dump-inputs %s: not a folder", o.DumpDir)
	}
	return nil
}
