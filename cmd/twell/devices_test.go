package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/twell-ai/twell/cuda"
)

// TestDevicesWithoutGPU checks that `twell devices` exits 0 with one clear
// line on a machine without a GPU (and lists GPUs on one with).
func TestDevicesWithoutGPU(t *testing.T) {
	var out, errb bytes.Buffer
	code := run([]string{"devices"}, &out, &errb)
	if code != 0 {
		t.Fatalf("twell devices exited %d: %s%s", code, out.String(), errb.String())
	}
	if _, err := cuda.Count(); err != nil {
		if !strings.HasSuffix(out.String(), "the CPU backend will be used\n") || strings.Count(out.String(), "\n") != 1 {
			t.Fatalf("without a GPU, output %q is not one line saying the CPU backend will be used", out.String())
		}
		return
	}
	if !strings.Contains(out.String(), "GPU 0: ") {
		t.Fatalf("with a GPU, output lacks \"GPU 0: \":\n%s", out.String())
	}
}

func TestParseGemmSizes(t *testing.T) {
	got, err := parseGemmSizes("4096, 128x256x512")
	if err != nil || len(got) != 2 || got[0] != (gemmSize{4096, 4096, 4096}) || got[1] != (gemmSize{128, 256, 512}) {
		t.Fatalf("parseGemmSizes = %v, %v", got, err)
	}
	for _, bad := range []string{"", "0", "4x5", "axbxc", "-3"} {
		if _, err := parseGemmSizes(bad); err == nil {
			t.Errorf("parseGemmSizes(%q) accepted", bad)
		}
	}
	var out, errb bytes.Buffer
	if code := run([]string{"bench", "gemm", "-sizes", "12x"}, &out, &errb); code != 2 {
		t.Errorf("bad -sizes exit code %d, want 2", code)
	}
	if code := run([]string{"bench", "gemm", "-m", "5"}, &out, &errb); code != 2 {
		t.Errorf("-m without -n -k: exit code %d, want 2", code)
	}
}
