package bench

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// cdfPoints is the most points a distribution's line is drawn with.
const cdfPoints = 400

// PlotServe writes a PNG of a serving load test: each request's time to
// first token and end-to-end latency against when it was sent, and the
// distributions (CDF) of the inter-token latency and of the time per
// output token.
func PlotServe(res *ServeResult, path string) error {
	if res == nil {
		return fmt.Errorf("bench: no serving result to plot")
	}
	var notes notes
	lat := newPanel("latency of each request", "request sent at (s from the start)", "latency (ms, log scale)")
	leg := newLegend()
	var xs, ys []float64
	ttft, e2e := plotter.XYs{}, plotter.XYs{}
	failed := 0
	for i, q := range res.PerRequest {
		if q.Error != "" {
			failed++
			continue
		}
		if !finite(q.StartS) {
			notes.drop(fmt.Sprintf("request %d", i), "send time (s)", q.StartS, "x axis")
			continue
		}
		for _, s := range []struct {
			name string
			v    float64
			pts  *plotter.XYs
		}{{"time to first token", q.TTFTMS, &ttft}, {"end-to-end", q.E2EMS, &e2e}} {
			if !(s.v > 0) || math.IsInf(s.v, 0) {
				notes.drop(fmt.Sprintf("request %d", i), s.name+" (ms)", s.v, "log y axis")
				continue
			}
			*s.pts = append(*s.pts, plotter.XY{X: q.StartS, Y: s.v})
		}
	}
	if failed > 0 {
		notes.add(fmt.Sprintf("%d failed requests are not shown", failed))
	}
	for i, s := range []struct {
		name string
		pts  plotter.XYs
	}{{"time to first token", ttft}, {"end-to-end latency", e2e}} {
		if len(s.pts) == 0 {
			continue
		}
		sc, err := plotter.NewScatter(s.pts)
		if err != nil {
			return fmt.Errorf("bench: plot %s: %w", s.name, err)
		}
		sc.Color = plotutil.Color(i)
		sc.Shape = plotutil.Shape(i)
		lat.Add(sc)
		leg.Add(s.name, sc)
		xs, ys = appendXY(xs, ys, s.pts)
	}
	if len(xs) == 0 {
		notes.add("no request succeeded with positive latencies: the latency panel is empty")
		xs, ys = []float64{0}, []float64{1}
	}
	setLinearAxis(&lat.X, xs, true)
	setLogAxis(&lat.Y, ys, false)

	dist := newPanel("latency distributions", "latency (ms, log scale)", "fraction of samples at or below")
	xs, ys = nil, nil
	tpot := make([]float64, 0, len(res.PerRequest))
	for _, q := range res.PerRequest {
		if q.Error == "" && q.OutputTokens > 1 {
			tpot = append(tpot, q.TPOTMS)
		}
	}
	for i, s := range []struct {
		name string
		v    []float64
	}{{"inter-token latency", res.itl}, {"time per output token", tpot}} {
		pts := cdf(s.name, s.v, &notes)
		if len(pts) == 0 {
			continue
		}
		l, err := plotter.NewLine(pts) // no glyphs: hundreds of points
		if err != nil {
			return fmt.Errorf("bench: plot %s: %w", s.name, err)
		}
		l.Color, l.Dashes, l.Width = plotutil.Color(i+2), plotutil.Dashes(i), vg.Points(1.5)
		dist.Add(l)
		leg.Add(s.name, l)
		xs, ys = appendXY(xs, ys, pts)
	}
	if len(xs) == 0 {
		notes.add("no inter-token latency measured (every request gave at most one chunk): the distribution panel is empty")
		xs = []float64{1}
	}
	setLogAxis(&dist.X, xs, false)
	setLinearAxis(&dist.Y, []float64{0, 1}, true)

	rate := "all at once"
	if res.Rate > 0 {
		rate = fmt.Sprintf("%g requests/s (Poisson)", res.Rate)
	}
	conc := "no concurrency limit"
	if res.Concurrency > 0 {
		conc = fmt.Sprintf("at most %d in flight", res.Concurrency)
	}
	header := []string{
		fmt.Sprintf("twell bench serve: %d requests, %s, %s, max_tokens %d", res.Requests, rate, conc, res.MaxTokens),
		fmt.Sprintf("%d done in %.2f s: %.2f requests/s, %.1f output tokens/s; TTFT median %.1f ms, ITL median %.2f ms",
			res.Completed, res.DurationS, res.RequestsPerS, res.OutputTokPerS, res.TTFT.Median, res.ITL.Median),
	}
	header = append(header, wrap(res.Server, 130)...)
	header = append(header, res.Machine+", "+res.Date)
	return render(path, 12*vg.Inch, 5.5*vg.Inch, header, []*plot.Plot{lat, dist}, &leg, notes)
}

// cdf returns the empirical distribution of the positive finite values of
// vs as points (value, fraction at or below it), at most cdfPoints of them;
// the others are counted in notes.
func cdf(name string, vs []float64, n *notes) plotter.XYs {
	var ok []float64
	bad := 0
	for _, v := range vs {
		if v > 0 && !math.IsInf(v, 0) {
			ok = append(ok, v)
		} else {
			bad++
		}
	}
	if bad > 0 {
		n.add(fmt.Sprintf("left out: %d %s samples that are not positive and finite (log x axis)", bad, name))
	}
	if len(ok) == 0 {
		return nil
	}
	slices.Sort(ok)
	step := max(1, len(ok)/cdfPoints)
	var pts plotter.XYs
	for i := step - 1; i < len(ok); i += step {
		pts = append(pts, plotter.XY{X: ok[i], Y: float64(i+1) / float64(len(ok))})
	}
	if last := len(ok) - 1; pts[len(pts)-1].X != ok[last] || pts[len(pts)-1].Y != 1 {
		pts = append(pts, plotter.XY{X: ok[last], Y: 1})
	}
	return pts
}

// wrap cuts s into lines of at most width bytes at ", " (a longer part
// stays whole).
func wrap(s string, width int) []string {
	var lines []string
	line := ""
	for _, part := range strings.SplitAfter(s, ", ") {
		if line != "" && len(line)+len(part) > width {
			lines = append(lines, strings.TrimSuffix(line, " "))
			line = ""
		}
		line += part
	}
	if line != "" {
		lines = append(lines, line)
	}
	return lines
}
