package main

import (
	"fmt"
	"strings"
	"testing"

	"github.com/twell-ai/twell/bench"
	"github.com/twell-ai/twell/gpu/trainer"
	"github.com/twell-ai/twell/internal/testutil"
)

func TestBenchTrainBadInputExits2(t *testing.T) {
	checkUsageErrors(t, []usageCase{
		{[]string{"bench", "train", "-bogus"}, "flag provided but not defined: -bogus"},
		{[]string{"bench", "train", "-density", "0"}, "-density 0: must be inside (0, 1)"},
		{[]string{"bench", "train", "-density", "abc"}, "is not a number"},
		{[]string{"bench", "train", "-d", "100"}, "-d 100: the hidden size must be a positive multiple of 8"},
		{[]string{"bench", "train", "-f", "0"}, "-f 0"},
		{[]string{"bench", "train", "-m", "0"}, "-m 0"},
		{[]string{"bench", "train", "-m", "1000000", "-f", "4096"}, "at most 2^31 - 1"},
		{[]string{"bench", "train", "-reps", "0"}, "-reps 0"},
		{[]string{"bench", "train", "-l1", "-1"}, "-l1 -1"},
		{[]string{"bench", "train", "-dist", "zipf"}, "unknown distribution"},
		{[]string{"bench", "train", "-device", "cpu"}, "give -device cuda"},
		{[]string{"bench", "train", "-mlp", "x"}, "flag provided but not defined: -mlp"},
		{[]string{"bench", "train", "-step", "-density", "0.005,0.01"}, "-step takes one -density"},
		{[]string{"bench", "train", "-step", "-batch", "0", "-density", "0.005"}, "-batch 0"},
		{[]string{"bench", "train", "-step", "-steps", "0", "-density", "0.005"}, "-steps 0"},
		{[]string{"bench", "train", "-step", "-layers", "-1", "-density", "0.005"}, "-layers -1"},
		{[]string{"bench", "train", "-step", "-paths", "sparse,fast", "-density", "0.005"}, "-paths \"sparse,fast\""},
		{[]string{"bench", "train", "-step", "-paths", "sparse,", "-density", "0.005"}, "-paths \"sparse,\""},
		{[]string{"bench", "train", "-step", "-paths", "sparse,dense,sparse", "-density", "0.005"}, "-paths: sparse given twice"},
	})
}

func TestTrainMLPFlagBadValues(t *testing.T) {
	checkUsageErrors(t, []usageCase{
		{[]string{"train", "-preset", "tiny", "-out", "x", "-mlp", "fast"}, "MLP path \"fast\""},
		{[]string{"train", "-preset", "tiny", "-out", "x", "-dense-above", "2"}, "-dense-above 2"},
		{[]string{"train", "-preset", "tiny", "-out", "x", "-dense-above", "0"}, "-dense-above 0"},
	})
}

// TestPrintTrainStepRatios: the "vs dense" column divides by the dense
// row's step time wherever that row sits, and reads "-" without one.
func TestPrintTrainStepRatios(t *testing.T) {
	rows := []bench.TrainStepResult{{Path: "sparse", StepMS: 250}, {Path: "dense", StepMS: 350}, {Path: "auto", StepMS: 245}}
	var b strings.Builder
	printTrainStep(&b, rows)
	for _, want := range []string{"1.40x", "1.00x", "1.43x"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("with a dense row, no %q in\n%s", want, b.String())
		}
	}
	b.Reset()
	printTrainStep(&b, []bench.TrainStepResult{rows[0], rows[2]})
	if strings.Contains(b.String(), "x\n") || strings.Count(b.String(), " -\n") != 2 {
		t.Errorf("without a dense row, want \"-\" in both rows' last column:\n%s", b.String())
	}
}

// TestPrintTrainStepGroups: a profiled step's "group: kernel" stages also
// print their group's sum, once per group, after the stages.
func TestPrintTrainStepGroups(t *testing.T) {
	r, seed := testutil.Rand(t)
	ms := func() float64 { return 0.01 + 10*r.Float64() }
	st := []trainer.StageTime{{Name: "norm fwd", MS: ms(), Count: 3}, {Name: "mlp fwd: gate GEMM", MS: ms(), Count: 2},
		{Name: "mlp fwd: row index", MS: ms(), Count: 2}, {Name: "mlp bwd: dx SpMM", MS: ms(), Count: 2}, {Name: "adamw", MS: ms(), Count: 1}}
	var b strings.Builder
	printTrainStep(&b, []bench.TrainStepResult{{Path: "sparse", StepMS: 250, Stages: st}})
	out := b.String()
	for g, want := range map[string]float64{"mlp fwd": st[1].MS + st[2].MS, "mlp bwd": st[3].MS} {
		line := fmt.Sprintf("%s, all stages", g)
		if strings.Count(out, line) != 1 {
			t.Fatalf("seed %d: want one %q line in\n%s", seed, line, out)
		}
		if !strings.Contains(out, fmt.Sprintf("%.2f", want)) {
			t.Errorf("seed %d: %s: no sum %.2f in\n%s", seed, g, want, out)
		}
	}
	for _, n := range []string{"norm fwd, all", "adamw, all"} {
		if strings.Contains(out, n) {
			t.Errorf("seed %d: a stage outside any group got a sum (%q) in\n%s", seed, n, out)
		}
	}
}
