package train

import (
	"fmt"
	"io"
	"math"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"github.com/twell-ai/twell/internal/atomicfile"
)

// Plot sizes: the data area on the left, the legend in a strip on the right
// so that it never covers a curve.
const (
	plotWidth   = 7 * vg.Inch
	plotHeight  = 4 * vg.Inch
	legendWidth = 1.3 * vg.Inch
)

// chart is one plot file: the plot, and the legend drawn beside it.
type chart struct {
	file   string
	p      *plot.Plot
	legend plot.Legend
	names  []string // the legend's entries
}

// Plot writes loss.png, l0.png and dead.png into Out from the run's
// metrics history.
func (r *Run) Plot() error {
	if r.noPlots || !r.writes() {
		return nil
	}
	charts, err := r.charts()
	if err != nil {
		return err
	}
	for _, c := range charts {
		path := filepath.Join(r.Out, c.file)
		err := atomicfile.Write(path, 0o644, func(w io.Writer) error {
			img := vgimg.New(plotWidth, plotHeight)
			dc := draw.New(img)
			c.p.Draw(draw.Crop(dc, 0, -legendWidth, 0, -vg.Points(6)))
			c.legend.Draw(draw.Crop(dc, plotWidth-legendWidth+vg.Points(8), 0, 0, -vg.Points(24)))
			_, err := vgimg.PngCanvas{Canvas: img}.WriteTo(w)
			return err
		})
		if err != nil {
			return fmt.Errorf("train: plot %s: %w", path, err)
		}
	}
	return nil
}

// charts builds the plots of the metrics history (none when it is empty).
func (r *Run) charts() ([]chart, error) {
	if len(r.history) == 0 {
		return nil, nil
	}
	mc := r.Cfg.ModelConfig()
	width := mc.IntermediateSize
	var train, val, dead plotter.XYs
	l0 := make([]plotter.XYs, mc.NumHiddenLayers)
	maxL0 := 0.0
	for _, m := range r.history {
		x := float64(m.Step)
		train = append(train, plotter.XY{X: x, Y: m.Loss})
		if m.ValLoss != nil {
			val = append(val, plotter.XY{X: x, Y: *m.ValLoss})
		}
		dead = append(dead, plotter.XY{X: x, Y: m.DeadFrac})
		for li := 0; li < len(l0) && li < len(m.L0); li++ {
			l0[li] = append(l0[li], plotter.XY{X: x, Y: m.L0[li]})
			maxL0 = math.Max(maxL0, m.L0[li])
		}
	}
	model := fmt.Sprintf("%d layers, hidden %d, MLP %d", mc.NumHiddenLayers, mc.HiddenSize, width)
	lossLines := []any{"train", train}
	if len(val) > 0 {
		lossLines = append(lossLines, "held-out", val)
	}
	loss, err := r.newChart("loss.png", "Loss ("+model+")", "cross-entropy (nats per token)", lossLines)
	if err != nil {
		return nil, err
	}
	var l0Lines []any
	for li, pts := range l0 {
		l0Lines = append(l0Lines, fmt.Sprintf("layer %d", li), pts)
	}
	active, err := r.newChart("l0.png", fmt.Sprintf("MLP L0: active units per token, of %d per layer", width),
		fmt.Sprintf("active units per token (of %d)", width), l0Lines)
	if err != nil {
		return nil, err
	}
	active.p.Y.Min, active.p.Y.Max = 0, math.Max(1, maxL0*1.05)
	deadC, err := r.newChart("dead.png", fmt.Sprintf("Dead MLP units (no firing in %d tokens)", r.Cfg.DeadWindow),
		fmt.Sprintf("fraction of the %d units", width*mc.NumHiddenLayers), []any{"dead", dead})
	if err != nil {
		return nil, err
	}
	deadC.p.Y.Min, deadC.p.Y.Max = 0, 1
	return []chart{loss, active, deadC}, nil
}

// newChart returns a plot of lines (name, points, name, points...) over the
// run's steps, its legend taken out to be drawn beside it.
func (r *Run) newChart(file, title, ylabel string, lines []any) (chart, error) {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "step"
	p.Y.Label.Text = ylabel
	p.X.Min, p.X.Max = 0, float64(r.Cfg.Steps)
	if err := plotutil.AddLines(p, lines...); err != nil {
		return chart{}, fmt.Errorf("train: plot %s: %w", file, err)
	}
	c := chart{file: file, p: p, legend: p.Legend}
	for i := 0; i < len(lines); i += 2 {
		c.names = append(c.names, lines[i].(string))
	}
	c.legend.Top, c.legend.Left = true, true
	p.Legend = plot.NewLegend()
	return c, nil
}
