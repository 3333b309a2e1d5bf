package memcheck

import (
	"math"
	"runtime/debug"
	"strings"
	"testing"
)

func TestFits(t *testing.T) {
	avail, ok := Available()
	if !ok {
		t.Skip("no /proc/meminfo")
	}
	if avail <= 0 {
		t.Fatalf("available memory %d", avail)
	}
	if err := Fits("a small buffer", 1<<20, ""); err != nil {
		t.Errorf("1 MiB: %v", err)
	}
	err := Fits("the model", float64(avail)*4, "try -layers 2")
	if err == nil || !strings.Contains(err.Error(), "the model needs about") || !strings.Contains(err.Error(), "try -layers 2") {
		t.Errorf("4x the available memory: %v", err)
	}
	for _, bad := range []float64{math.NaN(), math.Inf(1), -1, 1e30} {
		if err := Fits("x", bad, ""); err == nil {
			t.Errorf("need %v accepted", bad)
		}
	}
}

func TestFormat(t *testing.T) {
	for _, k := range []struct {
		b    float64
		want string
	}{{512 << 10, "512 KiB"}, {3 << 20, "3 MiB"}, {3.25 * (1 << 30), "3.2 GiB"}} {
		if got := Format(k.b); got != k.want {
			t.Errorf("Format(%g) = %q, want %q", k.b, got, k.want)
		}
	}
}

// TestLimitHeap: the soft limit is set below what is available, read back
// from the runtime, and left alone when GOMEMLIMIT sets one.
func TestLimitHeap(t *testing.T) {
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(-1))
	t.Setenv("GOMEMLIMIT", "")
	avail, ok := Available()
	got := LimitHeap()
	if !ok {
		if got != 0 {
			t.Fatalf("no memory figure, but a limit of %d was set", got)
		}
		return
	}
	if got <= 0 || got > avail || debug.SetMemoryLimit(-1) != got {
		t.Fatalf("limit %d (runtime says %d) for %d bytes available", got, debug.SetMemoryLimit(-1), avail)
	}
	debug.SetMemoryLimit(math.MaxInt64)
	t.Setenv("GOMEMLIMIT", "1GiB")
	if got := LimitHeap(); got != 0 || debug.SetMemoryLimit(-1) != math.MaxInt64 {
		t.Fatalf("with GOMEMLIMIT set, LimitHeap set %d", got)
	}
}
