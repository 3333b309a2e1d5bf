// Package bench measures twell's kernels against the strongest dense
// baseline in the same run: medians over repetitions, rotating inputs, every
// timed output checked against a float64 reference. Results are plain
// structs that the CLI prints as a table and writes as JSON and PNG plots.
package bench

import (
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"github.com/twell-ai/twell/internal/buildinfo"
)

// Median returns the median of xs (which it sorts).
func Median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	slices.Sort(xs)
	n := len(xs)
	if n%2 == 1 {
		return xs[n/2]
	}
	return (xs[n/2-1] + xs[n/2]) / 2
}

// timeMS runs f reps times after one warm-up call and returns the median
// wall time in milliseconds.
func timeMS(reps int, f func(rep int) error) (float64, error) {
	if err := f(-1); err != nil {
		return 0, err
	}
	ts := make([]float64, reps)
	for i := range ts {
		t0 := time.Now()
		if err := f(i); err != nil {
			return 0, err
		}
		ts[i] = float64(time.Since(t0).Nanoseconds()) / 1e6
	}
	return Median(ts), nil
}

// CPUName returns the processor model and core count of this machine.
func CPUName() string {
	name := runtime.GOARCH
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				name = strings.TrimSpace(v)
				break
			}
		}
	}
	return name + ", " + itoa(runtime.GOMAXPROCS(0)) + " threads"
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	var b []byte
	for ; n > 0; n /= 10 {
		b = append([]byte{byte('0' + n%10)}, b...)
	}
	return string(b)
}

// Row is what every result row starts with: the layout of the row (its
// schema and version), where it ran and when, the source commit of the
// build that measured it, and the TWELL_ environment variables set for the
// run (the experiment switches), so that rows of an A/B say which side
// they are.
type Row struct {
	Schema  string `json:"schema"`
	Device  string `json:"device"` // "cpu" or "cuda"
	Machine string `json:"machine"`
	Date    string `json:"date"`
	// Commit is the source commit the measuring binary was built from, its
	// first 7 hex digits, with "+dirty" when the tree had uncommitted
	// changes; empty when the build does not record it (test binaries,
	// builds outside the repository).
	Commit   string            `json:"commit,omitempty"`
	Switches map[string]string `json:"switches,omitempty"`
}

// rowSchema returns the row's schema (for readRows).
func (r Row) rowSchema() string { return r.Schema }

// newRow returns the start of a row of schema measured now on device of
// machine.
func newRow(schema, device, machine string) Row {
	bi, _ := debug.ReadBuildInfo()
	return Row{Schema: schema, Device: device, Machine: machine, Date: time.Now().UTC().Format(time.RFC3339),
		Commit: commitOf(bi), Switches: switches(os.Environ())}
}

// commitOf returns the source commit recorded in bi (see Row.Commit), or
// "" when bi is nil or records none.
func commitOf(bi *debug.BuildInfo) string {
	commit, dirty := buildinfo.VCS(bi)
	if commit == "" {
		return ""
	}
	commit = commit[:min(7, len(commit))]
	if dirty {
		commit += "+dirty"
	}
	return commit
}

// switches returns the TWELL_ variables of env (KEY=VALUE entries), or nil
// if there are none.
func switches(env []string) map[string]string {
	var m map[string]string
	for _, kv := range env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || !strings.HasPrefix(k, "TWELL_") {
			continue
		}
		if m == nil {
			m = map[string]string{}
		}
		m[k] = v
	}
	return m
}
