package train

import (
	"fmt"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// Plot writes loss.png, l0.png and dead.png into Out from the run's
// metrics history.
func (r *Run) Plot() error {
	if len(r.history) == 0 {
		return nil
	}
	var train, val, dead plotter.XYs
	layers := len(r.history[0].L0)
	l0 := make([]plotter.XYs, layers)
	for _, m := range r.history {
		x := float64(m.Step)
		train = append(train, plotter.XY{X: x, Y: m.Loss})
		if m.ValLoss != nil {
			val = append(val, plotter.XY{X: x, Y: *m.ValLoss})
		}
		dead = append(dead, plotter.XY{X: x, Y: m.DeadFrac})
		for li := 0; li < layers && li < len(m.L0); li++ {
			l0[li] = append(l0[li], plotter.XY{X: x, Y: m.L0[li]})
		}
	}
	lossLines := []any{"train", train}
	if len(val) > 0 {
		lossLines = append(lossLines, "held-out", val)
	}
	if err := savePlot(filepath.Join(r.Out, "loss.png"), "loss", "cross-entropy (nats/token)", lossLines); err != nil {
		return err
	}
	var l0Lines []any
	for li, pts := range l0 {
		l0Lines = append(l0Lines, fmt.Sprintf("layer %d", li), pts)
	}
	if err := savePlot(filepath.Join(r.Out, "l0.png"), "MLP L0", "active units per token", l0Lines); err != nil {
		return err
	}
	return savePlot(filepath.Join(r.Out, "dead.png"), "dead MLP units", "fraction of units", []any{"dead", dead})
}

func savePlot(path, title, ylabel string, lines []any) error {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "step"
	p.Y.Label.Text = ylabel
	if err := plotutil.AddLines(p, lines...); err != nil {
		return fmt.Errorf("train: plot %s: %w", path, err)
	}
	p.Legend.Top = true
	return p.Save(6*vg.Inch, 4*vg.Inch, path)
}
