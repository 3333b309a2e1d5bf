// Command twell trains, runs, serves and measures sparse-activation transformer
// language models whose MLP hidden activations are packed in the TwELL format.
//
// Usage:
//
//	twell <command> [flags]
//
// Run "twell help" for the list of commands.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
)

// command is one subcommand of the twell binary. Files in this package add
// themselves to the table with register from an init function, so each job
// lives in its own file.
type command struct {
	name    string // e.g. "bench ffn"
	summary string
	run     func(args []string, stdout, stderr io.Writer) error
}

var commands = map[string]command{}

func register(c command) { commands[c.name] = c }

// usageError marks bad command-line input: it is printed as one line and
// the process exits with code 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// usagef returns a usageError with a formatted message.
func usagef(format string, a ...any) error { return usageError{fmt.Sprintf(format, a...)} }

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run dispatches args to a command and returns the process exit code.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		printHelp(stdout)
		return 0
	}
	// Longest match first: "bench ffn" before "bench".
	var c command
	var rest []string
	found := false
	if len(args) >= 2 {
		if cc, ok := commands[args[0]+" "+args[1]]; ok {
			c, rest, found = cc, args[2:], true
		}
	}
	if !found {
		if cc, ok := commands[args[0]]; ok {
			c, rest, found = cc, args[1:], true
		}
	}
	if !found {
		name := args[0]
		if len(args) >= 2 && hasGroup(args[0]) {
			name = args[0] + " " + args[1]
		}
		fmt.Fprintf(stderr, "twell: unknown command %q (run \"twell help\")\n", name)
		return 2
	}
	err := c.run(rest, stdout, stderr)
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return 0
	}
	var ue usageError
	if errors.As(err, &ue) {
		fmt.Fprintf(stderr, "twell %s: %s\n", c.name, ue.msg)
		return 2
	}
	fmt.Fprintf(stderr, "twell %s: %v\n", c.name, err)
	return 1
}

func hasGroup(g string) bool {
	for name := range commands {
		if strings.HasPrefix(name, g+" ") {
			return true
		}
	}
	return false
}

func printHelp(w io.Writer) {
	fmt.Fprintln(w, "twell: sparse-activation transformer LMs with TwELL kernels")
	fmt.Fprintln(w, "\nUsage: twell <command> [flags]   (twell <command> -h for its flags)")
	fmt.Fprintln(w, "\nCommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-20s %s\n", n, commands[n].summary)
	}
}

// newFlagSet returns a FlagSet that reports parse errors as usageErrors
// instead of printing usage text and exiting.
func newFlagSet(name string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("twell "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	return fs
}

// parseFlags parses args into fs, turning a flag error into one usage line.
func parseFlags(fs *flag.FlagSet, args []string) error {
	out := fs.Output()
	fs.SetOutput(io.Discard) // the error is printed once, by run
	err := fs.Parse(args)
	fs.SetOutput(out)
	if err == nil {
		if fs.NArg() > 0 {
			return usagef("unexpected argument %q", fs.Arg(0))
		}
		return nil
	}
	if errors.Is(err, flag.ErrHelp) {
		fs.SetOutput(out)
		fs.PrintDefaults()
		return flag.ErrHelp
	}
	return usageError{err.Error()}
}
