package gpu

import (
	_ "embed"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/twell-ai/twell/cuda"
)

// Hot units. Firing rates are skewed in trained sparse models (about 30% of
// units never fire and a few fire often) and in the skewed synthetic
// workload, where the 256 most frequent of 5632 units hold about half of the
// active (token, unit) pairs. The sparse tail pays for every pair (gathering
// a unit's up and down rows), the dense products for every (token, unit):
// for a unit that fires in more than about 2% of tokens the dense products
// are cheaper. Calibrate counts each unit's firings on a batch and moves the
// units worth computing densely, 256 at a time, to the end of the MLP's unit
// order (the MLP's output does not depend on that order). The sparse path
// then runs D2T and the tail over the other units only, and the hot ones as
// a dense MLP: h = relu(gate) up (on Hopper from extra tiles of the wgmma
// D2T, which stores h densely instead of packing it; elsewhere, or with
// SeparateHot, cuBLASLt GEMMs over the hot slice and relu_mul), and a down
// GEMM that adds into the tail's output.

//go:embed hot.cu
var hotSrc []byte

// The cost model of the hot units, from H200 measurements (SparseLM shape,
// m = 65536; docs/gpu-twell.md): the sorted tail gathers an active pair's
// weight rows at about hotPairRate, and the hot dense products run at about
// hotGEMMRate with hotElemBytes of elementwise traffic per (token, unit) at
// hotElemRate.
const (
	hotPairRate  = 8e12   // B/s of weight rows through the sorted tail (t2u + t2d_ws)
	hotGEMMRate  = 600e12 // FLOP/s of the hot slice's GEMMs (N = a few hundred)
	hotElemBytes = 12     // gate and up written and read, h written and read (bf16): the cuBLASLt path's; the D2T's h store moves 4, which the model does not tell apart
	hotElemRate  = 3e12   // B/s
	hotBlock     = 256    // units moved at a time (a D2T tile)
)

// CalibrationTokens and CalibrationMaxTokens bound the batch that callers
// give Calibrate: enough tokens for the firing counts of units around the
// cost model's break-even rate (about 2%) to be tens, and few enough that
// the count stays a small part of the pass it runs in.
const (
	CalibrationTokens    = 4096
	CalibrationMaxTokens = 16384
)

// Calibrated reports whether Calibrate has run on the MLP.
func (l *MLP) Calibrated() bool { return l.calibrated }

// Calibration is what Calibrate measured and chose.
type Calibration struct {
	Tokens int     // tokens counted (the batch's rows that D2T did not flag)
	Counts []int64 // firings per unit, numbered as given to NewMLP
	Hot    []int   // the units the sparse path computes densely, numbered as given to NewMLP, most frequent first
	// Covered is the fraction of the counted active (token, unit) pairs that
	// the hot units hold.
	Covered float64
	// Gain is the time per token the cost model expects the hot units to
	// save in a large batch, in seconds.
	Gain float64
}

// HotUnits returns how many units the sparse path computes densely (the
// last ones of the MLP's unit order), as Calibrate chose.
func (l *MLP) HotUnits() int { return l.hotK }

// UnitOrder returns the MLP's unit order: position i of the device weights
// holds the unit given to NewMLP as unit UnitOrder()[i].
func (l *MLP) UnitOrder() []int {
	if l.order == nil {
		o := make([]int, l.F)
		for i := range o {
			o[i] = i
		}
		return o
	}
	return slices.Clone(l.order)
}

// sparseCols returns the units D2T packs and the tail gathers in every
// sparse call through D2T: all but the hot ones, whatever the call's size.
// D2T must never pack the hot units: the reorder puts the most frequent
// units together in the last tiles, which would overflow their capacity in
// most rows (at 2% skewed density and C = 8, every row of a 4096-token
// batch).
func (l *MLP) sparseCols() int { return l.F - l.hotK }

// Calibrate runs the gate of the m tokens in x (m x D bf16; a few thousand
// tokens of the data the MLP will see), counts how often each unit fires,
// chooses the hot units by the cost model (chooseHot) and reorders the
// MLP's weights on the device so that they come last. Later sparse calls
// through D2T compute them densely (see sparseCols). It needs the cuBLAS
// handle and synchronizes stream s. Calibrating again first restores the order
// NewMLP was given (counting in the reordered one would pack the hot units
// together and flag most rows), then chooses anew from the new batch's
// counts. Work recorded into CUDA graphs before it must be recorded again:
// it advances Epoch.
func (l *MLP) Calibrate(s *cuda.Stream, x *cuda.Buffer, m int) (*Calibration, error) {
	if err := l.checkIO(nil, x, m); err != nil {
		return nil, err
	}
	if l.blas == nil {
		return nil, errors.New("gpu: Calibrate needs a cuBLAS handle (the hot units run on cuBLASLt)")
	}
	hk, err := l.k.hot()
	if err != nil {
		return nil, err
	}
	if l.order != nil {
		back := make([]int, l.F) // new position u takes the current position of unit u
		for p, u := range l.order {
			back[u] = p
		}
		if err := l.reorder(s, hk, back); err != nil {
			return nil, err
		}
	}
	l.hotK, l.calibrated = 0, true
	ws, _, err := l.runD2T(s, x, m, l.F, nil)
	if err != nil {
		return nil, err
	}
	counts, err := l.dev.Alloc(4 * l.F)
	if err != nil {
		return nil, err
	}
	defer counts.Free()
	if err := l.dev.Memset8(counts, 0, s); err != nil {
		return nil, err
	}
	tiles := l.F / 256
	grid := cuda.Dim3{uint32(min((m*tiles+7)/8, 16*l.dev.Properties().SMs)), 1, 1}
	if err := hk.count.Launch(grid, cuda.Dim3{256, 1, 1}, 0, s, ws.packed, ws.flags, int32(m), int32(l.Layout.S()),
		int32(tiles), int32(l.F/l.Layout.C), counts); err != nil {
		return nil, fmt.Errorf("gpu: unit_count: %w", err)
	}
	if err := syncStream(l.dev, s); err != nil {
		return nil, err
	}
	got := make([]uint32, l.F)
	if err := l.dev.CopyDtoH(cuda.Bytes(got), counts); err != nil {
		return nil, err
	}
	flagged := make([]int32, 1)
	if err := l.dev.CopyDtoH(cuda.Bytes(flagged), ws.ovf); err != nil {
		return nil, err
	}
	// Counts by the current position, and by the unit given to NewMLP.
	pos := make([]int64, l.F)
	order := l.UnitOrder()
	c := &Calibration{Tokens: m - int(flagged[0]), Counts: make([]int64, l.F)}
	for i, v := range got {
		pos[i] = int64(v)
		c.Counts[order[i]] = int64(v)
	}
	hot, gain := chooseHot(pos, c.Tokens, l.D, l.Gated)
	perm := hotOrder(l.F, hot)
	if err := l.reorder(s, hk, perm); err != nil {
		return nil, err
	}
	var all, held int64
	for _, v := range pos {
		all += v
	}
	for _, p := range hot {
		held += pos[p]
		c.Hot = append(c.Hot, order[p])
	}
	if all > 0 {
		c.Covered = float64(held) / float64(all)
	}
	c.Gain = gain
	l.hotK = len(hot)
	return c, nil
}

// chooseHot returns the positions of the units worth computing densely,
// given their firings over tokens tokens (counts by position), most
// frequent first, and the time per token they save by the cost model:
// units in descending count order (ties by position), hotBlock at a time,
// while a block's dense cost (the up and down products beyond D2T's, and
// the elementwise traffic) is below the gathers its firings cost in the
// sparse tail. At least one block stays sparse.
func chooseHot(counts []int64, tokens, d int, gated bool) ([]int, float64) {
	f := len(counts)
	if tokens <= 0 || f < 2*hotBlock {
		return nil, 0
	}
	rows, flops := 1.0, 2*float64(d) // non-gated: D2T computes the up product; the down rows are gathered
	if gated {
		rows, flops = 2, 4*float64(d)
	}
	pair := rows * 2 * float64(d) / hotPairRate
	unit := flops/hotGEMMRate + hotElemBytes/hotElemRate
	byCount := make([]int, f)
	for i := range byCount {
		byCount[i] = i
	}
	slices.SortStableFunc(byCount, func(a, b int) int {
		switch {
		case counts[a] > counts[b]:
			return -1
		case counts[a] < counts[b]:
			return 1
		}
		return 0
	})
	var gain float64
	k := 0
	for ; k+hotBlock <= f-hotBlock; k += hotBlock {
		var fired int64
		for _, p := range byCount[k : k+hotBlock] {
			fired += counts[p]
		}
		g := float64(fired)/float64(tokens)*pair - hotBlock*unit
		if g <= 0 {
			break
		}
		gain += g
	}
	if k == 0 {
		return nil, 0
	}
	return byCount[:k], gain
}

// hotOrder returns the new order of f positions (new position i takes
// current position perm[i]): the positions not in hot in ascending order,
// then hot's, in its order.
func hotOrder(f int, hot []int) []int {
	isHot := make([]bool, f)
	for _, p := range hot {
		isHot[p] = true
	}
	perm := make([]int, 0, f)
	for i := 0; i < f; i++ {
		if !isHot[i] {
			perm = append(perm, i)
		}
	}
	return append(perm, hot...)
}

// reorder moves the rows of the MLP's weights so that new position i holds
// the unit at current position perm[i], through a scratch matrix, and
// advances the workspace's epoch (recorded graphs may have captured the
// old hot split). It synchronizes s.
func (l *MLP) reorder(s *cuda.Stream, hk *hotSet, perm []int) error {
	identity := true
	p32 := make([]int32, len(perm))
	for i, p := range perm {
		p32[i] = int32(p)
		identity = identity && p == i
	}
	l.ws.epoch++
	if identity {
		return nil
	}
	pb, err := l.dev.Alloc(4 * len(p32))
	if err != nil {
		return err
	}
	defer pb.Free()
	if err := l.dev.CopyHtoD(pb, cuda.Bytes(p32)); err != nil {
		return err
	}
	n := 2 * l.F * l.D
	tmp, err := l.dev.Alloc(n)
	if err != nil {
		return fmt.Errorf("gpu: reordering the MLP's units needs a scratch matrix of %d bytes: %w", n, err)
	}
	defer tmp.Free()
	grid := cuda.Dim3{uint32(min(l.F, 8*l.dev.Properties().SMs)), 1, 1}
	for _, w := range []*cuda.Buffer{l.gate, l.up, l.down} {
		if w == nil {
			continue
		}
		if err = hk.permute.Launch(grid, cuda.Dim3{256, 1, 1}, 0, s, w, tmp, pb, int32(l.F), int32(l.D)); err == nil {
			err = l.dev.CopyDtoDAsync(w, tmp, n, s)
		}
		if err != nil {
			break
		}
	}
	if err == nil {
		err = syncStream(l.dev, s)
	}
	if err != nil {
		// Some matrices may be reordered and others not.
		l.bad = fmt.Errorf("gpu: MLP weights left half reordered: %w", err)
		return l.bad
	}
	old := l.UnitOrder()
	l.order = make([]int, l.F)
	for i, p := range perm {
		l.order[i] = old[p]
	}
	return nil
}

// hotDense queues the hot units' part of a sparse call of m tokens whose
// other units went through D2T and the tail: dn, the dense MLP of the hot
// units (hotSlice), whose down product adds into y. With projected, D2T
// already wrote h into the hot workspace's g and counted the hot units'
// firings, and only the down product runs; else relu_mul counts them into
// the MLP's counter.
func (l *MLP) hotDense(s *cuda.Stream, y, x *cuda.Buffer, m int, dn *DenseMLP, projected bool) error {
	var err error
	if projected {
		err = dn.downProduct(s, y, m, l.ws.hot.g, true)
	} else {
		err = dn.queue(s, y, x, m, &l.ws.hot, l.realloc, true)
	}
	if err != nil {
		return fmt.Errorf("gpu: hot units: %w", err)
	}
	return nil
}

// hotSlice returns the dense MLP of the units after the first cols (views
// of the hot units' weight rows), or nil when cols is all of them.
func (l *MLP) hotSlice(cols int) (*DenseMLP, error) {
	if cols == l.F {
		return nil, nil
	}
	off, n := 2*cols*l.D, 2*(l.F-cols)*l.D
	dn := &DenseMLP{D: l.D, F: l.F - cols, Gated: l.Gated, Act: ActReLU, dev: l.dev, k: l.k, blas: l.blas, nnz: l.nnz}
	var err error
	if l.Gated {
		if dn.gate, err = l.gate.Slice(off, n); err != nil {
			return nil, err
		}
	}
	if dn.up, err = l.up.Slice(off, n); err != nil {
		return nil, err
	}
	if dn.down, err = l.down.Slice(off, n); err != nil {
		return nil, err
	}
	return dn, nil
}

// hotActBytes returns the activation memory of the hot units' dense part
// in a call of m tokens: h, and gated the up products too where cuBLASLt
// computes them (not hotInD2T).
func (l *MLP) hotActBytes(m int) int64 {
	k := int64(l.hotK)
	if l.Gated && !l.hotInD2T() {
		return 2 * 2 * int64(m) * k
	}
	return 2 * int64(m) * k
}

// hotInD2T reports whether the D2T kernel computes the hot units' h (see
// hotInKernel).
func (l *MLP) hotInD2T() bool {
	_, kind, err := l.d2tKernel()
	return err == nil && l.hotInKernel(kind)
}

// hotInKernel reports whether D2T kernel kind computes the hot units' h:
// the wgmma kernel does, unless SeparateHot is set.
func (l *MLP) hotInKernel(kind Kernel) bool { return kind == KernelWGMMA && !l.SeparateHot }

// syncStream waits for stream s (nil: the whole device).
func syncStream(dev *cuda.Device, s *cuda.Stream) error {
	if s != nil {
		return s.Synchronize()
	}
	return dev.Synchronize()
}

// hotSet are the kernels of hot.cu.
type hotSet struct {
	count, permute *cuda.Function
	once           sync.Once
	err            error
}

// hotExprs are the kernels of hot.cu.
var hotExprs = []string{"unit_count", "permute_rows"}

// hot returns the kernels of hot.cu, compiling them on first use.
func (k *kernels) hot() (*hotSet, error) {
	h := &k.hotKs
	h.once.Do(func() {
		exprs := hotExprs
		fs, err := k.compile("hot.cu", hotSrc, exprs)
		if err != nil {
			h.err = err
			return
		}
		h.count, h.permute = fs[exprs[0]], fs[exprs[1]]
	})
	return h, h.err
}
