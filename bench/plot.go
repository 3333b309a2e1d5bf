package bench

import (
	"bytes"
	"cmp"
	"fmt"
	"slices"

	"github.com/twell-ai/twell/internal/atomicfile"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
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

// PlotModel writes a PNG of a whole-model benchmark: prefill tokens/ms by
// path (bars) and decode tokens/s against the batch size, one line per path.
func PlotModel(results []ModelResult, path string) error {
	if len(results) == 0 {
		return fmt.Errorf("no results to plot")
	}
	r0 := results[0]
	pre := plot.New()
	pre.Title.Text = fmt.Sprintf("prefill, %d tokens", r0.PrefillTokens)
	pre.Y.Label.Text = "tokens/ms"
	var vals plotter.Values
	var names []string
	for _, r := range results {
		vals = append(vals, r.PrefillTokPerMS)
		names = append(names, fmt.Sprintf("%s (%.2fx)", r.Path, r.Speedup))
	}
	bars, err := plotter.NewBarChart(vals, vg.Points(40))
	if err != nil {
		return err
	}
	bars.Color = plotutil.Color(0)
	pre.Add(bars)
	var at plotter.XYLabels
	for i, v := range vals {
		at.XYs = append(at.XYs, plotter.XY{X: float64(i), Y: v})
		at.Labels = append(at.Labels, fmt.Sprintf("%.1f", v))
	}
	labels, err := plotter.NewLabels(at)
	if err != nil {
		return err
	}
	for i := range labels.TextStyle {
		labels.TextStyle[i].XAlign = draw.XCenter
	}
	labels.Offset = vg.Point{Y: vg.Points(4)}
	pre.Add(labels)
	pre.NominalX(names...)
	pre.Y.Min = 0

	dec := plot.New()
	dec.Title.Text = "decode"
	dec.X.Label.Text = "batch (sequences)"
	dec.Y.Label.Text = "tokens/s"
	var lines []any
	for _, r := range results {
		var pts plotter.XYs
		for _, d := range r.Decode {
			if d.Batch > 0 && d.TokensPerSec > 0 {
				pts = append(pts, plotter.XY{X: float64(d.Batch), Y: d.TokensPerSec})
			}
		}
		if len(pts) > 0 {
			slices.SortFunc(pts, func(a, b plotter.XY) int { return cmp.Compare(a.X, b.X) })
			lines = append(lines, r.Path, pts)
		}
	}
	if len(lines) > 0 {
		dec.X.Scale, dec.Y.Scale = plot.LogScale{}, plot.LogScale{}
		dec.X.Tick.Marker, dec.Y.Tick.Marker = plot.LogTicks{Prec: -1}, plot.LogTicks{Prec: -1}
		if err := plotutil.AddLinePoints(dec, lines...); err != nil {
			return err
		}
		dec.Legend.Top, dec.Legend.Left = true, true
	}

	const w, h = 10 * vg.Inch, 4.5 * vg.Inch
	img := vgimg.New(w, h)
	dc := draw.New(img)
	titleHeight := vg.Points(30)
	sty := pre.Title.TextStyle // a copy, with the plot's text handler
	sty.XAlign, sty.YAlign = draw.XCenter, draw.YCenter
	sty.Font.Size = vg.Points(10)
	dc.FillText(sty, vg.Point{X: w / 2, Y: h - vg.Points(8)}, r0.Model)
	dc.FillText(sty, vg.Point{X: w / 2, Y: h - vg.Points(21)}, r0.Machine+", "+r0.Date)
	body := draw.Crop(dc, 0, 0, 0, -titleHeight)
	tiles := draw.Tiles{Rows: 1, Cols: 2, PadX: vg.Points(20), PadTop: vg.Points(4), PadBottom: vg.Points(4),
		PadLeft: vg.Points(4), PadRight: vg.Points(8)}
	cs := plot.Align([][]*plot.Plot{{pre, dec}}, tiles, body)
	pre.Draw(cs[0][0])
	dec.Draw(cs[0][1])
	var buf bytes.Buffer
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(&buf); err != nil {
		return err
	}
	return atomicfile.WriteFile(path, buf.Bytes())
}
