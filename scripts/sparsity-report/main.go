// Command sparsity-report compares training runs of one model shape at
// different L1 weights: it reads each run's metrics.jsonl, its trainer state
// (for the config) and the `twell eval -json` report written beside them
// (DIR/eval.json), prints a Markdown table, and draws the plots of
// docs/sparsity.md.
//
//	go run ./scripts/sparsity-report -out docs/sparsity runs/dense runs/l1-3e-4 ...
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/twell-ai/twell/eval"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/train"
)

// run is what the report needs of one training run.
type run struct {
	dir     string
	l1      float64
	steps   int
	tokens  int64
	width   int
	layers  int
	params  int64 // model parameters
	reinit  bool  // dead units re-initialised
	seed    uint64
	seeds   bool // the report holds more than one seed: name it
	sizes   bool // the report holds more than one model size: name the size
	metrics []train.Metrics
	eval    eval.Report
}

func main() {
	out := flag.String("out", "", "folder for the plots (PNG); empty: only the table")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: sparsity-report [-out DIR] RUN_DIR...")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	var runs []*run
	for _, d := range flag.Args() {
		r, err := load(d)
		if err != nil {
			fmt.Fprintln(os.Stderr, "sparsity-report:", err)
			os.Exit(1)
		}
		runs = append(runs, r)
	}
	sort.SliceStable(runs, func(i, j int) bool {
		a, b := runs[i], runs[j]
		if a.params != b.params {
			return a.params < b.params
		}
		if a.seed != b.seed {
			return a.seed < b.seed
		}
		if a.reinit != b.reinit {
			return !a.reinit
		}
		return a.l1 < b.l1
	})
	sizes := runs[len(runs)-1].params != runs[0].params // sorted by size
	seeds := slices.ContainsFunc(runs, func(o *run) bool { return o.seed != runs[0].seed })
	for _, r := range runs {
		r.sizes, r.seeds = sizes, seeds
	}
	table(os.Stdout, runs)
	if *out != "" {
		if err := plots(*out, runs); err != nil {
			fmt.Fprintln(os.Stderr, "sparsity-report:", err)
			os.Exit(1)
		}
	}
}

func load(dir string) (*run, error) {
	var st struct {
		Step   int          `json:"step"`
		Tokens int64        `json:"tokens"`
		Config train.Config `json:"config"`
	}
	if err := readJSON(filepath.Join(dir, "checkpoint", "trainer_state.json"), &st); err != nil {
		return nil, err
	}
	mc, err := model.ParseConfig(st.Config.Model)
	if err != nil {
		return nil, fmt.Errorf("%s: model config: %w", dir, err)
	}
	r := &run{dir: dir, l1: st.Config.L1, steps: st.Step, tokens: st.Tokens, width: mc.IntermediateSize, layers: mc.NumHiddenLayers,
		params: mc.ParamCount(), reinit: st.Config.ReinitDead, seed: st.Config.Seed}
	if err := readJSON(filepath.Join(dir, "eval.json"), &r.eval); err != nil {
		return nil, err
	}
	b, err := os.ReadFile(filepath.Join(dir, "metrics.jsonl"))
	if err != nil {
		return nil, err
	}
	for i, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var m train.Metrics
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			return nil, fmt.Errorf("%s: metrics.jsonl line %d: %w", dir, i+1, err)
		}
		r.metrics = append(r.metrics, m)
	}
	if len(r.metrics) == 0 {
		return nil, fmt.Errorf("%s: metrics.jsonl is empty", dir)
	}
	return r, nil
}

func readJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// heldOutCE is the cross-entropy and bits per byte of the eval report's
// pooled perplexity row ("all", the last).
func (r *run) heldOutCE() (ce, bpb float64) {
	ps := r.eval.Perplexity
	if len(ps) == 0 {
		return math.NaN(), math.NaN()
	}
	p := ps[len(ps)-1]
	return p.CE, p.BitsPerByte
}

// active returns the per-layer fraction of active MLP units on held-out
// text, from the eval report.
func (r *run) active() []float64 {
	var f []float64
	for _, s := range r.eval.Sparsity {
		if s.Fraction != nil {
			f = append(f, *s.Fraction)
		}
	}
	return f
}

func (r *run) name() string {
	n := fmt.Sprintf("λ %g", r.l1)
	if r.l1 == 0 {
		n = "dense (λ 0)"
	}
	if r.reinit {
		n += ", re-init"
	}
	if r.seeds {
		n += fmt.Sprintf(", seed %d", r.seed)
	}
	if r.sizes {
		n = r.size() + " " + n
	}
	return n
}

// size names the model's parameter count, e.g. "7.2M".
func (r *run) size() string { return fmt.Sprintf("%.3gM", float64(r.params)/1e6) }

// meanActive is the mean over layers of the fraction of active MLP units on
// held-out text.
func (r *run) meanActive() float64 {
	a := r.active()
	var s float64
	for _, f := range a {
		s += f
	}
	return s / float64(max(1, len(a)))
}

func table(w io.Writer, runs []*run) {
	var tasks []string
	for _, t := range runs[0].eval.Tasks {
		tasks = append(tasks, strings.TrimSuffix(filepath.Base(t.Name), ".jsonl"))
	}
	fmt.Fprintf(w, "| run | steps | tokens | held-out CE | bits/byte |")
	for _, t := range tasks {
		fmt.Fprintf(w, " %s acc (norm) |", t)
	}
	fmt.Fprintf(w, " active units per layer (%% of the MLP width) | dead |\n|---|---|---|---|---|")
	for range tasks {
		fmt.Fprintf(w, "---|")
	}
	fmt.Fprintln(w, "---|---|")
	for _, r := range runs {
		ce, bpb := r.heldOutCE()
		fmt.Fprintf(w, "| %s | %d | %.1fM | %.4f | %.4f |", r.name(), r.steps, float64(r.tokens)/1e6, ce, bpb)
		for i := range tasks {
			if i < len(r.eval.Tasks) {
				t := r.eval.Tasks[i]
				fmt.Fprintf(w, " %.1f%% (%.1f%%) |", 100*t.Acc, 100*t.AccNorm)
			}
		}
		var act []string
		for _, a := range r.active() {
			act = append(act, fmt.Sprintf("%.2f", 100*a))
		}
		last := r.metrics[len(r.metrics)-1]
		fmt.Fprintf(w, " %s | %.1f%% |\n", strings.Join(act, " / "), 100*last.DeadFrac)
	}
}

func plots(dir string, runs []*run) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var loss, l0 []any
	for _, r := range runs {
		var val, act plotter.XYs
		for _, m := range r.metrics {
			x := float64(m.Tokens) / 1e6
			if m.ValLoss != nil {
				val = append(val, plotter.XY{X: x, Y: *m.ValLoss})
			}
			act = append(act, plotter.XY{X: x, Y: math.Max(100*m.L0Mean/float64(r.width), 1e-3)})
		}
		loss = append(loss, r.name(), val)
		l0 = append(l0, r.name(), act)
	}
	if err := save(dir, "heldout-loss.png", "Held-out loss during training", "tokens (millions)", "cross-entropy (nats/token)", false, loss); err != nil {
		return err
	}
	if err := save(dir, "active-units.png", "Active MLP units per token (mean over layers, training batches)", "tokens (millions)", "% of the MLP width (log)", true, l0); err != nil {
		return err
	}
	var layers []any
	for _, r := range runs {
		var pts plotter.XYs
		for li, a := range r.active() {
			pts = append(pts, plotter.XY{X: float64(li), Y: math.Max(100*a, 1e-3)})
		}
		layers = append(layers, r.name(), pts)
	}
	if err := save(dir, "active-per-layer.png", "Active MLP units per token on held-out text, by layer", "layer", "% of the MLP width (log)", true, layers); err != nil {
		return err
	}
	// The sweep: per model size, held-out CE and mean active units against
	// λ (runs without re-initialisation; λ 0 drawn at a tenth of the
	// smallest λ > 0, so that it fits the log axis).
	least := math.Inf(1)
	for _, r := range runs {
		if r.l1 > 0 {
			least = min(least, r.l1)
		}
	}
	var ce, act []any
	for i := 0; i < len(runs); {
		j := i
		var c, a plotter.XYs
		for ; j < len(runs) && runs[j].params == runs[i].params && runs[j].seed == runs[i].seed; j++ {
			r := runs[j]
			if r.reinit {
				continue
			}
			x := r.l1
			if x == 0 {
				x = least / 10
			}
			v, _ := r.heldOutCE()
			c = append(c, plotter.XY{X: x, Y: v})
			a = append(a, plotter.XY{X: x, Y: math.Max(100*r.meanActive(), 1e-3)})
		}
		label := runs[i].size() + " parameters"
		if runs[i].seeds {
			label += fmt.Sprintf(", seed %d", runs[i].seed)
		}
		ce = append(ce, label, c)
		act = append(act, label, a)
		i = j
	}
	if math.IsInf(least, 1) {
		return nil
	}
	if err := saveXY(dir, "l1-sweep-ce.png", "Held-out cross-entropy against the L1 weight (λ 0 at the far left)", "λ (log)", "cross-entropy (nats/token)", false, ce); err != nil {
		return err
	}
	return saveXY(dir, "l1-sweep-active.png", "Active MLP units on held-out text against the L1 weight (mean over layers)", "λ (log)", "% of the MLP width (log)", true, act)
}

// saveXY is save with a log x axis.
func saveXY(dir, file, title, xl, yl string, logY bool, lines []any) error {
	return saveScaled(dir, file, title, xl, yl, true, logY, lines)
}

func save(dir, file, title, xl, yl string, logY bool, lines []any) error {
	return saveScaled(dir, file, title, xl, yl, false, logY, lines)
}

func saveScaled(dir, file, title, xl, yl string, logX, logY bool, lines []any) error {
	p := plot.New()
	p.Title.Text, p.X.Label.Text, p.Y.Label.Text = title, xl, yl
	if logX {
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = logTicks{}
	}
	if logY {
		p.Y.Scale = plot.LogScale{}
		p.Y.Tick.Marker = logTicks{}
	}
	if err := plotutil.AddLinePoints(p, lines...); err != nil {
		return err
	}
	p.Legend.Top = true
	return p.Save(8*vg.Inch, 4.5*vg.Inch, filepath.Join(dir, file))
}

// logTicks labels a log axis at 1, 2 and 5 times the powers of ten, so that
// a range within one decade still gets labels.
type logTicks struct{}

// Ticks implements plot.Ticker.
func (logTicks) Ticks(lo, hi float64) []plot.Tick {
	var t []plot.Tick
	for e := math.Floor(math.Log10(lo)); e <= math.Ceil(math.Log10(hi)); e++ {
		for _, m := range []float64{1, 2, 5} {
			v := m * math.Pow(10, e)
			if v >= lo && v <= hi {
				t = append(t, plot.Tick{Value: v, Label: fmt.Sprintf("%g", v)})
			}
		}
	}
	return t
}
