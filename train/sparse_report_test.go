package train

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

// sparseReporting is a CPU backend that says its first layer's MLP ran
// sparse, as the GPU backend reports its per-layer path.
type sparseReporting struct{ *CPU }

func (b sparseReporting) EndStep() (*StepStats, error) {
	st, err := b.CPU.EndStep()
	if err == nil {
		st.SparseMLP = make([]bool, len(st.L0))
		st.SparseMLP[0] = true
	}
	return st, err
}

// TestSparseLayersReported: a backend that reports its MLP paths gets the
// count of sparse layers into metrics.jsonl and the progress lines; the
// CPU backend, which has one path, leaves both out.
func TestSparseLayersReported(t *testing.T) {
	for _, reporting := range []bool{false, true} {
		c := testConfig(t, 3, 1e-2)
		out := t.TempDir()
		r := newTestRun(t, c, out, 5)
		if reporting {
			r.Backend = sparseReporting{r.Backend.(*CPU)}
		}
		var log bytes.Buffer
		r.Log = &log
		if err := r.Loop(context.Background()); err != nil {
			t.Fatal(err)
		}
		ms := readMetrics(t, out)
		if len(ms) == 0 {
			t.Fatal("no metrics")
		}
		for _, m := range ms {
			if reporting != (m.SparseLayers != nil) || (reporting && *m.SparseLayers != 1) {
				t.Errorf("reporting %v: step %d: sparse layers %v", reporting, m.Step, m.SparseLayers)
			}
		}
		if got := strings.Contains(log.String(), "sparse MLP 1/2"); got != reporting {
			t.Errorf("reporting %v: progress %q", reporting, log.String())
		}
	}
}
