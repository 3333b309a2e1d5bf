package trainer

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/train"
)

// skewedTokens returns n token ids below vocab, about 30% of them id 7, so
// that in a micro-batch of a few thousand tokens one id's rows span
// several chunks of the embedding gradient.
func skewedTokens(r *rand.Rand, n, vocab int) []int {
	out := randomTokens(r, n, vocab)
	for i := range out {
		if r.IntN(10) < 3 {
			out[i] = 7
		}
	}
	return out
}

// firstDiff returns the index of the first value of a and b whose bits
// differ, or -1 when they are bitwise equal (lengths included).
func firstDiff[T float32 | float64](a, b []T) int {
	bits := func(v T) uint64 {
		if x, ok := any(v).(float32); ok {
			return uint64(math.Float32bits(x))
		}
		return math.Float64bits(float64(v))
	}
	for i := range min(len(a), len(b)) {
		if bits(a[i]) != bits(b[i]) {
			return i
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}

// stepTrace is what a few training steps report and leave behind.
type stepTrace struct {
	stats   []*train.StepStats
	norms   []float64
	evalNLL float64
	w       [][]float32
	opt     *train.OptimizerState
}

// traceSteps runs len(toks)/micro full steps (micro-batches of batch x seq,
// clipping, AdamW) on a fresh backend from weights w, then one evaluation.
func traceSteps(t *testing.T, dev *cuda.Device, c model.Config, w *model.Weights, o Options, toks [][]int, micro, batch, seq int, l1 float64) stepTrace {
	t.Helper()
	b, err := New(dev, c, cloneWeights(w), o)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	h := train.AdamW{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.1}
	var tr stepTrace
	for s := 0; s < len(toks)/micro; s++ {
		if err := b.BeginStep(micro); err != nil {
			t.Fatal(err)
		}
		for _, tk := range toks[s*micro : (s+1)*micro] {
			if err := b.Accumulate(tk, batch, seq, l1); err != nil {
				t.Fatal(err)
			}
		}
		st, err := b.EndStep()
		if err != nil {
			t.Fatal(err)
		}
		norm, err := b.ClipGradients(0.05) // below the norm: the scaling runs
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Update(h, 1e-3); err != nil {
			t.Fatal(err)
		}
		tr.stats, tr.norms = append(tr.stats, st), append(tr.norms, norm)
	}
	if tr.evalNLL, err = b.Loss(toks[0], batch, seq); err != nil {
		t.Fatal(err)
	}
	gw, err := b.Weights()
	if err != nil {
		t.Fatal(err)
	}
	tr.w = flatTensors(c, gw)
	if tr.opt, err = b.OptimizerState(); err != nil {
		t.Fatal(err)
	}
	return tr
}

// TestStepRepeatsBitwise runs three full steps (two micro-batches each,
// forward, backward with the L1 term, clipping, AdamW) twice on fresh
// backends from the same weights and tokens, then an evaluation: the
// reported loss, L1, L0, firing counts and gradient norms, the evaluation
// loss, the weights and the AdamW moments are bitwise equal. On the sparse
// path every unit fires for several hundred tokens of a micro-batch, so
// the weight-gradient sums are cut into parts; the vocabulary needs two
// passes of the embedding gradient's sort, and one token id takes about 30%
// of the positions.
func TestStepRepeatsBitwise(t *testing.T) {
	dev := cudatest.Device(t)
	for _, tc := range []struct {
		gated, tied bool
		mlp         mlp.Path
	}{{true, true, mlp.Sparse}, {false, false, mlp.Sparse}, {true, true, mlp.Dense}} {
		t.Run(fmt.Sprintf("gated=%v,tied=%v,mlp=%v", tc.gated, tc.tied, tc.mlp), func(t *testing.T) {
			seed := rand.Uint64()
			r := rand.New(rand.NewPCG(seed, 7))
			c := testModel(tc.gated, tc.tied)
			c.VocabSize = 1000
			w := model.RandomWeights(c, r)
			const steps, micro, batch, seq, l1 = 3, 2, 16, 128, 0.05
			toks := make([][]int, steps*micro)
			for i := range toks {
				toks[i] = skewedTokens(r, batch*(seq+1), c.VocabSize)
			}
			o := Options{Batch: batch, Seq: seq, LogitRows: 300, MLP: tc.mlp}
			a := traceSteps(t, dev, c, w, o, toks, micro, batch, seq, l1)
			b := traceSteps(t, dev, c, w, o, toks, micro, batch, seq, l1)
			if tc.mlp == mlp.Sparse && slices.Max(a.stats[0].Active[0]) <= micro*spColChunk {
				t.Fatalf("seed %d: no unit fired for more than %d tokens of a micro-batch: no split sums tested", seed, spColChunk)
			}
			sameTraces(t, seed, c, a, b)
		})
	}
}

// sameTraces fails the test where two traces of the same steps differ in
// any statistic, weight or moment.
func sameTraces(t *testing.T, seed uint64, c model.Config, a, b stepTrace) {
	t.Helper()
	for s := range a.stats {
		x, y := a.stats[s], b.stats[s]
		if firstDiff([]float64{x.Loss, x.L1, a.norms[s]}, []float64{y.Loss, y.L1, b.norms[s]}) >= 0 || firstDiff(x.L0, y.L0) >= 0 {
			t.Errorf("seed %d: step %d: loss %v, %v; L1 %v, %v; gradient norm %v, %v; L0 %v, %v", seed, s,
				x.Loss, y.Loss, x.L1, y.L1, a.norms[s], b.norms[s], x.L0, y.L0)
		}
		for l := range x.Active {
			if !slices.Equal(x.Active[l], y.Active[l]) {
				t.Errorf("seed %d: step %d: layer %d firing counts differ", seed, s, l)
			}
		}
	}
	if math.Float64bits(a.evalNLL) != math.Float64bits(b.evalNLL) {
		t.Errorf("seed %d: evaluation loss %v, then %v", seed, a.evalNLL, b.evalNLL)
	}
	sameState(t, seed, c, a.w, b.w, a.opt, b.opt)
}

// sameState fails the test where two runs' weights or AdamW moments differ
// in any bit, naming the first tensor and element.
func sameState(t *testing.T, seed uint64, c model.Config, wa, wb [][]float32, oa, ob *train.OptimizerState) {
	t.Helper()
	for i, ts := range train.Tensors(c) {
		for _, v := range []struct {
			what string
			x, y []float32
		}{{"weights", wa[i], wb[i]}, {"first moment", oa.M[i], ob.M[i]}, {"second moment", oa.V[i], ob.V[i]}} {
			if k := firstDiff(v.x, v.y); k >= 0 {
				t.Errorf("seed %d: %s %s differ first at %d", seed, ts.Name, v.what, k)
			}
		}
	}
}

// TestRecomputeIsBitwise runs the same steps with and without
// Options.Recompute, on both MLP paths: every statistic, weight and moment
// must agree bit for bit (recomputation reruns deterministic kernels).
func TestRecomputeIsBitwise(t *testing.T) {
	dev := cudatest.Device(t)
	for _, path := range []mlp.Path{mlp.Sparse, mlp.Dense} {
		t.Run(path.String(), func(t *testing.T) {
			seed := rand.Uint64()
			r := rand.New(rand.NewPCG(seed, 9))
			c := testModel(true, true)
			c.VocabSize, c.NumHiddenLayers = 1000, 3
			w := model.RandomWeights(c, r)
			const steps, micro, batch, seq, l1 = 3, 2, 8, 96, 0.05
			toks := make([][]int, steps*micro)
			for i := range toks {
				toks[i] = skewedTokens(r, batch*(seq+1), c.VocabSize)
			}
			o := Options{Batch: batch, Seq: seq, LogitRows: 300, MLP: path}
			a := traceSteps(t, dev, c, w, o, toks, micro, batch, seq, l1)
			o.Recompute = true
			b := traceSteps(t, dev, c, w, o, toks, micro, batch, seq, l1)
			sameTraces(t, seed, c, a, b)
		})
	}
}

// TestClipFactorEndsWithStep checks that a clipping factor lasts only as
// long as the gradient it was found for: a step that clips but is not
// applied, then a step that updates without calling ClipGradients, leaves
// the same weights and moments, to the bit, as that second step alone on a
// fresh backend (an in-place scaling of the first step's gradient was
// cleared with it).
func TestClipFactorEndsWithStep(t *testing.T) {
	dev := cudatest.Device(t)
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 9))
	c := testModel(true, true)
	w := model.RandomWeights(c, r)
	const batch, seq, maxNorm = 4, 32, 1e-3
	toks := [][]int{randomTokens(r, batch*(seq+1), c.VocabSize), randomTokens(r, batch*(seq+1), c.VocabSize)}
	h := train.AdamW{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.1}
	// run runs one step of one micro-batch per token batch on a fresh
	// backend (the dense path: the automatic one could change course after
	// the first step), clipping and updating only where asked, and returns
	// the weights and moments.
	run := func(tks [][]int, clip, update []bool) ([][]float32, *train.OptimizerState) {
		b, err := New(dev, c, cloneWeights(w), Options{Batch: batch, Seq: seq, MLP: mlp.Dense})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		for s, tk := range tks {
			if err := b.BeginStep(1); err != nil {
				t.Fatal(err)
			}
			if err := b.Accumulate(tk, batch, seq, 0.01); err != nil {
				t.Fatal(err)
			}
			if _, err := b.EndStep(); err != nil {
				t.Fatal(err)
			}
			if clip[s] {
				norm, err := b.ClipGradients(maxNorm)
				if err != nil {
					t.Fatal(err)
				}
				if !(norm > 10*maxNorm) {
					t.Fatalf("seed %d: gradient norm %g: clipping to %g tests little", seed, norm, maxNorm)
				}
			}
			if update[s] {
				if err := b.Update(h, 1e-3); err != nil {
					t.Fatal(err)
				}
			}
		}
		gw, err := b.Weights()
		if err != nil {
			t.Fatal(err)
		}
		opt, err := b.OptimizerState()
		if err != nil {
			t.Fatal(err)
		}
		return flatTensors(c, gw), opt
	}
	wa, oa := run(toks, []bool{true, false}, []bool{false, true})
	wb, ob := run(toks[1:], []bool{false}, []bool{true})
	sameState(t, seed, c, wa, wb, oa, ob)
}

// TestResumeIsBitwise runs 16 steps through train.NewRun straight, and
// again stopped after step 11 and resumed from the checkpoint of step 8:
// both log the same metrics to the bit and end with byte-identical
// checkpoints (weights and optimizer state), on the sparse and the dense
// MLP path.
func TestResumeIsBitwise(t *testing.T) {
	dev := cudatest.Device(t)
	for _, path := range []mlp.Path{mlp.Sparse, mlp.Dense} {
		t.Run(path.String(), func(t *testing.T) {
			seed := rand.Uint64()
			r := rand.New(rand.NewPCG(seed, 8))
			c := testModel(true, true)
			mj, _ := c.MarshalJSON()
			cfg, err := train.ParseConfig([]byte(fmt.Sprintf(`{"model": %s, "steps": 16, "batch": 4, "seq": 32, "accum": 2, "lr": 3e-3,
				"min_lr": 3e-4, "warmup": 4, "l1": 1e-2, "eval_every": 8, "eval_batches": 2, "checkpoint_every": 8, "seed": 3}`, mj)))
			if err != nil {
				t.Fatal(err)
			}
			toks := randomTokens(r, 20000, c.VocabSize)
			w := model.RandomWeights(c, r)
			newRun := func(out string) *train.Run {
				b, err := New(dev, c, cloneWeights(w), Options{MLP: path})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { b.Close() })
				return train.NewRun(cfg, out, b, train.NewStreamSource(toks[:18000], 3), train.Windows(toks[18000:], 32, 20))
			}
			straight, resumed := t.TempDir(), t.TempDir()
			if err := newRun(straight).Loop(context.Background()); err != nil {
				t.Fatal(err)
			}
			r1 := newRun(resumed)
			r1.StopAt = 11
			if err := r1.Loop(context.Background()); err != nil {
				t.Fatal(err)
			}
			r2 := newRun(resumed)
			if err := r2.Resume(); err != nil {
				t.Fatal(err)
			}
			if r2.Step() != 8 {
				t.Fatalf("resumed at step %d, want 8", r2.Step())
			}
			if err := r2.Loop(context.Background()); err != nil {
				t.Fatal(err)
			}
			sameRuns(t, seed, straight, resumed, "resumed", "straight", false)
		})
	}
}

// sameRuns requires two 16-step runs in folders a and b (named for the
// messages) to have logged bit-identical metrics (with deadFrac, the dead
// fractions too) and written byte-identical final weights and optimizer
// state.
func sameRuns(t *testing.T, seed uint64, a, b, nameA, nameB string, deadFrac bool) {
	t.Helper()
	ms, ms2 := readMetricsFile(t, a), readMetricsFile(t, b)
	if len(ms) != 16 || len(ms2) != len(ms) {
		t.Fatalf("%d and %d metrics lines, want 16", len(ms), len(ms2))
	}
	for i, m := range ms {
		n := ms2[i]
		x, y := []float64{m.Loss, m.L1, m.GradNorm}, []float64{n.Loss, n.L1, n.GradNorm}
		if deadFrac {
			x, y = append(x, m.DeadFrac), append(y, n.DeadFrac)
		}
		same := firstDiff(x, y) < 0 && firstDiff(m.L0, n.L0) < 0 && (m.ValLoss == nil) == (n.ValLoss == nil) &&
			(m.ValLoss == nil || math.Float64bits(*m.ValLoss) == math.Float64bits(*n.ValLoss))
		if !same {
			t.Errorf("seed %d: step %d: %s loss %v, L1 %v, gradient norm %v; %s %v, %v, %v", seed, m.Step,
				nameB, n.Loss, n.L1, n.GradNorm, nameA, m.Loss, m.L1, m.GradNorm)
		}
	}
	for _, f := range []string{"model.safetensors", "optimizer.safetensors"} {
		x, err1 := os.ReadFile(filepath.Join(a, "checkpoint", f))
		y, err2 := os.ReadFile(filepath.Join(b, "checkpoint", f))
		if err1 != nil || err2 != nil {
			t.Fatal(err1, err2)
		}
		if !bytes.Equal(x, y) {
			t.Errorf("seed %d: the final %s differ", seed, f)
		}
	}
}

// readMetricsFile reads a run's metrics.jsonl.
func readMetricsFile(t *testing.T, dir string) []train.Metrics {
	t.Helper()
	f, err := os.ReadFile(filepath.Join(dir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	var out []train.Metrics
	for _, line := range strings.Split(strings.TrimSpace(string(f)), "\n") {
		var m train.Metrics
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}

// TestEmbedBwdOrder checks the embedding gradient (sort, chunk sums and
// joins) bit for bit against a host replica of its summation order, on a
// vocabulary that takes three passes of the sort, a token count that fills
// no tile, a width that fills no block, and one id that spans many chunks.
func TestEmbedBwdOrder(t *testing.T) {
	dev, l := testLauncher(t)
	s := l.s
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 9))
	const n, h, V = 3000, 72, 70000
	ids := make([]int32, n)
	for i, id := range skewedTokens(r, n, V) {
		ids[i] = int32(id)
	}
	dx, table := make([]float32, n*h), make([]float32, V*h)
	for i := range dx {
		dx[i] = float32(r.NormFloat64())
	}
	for i := range table {
		table[i] = float32(r.NormFloat64())
	}

	// The host replica: positions sorted by id (stable), cut into chunks of
	// embChunk; each id's rows summed in order within a chunk, the pieces of
	// an id that crosses chunks added in chunk order, the total added once.
	want := slices.Clone(table)
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return int(ids[a] - ids[b]) })
	for i0 := 0; i0 < n; {
		i1 := i0
		for i1 < n && ids[order[i1]] == ids[order[i0]] {
			i1++
		}
		row := want[int(ids[order[i0]])*h:][:h]
		for c := range h {
			var total, piece float32
			for i := i0; i < i1; i++ {
				piece += dx[order[i]*h+c]
				if i == i1-1 || (i+1)%embChunk == 0 {
					if i0/embChunk == i/embChunk {
						total = piece
					} else {
						total += piece
					}
					piece = 0
				}
			}
			row[c] += total
		}
		i0 = i1
	}

	bufs := make([]*cuda.Buffer, 4)
	for i, size := range []int{4 * n, 4 * n * h, 4 * V * h, carvedBytes(embedSizes(n, h))} {
		bufs[i] = cudatest.Alloc(t, dev, size)
	}
	idB, dxB, tableB, work := bufs[0], bufs[1], bufs[2], bufs[3]
	for rep := range 2 {
		for _, c := range []struct {
			dst *cuda.Buffer
			src []byte
		}{{idB, cuda.Bytes(ids)}, {dxB, cuda.Bytes(dx)}, {tableB, cuda.Bytes(table)}} {
			if err := dev.CopyHtoD(c.dst, c.src); err != nil {
				t.Fatal(err)
			}
		}
		if err := l.embedBwd(tableB, idB, dxB, work, n, h, V); err != nil {
			t.Fatal(err)
		}
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		got := make([]float32, V*h)
		if err := dev.CopyDtoH(cuda.Bytes(got), tableB); err != nil {
			t.Fatal(err)
		}
		if i := firstDiff(got, want); i >= 0 {
			t.Fatalf("seed %d: run %d: row %d column %d: %v, want %v", seed, rep, i/h, i%h, got[i], want[i])
		}
	}
}
