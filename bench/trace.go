package bench

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/twell-ai/twell/cuda/cupti"
)

// KernelShare is one kernel's part of the steps of a trace, per step.
type KernelShare struct {
	Name         string  `json:"name"`
	CallsPerStep float64 `json:"calls_per_step"`
	// MedianUS is the median time from a call's first block starting to its
	// last block ending. Kernels that start early (programmatic dependent
	// launch) count the time they wait for the kernel before.
	MedianUS float64 `json:"median_us"`
	// AddsUS is how much its calls add to a step's GPU time: the part of
	// each call that ends past every kernel before it in the step. The
	// kernels' AddsUS sum to BusyMS.
	AddsUS float64 `json:"adds_us_per_step"`
}

// TraceSummary is what a kernel trace (package cuda/cupti) of some steps
// shows: per step, how long the host took, how long the GPU ran, and each
// kernel's part.
type TraceSummary struct {
	Steps          int     `json:"steps"`
	KernelsPerStep float64 `json:"kernels_per_step"`
	// WallMS is the median host time from one step's start to the next.
	WallMS float64 `json:"wall_ms_per_step"`
	// SpanMS is the median time from a step's first kernel starting to its
	// last ending; BusyMS the mean time some kernel of the step ran. SpanMS
	// - BusyMS is the GPU idle within a step; WallMS - SpanMS the host time
	// around it.
	SpanMS float64 `json:"span_ms_per_step"`
	BusyMS float64 `json:"busy_ms_per_step"`
	// Kernels lists the kernels by AddsUS, largest first.
	Kernels []KernelShare `json:"kernels"`
}

// SummarizeTrace summarizes the kernels of len(marks) - 1 steps: step i is
// the kernels that start in [marks[i], marks[i+1]) (host timestamps on the
// kernels' clock, cupti.Now); kernels outside every step are left out.
func SummarizeTrace(ks []cupti.Kernel, marks []uint64) (TraceSummary, error) {
	steps := len(marks) - 1
	if steps < 1 {
		return TraceSummary{}, fmt.Errorf("bench: a trace summary needs at least 2 step marks, got %d", len(marks))
	}
	for i := 1; i < len(marks); i++ {
		if marks[i] < marks[i-1] {
			return TraceSummary{}, fmt.Errorf("bench: step mark %d (%d) is before mark %d (%d)", i, marks[i], i-1, marks[i-1])
		}
	}
	ks = slices.Clone(ks)
	slices.SortStableFunc(ks, func(a, b cupti.Kernel) int { return cmp.Compare(a.Start, b.Start) })
	type acc struct {
		calls int
		durs  []float64
		adds  float64
	}
	byName := map[string]*acc{}
	var walls, spans []float64
	busy, n := 0.0, 0
	k := 0
	for s := range steps {
		for k < len(ks) && ks[k].Start < marks[s] {
			k++
		}
		walls = append(walls, float64(marks[s+1]-marks[s])/1e6)
		first, last, prevEnd := uint64(0), uint64(0), uint64(0)
		in := 0
		for ; k < len(ks) && ks[k].Start < marks[s+1]; k++ {
			kn := ks[k]
			end := max(kn.End, kn.Start)
			if in == 0 {
				first = kn.Start
			}
			last = max(last, end)
			add := 0.0
			if from := max(kn.Start, prevEnd); end > from {
				add = float64(end - from)
			}
			prevEnd = max(prevEnd, end)
			a := byName[kn.Name]
			if a == nil {
				a = &acc{}
				byName[kn.Name] = a
			}
			a.calls++
			a.durs = append(a.durs, float64(end-kn.Start)/1e3)
			a.adds += add / 1e3
			busy += add / 1e6
			in++
		}
		n += in
		if in > 0 {
			spans = append(spans, float64(last-first)/1e6)
		}
	}
	t := TraceSummary{Steps: steps, KernelsPerStep: float64(n) / float64(steps), WallMS: Median(walls),
		BusyMS: busy / float64(steps)}
	if len(spans) > 0 {
		t.SpanMS = Median(spans)
	}
	for name, a := range byName {
		t.Kernels = append(t.Kernels, KernelShare{Name: name, CallsPerStep: float64(a.calls) / float64(steps),
			MedianUS: Median(a.durs), AddsUS: a.adds / float64(steps)})
	}
	slices.SortFunc(t.Kernels, func(a, b KernelShare) int {
		return cmp.Or(cmp.Compare(b.AddsUS, a.AddsUS), strings.Compare(a.Name, b.Name))
	})
	return t, nil
}

// TraceError is a failure of the kernel tracer itself, not of the traced
// work: the benchmarks record it (trace_error in their JSON) and keep their
// timings.
type TraceError struct{ Err error }

// Error says that the kernel trace failed, and why.
func (e *TraceError) Error() string { return "kernel trace: " + e.Err.Error() }

// Unwrap returns the tracer's error.
func (e *TraceError) Unwrap() error { return e.Err }

// traceFailure returns err's message when err is a *TraceError, and
// whether it is one.
func traceFailure(err error) (string, bool) {
	var te *TraceError
	if errors.As(err, &te) {
		return te.Error(), true
	}
	return "", false
}

// traceSteps records the kernels (package cuda/cupti) of n calls of step,
// after prepare (when set; run with the tracer on, but not as a step),
// and summarizes them; the section holds the steps' kernels under label.
// step must wait for its kernels (the marks between steps are host times).
// The tracer's own failures come as *TraceError, those of the work as they
// are.
func traceSteps(label string, n int, prepare, step func() error) (TraceSummary, TraceSection, error) {
	rec, err := cupti.Start()
	if err != nil {
		return TraceSummary{}, TraceSection{}, &TraceError{err}
	}
	run := func() ([]uint64, error) {
		if prepare != nil {
			if err := prepare(); err != nil {
				return nil, err
			}
		}
		marks := make([]uint64, 0, n+1)
		for i := 0; i <= n; i++ {
			t, err := cupti.Now()
			if err != nil {
				return nil, &TraceError{err}
			}
			marks = append(marks, t)
			if i < n {
				if err := step(); err != nil {
					return nil, err
				}
			}
		}
		return marks, nil
	}
	marks, err := run()
	ks, serr := rec.Stop()
	if err != nil {
		return TraceSummary{}, TraceSection{}, err
	}
	if serr != nil {
		return TraceSummary{}, TraceSection{}, &TraceError{serr}
	}
	sum, err := SummarizeTrace(ks, marks)
	if err != nil {
		return TraceSummary{}, TraceSection{}, &TraceError{err}
	}
	sec := TraceSection{Label: label}
	for _, k := range ks {
		if k.Start >= marks[0] && k.Start < marks[n] {
			sec.Kernels = append(sec.Kernels, k)
		}
	}
	return sum, sec, nil
}

// String gives the summary in a few lines: the step's times, then the
// kernels that add the most.
func (t TraceSummary) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d steps: wall %.3f ms, GPU span %.3f ms, busy %.3f ms, %.0f kernels a step", t.Steps, t.WallMS,
		t.SpanMS, t.BusyMS, t.KernelsPerStep)
	for i, k := range t.Kernels {
		if i == 12 {
			fmt.Fprintf(&b, "\n  ... %d more", len(t.Kernels)-i)
			break
		}
		fmt.Fprintf(&b, "\n  %-28s %6.1f calls  %8.2f us each (median)  adds %8.1f us", k.Name, k.CallsPerStep, k.MedianUS, k.AddsUS)
	}
	return b.String()
}

// TraceSection is a labelled run of traced kernels, one process of a
// Chrome trace.
type TraceSection struct {
	Label   string
	Kernels []cupti.Kernel
}

// chromeEvent is one event of the Chrome trace event format, which
// Perfetto and chrome://tracing read.
type chromeEvent struct {
	Name string         `json:"name"`
	Ph   string         `json:"ph"`
	TS   float64        `json:"ts"`
	Dur  float64        `json:"dur"`
	PID  int            `json:"pid"`
	TID  uint32         `json:"tid"`
	Args map[string]any `json:"args,omitempty"`
}

// WriteChromeTrace writes sections as a Chrome trace (JSON): a process per
// section, a thread per stream, a complete event per kernel with its
// launch shape in args; each section's time starts at its first kernel.
func WriteChromeTrace(w io.Writer, sections []TraceSection) error {
	evs := []chromeEvent{}
	for i, sec := range sections {
		pid := i + 1
		evs = append(evs, chromeEvent{Name: "process_name", Ph: "M", PID: pid, Args: map[string]any{"name": sec.Label}},
			chromeEvent{Name: "process_sort_index", Ph: "M", PID: pid, Args: map[string]any{"sort_index": i}})
		if len(sec.Kernels) == 0 {
			continue
		}
		t0 := sec.Kernels[0].Start
		for _, k := range sec.Kernels {
			t0 = min(t0, k.Start)
		}
		for _, k := range sec.Kernels {
			args := map[string]any{"grid": k.Grid, "block": k.Block, "registers": k.Registers,
				"shared_bytes": k.StaticShared + k.DynamicShared, "correlation": k.Correlation}
			if k.Graph != 0 {
				args["graph"] = k.Graph
			}
			evs = append(evs, chromeEvent{Name: k.Name, Ph: "X", TS: float64(k.Start-t0) / 1e3,
				Dur: float64(max(k.End, k.Start)-k.Start) / 1e3, PID: pid, TID: k.Stream, Args: args})
		}
	}
	enc := json.NewEncoder(w)
	return enc.Encode(struct {
		TraceEvents     []chromeEvent `json:"traceEvents"`
		DisplayTimeUnit string        `json:"displayTimeUnit"`
	}{evs, "ns"})
}
