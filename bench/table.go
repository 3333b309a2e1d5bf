package bench

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Table writes one line per result row of the benchmark JSON files (what
// the bench commands' -json writes: an array of rows), for comparing runs
// at a glance: the file, the switches the run had (its TWELL_ variables,
// less the ones that name paths) and the row's headline figures by schema.
// MLP-block rows (FFNSchema) give the dense, TwELL and automatic times;
// training rows (TrainMLPSchema, TrainStepSchema) their times and rates;
// serving rows (ServeSchema) throughput and latency medians;
// whole-model rows (ModelSchema) the prefill rate and each decode batch's
// tokens/s (on the GPU's TwELL path with the layers that ran sparse), and
// a file with both paths adds a line of TwELL / dense ratios; kernel
// traces in a row add a line each.
// Rows of other schemas give their schema and date. A folder stands for
// the .json files in it. A file holds an array of rows or one row; other
// files (Chrome traces, say) are skipped with a note; a file that cannot be
// read or parsed is an error naming it.
func Table(w io.Writer, paths []string) error {
	files, err := tableFiles(paths)
	if err != nil {
		return err
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		if err := tableFile(w, filepath.Base(f), b); err != nil {
			return fmt.Errorf("%s: %w", f, err)
		}
	}
	return nil
}

// tableFiles expands folders into their .json files, in name order.
func tableFiles(paths []string) ([]string, error) {
	if len(paths) == 0 {
		return nil, errors.New("no files given")
	}
	var files []string
	for _, p := range paths {
		st, err := os.Stat(p)
		if err != nil {
			return nil, err
		}
		if !st.IsDir() {
			files = append(files, p)
			continue
		}
		m, err := filepath.Glob(filepath.Join(p, "*.json"))
		if err != nil {
			return nil, err
		}
		slices.Sort(m)
		files = append(files, m...)
	}
	return files, nil
}

// tableFile writes the lines of the rows of file name, whose contents are
// b.
func tableFile(w io.Writer, name string, b []byte) error {
	var rows []json.RawMessage
	if err := json.Unmarshal(b, &rows); err != nil {
		var ute *json.UnmarshalTypeError
		if !errors.As(err, &ute) {
			return err
		}
		// One row on its own (bench serve writes one), or something else.
		var head Row
		if json.Unmarshal(b, &head) != nil || head.Schema == "" {
			fmt.Fprintf(w, "%s: not a result row or a list of them, skipped\n", name)
			return nil
		}
		rows = []json.RawMessage{b}
	}
	var models []ModelResult
	for _, raw := range rows {
		var head Row
		if err := json.Unmarshal(raw, &head); err != nil {
			return err
		}
		sw := switchString(head.Switches)
		switch rowSchema(head.Schema, raw) {
		case FFNSchema:
			var r FFNResult
			if err := json.Unmarshal(raw, &r); err != nil {
				return err
			}
			fmt.Fprintf(w, "%s%s: ffn m %d, %.3g%% %s: dense %.4g ms, twell %.4g ms (%.2fx", name, sw, r.M, 100*r.Density, r.Dist,
				r.DenseMS, r.TwELLMS, r.Speedup)
			if r.Tail != "" {
				fmt.Fprintf(w, ", %s tail", r.Tail)
			}
			fmt.Fprint(w, ")")
			if r.AutoMS > 0 {
				fmt.Fprintf(w, ", auto %.4g ms (%.2fx, %s)", r.AutoMS, r.AutoSpeedup, r.autoDesc())
			}
			if r.DenseD2TMS > 0 {
				fmt.Fprintf(w, ", dense in D2T %.4g ms (%.2fx)", r.DenseD2TMS, r.DenseMS/r.DenseD2TMS)
			}
			fmt.Fprintf(w, ", rel err %.2g\n", r.RelErr)
			traceLine(w, name, "dense", r.DenseTrace)
			traceLine(w, name, "twell", r.TwELLTrace)
		case ModelSchema:
			var r ModelCUDAResult // a CPU row leaves the GPU fields empty
			if err := json.Unmarshal(raw, &r); err != nil {
				return err
			}
			models = append(models, r.ModelResult)
			fmt.Fprintf(w, "%s%s: model %s: prefill %.4g tokens/ms (%.2fx dense)", name, sw, r.Path, r.PrefillTokPerMS, r.Speedup)
			for _, d := range r.Decode {
				fmt.Fprintf(w, ", b%d@%d %.5g tokens/s", d.Batch, d.Context, d.TokensPerSec)
				if d.GreedyTokensPerSec > 0 {
					fmt.Fprintf(w, " (greedy decoder %.5g)", d.GreedyTokensPerSec)
				}
				if d.DrawnTokensPerSec > 0 {
					fmt.Fprintf(w, " (drawing decoder %.5g)", d.DrawnTokensPerSec)
				}
				if r.Path == "twell" && d.Steps > 0 {
					fmt.Fprintf(w, " (%d sparse layers)", d.SparseLayers)
				}
			}
			fmt.Fprintln(w)
			traceLine(w, name, r.Path+" prefill", r.PrefillTrace)
			for _, d := range r.Decode {
				traceLine(w, name, fmt.Sprintf("%s decode b%d", r.Path, d.Batch), d.Trace)
			}
		case TrainMLPSchema:
			var r TrainMLPResult
			if err := json.Unmarshal(raw, &r); err != nil {
				return err
			}
			fmt.Fprintf(w, "%s%s: train-mlp m %d, %.3g%% %s: dense %.4g ms, sparse %.4g ms (%.2fx), auto %.4g ms (%.2fx, %s)\n",
				name, sw, r.M, 100*r.Density, r.Dist, r.DenseMS, r.TwellMS, r.Speedup, r.AutoMS, r.AutoSpeedup, r.AutoPath)
		case TrainStepSchema:
			var r TrainStepResult
			if err := json.Unmarshal(raw, &r); err != nil {
				return err
			}
			fmt.Fprintf(w, "%s%s: train-step %s, %d x %d tokens: %.4g ms a step, %.4g tokens/ms, MFU %.1f%%, %d sparse layers\n",
				name, sw, r.Path, r.Batch, r.Seq, r.StepMS, r.TokensPerMS, 100*r.MFU, r.SparseLayers)
		case ServeSchema:
			var r ServeResult
			if err := json.Unmarshal(raw, &r); err != nil {
				return err
			}
			fmt.Fprintf(w, "%s%s: serve %d/%d requests: %.4g output tokens/s, TTFT median %.4g ms, TPOT median %.4g ms\n",
				name, sw, r.Completed, r.Requests, r.OutputTokPerS, r.TTFT.Median, r.TPOT.Median)
		default:
			fmt.Fprintf(w, "%s%s: %s, %s\n", name, sw, cmp.Or(head.Schema, "unknown schema"), head.Date)
		}
	}
	modelRatios(w, name, models)
	return nil
}

// traceTop is how many kernels a trace line names.
const traceTop = 5

// traceLine writes a kernel trace's summary, when there is one: the GPU's
// busy time a step against the host's, and the kernels that add the most
// to a step.
func traceLine(w io.Writer, name, what string, t *TraceSummary) {
	if t == nil {
		return
	}
	fmt.Fprintf(w, "%s:   trace %s: busy %.4g of %.4g ms a step, %.0f kernels;", name, what, t.BusyMS, t.WallMS, t.KernelsPerStep)
	for i, k := range t.Kernels {
		if i == traceTop {
			break
		}
		fmt.Fprintf(w, " %s %.3g us", k.Name, k.AddsUS)
	}
	fmt.Fprintln(w)
}

// rowSchema returns a row's schema; rows written before rows named their
// schema are told by their fields (an MLP-block row has twell_ms, a model
// row decode).
func rowSchema(schema string, raw json.RawMessage) string {
	if schema != "" {
		return schema
	}
	var fields map[string]json.RawMessage
	if json.Unmarshal(raw, &fields) != nil {
		return ""
	}
	switch {
	case fields["twell_ms"] != nil:
		return FFNSchema
	case fields["decode"] != nil:
		return ModelSchema
	}
	return ""
}

// modelRatios writes, for each TwELL row of a file's model rows (variants
// included, named by the switches they set over the dense row's), its
// decode ratios to the dense row's.
func modelRatios(w io.Writer, name string, models []ModelResult) {
	i := slices.IndexFunc(models, func(r ModelResult) bool { return r.Path == "dense" })
	if i < 0 {
		return
	}
	dense := models[i]
	for _, t := range models {
		if t.Path != "twell" {
			continue
		}
		label := "twell"
		if d := SwitchDiff(t.Switches, dense.Switches); d != "" {
			label += " [" + d + "]"
		}
		fmt.Fprintf(w, "%s: %s / dense:", name, label)
		for _, tp := range t.Decode {
			for _, dp := range dense.Decode {
				if dp.Batch == tp.Batch && dp.Context == tp.Context && dp.TokensPerSec > 0 {
					fmt.Fprintf(w, " b%d@%d %.3fx", tp.Batch, tp.Context, tp.TokensPerSec/dp.TokensPerSec)
					if dp.GreedyTokensPerSec > 0 {
						fmt.Fprintf(w, " (greedy decoder %.3fx)", tp.GreedyTokensPerSec/dp.GreedyTokensPerSec)
					}
				}
			}
		}
		fmt.Fprintln(w)
	}
}

// SwitchDiff lists, in the form of SwitchList, the switches of sw that
// base lacks or sets otherwise ("" when they agree).
func SwitchDiff(sw, base map[string]string) string {
	d := map[string]string{}
	for k, v := range sw {
		if b, ok := base[k]; !ok || b != v {
			d[k] = v
		}
	}
	return SwitchList(d)
}

// switchString is SwitchList in brackets after a space, or "" for none.
func switchString(sw map[string]string) string {
	if l := SwitchList(sw); l != "" {
		return " [" + l + "]"
	}
	return ""
}

// SwitchList lists a row's switches (Row.Switches) as "NAME=VALUE ..."
// with the TWELL_ prefix dropped, in name order, leaving out values that
// are paths; "" for none.
func SwitchList(sw map[string]string) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(sw)) {
		v := sw[k]
		if strings.Contains(v, "/") {
			continue
		}
		parts = append(parts, strings.TrimPrefix(k, "TWELL_")+"="+v)
	}
	return strings.Join(parts, " ")
}
