// Package memcheck estimates whether an allocation fits in the memory this
// process can still take, so that commands refuse a job that would not fit
// with both figures, instead of being killed by the kernel or dying with
// "fatal error: runtime: out of memory".
package memcheck

import (
	"bufio"
	"bytes"
	"fmt"
	"math"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
)

// Available returns the bytes of memory the process can still allocate:
// the kernel's MemAvailable, capped by the cgroup's memory limit less its
// usage where one is set. ok is false where neither can be read (not
// Linux); callers then skip the check.
func Available() (bytes int64, ok bool) {
	avail, ok := meminfo("MemAvailable")
	if lim, used, cok := cgroup(); cok && (!ok || lim-used < avail) {
		avail, ok = max(lim-used, 0), true
	}
	return avail, ok
}

// meminfo reads one field of /proc/meminfo, in bytes.
func meminfo(key string) (int64, bool) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, false
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok || name != key {
			continue
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			return 0, false
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0, false
		}
		return kb * 1024, true
	}
	return 0, false
}

// cgroup returns the cgroup v2 memory limit and usage, if a limit is set.
func cgroup() (limit, used int64, ok bool) {
	read := func(p string) (int64, bool) {
		b, err := os.ReadFile(p)
		if err != nil {
			return 0, false
		}
		v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		return v, err == nil
	}
	limit, ok = read("/sys/fs/cgroup/memory.max") // "max" when unlimited: not a number
	if !ok {
		return 0, 0, false
	}
	used, _ = read("/sys/fs/cgroup/memory.current")
	return limit, used, true
}

// Fits returns an error when need bytes (an estimate of what is about to be
// allocated for what) exceed the memory available; hint, when not empty,
// says what would fit ("try -layers 4"). Before refusing it returns the Go
// heap's garbage to the system and looks again: memory a process has
// dropped (an engine closed a moment ago) is not available until then. A need that is not a finite,
// non-negative number, or past what any machine has, is an error too.
func Fits(what string, need float64, hint string) error {
	if math.IsNaN(need) || need < 0 || math.IsInf(need, 0) || need > 1<<62 {
		return fmt.Errorf("%s would need %s of memory: far more than any machine has%s", what, Format(need), suffix(hint))
	}
	avail, ok := Available()
	if !ok || need <= float64(avail) {
		return nil
	}
	debug.FreeOSMemory()
	if avail, ok = Available(); !ok || need <= float64(avail) {
		return nil
	}
	return fmt.Errorf("%s needs about %s of memory, but %s is available%s", what, Format(need), Format(float64(avail)), suffix(hint))
}

func suffix(hint string) string {
	if hint == "" {
		return ""
	}
	return "; " + hint
}

// Format writes a byte count with a binary unit: "512 MiB", "3.2 GiB".
func Format(b float64) string {
	switch {
	case math.IsNaN(b) || math.IsInf(b, 0):
		return fmt.Sprint(b)
	case b >= 1<<50:
		return fmt.Sprintf("%.3g PiB", b/(1<<50))
	case b >= 1<<30:
		return fmt.Sprintf("%.1f GiB", b/(1<<30))
	case b >= 1<<20:
		return fmt.Sprintf("%.0f MiB", b/(1<<20))
	}
	return fmt.Sprintf("%.0f KiB", b/(1<<10))
}

// LimitHeap sets the Go runtime's soft memory limit to 90% of the memory
// available now (unless GOMEMLIMIT sets one), and returns it (0 when none
// was set). By default the collector lets the heap reach twice what was
// live after the last collection: a job whose live data takes half the
// machine (a model's weights and their packed copies) would be killed for
// garbage it never needed. Under the limit the collector runs sooner
// instead. Call it once, at the start of a command.
func LimitHeap() int64 {
	if os.Getenv("GOMEMLIMIT") != "" {
		return 0
	}
	avail, ok := Available()
	if !ok || avail <= 0 {
		return 0
	}
	limit := avail / 10 * 9
	debug.SetMemoryLimit(limit)
	return limit
}
