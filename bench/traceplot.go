package bench

import (
	"cmp"
	"fmt"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/vg"
)

// traceLabelMax is the most characters of a kernel's name a trace plot
// shows (library kernels' names run past 100).
const traceLabelMax = 34

// tracePanel is one panel of a trace plot: the traced steps of one
// workload, a series per path, in ms or us per step.
type tracePanel struct {
	title  string
	us     bool   // microseconds, else milliseconds
	per    string // what the time is of: "step" or "call"
	series []traceSeries
}

// traceSeries is one path's summary in a trace plot panel.
type traceSeries struct {
	name string
	sum  *TraceSummary
}

// PlotModelTraces writes a PNG of what each kernel adds to a step (the
// kernel traces of ModelCUDA with TraceSteps): a panel for the prefill pass
// and one per decode batch, a bar series per path.
func PlotModelTraces(results []ModelCUDAResult, path string) error {
	if len(results) == 0 {
		return fmt.Errorf("bench: no model results to plot")
	}
	var panels []tracePanel
	pre := tracePanel{title: fmt.Sprintf("prefill, %d tokens", results[0].PrefillTokens), per: "pass"}
	for _, r := range results {
		if r.PrefillTrace != nil {
			pre.series = append(pre.series, traceSeries{r.Path, r.PrefillTrace})
		}
	}
	if len(pre.series) > 0 {
		panels = append(panels, pre)
	}
	for i, d := range results[0].Decode {
		p := tracePanel{title: fmt.Sprintf("decode b=%d, %d cached", d.Batch, d.Context), us: true, per: "step"}
		for _, r := range results {
			if i < len(r.Decode) && r.Decode[i].Trace != nil {
				p.series = append(p.series, traceSeries{r.Path, r.Decode[i].Trace})
			}
		}
		if len(p.series) > 0 {
			panels = append(panels, p)
		}
	}
	r0 := results[0]
	header := []string{"what each kernel adds to a pass or step (CUPTI traces; kernels under 1.5% of one as \"other\")",
		fmt.Sprintf("%s, %s, %s", r0.Model, r0.Machine, r0.Date)}
	return plotTraces(path, header, panels)
}

// PlotFFNTraces writes a PNG of what each kernel adds to an MLP-block call
// (the kernel traces of FFNCUDA with TraceSteps): a panel per case, a bar
// series per path.
func PlotFFNTraces(results []FFNResult, path string) error {
	if len(results) == 0 {
		return fmt.Errorf("bench: no MLP-block results to plot")
	}
	var panels []tracePanel
	for _, r := range results {
		p := tracePanel{title: fmt.Sprintf("m=%d, density %g, %s", r.M, r.Density, r.Dist), us: true, per: "call"}
		for _, c := range []traceSeries{{"dense", r.DenseTrace}, {"twell", r.TwELLTrace}} {
			if c.sum != nil {
				p.series = append(p.series, c)
			}
		}
		if len(p.series) > 0 {
			panels = append(panels, p)
		}
	}
	r0 := results[0]
	header := []string{"what each kernel adds to a call (CUPTI traces; kernels under 1.5% of a call as \"other\")",
		fmt.Sprintf("d=%d f=%d, %s, %s", r0.D, r0.F, r0.Machine, r0.Date)}
	return plotTraces(path, header, panels)
}

// plotTraces draws the panels side by side, one legend for the series.
func plotTraces(path string, header []string, panels []tracePanel) error {
	if len(panels) == 0 {
		return fmt.Errorf("bench: no kernel traces to plot")
	}
	var notes notes
	leg := newLegend()
	inLegend := map[string]bool{}
	var plots []*plot.Plot
	for _, tp := range panels {
		unit, scale := "ms", 1e-3
		if tp.us {
			unit, scale = "us", 1
		}
		// Rows by what the kernel adds over all series, largest first.
		total := map[string]float64{}
		var names []string
		for _, ts := range tp.series {
			for _, k := range ts.sum.Kernels {
				if _, ok := total[k.Name]; !ok {
					names = append(names, k.Name)
				}
				if finite(k.AddsUS) {
					total[k.Name] += k.AddsUS
				}
			}
		}
		slices.SortStableFunc(names, func(a, b string) int { return cmp.Compare(total[b], total[a]) })
		labels := traceLabels(names)
		var series []stageSeries
		for _, ts := range tp.series {
			adds := map[string]float64{}
			for _, k := range ts.sum.Kernels {
				adds[k.Name] += k.AddsUS
			}
			ss := stageSeries{name: ts.name}
			for j, n := range names {
				ss.stages = append(ss.stages, stageMS{labels[j], adds[n] * scale})
			}
			series = append(series, ss)
		}
		p, err := stageBars(tp.title, fmt.Sprintf("added to a %s (%s)", tp.per, unit), series, &leg, inLegend, &notes)
		if err != nil {
			return err
		}
		plots = append(plots, p)
	}
	return render(path, vg.Length(max(8, 5*len(plots)+1))*vg.Inch, 6*vg.Inch, header, plots, &leg, notes)
}

// traceLabels shortens kernel names to traceLabelMax characters, numbering
// the ones that would otherwise read the same (library kernels share long
// prefixes).
func traceLabels(names []string) []string {
	out := make([]string, len(names))
	used := map[string]int{}
	for i, n := range names {
		l := n
		if len(l) > traceLabelMax {
			l = l[:traceLabelMax-3] + "..."
		}
		if k := used[l]; k > 0 {
			used[l]++
			l = fmt.Sprintf("%s#%d", l[:min(len(l), traceLabelMax-4)], k+1)
		} else {
			used[l] = 1
		}
		out[i] = l
	}
	return out
}
