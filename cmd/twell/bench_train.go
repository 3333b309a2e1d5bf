package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/twell-ai/twell/backend"
	"github.com/twell-ai/twell/bench"
	"github.com/twell-ai/twell/gpu/trainer"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/mlp"
)

func init() {
	register(command{name: "bench train", summary: "time one MLP block's training forward + backward, dense against sparse (GPU)", run: runBenchTrain})
}

func runBenchTrain(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench train", stderr)
	device := fs.String("device", "cuda", "where to run: cuda (the sparse training kernels are GPU kernels)")
	mf := addMLPBenchFlags(fs, "hidden size, a positive multiple of 8", "MLP width, a positive multiple of 8",
		16384, "tokens in the micro-batch", 30, "timed repetitions per path, >= 1, median reported")
	d, f, m, gated, reps, seed, jsonPath, plotPath := mf.d, mf.f, mf.m, mf.gated, mf.reps, mf.seed, mf.jsonPath, mf.plotPath
	l1 := fs.Float64("l1", 2e-3, "L1 coefficient on the mean over tokens of sum |h|")
	profile := fs.Bool("profile", false, "also time each stage: of the dense and sparse paths alone (MLP block), or with -step of one more step per path")
	step := fs.Bool("step", false, "time whole training steps of the SparseLM-1.5B shape instead (dense, sparse and auto MLP paths; -density is the gates' calibrated density, one value)")
	layers := fs.Int("layers", 0, "with -step: layers (0: the shape's 28)")
	batch := fs.Int("batch", 8, "with -step: sequences per step")
	seq := fs.Int("seq", 2048, "with -step: tokens per sequence")
	steps := fs.Int("steps", 5, "with -step: timed steps per path, after 2 warm-up steps")
	logitRows := fs.Int("logit-rows", 0, "with -step: token rows of logits at once in the cross-entropy (0: the trainer's default)")
	recompute := fs.Bool("recompute", false, "with -step: keep only each layer's input and run its forward again before its backward (as train -recompute)")
	pathsFlag := fs.String("paths", "dense,sparse,auto", "with -step: comma-separated MLP paths to time, in this order")
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
	if kind != backend.CUDA {
		return usagef("-device %s: bench train times the GPU kernels; give -device cuda", *device)
	}
	if *step {
		if len(dens) != 1 {
			return usagef("-step takes one -density (the gates' calibrated density), not %d", len(dens))
		}
		var paths []mlp.Path
		for _, f := range strings.Split(*pathsFlag, ",") {
			p, err := mlp.ParsePath(f)
			if err != nil || strings.TrimSpace(f) == "" {
				return usagef("-paths %q: want a comma-separated list of dense, sparse and auto", *pathsFlag)
			}
			paths = append(paths, p)
		}
		o := bench.TrainStepOptions{Layers: *layers, Batch: *batch, Seq: *seq, Density: dens[0], Dist: dst, Steps: *steps, Seed: *seed,
			L1: *l1, LogitRows: *logitRows, Recompute: *recompute, Profile: *profile, Paths: paths}
		if err := o.Validate(); err != nil {
			return usageError{err.Error()}
		}
		if err := checkWritable(*jsonPath, *plotPath); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "bench train -step: SparseLM-1.5B shape, %d x %d tokens, density %g %s, seed %d\n", o.Batch, o.Seq, o.Density, dst, o.Seed)
		results, err := bench.TrainStepCUDA(o, func(s string) { fmt.Fprintln(stderr, "  "+s) })
		if err != nil {
			return err
		}
		printTrainStep(stdout, results)
		return writeResults(*jsonPath, results, *plotPath, func() error { return bench.PlotTrainStep(results, *plotPath) })
	}
	o := bench.TrainMLPOptions{D: *d, F: *f, M: *m, Densities: dens, Dist: dst, Gated: *gated, Reps: *reps, Seed: *seed, L1: *l1,
		Profile: *profile}
	if err := o.Validate(); err != nil {
		return usageError{err.Error()}
	}
	if err := memcheck.Fits(fmt.Sprintf("the d=%d f=%d m=%d benchmark", o.D, o.F, o.M), o.HostBytes(), ""); err != nil {
		return err
	}
	if err := checkWritable(*jsonPath, *plotPath); err != nil {
		return err
	}
	fmt.Fprintf(stderr, "bench train: d=%d f=%d m=%d %s gated=%v l1=%g seed=%d\n", o.D, o.F, o.M, dst, o.Gated, o.L1, o.Seed)
	results, err := bench.TrainMLPCUDA(o, func(s string) { fmt.Fprintln(stderr, "  "+s) })
	if err != nil {
		return err
	}
	printTrainMLP(stdout, results)
	return writeResults(*jsonPath, results, *plotPath, func() error { return bench.PlotTrainMLP(results, *plotPath) })
}

func printTrainMLP(w io.Writer, rs []bench.TrainMLPResult) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "m\tdensity\tdist\tnnz mean\tdense ms\tsparse ms\tspeedup\tauto\tauto ms\tauto speedup\tdense TFLOP/s\tmax rel err\t")
	for _, r := range rs {
		e := max(r.OutRelErr, r.DXRelErr, r.DGateRelErr, r.DUpRelErr, r.DDownRelErr)
		fmt.Fprintf(tw, "%d\t%g\t%s\t%.1f\t%.3f\t%.3f\t%.2fx\t%s\t%.3f\t%.2fx\t%.0f\t%.1e\t\n",
			r.M, r.Density, r.Dist, r.NNZMean, r.DenseMS, r.TwellMS, r.Speedup, r.AutoPath, r.AutoMS, r.AutoSpeedup, r.DenseTFLOPS, e)
	}
	tw.Flush()
	fmt.Fprint(w, `
  dense ms     forward + backward of the block (L1 term included) through cuBLASLt GEMMs, median
  sparse ms    the same through the sparse kernels (gate GEMM, then only the active units), median
  auto         the path training takes at the measured density (sparse at most `+fmt.Sprint(100*trainer.DefaultDenseAbove)+`%)
  max rel err  sparse against dense over the output, dx and the three weight gradients
`)
}

func printTrainStep(w io.Writer, rs []bench.TrainStepResult) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "MLP path\tlayers\tsparse layers\tl0 mean\tstep ms\ttokens/ms\tMFU\tpeak GiB\tmJ/token\tvs dense\t")
	dense := 0.0
	for _, r := range rs {
		if r.Path == mlp.Dense.String() {
			dense = r.StepMS
		}
	}
	for _, r := range rs {
		vs := "-" // no dense path timed
		if dense > 0 {
			vs = fmt.Sprintf("%.2fx", dense/r.StepMS)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.1f\t%.1f\t%.1f\t%.1f%%\t%.1f\t%.3f\t%s\t\n", r.Path, r.Layers, r.SparseLayers, r.L0Mean,
			r.StepMS, r.TokensPerMS, 100*r.MFU, float64(r.PeakBytes)/(1<<30), r.MJPerToken, vs)
	}
	tw.Flush()
	for _, r := range rs {
		if len(r.Stages) == 0 {
			continue
		}
		total := 0.0
		for _, s := range r.Stages {
			total += s.MS
		}
		fmt.Fprintf(w, "\n%s MLP path, one profiled step: %.1f ms of GPU time\n", r.Path, total)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "stage\truns\tms\tshare\t")
		// Stages named "group: kernel" (the MLP's) also add up by group.
		var groups []string
		groupMS := map[string]float64{}
		for _, s := range r.Stages {
			fmt.Fprintf(tw, "%s\t%d\t%.2f\t%.1f%%\t\n", s.Name, s.Count, s.MS, 100*s.MS/total)
			if g, _, ok := strings.Cut(s.Name, ": "); ok {
				if _, seen := groupMS[g]; !seen {
					groups = append(groups, g)
				}
				groupMS[g] += s.MS
			}
		}
		for _, g := range groups {
			fmt.Fprintf(tw, "%s, all stages\t\t%.2f\t%.1f%%\t\n", g, groupMS[g], 100*groupMS[g]/total)
		}
		tw.Flush()
	}
}
