package bench

import (
	"bytes"
	"cmp"
	"fmt"
	"image/color"
	"maps"
	"math"
	"slices"
	"strconv"

	"github.com/twell-ai/twell/internal/atomicfile"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// The plots follow one set of rules: every panel has a title, numbers on
// both axes (at least three labelled ticks each) and units in the axis
// labels; legends sit in a column to the right of the panels, never over
// the data; values that an axis cannot show (not finite, or <= 0 on a
// logarithmic axis) are left out and counted in a note under the panels.
// No input makes them panic.

// PlotFFN writes a PNG of speedup against density, one line per device,
// distribution, token count and MLP kind (and, on the GPU, one for the
// automatic path and one for the dense MLP in D2T), with the 1x line for
// reference.
func PlotFFN(results []FFNResult, path string) error {
	if len(results) == 0 {
		return fmt.Errorf("bench: no MLP results to plot")
	}
	var pts []speedupPoint
	type key struct {
		line    string
		density float64
	}
	seen := map[key]bool{}
	for _, r := range results {
		kind := "gated"
		if !r.Gated {
			kind = "non-gated"
		}
		// a line per setting of the switches (bench ffn -variants)
		pts = append(pts, speedupPoint{fmt.Sprintf("%s, %s, m=%d, %s%s", r.Device, r.Dist, r.M, kind, switchString(r.Switches)), r.Density, r.Speedup})
		// The automatic path and the dense MLP in D2T (GPU), the same in
		// every variant's row of a density: once.
		for _, p := range []speedupPoint{
			{fmt.Sprintf("auto: %s, %s, m=%d, %s", r.Device, r.Dist, r.M, kind), r.Density, r.AutoSpeedup},
			{fmt.Sprintf("dense in D2T: %s, %s, m=%d, %s", r.Device, r.Dist, r.M, kind), r.Density, ratio(r.DenseMS, r.DenseD2TMS)},
		} {
			if k := (key{p.line, p.density}); p.speedup > 0 && !seen[k] {
				seen[k] = true
				pts = append(pts, p)
			}
		}
	}
	r0 := results[0]
	header := []string{fmt.Sprintf("MLP block d=%d, f=%d, compression %d", r0.D, r0.F, r0.C), r0.Machine + ", " + r0.Date}
	return plotSpeedups(path, "TwELL MLP speedup over the dense MLP (same run)", "speedup (dense time / path time, x)", header, pts)
}

// ratio returns a / b, or 0 where b is 0 (a time not measured).
func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

// PlotTrainMLP writes a PNG of the training MLP block's speedup over dense
// against density: the sparse path and the automatic path, one line per
// distribution and token count.
func PlotTrainMLP(results []TrainMLPResult, path string) error {
	if len(results) == 0 {
		return fmt.Errorf("bench: no training MLP results to plot")
	}
	var pts []speedupPoint
	for _, r := range results {
		pts = append(pts, speedupPoint{fmt.Sprintf("sparse, %s, m=%d", r.Dist, r.M), r.Density, r.Speedup},
			speedupPoint{fmt.Sprintf("auto, %s, m=%d", r.Dist, r.M), r.Density, r.AutoSpeedup})
	}
	r0 := results[0]
	header := []string{fmt.Sprintf("training MLP block forward + backward (L1 term included), d=%d, f=%d", r0.D, r0.F), r0.Machine + ", " + r0.Date}
	return plotSpeedups(path, "Sparse training MLP speedup over the dense path (same run)", "speedup (dense time / path time, x)", header, pts)
}

// speedupPoint is one point of a speedup-against-density line.
type speedupPoint struct {
	line             string
	density, speedup float64
}

// plotSpeedups draws speedup lines against density (log scale) with the 1x
// line, dropping (and noting) points that cannot be drawn.
func plotSpeedups(path, title, ylabel string, header []string, points []speedupPoint) error {
	p := newPanel(title, "density (fraction of MLP units active per token, log scale)", ylabel)
	var notes notes
	groups := map[string]plotter.XYs{}
	var names []string
	for _, pt := range points {
		if !(pt.density > 0) || math.IsInf(pt.density, 0) {
			notes.drop(pt.line, "density", pt.density, "log x axis")
			continue
		}
		if !finite(pt.speedup) {
			notes.drop(pt.line, "speedup", pt.speedup, "y axis")
			continue
		}
		if _, ok := groups[pt.line]; !ok {
			names = append(names, pt.line)
		}
		groups[pt.line] = append(groups[pt.line], plotter.XY{X: pt.density, Y: pt.speedup})
	}
	slices.Sort(names)
	leg := newLegend()
	var xs, ys []float64
	for i, n := range names {
		pts := groups[n]
		if err := addLine(p, &leg, i, n, pts); err != nil {
			return err
		}
		xs, ys = appendXY(xs, ys, pts)
	}
	if len(xs) == 0 {
		notes.add("no result has a positive density and a finite speedup: nothing to plot")
		xs, ys = []float64{0.01}, []float64{1}
	}
	setLogAxis(&p.X, xs, true)
	ys = append(ys, 1) // keep the 1x line in view
	setLinearAxis(&p.Y, ys, true)
	one, err := plotter.NewLine(plotter.XYs{{X: p.X.Min, Y: 1}, {X: p.X.Max, Y: 1}})
	if err != nil {
		return err
	}
	one.Dashes = []vg.Length{vg.Points(4), vg.Points(4)}
	p.Add(one)
	leg.Add("1x (as fast as dense)", one)
	return render(path, 10*vg.Inch, 5*vg.Inch, header, []*plot.Plot{p}, &leg, notes)
}

// PlotModel writes a PNG of a whole-model benchmark: prefill tokens/ms by
// path (bars) and decode tokens/s against the batch size, one line per path.
// A run with more rows than the dense and the TwELL one (variants, each
// named by its path, rounds that repeat names) gets plotModelRows' figure
// instead, where lines of near-equal rows would cover each other.
func PlotModel(results []ModelResult, path string) error {
	if len(results) == 0 {
		return fmt.Errorf("bench: no model results to plot")
	}
	if len(results) > 2 {
		return plotModelRows(results, path)
	}
	r0 := results[0]
	var notes notes

	pre := newPanel(fmt.Sprintf("prefill, %d tokens per pass", r0.PrefillTokens),
		"MLP path (prefill speedup over dense)", "prefill throughput (tokens/ms)")
	var vals plotter.Values
	var names, labels []string
	for _, r := range results {
		v, label := notes.bar(r.Path, "prefill tokens/ms", r.PrefillTokPerMS)
		vals = append(vals, v)
		speedup := "n/a"
		if finite(r.Speedup) {
			speedup = fmt.Sprintf("%.2fx", r.Speedup)
		}
		names = append(names, fmt.Sprintf("%s (%s)", r.Path, speedup))
		labels = append(labels, label)
	}
	if err := addValueBars(pre, vals, labels, names); err != nil {
		return err
	}

	context := 0
	for _, r := range results {
		for _, d := range r.Decode {
			context = max(context, d.Context)
		}
	}
	title := "decode"
	if context > 0 {
		title = fmt.Sprintf("decode, %d tokens cached per sequence", context)
	}
	dec := newPanel(title, "batch (sequences per step, log scale)", "decode throughput (tokens/s, log scale)")
	leg := newLegend()
	var xs, ys []float64
	// A run's decoder steps (GPU), greedy and drawing, are more lines of
	// its path (runs before the drawing decoder have no drawn figures).
	decoders := false
	for _, r := range results {
		for _, d := range r.Decode {
			decoders = decoders || d.GreedyTokensPerSec != 0 || d.DrawnTokensPerSec != 0
		}
	}
	for i, r := range results {
		var pts, gpts, dpts plotter.XYs
		for _, d := range r.Decode {
			if d.Batch <= 0 {
				notes.drop(r.Path, "decode batch", float64(d.Batch), "log x axis")
				continue
			}
			x := float64(d.Batch)
			for _, v := range []struct {
				what string
				y    float64
				pts  *plotter.XYs
				skip bool
			}{
				{"decode tokens/s", d.TokensPerSec, &pts, false},
				{"greedy decoder tokens/s", d.GreedyTokensPerSec, &gpts, !decoders},
				{"drawing decoder tokens/s", d.DrawnTokensPerSec, &dpts, !decoders || d.DrawnTokensPerSec == 0},
			} {
				switch {
				case v.skip:
				case !(v.y > 0) || math.IsInf(v.y, 0):
					notes.drop(r.Path, fmt.Sprintf("%s at batch %d", v.what, d.Batch), v.y, "log y axis")
				default:
					*v.pts = append(*v.pts, plotter.XY{X: x, Y: v.y})
				}
			}
		}
		name := r.Path
		if decoders {
			name += ", logits to the host"
		}
		for k, line := range []struct {
			name string
			pts  plotter.XYs
		}{{name, pts}, {r.Path + ", greedy decoder", gpts}, {r.Path + ", decoder drawing (T 1, top-p 0.95)", dpts}} {
			if len(line.pts) == 0 {
				continue
			}
			if err := addLine(dec, &leg, i+k*len(results), line.name, line.pts); err != nil {
				return err
			}
			xs, ys = appendXY(xs, ys, line.pts)
		}
	}
	if len(xs) == 0 {
		notes.add("no decode measurement with a positive batch and tokens/s: the decode panel is empty")
		xs, ys = []float64{1}, []float64{1}
	}
	setLogAxis(&dec.X, xs, true)
	setLogAxis(&dec.Y, ys, false)

	header := []string{r0.Model, r0.Machine + ", " + r0.Date}
	return render(path, 12*vg.Inch, 5*vg.Inch, header, []*plot.Plot{pre, dec}, &leg, notes)
}

// rowGroups groups results by path name, in the order the names first
// appear: names[i] holds the rows at the indices of rows[i]. Where the rows
// come from builds of more than one commit (an A/B of builds), the name is
// the path and the commit ("twell @ 1a2b3c4").
func rowGroups(results []ModelResult) (names []string, rows [][]int) {
	commits := map[string]bool{}
	for _, r := range results {
		commits[r.Commit] = true
	}
	at := map[string]int{}
	for i, r := range results {
		name := r.Path
		if len(commits) > 1 {
			name += " @ " + cmp.Or(r.Commit, "unknown build")
		}
		g, ok := at[name]
		if !ok {
			g = len(names)
			at[name] = g
			names = append(names, name)
			rows = append(rows, nil)
		}
		rows[g] = append(rows[g], i)
	}
	return names, rows
}

// plotModelRows writes the figure of a run with many rows: a panel for
// prefill and one per decode batch size (see plotRows).
func plotModelRows(results []ModelResult, path string) error {
	names, rows := rowGroups(results)
	r0 := results[0]
	metrics := []rowMetric{{fmt.Sprintf("prefill, %d tokens per pass", r0.PrefillTokens), "prefill throughput (tokens/ms)", "prefill tokens/ms",
		func(i int) (float64, bool) { return results[i].PrefillTokPerMS, true }}}
	// context[b]: the tokens cached before batch b's timed steps, the most
	// any row reports (for the panel's title).
	context := map[int]int{}
	for _, r := range results {
		for _, d := range r.Decode {
			context[d.Batch] = max(context[d.Batch], d.Context)
		}
	}
	for _, b := range slices.Sorted(maps.Keys(context)) {
		title := fmt.Sprintf("decode b=%d", b)
		if context[b] > 0 {
			title += fmt.Sprintf(", %d tokens cached", context[b])
		}
		metrics = append(metrics, rowMetric{title, "decode throughput (tokens/s)", fmt.Sprintf("decode tokens/s at batch %d", b),
			func(i int) (float64, bool) {
				for _, d := range results[i].Decode {
					if d.Batch == b {
						return d.TokensPerSec, true
					}
				}
				return 0, false
			}})
	}
	header := []string{r0.Model, r0.Machine + ", " + r0.Date + "; a point per row of the run, a bar at each name's median"}
	return plotRows(path, header, names, rows, metrics)
}

// rowMetric is one panel of plotRows: its title, y label, what it shows
// (for the notes), and each row's value (false: the row has none).
type rowMetric struct {
	title, ylabel, what string
	value               func(row int) (float64, bool)
}

// plotRows writes a figure of named groups of rows: a panel per metric,
// each row's value a point above its group's number (the legend names
// the groups), the rows of one group side by side and their median marked
// by a bar. The y axes start near the data, not at 0, so that differences
// of a few percent show. names[g] holds the rows at the indices rows[g].
func plotRows(path string, header, names []string, rows [][]int, metrics []rowMetric) error {
	var notes notes
	leg := newLegend()
	numbers := make([]string, len(names))
	for i := range names {
		numbers[i] = strconv.Itoa(i + 1)
	}
	var panels []*plot.Plot
	named := make([]bool, len(names)) // in the legend
	for _, m := range metrics {
		p := newPanel(m.title, "row (numbered as in the legend)", m.ylabel)
		var ys []float64
		for g, idx := range rows {
			var pts plotter.XYs
			var vals []float64
			for k, i := range idx {
				v, ok := m.value(i)
				if !ok {
					continue
				}
				if !finite(v) || v < 0 {
					notes.drop(names[g], m.what, v, "y axis")
					continue
				}
				// repeats of a name side by side, within +-0.3 of its place
				off := 0.0
				if len(idx) > 1 {
					off = 0.6 * (float64(k)/float64(len(idx)-1) - 0.5)
				}
				pts = append(pts, plotter.XY{X: float64(g) + off, Y: v})
				vals = append(vals, v)
			}
			if len(pts) == 0 {
				continue
			}
			s, err := plotter.NewScatter(pts)
			if err != nil {
				return fmt.Errorf("bench: plot points %q: %w", names[g], err)
			}
			s.Color, s.Shape = plotutil.Color(g), plotutil.Shape(g)
			med := Median(vals)
			bar, err := plotter.NewLine(plotter.XYs{{X: float64(g) - 0.4, Y: med}, {X: float64(g) + 0.4, Y: med}})
			if err != nil {
				return fmt.Errorf("bench: plot median %q: %w", names[g], err)
			}
			bar.Color, bar.Width = plotutil.Color(g), vg.Points(2)
			p.Add(s, bar)
			if !named[g] {
				leg.Add(fmt.Sprintf("%d  %s", g+1, names[g]), s)
				named[g] = true
			}
			ys = append(ys, vals...)
		}
		if len(ys) == 0 {
			notes.add(fmt.Sprintf("no row has a finite %s >= 0: its panel is empty", m.what))
		}
		p.NominalX(numbers...)
		p.X.Min, p.X.Max = -0.5, float64(len(names))-0.5
		setLinearAxis(&p.Y, ys, false)
		panels = append(panels, p)
	}
	w := vg.Length(max(10, 3.2*float64(len(panels))+3)) * vg.Inch
	return render(path, w, 5*vg.Inch, header, panels, &leg, notes)
}

// PlotFFNRuns writes a PNG of several bench ffn runs (the rounds of an
// A/B): for each shape (tokens, density, firing rates) a panel of the
// TwELL MLP block's time and, where measured, one of its D2T kernel's,
// each row a point above its build's number (the source commit and the
// switches that differ from the first row's), a bar at each build's
// median.
func PlotFFNRuns(results []FFNResult, path string) error {
	if len(results) == 0 {
		return fmt.Errorf("bench: no MLP results to plot")
	}
	at := map[string]int{}
	var names []string
	var rows [][]int
	type shape struct {
		m       int
		density float64
		dist    string
		gated   bool
	}
	var shapes []shape
	d2t, energy, d2tEnergy := map[shape]bool{}, map[shape]bool{}, map[shape]bool{}
	for i, r := range results {
		name := FFNBuildName(r, results[0].Switches)
		g, ok := at[name]
		if !ok {
			g = len(names)
			at[name] = g
			names = append(names, name)
			rows = append(rows, nil)
		}
		rows[g] = append(rows[g], i)
		sh := shape{r.M, r.Density, r.Dist, r.Gated}
		if !slices.Contains(shapes, sh) {
			shapes = append(shapes, sh)
		}
		d2t[sh] = d2t[sh] || r.D2TMS > 0
		energy[sh] = energy[sh] || r.TwELLMJPerToken > 0
		d2tEnergy[sh] = d2tEnergy[sh] || r.D2TMJPerToken > 0
	}
	var metrics []rowMetric
	for _, sh := range shapes {
		kind := ""
		if !sh.gated {
			kind = ", non-gated"
		}
		title := fmt.Sprintf("m=%d, %g%% %s%s", sh.m, 100*sh.density, sh.dist, kind)
		of := func(v func(FFNResult) float64) func(int) (float64, bool) {
			return func(i int) (float64, bool) {
				r := results[i]
				return v(r), shape{r.M, r.Density, r.Dist, r.Gated} == sh
			}
		}
		metrics = append(metrics, rowMetric{"MLP block, " + title, "TwELL path (ms, median of its reps)", "TwELL ms at " + title,
			of(func(r FFNResult) float64 { return r.TwELLMS })})
		if d2t[sh] {
			metrics = append(metrics, rowMetric{"D2T, " + title, "D2T kernel (ms, median of its reps)", "D2T ms at " + title,
				of(func(r FFNResult) float64 { return r.D2TMS })})
		}
		// Energy where NVML could be read: at large m the block runs at
		// the power limit, where energy, not waiting, sets its time.
		if energy[sh] {
			metrics = append(metrics, rowMetric{"MLP block energy, " + title, "TwELL path (mJ a token, NVML)", "TwELL mJ/token at " + title,
				of(func(r FFNResult) float64 { return r.TwELLMJPerToken })})
		}
		if d2tEnergy[sh] {
			metrics = append(metrics, rowMetric{"D2T energy, " + title, "D2T kernel (mJ a token, NVML)", "D2T mJ/token at " + title,
				of(func(r FFNResult) float64 { return r.D2TMJPerToken })})
		}
	}
	r0 := results[0]
	header := []string{fmt.Sprintf("MLP block d=%d, f=%d, compression %d", r0.D, r0.F, r0.C),
		r0.Machine + ", " + r0.Date + "; a point per run, a bar at each build's median"}
	return plotRows(path, header, names, rows, metrics)
}

// FFNBuildName names the build that measured r: its source commit (or
// "unknown build") and, in brackets, the switches that differ from base.
func FFNBuildName(r FFNResult, base map[string]string) string {
	name := r.Commit
	if name == "" {
		name = "unknown build"
	}
	if d := SwitchDiff(r.Switches, base); d != "" {
		name += " [" + d + "]"
	}
	return name
}

// addValueBars draws vals as bars on p's nominal x axis (names), each
// labelled above with its label, and fits the y axis from 0 with room for
// the labels.
func addValueBars(p *plot.Plot, vals plotter.Values, labels, names []string) error {
	bars, err := plotter.NewBarChart(vals, vg.Points(40))
	if err != nil {
		return err
	}
	bars.Color = plotutil.Color(0)
	p.Add(bars)
	var at plotter.XYLabels
	for i, v := range vals {
		at.XYs = append(at.XYs, plotter.XY{X: float64(i), Y: v})
	}
	at.Labels = labels
	l, err := plotter.NewLabels(at)
	if err != nil {
		return err
	}
	for i := range l.TextStyle {
		l.TextStyle[i].XAlign = draw.XCenter
	}
	l.Offset = vg.Point{Y: vg.Points(4)}
	p.Add(l)
	p.NominalX(names...)
	setLinearAxis(&p.Y, append(slices.Clone(vals), slices.Max(vals)*1.12), true) // room for the value labels
	return nil
}

// finite reports whether v is neither NaN nor infinite.
func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

// notes collects what a figure leaves out, printed under its panels.
type notes []string

func (n *notes) add(s string) { *n = append(*n, s) }

// drop records a value left out of a series.
func (n *notes) drop(series, what string, v float64, where string) {
	n.add(fmt.Sprintf("left out: %s %s = %g (cannot be shown on the %s)", series, what, v, where))
}

// bar returns v as a bar of a chart and its label: 0 and "n/a", with v
// noted as left out, when v is not a finite number >= 0.
func (n *notes) bar(series, what string, v float64) (float64, string) {
	if !finite(v) || v < 0 {
		n.drop(series, what, v, "bar chart")
		return 0, "n/a"
	}
	return v, strconv.FormatFloat(v, 'f', decimalsFor(v), 64)
}

// newPanel returns a plot with a title and axis labels in the figures' style.
func newPanel(title, xlabel, ylabel string) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.Title.TextStyle.Font.Size = vg.Points(12)
	p.Title.Padding = vg.Points(6)
	p.X.Label.Text, p.Y.Label.Text = xlabel, ylabel
	for _, a := range []*plot.Axis{&p.X, &p.Y} {
		a.Label.TextStyle.Font.Size = vg.Points(11)
		a.Tick.Label.Font.Size = vg.Points(10)
	}
	p.Add(plotter.NewGrid())
	return p
}

// newLegend returns an empty legend in the figures' style.
func newLegend() plot.Legend {
	l := plot.NewLegend()
	l.TextStyle.Font.Size = vg.Points(10)
	l.Left, l.Top = true, true
	l.Padding = vg.Points(3)
	return l
}

// addLine sorts pts by x and adds them to p as line i (color, glyph and
// dashes of plotutil's i-th style), named in leg.
func addLine(p *plot.Plot, leg *plot.Legend, i int, name string, pts plotter.XYs) error {
	slices.SortFunc(pts, func(a, b plotter.XY) int { return cmp.Compare(a.X, b.X) })
	l, s, err := plotter.NewLinePoints(pts)
	if err != nil {
		return fmt.Errorf("bench: plot line %q: %w", name, err)
	}
	l.Color, s.Color = plotutil.Color(i), plotutil.Color(i)
	l.Dashes = plotutil.Dashes(i)
	s.Shape = plotutil.Shape(i)
	p.Add(l, s)
	leg.Add(name, l, s)
	return nil
}

// appendXY appends the coordinates of pts to xs and ys (the values an axis
// is fitted to).
func appendXY(xs, ys []float64, pts plotter.XYs) ([]float64, []float64) {
	for _, q := range pts {
		xs, ys = append(xs, q.X), append(ys, q.Y)
	}
	return xs, ys
}

// setLinearAxis fits a linear axis to the finite values vs, from 0 when
// fromZero, with ticks at a round step.
func setLinearAxis(a *plot.Axis, vs []float64, fromZero bool) {
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, v := range vs {
		if finite(v) {
			lo, hi = min(lo, v), max(hi, v)
		}
	}
	if lo > hi { // no finite value
		lo, hi = 0, 1
	}
	if fromZero {
		lo, hi = min(lo, 0), max(hi, 0)
	}
	switch {
	case lo == hi && fromZero: // all zero
		hi = 1
	case lo == hi:
		lo, hi = lo-1, hi+1
	default:
		pad := 0.05 * (hi - lo)
		if !(fromZero && lo == 0) {
			lo -= pad
		}
		hi += pad
	}
	a.Scale = plot.LinearScale{}
	a.Min, a.Max = lo, hi
	a.Tick.Marker = linearTicks{}
}

// setLogAxis fits a logarithmic axis to the values vs that are positive and
// finite (the caller has left out the others), with room around them. With
// mark, the values themselves are labelled too (batch sizes, densities).
func setLogAxis(a *plot.Axis, vs []float64, mark bool) {
	lo, hi := math.Inf(1), 0.0
	for _, v := range vs {
		if v > 0 && !math.IsInf(v, 0) {
			lo, hi = min(lo, v), max(hi, v)
		}
	}
	if hi == 0 {
		lo, hi = 1, 1
	}
	pad := 1.25
	if hi/lo < 2 {
		pad = 1.6
	}
	a.Scale = plot.LogScale{}
	a.Min, a.Max = lo/pad, hi*pad
	if !(a.Min > 0) || math.IsInf(a.Max, 0) { // vs at the ends of float64
		a.Min, a.Max = lo, hi
	}
	a.Tick.Marker = logTicks{}
	if mark {
		a.Tick.Marker = logTicks{marked: vs}
	}
}

// linearTicks labels a linear axis at a round step (1, 2 or 5 times a power
// of ten) that gives 4 to 10 labels, with unlabelled minor ticks between.
type linearTicks struct{}

// Ticks returns the ticks between lo and hi.
func (linearTicks) Ticks(lo, hi float64) []plot.Tick {
	if !finite(lo) || !finite(hi) || hi <= lo {
		return []plot.Tick{{Value: lo, Label: formatTick(lo)}}
	}
	// The largest round step that still gives four labels.
	step := niceStep((hi - lo) / 4)
	for i := 0; i < 10 && math.Floor(hi/step)-math.Ceil(lo/step)+1 < 4; i++ {
		step = prevStep(step)
	}
	dec := max(0, -int(math.Floor(math.Log10(step)+1e-9)))
	var ts []plot.Tick
	minor := step / 5
	for k := math.Ceil(lo / minor); k*minor <= hi; k++ {
		v := k * minor
		t := plot.Tick{Value: v}
		switch {
		case math.Abs(v) < minor/2:
			t.Label = "0" // not "-0" or "0.00"
		case math.Abs(math.Remainder(v, step)) < minor/2:
			t.Label = strconv.FormatFloat(v, 'f', dec, 64)
		}
		ts = append(ts, t)
		if len(ts) > 200 {
			break
		}
	}
	return ts
}

// niceStep returns the smallest of 1, 2 or 5 times a power of ten that is
// at least x.
func niceStep(x float64) float64 {
	p := math.Pow(10, math.Floor(math.Log10(x)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= x*(1-1e-9) {
			return m * p
		}
	}
	return 10 * p
}

// prevStep returns the round step below step: 5 -> 2 -> 1 -> 0.5.
func prevStep(step float64) float64 {
	p := math.Pow(10, math.Floor(math.Log10(step)+1e-9))
	if m := step / p; m > 1.5 {
		return math.Round(m/2.2) * p // 5 -> 2, 2 -> 1
	}
	return p / 2
}

// logTicks labels a logarithmic axis at the marked values (the data's own:
// batch sizes, densities) and at 1, 2 and 5 times the powers of ten (only
// the powers of ten over more than three decades, where 2 and 5 would
// crowd), or at every digit when that gives fewer than three labels; labels
// closer than a factor 1.3 to a marked value are dropped. Minor ticks mark
// the other digits.
type logTicks struct {
	marked []float64
}

// Ticks returns the ticks between lo and hi.
func (t logTicks) Ticks(lo, hi float64) []plot.Tick {
	if !(lo > 0) || !(hi > lo) || math.IsInf(hi, 0) {
		return []plot.Tick{{Value: math.Max(lo, math.SmallestNonzeroFloat64), Label: formatTick(lo)}}
	}
	// The marked values in range, ascending, each at least a factor 1.3
	// above the one before (closer labels would overlap).
	var marked []float64
	for _, v := range slices.Sorted(slices.Values(t.marked)) {
		if v >= lo && v <= hi && (len(marked) == 0 || v >= 1.3*marked[len(marked)-1]) && len(marked) < 12 {
			marked = append(marked, v)
		}
	}
	digits := func(set []int) (labelled, minor []float64) {
		for e := int(math.Floor(math.Log10(lo))); e <= int(math.Ceil(math.Log10(hi))); e++ {
			for m := 1; m <= 9; m++ {
				v, _ := strconv.ParseFloat(fmt.Sprintf("%de%d", m, e), 64)
				if v < lo || v > hi {
					continue
				}
				if slices.Contains(set, m) {
					labelled = append(labelled, v)
				} else {
					minor = append(minor, v)
				}
			}
			if e-int(math.Floor(math.Log10(lo))) > 400 {
				break
			}
		}
		return labelled, minor
	}
	labelled, minor := digits([]int{1, 2, 5})
	if hi/lo > 1e3 {
		if l, m := digits([]int{1}); len(l) >= 3 {
			labelled, minor = l, m
		}
	}
	if len(labelled) < 3 {
		labelled, minor = digits([]int{1, 2, 3, 4, 5, 6, 7, 8, 9})
	}
	var ts []plot.Tick
	for _, v := range marked {
		ts = append(ts, plot.Tick{Value: v, Label: formatTick(v)})
	}
	near := func(v float64) bool {
		for _, m := range marked {
			if math.Max(v/m, m/v) < 1.3 {
				return true
			}
		}
		return false
	}
	for _, v := range labelled {
		if near(v) {
			ts = append(ts, plot.Tick{Value: v})
		} else {
			ts = append(ts, plot.Tick{Value: v, Label: formatTick(v)})
		}
	}
	for _, v := range minor {
		ts = append(ts, plot.Tick{Value: v})
	}
	if n := countLabels(ts); n < 3 {
		// A range narrower than one digit step: label it linearly.
		// Each new label at least a factor 1.12 from every other.
		var have []float64
		for _, t := range ts {
			if t.Label != "" {
				have = append(have, t.Value)
			}
		}
		for _, lt := range (linearTicks{}).Ticks(lo, hi) {
			if lt.Label != "" && lt.Value > 0 && !slices.ContainsFunc(have, func(m float64) bool { return math.Max(lt.Value/m, m/lt.Value) < 1.12 }) {
				ts = append(ts, lt)
				have = append(have, lt.Value)
			}
		}
	}
	slices.SortFunc(ts, func(a, b plot.Tick) int { return cmp.Compare(a.Value, b.Value) })
	return ts
}

func countLabels(ts []plot.Tick) int {
	n := 0
	for _, t := range ts {
		if t.Label != "" {
			n++
		}
	}
	return n
}

// formatTick writes v in at most four significant digits: "0.005", "16",
// "1234", "2.5e+06".
func formatTick(v float64) string {
	if v != 0 && (math.Abs(v) >= 1e6 || math.Abs(v) < 1e-4) {
		return strconv.FormatFloat(v, 'g', 3, 64)
	}
	r, _ := strconv.ParseFloat(strconv.FormatFloat(v, 'g', 4, 64), 64)
	return strconv.FormatFloat(r, 'f', -1, 64)
}

// decimalsFor returns the decimals that show v with about three significant digits.
func decimalsFor(v float64) int {
	if v == 0 || !finite(v) {
		return 0
	}
	return max(0, 2-int(math.Floor(math.Log10(math.Abs(v)))))
}

// render draws a figure: header lines on top, the panels side by side, the
// legend in a column on their right and the notes under them, and writes it
// as a PNG at path.
func render(path string, w, h vg.Length, header []string, panels []*plot.Plot, leg *plot.Legend, notes notes) (err error) {
	defer func() {
		// gonum/plot panics on some inputs (a log axis reaching 0); the axes
		// are set so that it cannot, and any other panic is a bug reported
		// as an error rather than a crash of the benchmark that measured.
		if r := recover(); r != nil {
			err = fmt.Errorf("bench: drawing %s: %v", path, r)
		}
	}()
	img := vgimg.New(w, h)
	dc := draw.New(img)
	dc.SetColor(color.White)
	dc.Fill(dc.Rectangle.Path())
	sty := panels[0].Title.TextStyle // a copy, with the plot's text handler
	sty.XAlign, sty.YAlign = draw.XCenter, draw.YTop
	top := h - vg.Points(6)
	for i, line := range header {
		sty.Font.Size = vg.Points(13)
		if i > 0 {
			sty.Font.Size = vg.Points(10)
		}
		dc.FillText(sty, vg.Point{X: w / 2, Y: top}, line)
		top -= sty.Rectangle(line).Size().Y + vg.Points(3)
	}
	const noteMax = 6
	if len(notes) > noteMax {
		more := len(notes) - noteMax + 1
		notes = append(notes[:noteMax-1:noteMax-1], fmt.Sprintf("... and %d more left out", more))
	}
	nsty := sty
	nsty.Font.Size = vg.Points(9)
	nsty.XAlign, nsty.YAlign = draw.XLeft, draw.YBottom
	bottom := vg.Points(4)
	for i := len(notes) - 1; i >= 0; i-- {
		dc.FillText(nsty, vg.Point{X: vg.Points(8), Y: bottom}, notes[i])
		bottom += nsty.Rectangle(notes[i]).Size().Y + vg.Points(2)
	}
	body := draw.Crop(dc, vg.Points(4), 0, bottom+vg.Points(2), -(h - top))
	if leg != nil {
		lw := leg.Rectangle(body).Size().X + vg.Points(12)
		lc := draw.Crop(body, body.Size().X-lw, 0, 0, -vg.Points(30)) // beside the panels' data, under their titles
		leg.Draw(lc)
		body = draw.Crop(body, 0, -lw, 0, 0)
	}
	tiles := draw.Tiles{Rows: 1, Cols: len(panels), PadX: vg.Points(28), PadTop: vg.Points(6), PadBottom: vg.Points(4),
		PadLeft: vg.Points(4), PadRight: vg.Points(10)}
	for i, p := range panels {
		p.Draw(tiles.At(body, i, 0))
	}
	var buf bytes.Buffer
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(&buf); err != nil {
		return err
	}
	return atomicfile.WriteFile(path, buf.Bytes())
}
