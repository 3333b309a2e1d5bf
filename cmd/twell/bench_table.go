package main

import (
	"io"

	"github.com/twell-ai/twell/bench"
)

func init() {
	register(command{name: "bench table", args: "FILE.json|DIR...",
		summary: "one line per result row of benchmark JSON files (the -json of the bench commands): switches and headline figures, to compare runs",
		run:     runBenchTable})
}

// runBenchTable prints bench.Table of the files and folders given.
func runBenchTable(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench table", stderr)
	paths, err := parseFlagsAndArgs(fs, args)
	if err != nil {
		return err
	}
	if len(paths) == 0 {
		return usagef("give the JSON files or folders to list")
	}
	return bench.Table(stdout, paths)
}
