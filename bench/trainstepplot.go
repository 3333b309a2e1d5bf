package bench

import (
	"fmt"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// stageShareShown is the share of a profiled step below which a stage is
// drawn in "other" (in every path).
const stageShareShown = 0.015

// PlotTrainStep writes a PNG of a whole-step training benchmark: the step
// time per MLP path (bars, labelled with the speedup over the dense path),
// and, when the steps were profiled, the GPU time per stage of each path
// (horizontal bars, stages under stageShareShown of the step in every
// path summed as "other").
func PlotTrainStep(results []TrainStepResult, path string) error {
	if len(results) == 0 {
		return fmt.Errorf("bench: no training step results to plot")
	}
	var notes notes
	dense := 0.0
	for _, r := range results {
		if r.Path == "dense" && finite(r.StepMS) && r.StepMS > 0 {
			dense = r.StepMS
		}
	}
	steps := newPanel("time per training step", "MLP path (speedup over the dense path)", "step time (ms, median)")
	var vals plotter.Values
	var names, labels []string
	for _, r := range results {
		v, label := notes.bar(r.Path, "step ms", r.StepMS)
		speedup := "n/a"
		if dense > 0 && v > 0 {
			speedup = fmt.Sprintf("%.2fx", dense/v)
		}
		vals = append(vals, v)
		names = append(names, fmt.Sprintf("%s (%s)", r.Path, speedup))
		labels = append(labels, label)
	}
	if err := addValueBars(steps, vals, labels, names); err != nil {
		return err
	}
	panels := []*plot.Plot{steps}

	leg := newLegend()
	if st, err := stagePanel(results, &leg, &notes); err != nil {
		return err
	} else if st != nil {
		panels = append(panels, st)
	}
	r0 := results[0]
	header := []string{fmt.Sprintf("%s, %d layers, %d x %d tokens a step, gate density %g", r0.Model, r0.Layers, r0.Batch, r0.Seq, r0.Density),
		r0.Machine + ", " + r0.Date}
	return render(path, 14*vg.Inch, 6*vg.Inch, header, panels, &leg, notes)
}

// stagePanel returns horizontal bars of each profiled path's GPU time per
// stage, or nil when no result has a profile.
func stagePanel(results []TrainStepResult, leg *plot.Legend, notes *notes) (*plot.Plot, error) {
	var series []stageSeries
	for _, r := range results {
		if len(r.Stages) == 0 {
			continue
		}
		ss := stageSeries{name: r.Path + " MLP path"}
		for _, s := range r.Stages {
			ss.stages = append(ss.stages, stageMS{s.Name, s.MS})
		}
		series = append(series, ss)
	}
	if len(series) == 0 {
		return nil, nil
	}
	return stageBars("GPU time per stage, one profiled step", "GPU time (ms)", series, leg, map[string]bool{}, notes)
}

// stageMS is the time of one stage (or kernel) of a step.
type stageMS struct {
	name string
	ms   float64
}

// stageSeries is one bar series of a stage panel: a path's stages.
type stageSeries struct {
	name   string
	stages []stageMS
}

// stageBars returns horizontal bars of each series' time per stage: the
// stages at stageShareShown or more of some series' total, in the order
// the first series lists them, the rest summed as "other". A legend entry
// goes to leg for each series not yet in inLegend, which records it.
func stageBars(title, xlabel string, series []stageSeries, leg *plot.Legend, inLegend map[string]bool, notes *notes) (*plot.Plot, error) {
	shown := map[string]bool{}
	var order []string
	for _, r := range series {
		total := 0.0
		for _, s := range r.stages {
			if finite(s.ms) && s.ms > 0 {
				total += s.ms
			}
		}
		for _, s := range r.stages {
			if !slices.Contains(order, s.name) {
				order = append(order, s.name)
			}
			if total > 0 && s.ms >= stageShareShown*total {
				shown[s.name] = true
			}
		}
	}
	var rows []string
	for _, n := range order {
		if shown[n] {
			rows = append(rows, n)
		}
	}
	rows = append(rows, "other")
	sums := make([]plotter.Values, len(series))
	other := false
	for i, r := range series {
		sums[i] = make(plotter.Values, len(rows))
		for _, s := range r.stages {
			if !finite(s.ms) || s.ms < 0 {
				notes.drop(r.name, s.name, s.ms, "bar chart")
				continue
			}
			k := slices.Index(rows, s.name)
			if k < 0 {
				k, other = len(rows)-1, true
			}
			sums[i][k] += s.ms
		}
	}
	if !other {
		rows = rows[:len(rows)-1]
	}
	p := newPanel(title, xlabel, "")
	w := vg.Points(min(14, 260/float64(len(rows)*len(series))))
	var all []float64
	for i, r := range series {
		vals := sums[i][:len(rows)]
		slices.Reverse(vals) // bars from top to bottom in the first series' order
		b, err := plotter.NewBarChart(vals, w)
		if err != nil {
			return nil, err
		}
		b.Horizontal = true
		b.Color = plotutil.Color(i + 1)
		b.LineStyle.Width = 0
		b.Offset = w * vg.Length(float64(len(series)-1)/2-float64(i))
		p.Add(b)
		if !inLegend[r.name] {
			leg.Add(r.name, b)
			inLegend[r.name] = true
		}
		all = append(all, vals...)
	}
	labels := slices.Clone(rows)
	slices.Reverse(labels)
	p.NominalY(labels...)
	setLinearAxis(&p.X, append(all, 0), true)
	return p, nil
}
