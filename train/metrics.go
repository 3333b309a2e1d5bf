package train

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/twell-ai/twell/internal/atomicfile"
)

// MetricsSchema names the layout of a metrics.jsonl line and its version.
const MetricsSchema = "twell.train.metrics/1"

// metricsFile is the name of the metrics log in a run's folder.
const metricsFile = "metrics.jsonl"

// Metrics is one line of metrics.jsonl. Every line has every key, in this
// order; val_loss is null on lines without a held-out evaluation.
type Metrics struct {
	Schema   string    `json:"schema"` // MetricsSchema
	Step     int       `json:"step"`
	Tokens   int64     `json:"tokens"`
	Loss     float64   `json:"loss"`
	L1       float64   `json:"l1"`
	L0       []float64 `json:"l0"`      // mean active MLP units per token, per layer
	L0Mean   float64   `json:"l0_mean"` // mean over layers
	DeadFrac float64   `json:"dead_frac"`
	ValLoss  *float64  `json:"val_loss"`
	LR       float64   `json:"lr"`
	GradNorm float64   `json:"grad_norm"`
	MS       float64   `json:"ms"` // wall time of the step
	// SparseLayers is how many layers' MLPs ran the sparse kernels (GPU;
	// left out when the backend has only the dense path).
	SparseLayers *int `json:"sparse_layers,omitempty"`
}

func newMetrics(step int, tokens int64, st *StepStats, dead, lr, norm float64, took time.Duration) Metrics {
	m := Metrics{Schema: MetricsSchema, Step: step, Tokens: tokens, Loss: st.Loss, L1: st.L1, L0: st.L0,
		DeadFrac: dead, LR: lr, GradNorm: norm, MS: float64(took.Microseconds()) / 1000}
	for _, v := range st.L0 {
		m.L0Mean += v / float64(len(st.L0))
	}
	if st.SparseMLP != nil {
		n := 0
		for _, s := range st.SparseMLP {
			if s {
				n++
			}
		}
		m.SparseLayers = &n
	}
	return m
}

// metricsWriter appends lines to metrics.jsonl.
type metricsWriter struct {
	f *os.File
}

func openMetrics(dir string) (*metricsWriter, error) {
	f, err := os.OpenFile(filepath.Join(dir, metricsFile), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	return &metricsWriter{f: f}, nil
}

func (w *metricsWriter) write(m Metrics) error {
	b, err := json.Marshal(m)
	if err != nil {
		return fmt.Errorf("train: metrics of step %d: %w", m.Step, err)
	}
	_, err = w.f.Write(append(b, '\n'))
	return err
}

func (w *metricsWriter) Close() error { return w.f.Close() }

// readMetricsUpTo returns the lines of metrics.jsonl in dir up to step, with
// their text; it stops at the first line that is not a metrics line of this
// schema (a line torn by an interruption) or that goes past step. A missing
// file gives os.ErrNotExist.
func readMetricsUpTo(dir string, step int) ([]Metrics, []byte, error) {
	b, err := os.ReadFile(filepath.Join(dir, metricsFile))
	if err != nil {
		return nil, nil, err
	}
	var keep bytes.Buffer
	var ms []Metrics
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(nil, 1<<26)
	for sc.Scan() {
		line := sc.Bytes()
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		var m Metrics
		if json.Unmarshal(line, &m) != nil || m.Schema != MetricsSchema || m.Step > step || m.Step < 1 {
			break
		}
		keep.Write(line)
		keep.WriteByte('\n')
		ms = append(ms, m)
	}
	return ms, keep.Bytes(), nil
}

// truncateMetrics cuts metrics.jsonl back to the resumed step and reloads
// the history for plots, so a resumed run continues the same curve.
func (r *Run) truncateMetrics() error {
	r.history = nil
	ms, keep, err := readMetricsUpTo(r.Out, r.step)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	r.history = ms
	return atomicfile.WriteFile(filepath.Join(r.Out, metricsFile), keep)
}
