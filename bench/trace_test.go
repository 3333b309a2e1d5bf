package bench

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/cuda/cupti"
)

func TestSummarizeTraceSteps(t *testing.T) {
	k := func(name string, s, e uint64) cupti.Kernel { return cupti.Kernel{Name: name, Start: s, End: e} }
	ks := []cupti.Kernel{
		k("B", 1190, 1300), k("early", 50, 90), // out of order, and before the first mark
		k("A", 100, 200), k("B", 150, 300), k("C", 400, 450), // step 0: B overlaps A, C after a gap
		k("A", 1100, 1180), k("late", 2000, 2100), // the last mark ends the steps
	}
	got, err := SummarizeTrace(ks, []uint64{100, 1000, 2000})
	if err != nil {
		t.Fatal(err)
	}
	// Step 0 is busy 250 ns of a 350 ns span, step 1 190 of 200; the steps
	// last 900 and 1000 ns.
	want := TraceSummary{Steps: 2, KernelsPerStep: 2.5, WallMS: 0.00095, SpanMS: 0.000275, BusyMS: 0.00022,
		Kernels: []KernelShare{
			{Name: "B", CallsPerStep: 1, MedianUS: 0.13, AddsUS: 0.105},
			{Name: "A", CallsPerStep: 1, MedianUS: 0.09, AddsUS: 0.09},
			{Name: "C", CallsPerStep: 0.5, MedianUS: 0.05, AddsUS: 0.025},
		}}
	if !traceClose(got, want) {
		t.Errorf("summary\n%+v\nwant\n%+v", got, want)
	}
	if s := got.String(); !strings.Contains(s, "2 steps") || !strings.Contains(s, "B ") {
		t.Errorf("String: %q", s)
	}
	for _, marks := range [][]uint64{nil, {5}, {5, 4}} {
		if _, err := SummarizeTrace(ks, marks); err == nil {
			t.Errorf("marks %v: no error", marks)
		}
	}
}

func traceClose(a, b TraceSummary) bool {
	eq := func(x, y float64) bool { return math.Abs(x-y) <= 1e-9*max(1, math.Abs(y)) }
	if a.Steps != b.Steps || !eq(a.KernelsPerStep, b.KernelsPerStep) || !eq(a.WallMS, b.WallMS) ||
		!eq(a.SpanMS, b.SpanMS) || !eq(a.BusyMS, b.BusyMS) || len(a.Kernels) != len(b.Kernels) {
		return false
	}
	for i := range a.Kernels {
		x, y := a.Kernels[i], b.Kernels[i]
		if x.Name != y.Name || !eq(x.CallsPerStep, y.CallsPerStep) || !eq(x.MedianUS, y.MedianUS) || !eq(x.AddsUS, y.AddsUS) {
			return false
		}
	}
	return true
}

// TestSummarizeTraceAddsToBusyTime checks on random overlapping kernels that
// what the kernels add sums to the union of their intervals in each step,
// which is at most the step's span.
func TestSummarizeTraceAddsToBusyTime(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 2))
	for trial := range 200 {
		steps := 1 + r.IntN(5)
		marks := []uint64{1000}
		for range steps {
			marks = append(marks, marks[len(marks)-1]+uint64(1+r.IntN(5000)))
		}
		var ks []cupti.Kernel
		union := 0.0
		for s := range steps {
			var iv [][2]uint64
			for range r.IntN(12) {
				st := marks[s] + uint64(r.Int64N(int64(marks[s+1]-marks[s])))
				en := st + uint64(r.IntN(3000))
				ks = append(ks, cupti.Kernel{Name: string(rune('a' + r.IntN(4))), Start: st, End: en})
				iv = append(iv, [2]uint64{st, en})
			}
			slices.SortFunc(iv, func(a, b [2]uint64) int { return int(a[0]) - int(b[0]) })
			cur := [2]uint64{}
			for i, x := range iv {
				if i == 0 || x[0] > cur[1] {
					union += float64(cur[1] - cur[0])
					cur = x
				} else {
					cur[1] = max(cur[1], x[1])
				}
			}
			union += float64(cur[1] - cur[0])
		}
		r.Shuffle(len(ks), func(i, j int) { ks[i], ks[j] = ks[j], ks[i] })
		got, err := SummarizeTrace(ks, marks)
		if err != nil {
			t.Fatal(err)
		}
		adds := 0.0
		for _, k := range got.Kernels {
			adds += k.AddsUS
		}
		wantBusy := union / 1e6 / float64(steps)
		if math.Abs(got.BusyMS-wantBusy) > 1e-9 || math.Abs(adds/1e3-wantBusy) > 1e-9 {
			t.Fatalf("seed %d trial %d: busy %g ms, kernels add %g ms, union of intervals %g ms", seed, trial, got.BusyMS, adds/1e3, wantBusy)
		}
		if got.KernelsPerStep*float64(steps) != float64(len(ks)) {
			t.Fatalf("seed %d trial %d: %g kernels a step over %d steps, want %d kernels", seed, trial, got.KernelsPerStep, steps, len(ks))
		}
	}
}

func TestWriteChromeTrace(t *testing.T) {
	secs := []TraceSection{
		{Label: "twell decode b=1", Kernels: []cupti.Kernel{
			{Name: "qkv_rope1", Start: 5000, End: 9000, Stream: 3, Grid: [3]int32{96, 1, 1}, Block: [3]int32{256, 1, 1}, Graph: 2},
			{Name: "gemv_act<1, true, false>", Start: 9500, End: 20000, Stream: 3}}},
		{Label: "empty"},
	}
	var buf bytes.Buffer
	if err := WriteChromeTrace(&buf, secs); err != nil {
		t.Fatal(err)
	}
	var got struct {
		TraceEvents []chromeEvent `json:"traceEvents"`
	}
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, buf.String())
	}
	var xs []string
	for _, e := range got.TraceEvents {
		switch e.Ph {
		case "X":
			xs = append(xs, e.Name)
			if e.PID != 1 || e.TID != 3 {
				t.Errorf("event %s: pid %d tid %d", e.Name, e.PID, e.TID)
			}
		case "M":
		default:
			t.Errorf("event phase %q", e.Ph)
		}
	}
	if !slices.Equal(xs, []string{"qkv_rope1", "gemv_act<1, true, false>"}) {
		t.Errorf("kernel events %v", xs)
	}
	e := got.TraceEvents[2] // after the first section's two metadata events
	if e.Name != "qkv_rope1" || e.TS != 0 || e.Dur != 4 || e.Args["graph"] != float64(2) {
		t.Errorf("first kernel event %+v, want ts 0 dur 4 us, graph 2", e)
	}
	if l := got.TraceEvents[3]; l.TS != 4.5 || l.Dur != 10.5 || l.Args["graph"] != nil {
		t.Errorf("second kernel event %+v, want ts 4.5 dur 10.5 us, no graph", l)
	}
}

// TestTraceStepsSeparatesTracerFailures: a failure of the tracer comes as
// a *TraceError (the benchmarks keep their timings), one of the traced work
// as it is.
func TestTraceStepsSeparatesTracerFailures(t *testing.T) {
	boom := errors.New("the step failed")
	_, _, err := traceSteps("test", 2, nil, func() error { return boom })
	msg, traceFailed := traceFailure(err)
	if cupti.Available() != nil {
		if !traceFailed || !strings.Contains(msg, "kernel trace") || !errors.Is(err, cupti.ErrNoCUPTI) {
			t.Errorf("without libcupti: err %v, want a TraceError wrapping ErrNoCUPTI", err)
		}
		return
	}
	if traceFailed || !errors.Is(err, boom) {
		t.Errorf("a failing step: err %v (tracer failure %v), want the step's error", err, traceFailed)
	}
}

func TestModelTraceErrorsNameThePoint(t *testing.T) {
	r := ModelCUDAResult{ModelResult: ModelResult{Path: "twell", Decode: []DecodePoint{{Batch: 1}, {Batch: 8, TraceError: "kernel trace: x"}}},
		PrefillTraceError: "kernel trace: y"}
	got := r.TraceErrors()
	if len(got) != 2 || got[0] != "twell prefill: kernel trace: y" || got[1] != "twell decode b=8: kernel trace: x" {
		t.Errorf("TraceErrors = %q", got)
	}
	if got := (ModelCUDAResult{}).TraceErrors(); got != nil {
		t.Errorf("no failures: %q", got)
	}
}
