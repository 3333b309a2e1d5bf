package main

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
)

// version is twell's release version.
const version = "0.1.0"

func init() {
	register(command{name: "version", summary: "print twell's version, the Go version and the source commit", run: runVersion})
}

func runVersion(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("version", stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	commit, modified := "unknown", false
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				commit = s.Value
			case "vcs.modified":
				modified = s.Value == "true"
			}
		}
	}
	if modified {
		commit += " (with uncommitted changes)"
	}
	_, err := fmt.Fprintf(stdout, "twell %s\ngo %s %s/%s\ncommit %s\n", version, runtime.Version(), runtime.GOOS, runtime.GOARCH, commit)
	return err
}
