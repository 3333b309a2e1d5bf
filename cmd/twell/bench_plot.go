package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/twell-ai/twell/bench"
	"github.com/twell-ai/twell/internal/atomicfile"
)

func init() {
	register(command{name: "bench plot", summary: "one figure of several bench model or bench ffn runs (rounds of an A/B), or of go test -bench output",
		args: "RUN.json... | -gobench METRIC BENCH.txt...", run: runBenchPlot})
}

// maxRunJSON bounds the size of a bench JSON file that bench plot reads: a
// run of many variants with traces is well under a megabyte.
const maxRunJSON = 64 << 20

func runBenchPlot(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench plot", stderr)
	out := fs.String("o", "", "write the figure (PNG) to this file (required)")
	goMetric := fs.String("gobench", "", "the files are go test -bench output: draw the median of this metric (a unit the benchmarks report, e.g. ns/op or us/step) of each benchmark")
	jsonOut := fs.String("json", "", "with -gobench: also write each benchmark's medians to this JSON file")
	title := fs.String("title", "", "with -gobench: the figure's title (default: go test -bench)")
	paths, err := parseFlagsAndArgs(fs, args)
	if err != nil {
		return err
	}
	if *out == "" {
		return usagef("-o is required: where to write the figure")
	}
	if *goMetric != "" {
		return plotGoBench(paths, *goMetric, *title, *out, *jsonOut, stdout)
	}
	if *jsonOut != "" || *title != "" {
		return usagef("-json and -title go with -gobench (bench model writes its own JSON and titles)")
	}
	if len(paths) == 0 {
		return usagef("name at least one JSON file that bench model or bench ffn -json wrote")
	}
	data := make([][]byte, len(paths))
	for i, path := range paths {
		if data[i], err = readRunFile(path); err != nil {
			return err
		}
	}
	schema, err := bench.ResultSchema(data[0])
	if err != nil {
		return fmt.Errorf("%s: %w", paths[0], err)
	}
	if schema == bench.FFNSchema {
		return plotFFNRuns(paths, data, *out, stdout)
	}
	var all []bench.ModelResult
	for i, path := range paths {
		rs, err := bench.ReadModelResults(data[i])
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		bench.NameVariants(rs) // as in the run's own table
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

// plotFFNRuns draws the bench ffn runs in data (read from paths) in one
// figure: each shape's TwELL and D2T times by build.
func plotFFNRuns(paths []string, data [][]byte, out string, stdout io.Writer) error {
	var all []bench.FFNResult
	for i, path := range paths {
		rs, err := bench.ReadFFNResults(data[i])
		if err != nil {
			if s, serr := bench.ResultSchema(data[i]); serr == nil && s != bench.FFNSchema {
				return fmt.Errorf("%s: rows of schema %q, but %s holds bench ffn runs: plot them apart", path, s, paths[0])
			}
			return fmt.Errorf("%s: %w", path, err)
		}
		all = append(all, rs...)
	}
	if err := bench.PlotFFNRuns(all, out); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote %s: %d rows of %d runs\n", out, len(all), len(paths))
	return nil
}

// readRunFile reads one JSON file that bench model or bench ffn wrote,
// refusing one larger than maxRunJSON.
func readRunFile(path string) ([]byte, error) {
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
		return nil, fmt.Errorf("%s: larger than %d MiB: not a bench JSON file", path, maxRunJSON>>20)
	}
	return data, nil
}

// maxGoBench bounds the size of a go test -bench output file bench plot
// reads.
const maxGoBench = 64 << 20

// plotGoBench draws the median of metric of each benchmark in the go test
// -bench output files paths, and with jsonOut writes all their medians.
func plotGoBench(paths []string, metric, title, out, jsonOut string, stdout io.Writer) error {
	if len(paths) == 0 {
		return usagef("name at least one file of go test -bench output")
	}
	if title == "" {
		title = "go test -bench"
	}
	var all []bench.GoBenchResult
	for _, path := range paths {
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		rs, err := bench.ReadGoBench(io.LimitReader(f, maxGoBench), path)
		f.Close()
		if err != nil {
			return err
		}
		all = append(all, rs...)
	}
	if err := bench.PlotGoBench(all, metric, title, out); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote %s: %d benchmarks of %d files\n", out, len(all), len(paths))
	if jsonOut == "" {
		return nil
	}
	data, err := json.MarshalIndent(all, "", "  ")
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(jsonOut, append(data, '\n')); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote %s\n", jsonOut)
	return nil
}
