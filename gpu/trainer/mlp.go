package trainer

import (
	"errors"
	"fmt"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/mlp"
)

// DefaultDenseAbove is the density (active units per token over the MLP
// width, measured in the previous step) above which mlp.Auto runs a
// layer's MLP dense: below it the sparse forward and backward of an MLP
// block beat the dense GEMMs on an H200 (docs/gpu-train.md: 1.29x at 1%,
// 0.71x at 2%).
const DefaultDenseAbove = 0.01

// sparseRowsPer is the number of token rows per chunk of the column index
// (sp_col_count, sp_col_fill); it must stay below 65536.
const sparseRowsPer = 32

// sparseOK reports whether the sparse kernels take a block of width h and
// f units for m tokens on a device whose blocks may use smem bytes of
// shared memory: 16-byte rows, an entry count that fits int32, and the
// column index's per-unit counters (4f bytes) and a staged row (2h bytes)
// in shared memory.
func sparseOK(m, h, f, smem int) error {
	if h%8 != 0 || f%8 != 0 {
		return fmt.Errorf("trainer: the sparse MLP needs hidden size and MLP width divisible by 8 (have %d and %d)", h, f)
	}
	if int64(m)*int64(f) >= 1<<31 {
		return fmt.Errorf("trainer: the sparse MLP takes at most 2^31 - 1 entries per micro-batch (%d tokens x %d units)", m, f)
	}
	if need := max(4*f, 2*h); need > smem {
		return fmt.Errorf("trainer: the sparse MLP of hidden size %d and %d units needs %d bytes of shared memory per block, the device gives %d",
			h, f, need, smem)
	}
	return nil
}

// sharedPerBlock is the shared memory a block of dev may use (after
// opting in).
func sharedPerBlock(dev *cuda.Device) int {
	p := dev.Properties()
	return max(p.SharedPerBlockOptin, 48<<10)
}

// mlpShape is one MLP block's shape for m tokens.
type mlpShape struct {
	m, h, f int
	gated   bool
}

func (s mlpShape) guW() int {
	if s.gated {
		return 2 * s.f
	}
	return s.f
}

// align16 rounds n up to a multiple of 16.
func align16(n int) int { return (n + 15) &^ 15 }

// denseSizes are the byte sizes of the dense path's saved views, in
// carving order: the fp32 pre-activations and the bf16 hidden activations.
func (s mlpShape) denseSizes() []int { return []int{4 * s.m * s.guW(), 2 * s.m * s.f} }

// sparseSizes are the byte sizes of the sparse path's saved views, in
// carving order, sized for every unit of every token firing: row and
// column pointers, columns, tokens and positions, then P (and gated, R and
// T).
func (s mlpShape) sparseSizes() []int {
	nnz := s.m * s.f
	out := []int{4 * (s.m + 1), 4 * (s.f + 1), 4 * nnz, 4 * nnz, 4 * nnz, 2 * nnz}
	if s.gated {
		out = append(out, 2*nnz, 2*nnz)
	}
	return out
}

// carvedBytes is the region that views of sizes take, each 16-byte aligned.
func carvedBytes(sizes []int) int {
	n := 0
	for _, sz := range sizes {
		n += align16(sz)
	}
	return n
}

func (s mlpShape) denseSaveBytes() int  { return carvedBytes(s.denseSizes()) }
func (s mlpShape) sparseSaveBytes() int { return carvedBytes(s.sparseSizes()) }

// saveBytes is a layer's saved-activation region for the path p.
func (s mlpShape) saveBytes(p mlp.Path) int {
	if p == mlp.Dense {
		return s.denseSaveBytes()
	}
	return max(s.denseSaveBytes(), s.sparseSaveBytes())
}

// statPartBytes is the size of the partial sums of an MLP block's
// statistics (fp64, added up by sum_f64): two a block of relu_fwd, one a
// token row of sp_up (more than the row index's two per 8 rows).
func (s mlpShape) statPartBytes() int {
	return 8 * max(2*ceil(s.f, rowBlock)*ceil(s.m, rowsPer), s.m)
}

// sparseScratchBytes lists the sparse path's work buffers: row or column
// counts, the chunk counts of the column index and the column sums' slots.
func (s mlpShape) sparseScratchBytes() []int {
	chunks := (s.m + sparseRowsPer - 1) / sparseRowsPer
	return []int{countBytes(s.m, s.f), 4 * chunks * s.f, 8 * spColSlots(s.m, s.f) * s.h}
}

// carve cuts consecutive 16-byte aligned views of sizes out of region.
func carve(sl *slicer, region *cuda.Buffer, sizes []int) []*cuda.Buffer {
	out := make([]*cuda.Buffer, len(sizes))
	off := 0
	for i, n := range sizes {
		out[i] = sl.at(region, off, n)
		off += align16(n)
	}
	return out
}

// denseSave are the dense path's views of a layer's region.
type denseSave struct{ gu, hid *cuda.Buffer }

func (s mlpShape) carveDense(sl *slicer, region *cuda.Buffer) denseSave {
	v := carve(sl, region, s.denseSizes())
	return denseSave{gu: v[0], hid: v[1]}
}

// sparseSave are the sparse path's views of a layer's region: the
// row-major form (rowptr int32 [m+1], col int32 [nnz], pv, rv, tv bf16
// [nnz]; ungated, rv is nil and tv is pv) and the column index (colptr
// int32 [f+1], coltok, colpos int32 [nnz]).
type sparseSave struct {
	rowptr, col, pv, rv, tv, colptr, coltok, colpos *cuda.Buffer
}

func (s mlpShape) carveSparse(sl *slicer, region *cuda.Buffer) sparseSave {
	v := carve(sl, region, s.sparseSizes())
	out := sparseSave{rowptr: v[0], colptr: v[1], col: v[2], coltok: v[3], colpos: v[4], pv: v[5], tv: v[5]}
	if s.gated {
		out.rv, out.tv = v[6], v[7]
	}
	return out
}

// mlpScratch are the work buffers an MLP block's forward and backward share
// across layers: dh (fp32 [m][f]; the sparse path's bf16 gate
// pre-activations) and dgu (bf16 [m][guW]) of the dense backward, part for
// the statistics' partial sums (statPartBytes at least), and the sparse
// path's (sparseScratchBytes; nil when only dense runs).
type mlpScratch struct {
	dh, dgu, part *cuda.Buffer
	cnt, chunk    *cuda.Buffer
	slots         *cuda.Buffer // partial sums of busy units' weight gradients (spCols)
}

// mlpArgs are one MLP block's operands: out = base + MLP(x) forward;
// backward, from dy, the input gradient into dx and the weight gradients
// added into gGU and gDown.
type mlpArgs struct {
	mlpShape
	x          *cuda.Buffer // bf16 [m][h]: the normed input
	wgu, wd    *cuda.Buffer // bf16 [guW][h] (gate rows, then up rows), [f][h] (Wdᵀ: a row per unit)
	base, out  *cuda.Buffer // fp32 [m][h]
	region     *cuda.Buffer // saved activations (saveBytes)
	sc         mlpScratch
	noBackward bool // forward only: the sparse path skips the column index
	inline     bool // every kernel on the main stream (profiles time each stage alone)

	stat, active    *cuda.Buffer // fp64 [2] (L1 term, L0), int32 [f] firing counts
	l1Stat, l0Scale float64

	dy         *cuda.Buffer // bf16 [m][h]
	dx         *cuda.Buffer // fp32 [m][h]
	gGU, gDown *cuda.Buffer // fp32 [guW][h], [f][h]
	l1Grad     float32
}

// gpuCtx is what queues work on a device: the stream, cuBLASLt and this
// package's kernels, and a second stream for work that overlaps the first.
type gpuCtx struct {
	dev  *cuda.Device
	s    *cuda.Stream
	blas *cublas.Handle
	run  launcher
	// side (of the greatest priority) runs the sparse path's column index
	// beside the forward's row kernels: fork orders it after the row index,
	// join orders the main stream after it.
	side       *cuda.Stream
	sideRun    launcher
	fork, join *cuda.Event
}

// open creates the streams, events and cuBLASLt handle of kernels k.
func (g *gpuCtx) open(k kernels) error {
	var err error
	if g.s, err = g.dev.NewStream(); err != nil {
		return err
	}
	if g.side, err = g.dev.NewUrgentStream(); err != nil {
		return err
	}
	if g.fork, err = g.dev.NewEvent(); err != nil {
		return err
	}
	if g.join, err = g.dev.NewEvent(); err != nil {
		return err
	}
	if g.blas, err = cublas.New(g.dev); err != nil {
		return err
	}
	g.run, g.sideRun = newLauncher(k, g.s, g.dev), newLauncher(k, g.side, g.dev)
	return nil
}

// close waits for queued work, runs free (the owner's buffers), then
// closes cuBLASLt, the events and the streams; every error is returned.
func (g *gpuCtx) close(free func() error) error {
	var errs []error
	for _, s := range []*cuda.Stream{g.s, g.side} {
		if s != nil {
			errs = append(errs, s.Synchronize())
		}
	}
	errs = append(errs, free())
	if g.blas != nil {
		errs = append(errs, g.blas.Close())
		g.blas = nil
	}
	for _, e := range []**cuda.Event{&g.fork, &g.join} {
		if *e != nil {
			errs = append(errs, (*e).Destroy())
			*e = nil
		}
	}
	for _, s := range []**cuda.Stream{&g.s, &g.side} {
		if *s != nil {
			errs = append(errs, (*s).Destroy())
			*s = nil
		}
	}
	return errors.Join(errs...)
}

// beside queues work (given the side stream's launcher) on the side
// stream after what the main stream has queued so far; joinSide orders
// the main stream's later work after it.
func (g *gpuCtx) beside(work func(l launcher) error) error {
	return inOrder(
		func() error { return g.fork.Record(g.s) },
		func() error { return g.side.Wait(g.fork) },
		func() error { return work(g.sideRun) },
		func() error { return g.join.Record(g.side) },
	)
}

// joinSide makes the main stream's later work wait for the side stream's.
func (g *gpuCtx) joinSide() error { return g.s.Wait(g.join) }

// linear sets y = x·Wᵀ, y of type ct.
func (g *gpuCtx) linear(y, x, w *cuda.Buffer, m, in, out int, ct cublas.DataType) error {
	return g.blas.Matmul(g.s, cublas.Gemm{M: m, N: out, K: in, TransB: true, Alpha: 1, CType: ct}, x, w, y)
}

// linearOnto sets y = base + x·Wᵀ, fp32 (y and base may be one buffer):
// the residual is read once, not copied into y first.
func (g *gpuCtx) linearOnto(y, base, x, w *cuda.Buffer, m, in, out int) error {
	return g.blas.MatmulAdd(g.s, cublas.Gemm{M: m, N: out, K: in, TransB: true, Alpha: 1, Beta: 1, CType: cublas.F32}, x, w, base, y)
}

// linearTOnto is linearOnto for W stored [in][out]: y = base + x·W.
func (g *gpuCtx) linearTOnto(y, base, x, w *cuda.Buffer, m, in, out int) error {
	return g.blas.MatmulAdd(g.s, cublas.Gemm{M: m, N: out, K: in, Alpha: 1, Beta: 1, CType: cublas.F32}, x, w, base, y)
}

// linearDX sets dx = dy·W (dy [m][out], W [out][in]), dx of type ct.
func (g *gpuCtx) linearDX(dx, dy, w *cuda.Buffer, m, in, out int, ct cublas.DataType) error {
	return g.blas.Matmul(g.s, cublas.Gemm{M: m, N: in, K: out, Alpha: 1, CType: ct}, dy, w, dx)
}

// linearDW adds dyᵀ·x into dw (fp32 [out][in]).
func (g *gpuCtx) linearDW(dw, dy, x *cuda.Buffer, m, in, out int) error {
	return g.blas.Matmul(g.s, cublas.Gemm{M: out, N: in, K: m, TransA: true, Alpha: 1, Beta: 1, CType: cublas.F32}, dy, x, dw)
}

// mlpStep is one queued stage of an MLP block's forward or backward.
type mlpStep struct {
	name string
	run  func() error
}

// runSteps queues steps in order, stopping at the first error; before
// each, before (when set) is called with the step's name.
func runSteps(steps []mlpStep, before func(name string) error) error {
	for _, st := range steps {
		if before != nil {
			if err := before(st.name); err != nil {
				return err
			}
		}
		if err := st.run(); err != nil {
			return fmt.Errorf("%s: %w", st.name, err)
		}
	}
	return nil
}

// sparseViews are the weight and gradient views the sparse path reads:
// gate and up rows (the same matrix ungated) and their gradients.
type sparseViews struct{ gate, up, gGate, gUp *cuda.Buffer }

func (a mlpArgs) sparseViews(sl *slicer) sparseViews {
	fh, gated := a.f*a.h, int(b2i(a.gated))
	v := sparseViews{gate: sl.at(a.wgu, 0, 2*fh), up: sl.at(a.wgu, 2*fh*gated, 2*fh)}
	if a.gGU != nil {
		v.gGate, v.gUp = sl.at(a.gGU, 0, 4*fh), sl.at(a.gGU, 4*fh*gated, 4*fh)
	}
	return v
}

func (g *gpuCtx) mlpForwardSteps(a mlpArgs, sparse bool) ([]mlpStep, error) {
	sl := &slicer{}
	if !sparse {
		d := a.carveDense(sl, a.region)
		if sl.err != nil {
			return nil, sl.err
		}
		return []mlpStep{
			{"gate/up GEMM", func() error { return g.linear(d.gu, a.x, a.wgu, a.m, a.h, a.guW(), cublas.F32) }},
			{"activation", func() error {
				return g.run.reluFwd(reluArgs{gu: d.gu, m: a.m, f: a.f, gated: a.gated}, d.hid, a.active, a.stat, a.sc.part,
					a.l1Stat, a.l0Scale)
			}},
			{"down GEMM", func() error { return g.linearTOnto(a.out, a.base, d.hid, a.wd, a.m, a.f, a.h) }},
		}, nil
	}
	sp := a.carveSparse(sl, a.region)
	w := a.sparseViews(sl)
	gbf := sl.at(a.sc.dh, 0, 2*a.m*a.f) // the row index works in the rest of dh
	if sl.err != nil {
		return nil, sl.err
	}
	steps := []mlpStep{
		{"gate GEMM", func() error { return g.linear(gbf, a.x, w.gate, a.m, a.h, a.f, cublas.BF16) }},
		{"row index", func() error {
			return g.run.spRowIndex(a.mlpShape, a.sc.dh, sp, a.sc, a.active, a.stat, a.l0Scale, a.l1Stat)
		}},
	}
	// The column index (latency-bound, a few warps an SM) runs beside the
	// row kernels, which need only the row-major form.
	colIndex := func(l launcher) error { return l.spColIndex(a.mlpShape, sp, a.sc) }
	overlap := !a.noBackward && !a.inline
	switch {
	case overlap:
		steps = append(steps, mlpStep{"column index", func() error { return g.beside(colIndex) }})
	case !a.noBackward:
		steps = append(steps, mlpStep{"column index", func() error { return colIndex(g.run) }})
	}
	if a.gated {
		steps = append(steps, mlpStep{"up SDDMM", func() error {
			return g.run.spUp(a.mlpShape, a.x, w.up, sp, a.stat, a.sc.part, a.l1Stat)
		}})
	}
	steps = append(steps,
		mlpStep{"down SpMM", func() error { return g.run.spRows(a.out, a.base, sp, sp.tv, a.wd, nil, nil, a.m, a.h) }},
	)
	if overlap {
		// The next user of the scratch counts (the next layer's row index)
		// comes after this.
		steps = append(steps, mlpStep{"column index join", g.joinSide})
	}
	return steps, nil
}

func (g *gpuCtx) mlpBackwardSteps(a mlpArgs, sparse bool) ([]mlpStep, error) {
	sl := &slicer{}
	if !sparse {
		d := a.carveDense(sl, a.region)
		dh, dgu := sl.at(a.sc.dh, 0, 4*a.m*a.f), sl.at(a.sc.dgu, 0, 2*a.m*a.guW())
		if sl.err != nil {
			return nil, sl.err
		}
		return []mlpStep{
			{"dWd GEMM", func() error { return g.linearDW(a.gDown, d.hid, a.dy, a.m, a.h, a.f) }},
			{"dh GEMM", func() error { return g.linear(dh, a.dy, a.wd, a.m, a.h, a.f, cublas.F32) }},
			{"activation backward", func() error {
				return g.run.reluBwd(reluArgs{gu: d.gu, m: a.m, f: a.f, gated: a.gated}, dgu, dh, a.l1Grad)
			}},
			{"dWgu GEMM", func() error { return g.linearDW(a.gGU, dgu, a.x, a.m, a.h, a.guW()) }},
			{"dx GEMM", func() error { return g.linearDX(a.dx, dgu, a.wgu, a.m, a.h, a.guW(), cublas.F32) }},
		}, nil
	}
	sp := a.carveSparse(sl, a.region)
	w := a.sparseViews(sl)
	if sl.err != nil {
		return nil, sl.err
	}
	// dWd first: it reads T, which the ungated sp_grad overwrites (T = P).
	var cp colParts
	steps := []mlpStep{
		{"dWd SpMM", func() error {
			var err error
			if cp, err = g.run.spColParts(a.mlpShape, sp, a.sc); err != nil {
				return err
			}
			return g.run.spCols(a.gDown, nil, sp, a.sc, cp, sp.tv, nil, a.dy, a.m, a.f, a.h)
		}},
		{"grad SDDMM", func() error { return g.run.spGrad(a.mlpShape, a.dy, a.wd, sp, a.l1Grad) }},
	}
	if a.gated {
		// sp_grad left dR in pv and dG in rv.
		return append(steps,
			mlpStep{"dWg dWu SpMM", func() error { return g.run.spCols(w.gGate, w.gUp, sp, a.sc, cp, sp.rv, sp.pv, a.x, a.m, a.f, a.h) }},
			mlpStep{"dx SpMM", func() error { return g.run.spRows(a.dx, nil, sp, sp.rv, w.gate, sp.pv, w.up, a.m, a.h) }},
		), nil
	}
	return append(steps,
		mlpStep{"dWu SpMM", func() error { return g.run.spCols(w.gUp, nil, sp, a.sc, cp, sp.pv, nil, a.x, a.m, a.f, a.h) }},
		mlpStep{"dx SpMM", func() error { return g.run.spRows(a.dx, nil, sp, sp.pv, w.up, nil, nil, a.m, a.h) }},
	), nil
}
