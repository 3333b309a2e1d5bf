package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
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
	errb.Reset()
	if code := run([]string{"bench", "gemm", "-backend", "lt,fastest"}, &out, &errb); code != 2 || !strings.Contains(errb.String(), "tuned") {
		t.Errorf("unknown -backend: exit code %d, %q; want 2 and the backends", code, errb.String())
	}
}

// TestBenchGemmTuned times the engine's layout (B transposed) with the
// heuristic's choice and the tuned one on the GPU: both checked against
// float64 by the command, the tuned row carrying the candidates it timed.
func TestBenchGemmTuned(t *testing.T) {
	if n, err := cuda.Count(); err != nil || n == 0 {
		t.Skipf("no GPU: %v", err)
	}
	js := filepath.Join(t.TempDir(), "gemm.json")
	var out, errb bytes.Buffer
	if code := run([]string{"bench", "gemm", "-transb", "-sizes", "512x768x1024", "-backend", "lt,tuned", "-reps", "5",
		"-energy", "0", "-json", js}, &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	var rep struct {
		Description string
		Results     []struct {
			Backend string
			RelErr  float64 `json:"rel_err"`
			Tuning  *struct {
				Chosen     int
				Candidates []struct{ Rank int }
			}
		}
	}
	b, _ := os.ReadFile(js)
	if err := json.Unmarshal(b, &rep); err != nil || len(rep.Results) != 2 {
		t.Fatalf("JSON: %v, %+v", err, rep)
	}
	if !strings.Contains(rep.Description, "A·Bᵀ") {
		t.Errorf("description %q does not say B is transposed", rep.Description)
	}
	if r := rep.Results[0]; r.Backend != "cublasLt" || r.Tuning != nil {
		t.Errorf("first row %+v, want cublasLt untuned", r)
	}
	r := rep.Results[1]
	if r.Backend != "cublasLt tuned" {
		t.Errorf("second row %q, want the tuned backend", r.Backend)
	}
	if r.Tuning != nil && (r.Tuning.Chosen < 0 || r.Tuning.Chosen >= len(r.Tuning.Candidates)) {
		t.Errorf("tuning %+v", r.Tuning)
	}
	t.Logf("%s", out.String())
}
