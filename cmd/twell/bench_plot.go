package main

import (
	"fmt"
	"io"
	"os"

	"github.com/twell-ai/twell/bench"
)

func init() {
	register(command{name: "bench plot", summary: "one figure of several bench model runs (rounds of an A/B)", args: "RUN.json...",
		run: runBenchPlot})
}

// maxRunJSON bounds the size of a bench model JSON file that bench plot
// reads: a run of many variants with traces is well under a megabyte.
const maxRunJSON = 64 << 20

func runBenchPlot(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench plot", stderr)
	out := fs.String("o", "", "write the figure (PNG) to this file (required)")
	paths, err := parseFlagsAndArgs(fs, args)
	if err != nil {
		return err
	}
	if *out == "" {
		return usagef("-o is required: where to write the figure")
	}
	if len(paths) == 0 {
		return usagef("name at least one JSON file that bench model -json wrote")
	}
	var all []bench.ModelResult
	for _, path := range paths {
		rs, err := readRun(path)
		if err != nil {
			return err
		}
		if len(all) > 0 && rs[0].Model != all[0].Model {
			return fmt.Errorf("%s: model %q, but %s is of %q: plot runs of one model together", path, rs[0].Model, paths[0], all[0].Model)
		}
		all = append(all, rs...)
	}
	if err := bench.PlotModel(all, *out); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote %s: %d rows of %d runs\n", *out, len(all), len(paths))
	return nil
}

// readRun reads one bench model JSON file, its variants named by their
// switches as in the run's own table.
func readRun(path string) ([]bench.ModelResult, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxRunJSON+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(data) > maxRunJSON {
		return nil, fmt.Errorf("%s: larger than %d MiB: not a bench model JSON file", path, maxRunJSON>>20)
	}
	rs, err := bench.ReadModelResults(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	bench.NameVariants(rs)
	return rs, nil
}
