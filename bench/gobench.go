package bench

import (
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"

	"golang.org/x/perf/benchfmt"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// GoBenchResult is one benchmark of `go test -bench` output: the median of
// each metric over the benchmark's runs (lines), by the metric's unit as
// the benchmark reported it (ns/op, us/step, TB/s...).
type GoBenchResult struct {
	Name   string             `json:"name"`
	Runs   int                `json:"runs"`
	Median map[string]float64 `json:"median"`
	// Config is the output's file configuration (goos, goarch, pkg, cpu).
	Config map[string]string `json:"config,omitempty"`
}

// ReadGoBench reads `go test -bench` output from r (named file in errors)
// and returns its benchmarks in the order they first appear. Output with no
// benchmark line, or a line benchfmt cannot parse, is an error.
func ReadGoBench(r io.Reader, file string) ([]GoBenchResult, error) {
	rd := benchfmt.NewReader(r, file)
	var out []GoBenchResult
	index := map[string]int{}
	values := map[string]map[string][]float64{}
	for rd.Scan() {
		switch rec := rd.Result().(type) {
		case *benchfmt.SyntaxError:
			return nil, rec
		case *benchfmt.Result:
			name := rec.Name.String()
			i, ok := index[name]
			if !ok {
				i = len(out)
				index[name] = i
				cfg := map[string]string{}
				for _, c := range rec.Config {
					if c.File {
						cfg[c.Key] = string(c.Value)
					}
				}
				out = append(out, GoBenchResult{Name: name, Config: cfg, Median: map[string]float64{}})
				values[name] = map[string][]float64{}
			}
			out[i].Runs++
			for _, v := range rec.Values {
				unit, val := v.Unit, v.Value
				if v.OrigUnit != "" { // benchfmt tidied it (ns/op to sec/op): keep the benchmark's own
					unit, val = v.OrigUnit, v.OrigValue
				}
				values[name][unit] = append(values[name][unit], val)
			}
		}
	}
	if err := rd.Err(); err != nil {
		return nil, fmt.Errorf("bench: %s: %w", file, err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("bench: %s: no benchmark results (go test -bench output)", file)
	}
	for i := range out {
		for unit, vs := range values[out[i].Name] {
			out[i].Median[unit] = Median(vs)
		}
	}
	return out, nil
}

// PlotGoBench writes a PNG with one bar per benchmark: the median of its
// metric (a unit it reported), each bar named by the benchmark's name
// without "Benchmark" and the GOMAXPROCS suffix. Benchmarks without the
// metric are noted and left out; none having it is an error.
func PlotGoBench(results []GoBenchResult, metric, title, path string) error {
	var vals plotter.Values
	var labels, names []string
	var n notes
	for _, r := range results {
		v, ok := r.Median[metric]
		if !ok {
			n.add(fmt.Sprintf("left out: %s reports no %s", r.Name, metric))
			continue
		}
		v, label := n.bar(r.Name, metric, v)
		vals, labels = append(vals, v), append(labels, label)
		names = append(names, shortBenchName(r.Name))
	}
	if len(vals) == 0 {
		return fmt.Errorf("bench: no benchmark reports %q", metric)
	}
	p := newPanel(title, "", metric+" (median over runs)")
	if err := addValueBars(p, vals, labels, names); err != nil {
		return err
	}
	p.X.Min, p.X.Max = -0.5, float64(len(vals))-0.5
	p.X.Tick.Label.Rotation = math.Pi / 6
	p.X.Tick.Label.XAlign, p.X.Tick.Label.YAlign = draw.XRight, draw.YCenter
	var header []string
	if cfg := results[0].Config; cfg["pkg"] != "" {
		header = append(header, fmt.Sprintf("%s (host CPU %s)", cfg["pkg"], cfg["cpu"]))
	}
	return render(path, vg.Length(max(8, 0.9*float64(len(vals))+2))*vg.Inch, 6*vg.Inch, header, []*plot.Plot{p}, nil, n)
}

// shortBenchName drops the "Benchmark" prefix and the "-N" GOMAXPROCS
// suffix of a benchmark's name.
func shortBenchName(name string) string {
	name = strings.TrimPrefix(name, "Benchmark")
	if i := strings.LastIndexByte(name, '-'); i > 0 {
		if _, err := strconv.Atoi(name[i+1:]); err == nil {
			name = name[:i]
		}
	}
	return name
}
