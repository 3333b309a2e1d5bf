package main

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"

	"github.com/twell-ai/twell/internal/buildinfo"
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
	bi, _ := debug.ReadBuildInfo()
	commit, modified := buildinfo.VCS(bi)
	if commit == "" {
		commit = "unknown"
	}
	if modified {
		commit += " (with uncommitted changes)"
	}
	_, err := fmt.Fprintf(stdout, "twell %s\ngo %s %s/%s\ncommit %s\n", version, runtime.Version(), runtime.GOOS, runtime.GOARCH, commit)
	return err
}
