package main

import (
	"cmp"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/twell-ai/twell/backend"
	"github.com/twell-ai/twell/bench"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/twell"
)

func init() {
	register(command{name: "bench ffn", summary: "time the TwELL MLP block against dense (CPU or GPU)", run: runBenchFFN})
}

func runBenchFFN(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench ffn", stderr)
	device := fs.String("device", "auto", "where to run: cpu, cuda or auto (auto: cuda when a GPU is found)")
	mf := addMLPBenchFlags(fs, "hidden size, >= 2", "MLP width, a positive multiple of the tile width",
		1024, "tokens, >= 1 (default 1024 on CPU, 65536 on GPU)", 7, "timed repetitions per path, >= 1, median reported (default 7 on CPU, 30 on GPU)")
	d, f, m, gated, reps, seed, jsonPath, plotPath := mf.d, mf.f, mf.m, mf.gated, mf.reps, mf.seed, mf.jsonPath, mf.plotPath
	c := fs.Int("c", 8, "TwELL compression factor: 2, 4 or 8")
	tile := fs.Int("tile", 256, "TwELL tile width: 256 or 128")
	dumpDir := fs.String("dump-inputs", "", "write the inputs (batch 0, reference rows, each density's bf16 weights) as safetensors files into this folder, created if needed")
	trace := fs.String("trace", "", "cuda: record the kernels (CUPTI) of -trace-steps more calls of each path, each after the L2 flush, and write them to this file as a Chrome trace (Perfetto opens it); per-kernel summaries go to the JSON and stderr")
	traceSteps := fs.Int("trace-steps", 0, "cuda: calls of each path to trace (default 5 with -trace or -trace-plot)")
	tracePlot := fs.String("trace-plot", "", "cuda: write a PNG of what each kernel adds to a call of each path to this file (traces as -trace does)")
	variants := fs.String("variants", "", "cuda: time the TwELL path under each of these settings of the MLP's switches, in turns, a result row each: variants separated by ';', each NAME=VALUE ... (names with or without TWELL_: D2T_KERNEL, TAIL, EARLY_START, HOT_UNITS, HOT_D2T), over the environment's; e.g. 'TAIL=sorted;TAIL=warp'")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	dens, dst, err := mf.parse()
	if err != nil {
		return err
	}
	kind, err := backend.Parse(*device)
	if err != nil {
		return usagef("%v", err)
	}
	run := bench.FFNCPU
	if kind, _ = backend.Resolve(kind, nil); kind == backend.CUDA {
		run = bench.FFNCUDA
		set := setFlags(fs) // GPU-sized defaults for the flags not given
		if !set["m"] {
			*m = 65536
		}
		if !set["reps"] {
			*reps = 30
		}
	}
	if (*trace != "" || *tracePlot != "") && *traceSteps == 0 {
		*traceSteps = 5
	}
	if *traceSteps > 0 && kind != backend.CUDA {
		return usagef("-trace, -trace-steps and -trace-plot record GPU kernels: they need -device cuda")
	}
	o := bench.FFNOptions{
		D: *d, F: *f, M: *m, Densities: dens, Dist: dst, Gated: *gated, Reps: *reps,
		Layout: twell.Layout{Tile: *tile, C: *c}, Seed: *seed, TraceSteps: *traceSteps,
	}
	if *variants != "" {
		if kind != backend.CUDA {
			return usagef("-variants set the GPU kernels' switches: they need -device cuda")
		}
		if o.Variants, err = bench.ParseVariants(*variants); err != nil {
			return usagef("-variants: %v", err)
		}
	}
	if err := o.Validate(); err != nil {
		return usageError{err.Error()}
	}
	if err := memcheck.Fits(fmt.Sprintf("the d=%d f=%d m=%d benchmark", o.D, o.F, o.M), o.HostBytes(), ""); err != nil {
		return err
	}
	if err := checkWritable(*jsonPath, *plotPath, *trace, *tracePlot); err != nil {
		return err
	}
	if *dumpDir != "" {
		if err := os.MkdirAll(*dumpDir, 0o755); err != nil {
			return fmt.Errorf("-dump-inputs: %w", err)
		}
		o.DumpDir = *dumpDir
	}
	fmt.Fprintf(stderr, "bench ffn: %s, d=%d f=%d m=%d %s gated=%v C=%d seed=%d\n", bench.CPUName(), o.D, o.F, o.M, dst, o.Gated, o.Layout.C, o.Seed)
	results, err := run(o, func(s string) { fmt.Fprintln(stderr, "  "+s) })
	if err != nil {
		return err
	}
	printFFN(stdout, results)
	if err := writeResults(*jsonPath, results, *plotPath, func() error { return bench.PlotFFN(results, *plotPath) }); err != nil {
		return err
	}
	var failed []string
	for _, r := range results {
		if r.TraceError != "" {
			failed = append(failed, fmt.Sprintf("m=%d density %g: %s", r.M, r.Density, r.TraceError))
		}
	}
	if err := tracesFailed(failed); err != nil {
		return err
	}
	if *tracePlot != "" {
		if err := bench.PlotFFNTraces(results, *tracePlot); err != nil {
			return fmt.Errorf("trace plot (the JSON is written): %w", err)
		}
	}
	var secs []bench.TraceSection
	for _, r := range results {
		secs = append(secs, r.Traces...)
	}
	return writeTrace(*trace, secs)
}

func printFFN(w io.Writer, rs []bench.FFNResult) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "device\tm\tdensity\tdist\tnnz mean\tnnz max\tdense ms\ttwell ms\tspeedup\trel err\tdense act MiB\ttwell act MiB\tdense GFLOP/s\tkernels\tswitches\t")
	for _, r := range rs {
		fmt.Fprintf(tw, "%s\t%d\t%g\t%s\t%.1f\t%d\t%.2f\t%.2f\t%.2fx\t%.1e\t%.1f\t%.2f\t%.0f\t%s\t%s\t\n",
			r.Device, r.M, r.Density, r.Dist, r.NNZMean, r.NNZMax, r.DenseMS, r.TwELLMS, r.Speedup, r.RelErr,
			float64(r.DenseActBytes)/(1<<20), float64(r.TwELLActBytes)/(1<<20), r.DenseGFLOPS,
			cmp.Or(r.Tail, "-"), cmp.Or(bench.SwitchList(r.Switches), "-"))
	}
	tw.Flush()
	fmt.Fprint(w, `
  m          tokens in the batch
  density    fraction of the MLP units each token activates, on average (the synthetic gate's target)
  dist       per-unit firing rates: uniform, or skewed (heavy-tailed, about 30% of units never fire)
  nnz mean   measured active units per token, mean over the batch; nnz max: the most in one token
  dense ms   the project's own dense MLP (three GEMMs), median of the repetitions
  twell ms   the TwELL MLP (gate GEMM packing active units, then only those rows of up/down), median
  speedup    dense ms / twell ms
  rel err    TwELL output against a float64 reference, max |diff| / max |reference| over sampled rows
  act MiB    memory of the hidden activations: dense, m x f float32 (two when gated); TwELL, the packed words
  dense GFLOP/s  the dense path's arithmetic rate (2 m d f per projection)
  kernels    GPU: what the TwELL path ran (sorted or warp tail after D2T, "+hot" with hot units, or small-batch)
  switches   the TWELL_ settings of the row (the environment's, with -variants each variant's over them)
`)
}

func parseFloats(s string) ([]float64, error) {
	var out []float64
	for _, part := range strings.Split(s, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(part), 64)
		if err != nil {
			return nil, fmt.Errorf("%q is not a number", part)
		}
		out = append(out, v)
	}
	return out, nil
}

// checkWritable fails early, before any work, if an output file's folder
// does not exist.
func checkWritable(paths ...string) error {
	for _, p := range paths {
		if p == "" {
			continue
		}
		dir := "."
		if i := strings.LastIndexByte(p, '/'); i >= 0 {
			dir = p[:max(i, 1)]
		}
		if st, err := os.Stat(dir); err != nil || !st.IsDir() {
			return fmt.Errorf("cannot write %s: folder %s does not exist", p, dir)
		}
	}
	return nil
}

// mlpBenchFlags are the flags of the MLP-block benchmarks (bench ffn,
// bench train): the block's shape, densities, distribution, repetitions,
// seed and output files.
type mlpBenchFlags struct {
	d, f, m, reps      *int
	densities, dist    *string
	gated              *bool
	seed               *uint64
	jsonPath, plotPath *string
}

// addMLPBenchFlags defines the shared flags on fs with the command's own
// descriptions and defaults for the sizes and repetitions.
func addMLPBenchFlags(fs *flag.FlagSet, dUsage, fUsage string, m int, mUsage string, reps int, repsUsage string) mlpBenchFlags {
	return mlpBenchFlags{
		d:         fs.Int("d", 2048, dUsage),
		f:         fs.Int("f", 5632, fUsage),
		m:         fs.Int("m", m, mUsage),
		densities: fs.String("density", "0.005,0.02,0.05", "comma-separated fractions of MLP units active per token, each in (0,1)"),
		dist:      fs.String("dist", "uniform", "per-unit firing rates: uniform or skewed (heavy-tailed, ~30% dead units)"),
		gated:     fs.Bool("gated", true, "gated MLP (relu(x Wg^T) * x Wu^T); false for relu(x Wu^T)"),
		reps:      fs.Int("reps", reps, repsUsage),
		seed:      fs.Uint64("seed", 0, "random seed (0: a fresh one, printed)"),
		jsonPath:  fs.String("json", "", "write the results as JSON to this file"),
		plotPath:  fs.String("plot", "", "write a plot to this PNG file: speedup against density (bench train -step: step time per path, and time per stage with -profile)"),
	}
}

// parse reads the densities and the distribution (usage errors when bad)
// and draws a seed when none was given.
func (mf mlpBenchFlags) parse() ([]float64, synth.Dist, error) {
	dens, err := parseFloats(*mf.densities)
	if err != nil {
		return nil, "", usagef("-density: %v", err)
	}
	dst, err := synth.ParseDist(*mf.dist)
	if err != nil {
		return nil, "", usagef("-dist: %v", err)
	}
	if *mf.seed == 0 {
		*mf.seed = rand.Uint64()
	}
	return dens, dst, nil
}
