package bench

import (
	"fmt"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// PlotFFN writes a PNG of speedup against density, one line per device,
// distribution, token count and MLP kind, with the 1x line for reference.
func PlotFFN(results []FFNResult, path string) error {
	p := plot.New()
	p.Title.Text = "TwELL MLP speedup over dense (same run)"
	p.X.Label.Text = "density (fraction of MLP units active per token)"
	p.Y.Label.Text = "speedup (dense ms / TwELL ms)"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	groups := map[string]plotter.XYs{}
	var names []string
	lo, hi := 1.0, 0.0
	for _, r := range results {
		kind := "gated"
		if !r.Gated {
			kind = "non-gated"
		}
		name := fmt.Sprintf("%s %s m=%d %s", r.Device, r.Dist, r.M, kind)
		if _, ok := groups[name]; !ok {
			names = append(names, name)
		}
		groups[name] = append(groups[name], plotter.XY{X: r.Density, Y: r.Speedup})
		lo, hi = min(lo, r.Density), max(hi, r.Density)
	}
	slices.Sort(names)
	var lines []any
	for _, n := range names {
		pts := groups[n]
		slices.SortFunc(pts, func(a, b plotter.XY) int {
			switch {
			case a.X < b.X:
				return -1
			case a.X > b.X:
				return 1
			}
			return 0
		})
		lines = append(lines, n, pts)
	}
	if err := plotutil.AddLinePoints(p, lines...); err != nil {
		return err
	}
	one, err := plotter.NewLine(plotter.XYs{{X: lo, Y: 1}, {X: hi, Y: 1}})
	if err != nil {
		return err
	}
	one.Dashes = []vg.Length{vg.Points(4), vg.Points(4)}
	p.Add(one)
	p.Legend.Top = true
	p.Y.Min = 0
	return p.Save(7*vg.Inch, 4.5*vg.Inch, path)
}
