package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/twell-ai/twell/backend"
	"github.com/twell-ai/twell/bench"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/internal/atomicfile"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/synth"
)

func init() {
	register(command{name: "bench model", summary: "whole-model prefill and decode speed, dense vs TwELL", run: runBenchModel})
}

func runBenchModel(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench model", stderr)
	dir := fs.String("model", "", "checkpoint folder (config.json + model.safetensors)")
	preset := fs.String("preset", "", "random weights at a known shape: sparselm-1.5b")
	layers := fs.Int("layers", 0, "with -preset: keep only the first N layers, 1 to the preset's 28 (default: all)")
	density := fs.Float64("density", 0.005, "with -preset: fraction of MLP units active per token")
	dist := fs.String("dist", "skewed", "with -preset: per-unit firing rates, uniform or skewed")
	batch := fs.Int("batch", 2, "prefill: sequences per forward pass (cuda: default 64)")
	promptLen := fs.Int("prompt-len", 128, "prefill: tokens per sequence (cuda: default 2048)")
	decodeBatch := fs.String("decode-batch", "1,8", "decode: comma-separated batch sizes (cuda: default 1,8,64)")
	decodeSteps := fs.Int("decode-steps", 8, "decode: timed steps per batch size")
	decodeContext := fs.Int("decode-context", 16, "decode: tokens cached per sequence before the timed steps")
	reps := fs.Int("reps", 3, "repetitions, median reported")
	device := fs.String("device", "auto", backend.FlagUsage)
	seed := fs.Uint64("seed", 0, "random seed (0: fresh, printed)")
	jsonPath := fs.String("json", "", "write the results as JSON to this file")
	plotPath := fs.String("plot", "", "write a PNG of prefill tokens/ms and decode tokens/s per path to this file")
	save := fs.String("save", "", "also write the benchmarked model as a Hugging Face checkpoint (bf16) to this folder")
	trace := fs.String("trace", "", "cuda: record the kernels (CUPTI) of one more prefill pass and of -trace-steps more decode steps per batch, and write them to this file as a Chrome trace (Perfetto opens it); per-kernel summaries go to the JSON and stderr")
	traceSteps := fs.Int("trace-steps", 0, "cuda: decode steps per batch to trace (default 16 with -trace or -trace-plot)")
	tracePlot := fs.String("trace-plot", "", "cuda: write a PNG of what each kernel adds to a prefill pass and to a decode step, per path, to this file (traces as -trace does)")
	variants := fs.String("variants", "", "cuda: after the dense and TwELL paths, the TwELL path again on an engine per variant of the GPU engine's switches, a result row each: variants separated by ';', each NAME=VALUE ... (names with or without TWELL_, e.g. 'LLM_FUSE_NORMS=0;LLM_ATTENTION=mma TAIL=sorted'), over the environment's")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	kind, err := backend.Parse(*device)
	if err != nil {
		return usagef("%v", err)
	}
	if kind, _ = backend.Resolve(kind, nil); kind == backend.CUDA {
		if n, err := cuda.Count(); err != nil || n == 0 {
			return fmt.Errorf("-device cuda: no GPU found (%v)", err)
		}
		*device = "cuda"
	} else {
		*device = "cpu"
	}
	if set := setFlags(fs); set["layers"] && *layers < 1 {
		return usagef("-layers %d: must be between 1 and the preset's 28", *layers)
	}
	if *traceSteps < 0 {
		return usagef("-trace-steps %d must not be negative", *traceSteps)
	}
	if (*trace != "" || *tracePlot != "") && *traceSteps == 0 {
		*traceSteps = 16
	}
	if *traceSteps > 0 && *device != "cuda" {
		return usagef("-trace, -trace-steps and -trace-plot record GPU kernels: they need -device cuda")
	}
	if *device == "cuda" { // GPU-sized defaults for the flags not given
		set := setFlags(fs)
		if !set["batch"] {
			*batch = 64
		}
		if !set["prompt-len"] {
			*promptLen = 2048
		}
		if !set["decode-batch"] {
			*decodeBatch = "1,8,64"
		}
	}
	d, err := synth.ParseDist(*dist)
	if err != nil {
		return usagef("-dist: %v", err)
	}
	var batches []int
	for _, s := range strings.Split(*decodeBatch, ",") {
		b, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			return usagef("-decode-batch: %q is not an integer", s)
		}
		batches = append(batches, b)
	}
	if *seed == 0 {
		*seed = rand.Uint64()
	}
	o := bench.ModelOptions{Dir: *dir, Preset: *preset, Layers: *layers, Density: *density, Dist: d,
		Batch: *batch, PromptLen: *promptLen, DecodeBatches: batches, DecodeSteps: *decodeSteps, DecodeContext: *decodeContext, Reps: *reps, Seed: *seed,
		SaveDir: *save, TraceSteps: *traceSteps}
	if *variants != "" {
		if *device != "cuda" {
			return usagef("-variants set the GPU engine's switches: they need -device cuda")
		}
		if o.Variants, err = bench.ParseModelVariants(*variants); err != nil {
			return usagef("-variants: %v", err)
		}
	}
	if err := o.Validate(); err != nil {
		return usageError{err.Error()}
	}
	if err := checkWritable(*jsonPath, *plotPath, *trace, *tracePlot); err != nil {
		return err
	}
	if *device == "cuda" {
		return benchModelCUDA(o, *jsonPath, *plotPath, *trace, *tracePlot, stdout, stderr)
	}
	fmt.Fprintf(stderr, "bench model: %s, seed %d\n", bench.CPUName(), *seed)
	rs, err := bench.ModelCPU(o, func(s string) { fmt.Fprintln(stderr, "  "+s) })
	if err != nil {
		return err
	}
	printModelTable(stdout, rs, nil)
	fmt.Fprintf(stderr, "model: %s, %s parameters; peak RSS %s; energy per token: not readable on this CPU\n",
		rs[0].Model, countString(rs[0].Params), memcheck.Format(float64(rs[len(rs)-1].PeakRSSBytes)))
	return writeResults(*jsonPath, rs, *plotPath, func() error { return bench.PlotModel(rs, *plotPath) })
}

// benchModelCUDA runs bench model on the GPU and prints its table; with
// tracePath and tracePlot it writes the kernel trace and its plot there.
func benchModelCUDA(o bench.ModelOptions, jsonPath, plotPath, tracePath, tracePlot string, stdout, stderr io.Writer) error {
	fmt.Fprintf(stderr, "bench model (cuda): seed %d\n", o.Seed)
	rs, err := bench.ModelCUDA(o, func(s string) { fmt.Fprintln(stderr, "  "+s) })
	if err != nil {
		return err
	}
	base := make([]bench.ModelResult, len(rs))
	peak := make([]int64, len(rs))
	for i, r := range rs {
		base[i], peak[i] = r.ModelResult, r.PeakDeviceBytes
	}
	bench.NameVariants(base) // the variants named in the table and plot
	printModelTable(stdout, base, peak)
	for i, r := range rs {
		if line := powerLine(r); line != "" {
			fmt.Fprintf(stdout, "%s: %s\n", base[i].Path, line)
		}
	}
	r := rs[0]
	fmt.Fprintf(stderr, "model: %s, %s parameters on %s; weights %s, prefill KV caches %s; %d of %d layers on TwELL MLPs; GPU vs CPU logits %.1e\n",
		r.Model, countString(r.Params), r.Machine, memcheck.Format(float64(r.WeightBytes)), memcheck.Format(float64(r.KVCacheBytes)),
		r.TwELLLayers, len(rs[1].MLPActive), r.CPUCheckRelDiff)
	if err := writeResults(jsonPath, rs, plotPath, func() error { return bench.PlotModel(base, plotPath) }); err != nil {
		return err
	}
	var failed []string
	for _, r := range rs {
		failed = append(failed, r.TraceErrors()...)
	}
	if err := tracesFailed(failed); err != nil {
		return err
	}
	if tracePlot != "" {
		labeled := slices.Clone(rs) // the variants named, as in the table
		for i := range labeled {
			labeled[i].Path = base[i].Path
		}
		if err := bench.PlotModelTraces(labeled, tracePlot); err != nil {
			return fmt.Errorf("trace plot (the JSON is written): %w", err)
		}
	}
	var secs []bench.TraceSection
	for _, r := range rs {
		secs = append(secs, r.Traces...)
	}
	return writeTrace(tracePath, secs)
}

// tracesFailed returns an error listing the tracer's failures, if any; the
// results are written before it is returned.
func tracesFailed(failed []string) error {
	if len(failed) == 0 {
		return nil
	}
	return fmt.Errorf("the kernel traces failed (the results are written): %s", strings.Join(failed, "; "))
}

// writeTrace writes the traced kernels to path (if set) as a Chrome trace.
func writeTrace(path string, secs []bench.TraceSection) error {
	if path == "" {
		return nil
	}
	var buf bytes.Buffer
	if err := bench.WriteChromeTrace(&buf, secs); err != nil {
		return err
	}
	return atomicfile.WriteFile(path, buf.Bytes())
}

// writeResults writes v as JSON to jsonPath (if set), then the plot (if
// plotPath is set), so that a failed plot loses no results.
func writeResults(jsonPath string, v any, plotPath string, plot func() error) error {
	if jsonPath != "" {
		b, err := json.MarshalIndent(v, "", "  ")
		if err != nil {
			return err
		}
		if err := atomicfile.WriteFile(jsonPath, append(b, '\n')); err != nil {
			return err
		}
	}
	if plotPath != "" {
		if err := plot(); err != nil {
			return fmt.Errorf("plot (the JSON is written): %w", err)
		}
	}
	return nil
}

// countString writes a count with a decimal unit: "1.54B", "3.1M", "950".
func countString(n int64) string {
	switch v := float64(n); {
	case v >= 1e9:
		return fmt.Sprintf("%.2fB", v/1e9)
	case v >= 1e6:
		return fmt.Sprintf("%.1fM", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%.1fK", v/1e3)
	}
	return fmt.Sprint(n)
}

// setFlags returns the names of the flags given on the command line.
func setFlags(fs *flag.FlagSet) map[string]bool {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	return set
}

// powerLine describes the power and clocks of r's prefill energy window:
// "prefill at 688 W of a 700 W limit, SM clock 1530 of 1980 MHz, power cap
// in 100% of samples", or "" without energy figures.
func powerLine(r bench.ModelCUDAResult) string {
	if r.PrefillWatts == 0 {
		return ""
	}
	s := fmt.Sprintf("prefill at %.0f W", r.PrefillWatts)
	if r.PowerLimitWatts > 0 {
		s += fmt.Sprintf(" of a %.0f W limit", r.PowerLimitWatts)
	}
	if r.PrefillSMClockMHz > 0 {
		s += fmt.Sprintf(", SM clock %d", r.PrefillSMClockMHz)
		if r.MaxSMClockMHz > 0 {
			s += fmt.Sprintf(" of %d", r.MaxSMClockMHz)
		}
		s += " MHz"
	}
	if r.PrefillPowerCapped != nil {
		s += fmt.Sprintf(", power cap in %.0f%% of samples", 100**r.PrefillPowerCapped)
	}
	return s
}

// printModelTable prints one row per path; with peak device memory per path
// (the GPU), it adds that and energy per token.
func printModelTable(w io.Writer, rs []bench.ModelResult, peak []int64) {
	gpu := peak != nil
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "path\tprefill tokens\tprefill ms\ttokens/ms\tspeedup\t")
	for _, p := range rs[0].Decode {
		fmt.Fprintf(tw, "decode b=%d tok/s\t", p.Batch)
	}
	if gpu {
		for _, p := range rs[0].Decode {
			fmt.Fprintf(tw, "greedy b=%d tok/s\t", p.Batch)
		}
		for _, p := range rs[0].Decode {
			fmt.Fprintf(tw, "drawn b=%d tok/s\t", p.Batch)
		}
	}
	fmt.Fprint(tw, "MLP active/token\tmax |dlogit|\t")
	if gpu {
		fmt.Fprint(tw, "peak GiB\tmJ/token\t")
	}
	fmt.Fprintln(tw)
	for i, r := range rs {
		fmt.Fprintf(tw, "%s\t%d\t%.1f\t%.3f\t%.2fx\t", r.Path, r.PrefillTokens, r.PrefillMS, r.PrefillTokPerMS, r.Speedup)
		for _, p := range r.Decode {
			fmt.Fprintf(tw, "%.1f\t", p.TokensPerSec)
		}
		if gpu {
			for _, p := range r.Decode {
				fmt.Fprintf(tw, "%.1f\t", p.GreedyTokensPerSec)
			}
			for _, p := range r.Decode {
				fmt.Fprintf(tw, "%.1f\t", p.DrawnTokensPerSec)
			}
		}
		act := "-"
		if len(r.MLPActive) > 0 {
			s := 0.0
			for _, a := range r.MLPActive {
				s += a
			}
			act = fmt.Sprintf("%.1f of %d", s/float64(len(r.MLPActive)), r.MLPWidth)
		}
		fmt.Fprintf(tw, "%s\t%.2g\t", act, r.MaxLogitDiff)
		if gpu {
			energy := "-"
			if r.JoulesPerToken != nil {
				energy = fmt.Sprintf("%.3f", 1000**r.JoulesPerToken)
			}
			fmt.Fprintf(tw, "%.1f\t%s\t", float64(peak[i])/(1<<30), energy)
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
	if len(rs[0].Decode) > 0 {
		fmt.Fprintf(w, "decode: %d tokens cached per sequence before the timed steps\n", rs[0].Decode[0].Context)
	}
	for _, r := range rs {
		var parts []string
		for _, p := range r.Decode {
			if p.Steps > 0 {
				parts = append(parts, fmt.Sprintf("b=%d %d/%d (%d recorded, %d sparse MLP layers)", p.Batch, p.GraphSteps, p.Steps,
					p.GraphRecords, p.SparseLayers))
			}
		}
		if len(parts) > 0 {
			fmt.Fprintf(w, "%s: decode steps replayed from CUDA graphs: %s\n", r.Path, strings.Join(parts, ", "))
		}
	}
}
