package trainer

import (
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/nccl"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/train"
)

// BeginStep clears the gradients and the statistics for a step of
// microBatches micro-batches (over all ranks, of which this one runs those
// train.MicroBatchRank gives it).
func (b *Backend) BeginStep(microBatches int) error {
	if microBatches <= 0 {
		return fmt.Errorf("trainer: a step of %d micro-batches", microBatches)
	}
	for _, buf := range []*cuda.Buffer{b.g, b.stats, b.active} {
		if err := b.dev.Memset8(buf, 0, b.s); err != nil {
			return err
		}
	}
	b.stepTotal, b.stepN, b.stepDone, b.inStep = microBatches, b.localMicroBatches(microBatches), 0, true
	b.clipped = false // a clipping factor belongs to the gradient just cleared
	b.stepSparse = make([]bool, b.c.NumHiddenLayers)
	return nil
}

// Accumulate queues the forward and backward pass of one micro-batch,
// adding its gradient (already divided by the step's micro-batch count,
// so that the sum is their mean) and statistics to the step's. It returns
// before the device has finished.
func (b *Backend) Accumulate(tokens []int, batch, seq int, l1 float64) error {
	if !b.inStep || b.stepDone >= b.stepN {
		return errors.New("trainer: Accumulate outside a step, or more micro-batches than BeginStep announced")
	}
	if err := b.uploadTokens(tokens, batch, seq); err != nil {
		return err
	}
	m, n, L := float64(batch*seq), float64(b.stepTotal), float64(b.c.NumHiddenLayers)
	err := b.forwardBackward(pass{batch: batch, seq: seq, m: batch * seq, backward: true, stats: b.stats, active: b.active,
		lossScale: 1 / (m * n), gradScale: float32(1 / (m * n)), l1Stat: l1 / L / m / n,
		l1Grad: float32(l1 / L / m / n), l0Scale: 1 / (m * n)})
	if err != nil {
		b.inStep = false // the step is broken: EndStep refuses it
		return err
	}
	b.stepDone++
	return nil
}

// readStats waits for the device and reads statistics buffers (fp64
// [1+2L], int32 [L][f]) into a StepStats.
func (b *Backend) readStats(stats, active *cuda.Buffer) (*train.StepStats, error) {
	if err := b.mark("host wait"); err != nil {
		return nil, err
	}
	if err := b.s.Synchronize(); err != nil {
		return nil, err
	}
	b.samplePeak()
	L, f := b.c.NumHiddenLayers, b.c.IntermediateSize
	s := make([]float64, 1+2*L)
	act := make([]int32, L*f)
	if err := b.dev.CopyDtoH(cuda.Bytes(s), stats); err != nil {
		return nil, err
	}
	if err := b.dev.CopyDtoH(cuda.Bytes(act), active); err != nil {
		return nil, err
	}
	st := &train.StepStats{Loss: s[0], Active: make([][]int32, L), L0: make([]float64, L)}
	for l := range L {
		st.L1 += s[1+2*l]
		st.L0[l] = s[2+2*l]
		st.Active[l] = act[l*f : (l+1)*f : (l+1)*f]
	}
	return st, nil
}

// EndStep waits for the step's micro-batches and returns its statistics.
// The gradient is already the mean over the micro-batches.
func (b *Backend) EndStep() (*train.StepStats, error) {
	if !b.inStep || b.stepDone != b.stepN {
		return nil, fmt.Errorf("trainer: EndStep after %d of %d micro-batches", b.stepDone, b.stepN)
	}
	b.inStep = false
	if b.opts.Comm != nil {
		if err := inOrder(b.at("reduce-scatter"), b.reduceStep); err != nil {
			return nil, err
		}
	}
	st, err := b.readStats(b.stats, b.active)
	if err == nil {
		st.SparseMLP = b.stepSparse
	}
	if err == nil && b.opts.MLP == mlp.Auto {
		for l, units := range st.L0 {
			b.sparse[l] = mlp.Choose(mlp.Auto, units/float64(b.c.IntermediateSize), b.opts.denseAbove()) == mlp.Sparse
		}
	}
	return st, err
}

// SparseLayers reports which layers' MLP blocks the next step runs sparse.
func (b *Backend) SparseLayers() []bool { return slices.Clone(b.sparse) }

// SetSparseLayers sets which layers' MLP blocks the next step runs sparse,
// as a resumed run restores the choice the automatic path had made; with
// a fixed path (Options.MLP sparse or dense, or a shape only the dense
// kernels take) it changes nothing.
func (b *Backend) SetSparseLayers(sparse []bool) error {
	if len(sparse) != len(b.sparse) {
		return fmt.Errorf("trainer: %d layers' MLP paths for a model of %d layers", len(sparse), len(b.sparse))
	}
	if b.opts.MLP == mlp.Auto {
		copy(b.sparse, sparse)
	}
	return nil
}

// ClipGradients scales the gradient so that its global L2 norm is at most
// maxNorm (0: no clipping) and returns the norm before clipping. It waits
// for the device once. The gradient buffer is not rewritten: the factor is
// kept until the next BeginStep, and AdamW, the only reader of the gradient
// after this call, multiplies each value by it as it reads it (the same
// float32 product an in-place scaling would store), which saves a read and
// a write of the whole gradient. Called twice in a step, it measures the
// unscaled gradient again and replaces the factor.
func (b *Backend) ClipGradients(maxNorm float64) (float64, error) {
	if err := inOrder(b.at("clipping"), func() error { return b.dev.Memset8(b.norm2, 0, b.s) }); err != nil {
		return 0, err
	}
	// This rank's shard of the gradient (all of it on a single GPU); the
	// sum of squares is then summed over the ranks.
	lo, hi := b.lo, min(b.hi, b.n)
	sl := &slicer{}
	sum, part, g := sl.at(b.norm2, 0, 8), sl.at(b.norm2, 8, 8*flatGrid), sl.at(b.g, 4*lo, 4*(hi-lo))
	if sl.err != nil {
		return 0, sl.err
	}
	if err := b.run.sumSq(sum, part, g, hi-lo); err != nil {
		return 0, err
	}
	if b.opts.Comm != nil {
		if err := b.opts.Comm.AllReduce(sum, sum, 1, nccl.Float64, nccl.Sum, b.s); err != nil {
			return 0, err
		}
		if err := b.opts.Comm.Wait(b.s, b.timeout()); err != nil {
			return 0, err
		}
	}
	if err := inOrder(b.at("host wait"), b.s.Synchronize); err != nil {
		return 0, err
	}
	ss := make([]float64, 1)
	if err := b.dev.CopyDtoH(cuda.Bytes(ss), b.norm2); err != nil {
		return 0, err
	}
	norm := math.Sqrt(ss[0])
	b.clip, b.clipped = float32(maxNorm/norm), maxNorm > 0 && norm > maxNorm
	return norm, nil
}

// Update queues one AdamW step with learning rate lr: decoupled weight
// decay on the matrices, none on the RMSNorm gains (the 1-D tensors). It
// reads the gradient times the step's clipping factor (ClipGradients; 1
// when the step clipped nothing or did not call it).
func (b *Backend) Update(h train.AdamW, lr float64) error {
	b.optStep++
	if err := b.mark("adamw"); err != nil {
		return err
	}
	sl := &slicer{}
	for _, r := range b.adamRuns() {
		a, e := r.a, r.e
		w, wb, g := sl.at(b.w, 4*a, 4*(e-a)), sl.at(b.wb, 2*a, 2*(e-a)), sl.at(b.g, 4*a, 4*(e-a))
		m, v := b.momentView(sl, b.m, a, e), b.momentView(sl, b.v, a, e)
		if sl.err != nil {
			return sl.err
		}
		args := adamWArgsFor(h, lr, b.optStep, r.decays)
		if b.clipped {
			args.gradScale = b.clip
		}
		if err := b.run.adamW(w, wb, g, m, v, e-a, args); err != nil {
			return fmt.Errorf("trainer: AdamW on %s to %s: %w", b.specs[r.first].Name, b.specs[r.last].Name, err)
		}
	}
	if b.opts.Comm != nil {
		return inOrder(b.at("all-gather"), b.gatherWeights)
	}
	return nil
}

// adamRun is one AdamW launch of Update: values [a, e) of the flat order,
// this rank's part of tensors first to last, which all decay or all do
// not.
type adamRun struct {
	a, e, first, last int
	decays            bool
}

// adamRuns cuts this rank's shard (everything on a single GPU) into
// Update's launches: a run of consecutive tensors that all decay (the
// matrices) or all do not (the RMSNorm gains), contiguous in the flat
// buffers; 4 a layer. Every tensor holds a multiple of 4 values (New takes
// hidden sizes that are multiples of 4) and a shard a multiple of
// shardAlign, so each run starts 16-byte aligned and AdamW's 16-byte path
// covers it all.
func (b *Backend) adamRuns() []adamRun {
	var runs []adamRun
	for i := 0; i < len(b.specs); {
		decays := len(b.specs[i].Shape) > 1
		j := i + 1
		for j < len(b.specs) && (len(b.specs[j].Shape) > 1) == decays {
			j++
		}
		a, _ := b.owned(i)
		_, e := b.owned(j - 1)
		if a < e {
			runs = append(runs, adamRun{a: a, e: e, first: i, last: j - 1, decays: decays})
		}
		i = j
	}
	return runs
}

// ReinitUnits gives MLP units fresh gate and up rows, a zero down column
// and zero moments for all three. It waits for the device.
func (b *Backend) ReinitUnits(units []train.UnitInit) error {
	h, f, L := b.c.HiddenSize, b.c.IntermediateSize, b.c.NumHiddenLayers
	byLayer := make([][]train.UnitInit, L)
	for _, u := range units {
		if u.Layer < 0 || u.Layer >= L || u.Unit < 0 || u.Unit >= f {
			return fmt.Errorf("trainer: re-initialise unit %d of layer %d: outside the model (%d layers of %d units)", u.Unit, u.Layer, L, f)
		}
		if len(u.Up) != h || b.c.MLPGated != (u.Gate != nil) || (u.Gate != nil && len(u.Gate) != h) {
			return fmt.Errorf("trainer: re-initialise unit %d of layer %d: rows of %d (gate) and %d (up) values, want %d", u.Unit, u.Layer, len(u.Gate), len(u.Up), h)
		}
		byLayer[u.Layer] = append(byLayer[u.Layer], u)
	}
	for l, us := range byLayer {
		if len(us) == 0 {
			continue
		}
		if err := b.reinitLayer(l, us); err != nil {
			return err
		}
	}
	return b.s.Synchronize()
}

// reinitLayer re-initialises units us of layer l.
func (b *Backend) reinitLayer(l int, us []train.UnitInit) error {
	h, n := b.c.HiddenSize, len(us)
	ids := make([]int32, n)
	gate, up := make([]float32, 0, n*h), make([]float32, 0, n*h)
	for k, u := range us {
		ids[k] = int32(u.Unit)
		gate, up = append(gate, u.Gate...), append(up, u.Up...)
	}
	var tmp []*cuda.Buffer
	defer func() {
		if err := b.s.Synchronize(); err == nil {
			for _, t := range tmp {
				t.Free()
			}
		}
	}()
	upload := func(src []byte) (*cuda.Buffer, error) {
		buf, err := b.dev.Alloc(len(src))
		if err != nil {
			return nil, err
		}
		tmp = append(tmp, buf)
		return buf, b.dev.CopyHtoD(buf, src)
	}
	idBuf, err := upload(cuda.Bytes(ids))
	if err != nil {
		return err
	}
	i := b.layerBase(l) + tGateOrUp
	sl := &slicer{}
	// views returns tensor i's weights, bf16 copy, and the moments of the
	// part [lo, hi) of its values that this rank holds (relative to the
	// tensor; all of it on a single GPU).
	views := func(i int) (w, wb, m, v *cuda.Buffer, lo, hi int) {
		w, wb = b.tensorView(sl, b.w, 4, i, i+1), b.tensorView(sl, b.wb, 2, i, i+1)
		a, e := b.owned(i)
		if a >= e { // none: any valid pointer, never written
			return w, wb, sl.at(b.m, 0, 4), sl.at(b.v, 0, 4), 0, 0
		}
		return w, wb, b.momentView(sl, b.m, a, e), b.momentView(sl, b.v, a, e), a - b.off[i], e - b.off[i]
	}
	rows := [][]float32{up}
	if b.c.MLPGated {
		rows = [][]float32{gate, up}
	}
	for _, r := range rows {
		src, err := upload(cuda.Bytes(r))
		if err != nil {
			return err
		}
		w, wb, m, v, lo, hi := views(i)
		if sl.err != nil {
			return sl.err
		}
		if err := b.run.reinitRows(w, wb, m, v, src, idBuf, n, h, lo, hi); err != nil {
			return err
		}
		i++
	}
	w, wb, m, v, lo, hi := views(i) // down, transposed on the device: a row per unit
	if sl.err != nil {
		return sl.err
	}
	return b.run.reinitRows(w, wb, m, v, nil, idBuf, n, h, lo, hi)
}

// Loss returns the mean cross-entropy of one batch, without the L1 term,
// touching neither the gradients nor the step's statistics. It waits for
// the device.
func (b *Backend) Loss(tokens []int, batch, seq int) (float64, error) {
	if err := b.uploadTokens(tokens, batch, seq); err != nil {
		return 0, err
	}
	for _, buf := range []*cuda.Buffer{b.evalStats, b.evalActive} {
		if err := b.dev.Memset8(buf, 0, b.s); err != nil {
			return 0, err
		}
	}
	m := float64(batch * seq)
	err := b.forwardBackward(pass{batch: batch, seq: seq, m: batch * seq, stats: b.evalStats, active: b.evalActive,
		lossScale: 1 / m, l0Scale: 1 / m})
	if err != nil {
		return 0, err
	}
	st, err := b.readStats(b.evalStats, b.evalActive)
	if err != nil {
		return 0, err
	}
	return st.Loss, nil
}

// The GPU backend keeps its MLP path choice across a resume.
var _ train.PathKeeper = (*Backend)(nil)
