package main

import (
	"errors"
	"flag"
	"io"
	"os"
	"strings"

	"github.com/twell-ai/twell/dist"
)

// launchTrain checks -gpus and, when it asks for more than one GPU, runs
// twell train (args without -gpus) as one process per GPU of this host
// through dist.Launch. It reports whether it handled the command: false
// means this process is the run (-gpus 1, or one rank of a launched run).
func launchTrain(f *trainFlags, args []string, stdout, stderr io.Writer) (bool, error) {
	if f.gpus < 1 || f.gpus > dist.MaxLocalRanks {
		return true, usagef("-gpus %d: must be in [1, %d]", f.gpus, dist.MaxLocalRanks)
	}
	if ws := os.Getenv("WORLD_SIZE"); ws != "" && f.set["gpus"] {
		return true, usagef("-gpus: WORLD_SIZE=%s says this process is already one rank of a launched run; drop -gpus (it starts the ranks itself)", ws)
	}
	if f.gpus == 1 {
		return false, nil
	}
	exe, err := os.Executable()
	if err != nil {
		return true, err
	}

	// The first Ctrl-C (or SIGTERM) has every rank save a checkpoint and
	// stop; a second one kills them.
	kill := make(chan struct{})
	ctx, stopSignals := onInterrupt(func() { close(kill) }, 0)
	defer stopSignals()

	err = dist.Launch(ctx, dist.LaunchOptions{
		Ranks: f.gpus, Path: exe, Args: append([]string{"train"}, withoutFlag(flagSets["train"], args, "gpus")...),
		Stdout: stdout, Stderr: stderr, Kill: kill,
	})
	var stopped *dist.StoppedError
	if errors.As(err, &stopped) {
		msg := "" // the ranks said where they stopped
		if len(stopped.Killed) > 0 {
			msg = err.Error()
		}
		return true, exitCode{code: 130, msg: msg}
	}
	return true, err
}

// withoutFlag returns args, as fs parsed them, less every -name and its
// value.
func withoutFlag(fs *flag.FlagSet, args []string, name string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			return append(out, args[i:]...) // the end of the flags
		}
		n, _, hasValue := strings.Cut(strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-"), "=")
		takesNext := !hasValue && !isBoolFlag(fs.Lookup(n))
		if n != name {
			out = append(out, a)
		}
		if takesNext && i+1 < len(args) {
			i++
			if n != name {
				out = append(out, args[i])
			}
		}
	}
	return out
}

// isBoolFlag reports whether fl is a boolean flag, one that takes no
// separate value.
func isBoolFlag(fl *flag.Flag) bool {
	if fl == nil {
		return false
	}
	b, ok := fl.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}
