package llm

import (
	"errors"
	"slices"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/mlp"
)

// Decode steps are bound by the host: one step of a 28-layer model queues
// about 300 kernels and cuBLASLt calls at some 5 µs each, longer than the
// GPU needs to run them at small batches. So a decode step (one new token
// per sequence) is recorded into a CUDA graph and later steps of the same
// batch replay it with one launch. What changes from step to step (token
// ids, positions, cache lengths, the caches' page tables) is in the
// metadata buffer the kernels read, uploaded before each replay: a step of
// S sequences lays its sections out at the same offsets every time, the
// page tables last, as they grow when sequences cross into new pages. A
// graph is recorded once every TwELL layer's MLP path has settled
// (gpu.MLP.Settled: the automatic choice is frozen in the graph, without
// its bookkeeping), and recorded again when a buffer it uses was
// reallocated (the metadata buffer too, which doubles when the page tables
// outgrow it), a path changed or a setting that picks kernels changed
// (graphSettings).

// stepGraph is a recorded decode step of some number of sequences.
type stepGraph struct {
	g     *cuda.Graph
	gen   uint64        // e.gen when recorded
	epoch uint64        // the TwELL MLPs' workspace epoch when recorded
	paths []mlp.Path    // each layer's MLP path
	set   graphSettings // the engine's settings when recorded
	resid *cuda.Buffer  // where its layers leave the residual stream (batch.resid)
	delta *cuda.Buffer  // and the last layer's output (batch.delta)
}

// replay runs the decoder layers of b from a graph if b is a decode step
// and the MLP paths have settled, recording the graph first if needed. It
// reports whether it did; if recording fails the engine stops using graphs
// (GraphError) and the step runs kernel by kernel.
func (e *Engine) replay(b *batch, st *engine.Stats) (bool, error) {
	if e.NoGraphs || e.graphErr != nil || b.T != b.S {
		return false, nil
	}
	paths, ok := e.settledPaths(b.T)
	if !ok {
		return false, nil
	}
	sg := e.graphs[b.S]
	set := e.graphSettings()
	if sg != nil && (sg.gen != e.gen || sg.epoch != e.mlpEpoch() || !slices.Equal(sg.paths, paths) || sg.set != set) {
		delete(e.graphs, b.S)
		// A Decoder's step queued before may still replay it.
		if err := e.settle(); err != nil {
			return false, err
		}
		if err := sg.g.Destroy(); err != nil {
			return false, err
		}
		sg = nil
	}
	if sg == nil {
		g, err := e.record(b, paths)
		if err != nil {
			e.graphErr = err
			return false, nil
		}
		e.records++
		sg = &stepGraph{g: g, gen: e.gen, epoch: e.mlpEpoch(), paths: paths, set: set, resid: b.resid, delta: b.delta}
		if e.graphs == nil {
			e.graphs = map[int]*stepGraph{}
		}
		e.graphs[b.S] = sg
	}
	for i, l := range e.layers {
		if l.mlp != nil && e.mlpPath != mlp.Dense && paths[i] == mlp.Sparse {
			st.Paths[i] = mlp.Sparse
		}
	}
	e.replays++
	b.resid, b.delta = sg.resid, sg.delta
	return true, sg.g.Launch(e.stream)
}

// graphSettings are the engine's settings that pick the kernels a decode
// step queues. They are exported fields a caller may change between steps
// (and the tests' hooks): a graph recorded under other values would replay
// the kernels they picked then.
type graphSettings struct {
	attention                                        string
	noGEMV, serial, fuseNorms, attnRope, globalMerge bool
	decRuns                                          int
}

// graphSettings returns the engine's current graphSettings.
func (e *Engine) graphSettings() graphSettings {
	return graphSettings{attention: e.Attention, noGEMV: e.NoGEMV, serial: e.Serial, fuseNorms: e.FuseNorms,
		attnRope: e.AttnRope, globalMerge: e.decGlobalMerge, decRuns: e.decRunsFixed}
}

// record captures the decoder layers of b into a graph.
func (e *Engine) record(b *batch, paths []mlp.Path) (*cuda.Graph, error) {
	if err := e.stream.BeginCapture(); err != nil {
		return nil, err
	}
	scratch := engine.NewStats(0, len(e.layers))
	err := e.layersQueue(b, scratch, paths)
	g, cerr := e.stream.EndCapture()
	if err != nil {
		if cerr == nil {
			g.Destroy()
		}
		return nil, err
	}
	return g, cerr
}

// settledPaths returns each layer's MLP path for a step of T tokens, or
// false while some TwELL layer's automatic choice is still being measured.
func (e *Engine) settledPaths(T int) ([]mlp.Path, bool) {
	paths := make([]mlp.Path, len(e.layers))
	for i, l := range e.layers {
		switch {
		case l.mlp == nil || e.mlpPath == mlp.Dense:
			paths[i] = mlp.Dense
		case e.mlpPath == mlp.Sparse:
			paths[i] = mlp.Sparse
		default:
			p, ok := l.mlp.Settled(min(T, e.chunk()))
			if !ok {
				return nil, false
			}
			paths[i] = p
		}
	}
	return paths, true
}

// MLPSettled reports whether every TwELL layer's automatic MLP path has
// settled (gpu.MLP.Settled) for forward passes of T tokens: until then the
// layers are still timing both paths. Benchmarks warm up until it holds.
func (e *Engine) MLPSettled(T int) bool {
	_, ok := e.settledPaths(T)
	return ok
}

// mlpEpoch returns the TwELL MLPs' workspace epoch (they share one
// workspace), or 0 without them.
func (e *Engine) mlpEpoch() uint64 {
	var n uint64
	if l := e.firstMLP(); l != nil {
		n += l.Epoch()
	}
	if l := e.firstDense(); l != nil {
		n += l.Epoch()
	}
	return n
}

// GraphReplays returns how many decode steps ran from CUDA graphs so far.
func (e *Engine) GraphReplays() int { return e.replays }

// GraphRecords returns how many decode-step graphs the engine recorded so
// far (each settled batch size once, then again after a buffer moved or a
// path changed).
func (e *Engine) GraphRecords() int { return e.records }

// CalibrationError returns why calibrating a layer's hot units failed
// (Engine.HotUnits), or nil.
func (e *Engine) CalibrationError() error { return e.hotErr }

// HotUnitCounts returns, per layer, how many units its TwELL MLP computes
// densely (gpu.MLP.HotUnits): 0 for layers with a plain dense MLP and
// before the layer's calibration.
func (e *Engine) HotUnitCounts() []int {
	n := make([]int, len(e.layers))
	for i, l := range e.layers {
		if l.mlp != nil {
			n[i] = l.mlp.HotUnits()
		}
	}
	return n
}

// GraphError returns why recording a decode step into a CUDA graph failed,
// after which the engine runs every step kernel by kernel; nil if it has
// not failed.
func (e *Engine) GraphError() error { return e.graphErr }

// ResetGraphs destroys the recorded decode-step graphs, so that the next
// decode steps record them again: for a kernel tracer (package cuda/cupti)
// that sees the kernels of graphs recorded while it runs.
func (e *Engine) ResetGraphs() error { return e.dropGraphs() }

// dropGraphs destroys the recorded graphs.
func (e *Engine) dropGraphs() error {
	errs := []error{e.settle()}
	for k, sg := range e.graphs {
		errs = append(errs, sg.g.Destroy())
		delete(e.graphs, k)
	}
	return errors.Join(errs...)
}
