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

	"github.com/twell-ai/twell/internal/memcheck"
)

// command is one subcommand of the twell binary. Files in this package add
// themselves to the table with register from an init function, so each job
// lives in its own file.
type command struct {
	name    string // e.g. "bench ffn"
	summary string // one sentence: what the command does
	args    string // what follows the flags in the usage line, e.g. "INPUT..."
	run     func(args []string, stdout, stderr io.Writer) error
}

var commands = map[string]command{}

func register(c command) { commands[c.name] = c }

// flagSets holds each command's flag set once its run has made it (by
// newFlagSet), for printing its help.
var flagSets = map[string]*flag.FlagSet{}

// usageError marks bad command-line input: it is printed as one line and
// the process exits with code 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// exitCode ends a command with its own exit code; its message (which may
// be empty when the command has said everything) is printed as one line.
type exitCode struct {
	code int
	msg  string
}

func (e exitCode) Error() string { return e.msg }

// usagef returns a usageError with a formatted message.
func usagef(format string, a ...any) error { return usageError{fmt.Sprintf(format, a...)} }

func main() {
	memcheck.LimitHeap()
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run dispatches args to a command and returns the process exit code: 0,
// 2 for bad usage (one line on stderr), 1 for a failure (one line on
// stderr). A panic inside a command is reported as one line too.
func run(args []string, stdout, stderr io.Writer) (code int) {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "-help" {
		printHelp(stdout)
		return 0
	}
	if args[0] == "help" {
		if len(args) == 1 {
			printHelp(stdout)
			return 0
		}
		// "twell help bench ffn" is "twell bench ffn -h".
		return run(append(append([]string(nil), args[1:]...), "-h"), stdout, stderr)
	}
	c, rest, ok := lookup(args)
	if !ok {
		if hasGroup(args[0]) && (len(args) == 1 || isHelpFlag(args[1])) {
			printGroupHelp(stdout, args[0])
			if len(args) == 1 {
				fmt.Fprintf(stderr, "twell %s: which one? (see the list above)\n", args[0])
				return 2
			}
			return 0
		}
		name := args[0]
		if len(args) >= 2 && hasGroup(args[0]) {
			name = args[0] + " " + args[1]
		}
		fmt.Fprintf(stderr, "twell: unknown command %q (run \"twell help\")\n", name)
		return 2
	}
	defer func() {
		if p := recover(); p != nil {
			fmt.Fprintf(stderr, "twell %s: internal error: %v (this is a bug in twell; please report it with the command line)\n", c.name, p)
			code = 1
		}
	}()
	err := c.run(rest, stdout, stderr)
	if err == nil {
		return 0
	}
	if errors.Is(err, flag.ErrHelp) {
		printCommandHelp(stdout, c)
		return 0
	}
	var ec exitCode
	if errors.As(err, &ec) {
		if ec.msg != "" {
			fmt.Fprintf(stderr, "twell %s: %s\n", c.name, oneLine(ec.msg))
		}
		return ec.code
	}
	var ue usageError
	if errors.As(err, &ue) {
		fmt.Fprintf(stderr, "twell %s: %s\n", c.name, oneLine(ue.msg))
		return 2
	}
	fmt.Fprintf(stderr, "twell %s: %s\n", c.name, oneLine(err.Error()))
	return 1
}

// oneLine joins a multi-line message (errors.Join) into one line.
func oneLine(s string) string {
	return strings.ReplaceAll(strings.TrimSpace(s), "\n", "; ")
}

// lookup finds the command args name: "bench ffn" before "bench".
func lookup(args []string) (command, []string, bool) {
	if len(args) >= 2 {
		if c, ok := commands[args[0]+" "+args[1]]; ok {
			return c, args[2:], true
		}
	}
	if c, ok := commands[args[0]]; ok {
		return c, args[1:], true
	}
	return command{}, nil, false
}

func isHelpFlag(a string) bool { return a == "-h" || a == "--help" || a == "-help" }

func hasGroup(g string) bool {
	for name := range commands {
		if strings.HasPrefix(name, g+" ") {
			return true
		}
	}
	return false
}

// printGroupHelp lists the commands of group g ("bench", "tokenizer").
func printGroupHelp(w io.Writer, g string) {
	fmt.Fprintf(w, "usage: twell %s <command> [flags]\n\ncommands:\n", g)
	for _, n := range sortedNames() {
		if strings.HasPrefix(n, g+" ") {
			fmt.Fprintf(w, "  %-20s %s\n", n, commands[n].summary)
		}
	}
	fmt.Fprintf(w, "\nRun \"twell %s <command> -h\" for a command's flags.\n", g)
}

// printCommandHelp prints c's usage line, what it does and its flags.
func printCommandHelp(w io.Writer, c command) {
	fmt.Fprintf(w, "usage: twell %s [flags]", c.name)
	if c.args != "" {
		fmt.Fprintf(w, " %s", c.args)
	}
	fmt.Fprintf(w, "\n\n%s.\n", strings.TrimSuffix(upperFirst(c.summary), "."))
	fs := flagSets[c.name]
	if fs == nil {
		return
	}
	n := 0
	fs.VisitAll(func(*flag.Flag) { n++ })
	if n == 0 {
		fmt.Fprintln(w, "\nIt takes no flags.")
		return
	}
	fmt.Fprintln(w, "\nflags:")
	out := fs.Output()
	fs.SetOutput(w)
	fs.PrintDefaults()
	fs.SetOutput(out)
}

func upperFirst(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

func sortedNames() []string {
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func printHelp(w io.Writer) {
	fmt.Fprintln(w, "twell: sparse-activation transformer language models with TwELL kernels")
	fmt.Fprintln(w, "\nusage: twell <command> [flags]")
	fmt.Fprintln(w, "\ncommands:")
	for _, n := range sortedNames() {
		fmt.Fprintf(w, "  %-20s %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(w, "\nRun \"twell help <command>\" or \"twell <command> -h\" for a command's flags.")
}

// newFlagSet returns a FlagSet that reports parse errors as usageErrors
// instead of printing usage text and exiting.
func newFlagSet(name string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("twell "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	flagSets[name] = fs
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
		return flag.ErrHelp // run prints the command's help
	}
	return usageError{err.Error()}
}
