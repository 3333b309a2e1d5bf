package trainer

import "github.com/twell-ai/twell/cuda"

// Launchers of sparse.cu's kernels (see its header for the algorithm).

// countBytes is the size of the sparse path's count buffer for m tokens
// and f units: the row index's counts and offsets, then the column index's
// counts and offsets.
func countBytes(m, f int) int { return max(carvedBytes(rowCountSizes(m)), 4*(4*f+2)) }

// vecThreads is the block of a kernel whose threads take 8 of h columns
// each: enough warps to cover h once, at most 256.
func vecThreads(h int) int { return min(256, max(32, (h/8+31)&^31)) }

// spIndexRows is the number of rows of a block of the row index (SPI_ROWS).
const spIndexRows = 8

// spStashCap is the most entries of a row that the row index's first pass
// keeps for its second (a row with more is read from G again).
const spStashCap = 128

// rowCountSizes are the byte sizes of the row index's counts for m rows,
// in carving order: per row, per block, and the blocks' offsets.
func rowCountSizes(m int) []int {
	nb := ceil(m, spIndexRows)
	return []int{4 * m, 4 * nb, 4 * (nb + 1)}
}

// stashCap is the row index's stash, in entries a row, for m rows of f
// units: as many as fit in the 2mf bytes of the gate buffer that G leaves
// (int32 column and bf16 value each), at most spStashCap.
func stashCap(m, f int) int { return max(0, min(spStashCap, (2*m*f-16)/(6*m))) }

// rowIndexWork are the row index's work views: the counts (from the count
// buffer) and the stash of cap entries a row (from the half of the gate
// buffer dh that G leaves).
type rowIndexWork struct {
	cnt, btot, boff, stashCol, stashVal *cuda.Buffer
	cap                                 int
}

func (s mlpShape) rowIndexWork(sl *slicer, dh, counts *cuda.Buffer) rowIndexWork {
	c := stashCap(s.m, s.f)
	v := carve(sl, counts, rowCountSizes(s.m))
	st := carve(sl, sl.at(dh, 2*s.m*s.f, 2*s.m*s.f), []int{4 * s.m * c, 2 * s.m * c})
	return rowIndexWork{cnt: v[0], btot: v[1], boff: v[2], stashCol: st[0], stashVal: st[1], cap: c}
}

// spRowIndex builds the row-major form of the active units of g (bf16 [m]
// [f] gate pre-activations, the first half of dh) into sp: sp_row_count
// reads g once, sp_scan places the blocks and sp_row_write the rows. The
// firing counts are added into active (may be nil) and the L0 (and,
// ungated, the L1) statistic into stat (may be nil; through partial sums
// in sc.part).
func (l launcher) spRowIndex(s mlpShape, dh *cuda.Buffer, sp sparseSave, sc mlpScratch, active, stat *cuda.Buffer, l0Scale, l1Scale float64) error {
	m, f := s.m, s.f
	nb := ceil(m, spIndexRows)
	if err := check(need("gate buffer (G and the row index's stash)", dh, 4*m*f), need("row counts", sc.cnt, countBytes(m, f))); err != nil {
		return err
	}
	var tv any = cuda.DevicePtr(0)
	if !s.gated {
		tv = sp.pv
	}
	sl := &slicer{}
	g := sl.at(dh, 0, 2*m*f)
	w := s.rowIndexWork(sl, dh, sc.cnt)
	var part0, part1, l1, l0 *cuda.Buffer
	if stat != nil {
		if err := need("statistics partial sums", sc.part, 16*nb); err != nil {
			return err
		}
		part0, part1, l1, l0 = sl.at(sc.part, 0, 8*nb), sl.at(sc.part, 8*nb, 8*nb), sl.at(stat, 0, 8), sl.at(stat, 8, 8)
	}
	if sl.err != nil {
		return sl.err
	}
	return inOrder(
		func() error {
			return l.k["sp_row_count"].Launch(dim(nb), dim(32*spIndexRows), 0, l.s, g, w.cnt, w.btot, w.stashCol, w.stashVal,
				int32(w.cap), optional(active), optional(part0), optional(part1), b2i(!s.gated), int32(m), int32(f), l0Scale, l1Scale)
		},
		func() error { return l.k["sp_scan"].Launch(dim(1), dim(1024), 0, l.s, w.btot, w.boff, int32(nb)) },
		func() error {
			return l.k["sp_row_write"].Launch(dim(nb), dim(32*spIndexRows), 0, l.s, g, w.cnt, w.boff, w.stashCol, w.stashVal,
				int32(w.cap), sp.rowptr, sp.col, sp.pv, tv, int32(m), int32(f))
		},
		func() error {
			if stat == nil {
				return nil
			}
			return l.sumF64(l0, part0, nb, 1)
		},
		func() error {
			if stat == nil || s.gated {
				return nil
			}
			return l.sumF64(l1, part1, nb, 1)
		},
	)
}

// spColIndex builds the column index of sp's row-major form.
func (l launcher) spColIndex(s mlpShape, sp sparseSave, sc mlpScratch) error {
	m, f := s.m, s.f
	if err := check(need("column counts", sc.cnt, countBytes(m, f)),
		need("column chunk counts", sc.chunk, 4*ceil(m, sparseRowsPer)*f)); err != nil {
		return err
	}
	chunks := ceil(m, sparseRowsPer)
	return inOrder(
		func() error {
			return l.k["sp_col_count"].Launch(dim(chunks), dim(rowBlock), 4*ceil(f, 2), l.s, sp.rowptr, sp.col, sc.chunk,
				int32(m), int32(f), int32(sparseRowsPer))
		},
		func() error {
			return l.k["sp_col_prefix"].Launch(dim(ceil(f, 32)), dim2(32, 32), 0, l.s, sc.chunk, sc.cnt, int32(chunks), int32(f))
		},
		func() error { return l.k["sp_scan"].Launch(dim(1), dim(1024), 0, l.s, sc.cnt, sp.colptr, int32(f)) },
		func() error {
			return l.k["sp_col_fill"].Launch(dim(chunks), dim(32), 4*f, l.s, sp.rowptr, sp.col, sc.chunk, sp.colptr,
				sp.coltok, sp.colpos, int32(m), int32(f), int32(sparseRowsPer))
		},
	)
}

// spUp computes R and T on the support (gated forward), adding the L1
// statistic into stat (may be nil) through per-row partial sums in part.
func (l launcher) spUp(s mlpShape, x, up *cuda.Buffer, sp sparseSave, stat, part *cuda.Buffer, l1Scale float64) error {
	if err := check(need("MLP input", x, 2*s.m*s.h), need("up weights", up, 2*s.f*s.h)); err != nil {
		return err
	}
	if stat == nil {
		part = nil
	} else if err := need("statistics partial sums", part, 8*s.m); err != nil {
		return err
	}
	err := l.k["sp_up"].Launch(dim(s.m), dim(rowBlock), 2*s.h, l.s, x, up, sp.rowptr, sp.col, sp.pv, sp.rv, sp.tv,
		optional(part), int32(s.h), l1Scale)
	if err != nil || stat == nil {
		return err
	}
	return l.sumF64(stat, part, s.m, 1)
}

// spGrad computes the gradient on the support from dy (bf16 [m][h]) and
// wdT (bf16 [f][h]): dR into pv and dG into rv (gated), dU into pv
// (ungated).
func (l launcher) spGrad(s mlpShape, dy, wdT *cuda.Buffer, sp sparseSave, l1Grad float32) error {
	if err := check(need("MLP output gradient", dy, 2*s.m*s.h), need("transposed down weights", wdT, 2*s.f*s.h)); err != nil {
		return err
	}
	rv := any(cuda.DevicePtr(0))
	if s.gated {
		rv = sp.rv
	}
	return l.k["sp_grad"].Launch(dim(s.m), dim(rowBlock), 2*s.h, l.s, dy, wdT, sp.rowptr, sp.col, sp.pv, rv, sp.tv,
		int32(s.h), b2i(s.gated), l1Grad)
}

// spRows sets out = base (nil: 0) + v1·B1 (+ v2·B2) over the row-major
// form, B1 and B2 bf16 [f][h].
func (l launcher) spRows(out, base *cuda.Buffer, sp sparseSave, v1, b1, v2, b2 *cuda.Buffer, m, h int) error {
	if err := check(need("sparse product output", out, 4*m*h), need("sparse product weights", b1, 32*h)); err != nil {
		return err
	}
	return l.k["sp_rows"].Launch(dim(m), dim(vecThreads(h)), 0, l.s, out, optional(base), sp.rowptr, sp.col, v1, b1,
		optional(v2), optional(b2), int32(h))
}

// spColChunk is the most entries of a unit that one block of spCols sums:
// the gradient rows of a busier unit are summed in token ranges of at most
// spColChunk entries each (more when the column-sum slots run short; see
// sp_col_plan), so that one hot unit does not hold up the kernel.
const spColChunk = 256

// spColSlots is the number of partial-sum slots (2h floats each) of the
// column sums for m tokens and f units: at most 4096, and no more than the
// parts of every entry firing.
func spColSlots(m, f int) int { return min(4096, ceil(2*m*f, spColChunk)) }

// colParts are spColParts' views of the count buffer: the part prefix
// (int32 [f+1]) and the slot prefix of the units in more than one part.
type colParts struct{ partptr, slotptr *cuda.Buffer }

// spColParts cuts each unit's gradient rows into the parts spCols sums
// (see sp_col_plan), leaving their prefixes in views of sc.cnt.
func (l launcher) spColParts(s mlpShape, sp sparseSave, sc mlpScratch) (colParts, error) {
	f := s.f
	sl := &slicer{}
	cp := colParts{partptr: sl.at(sc.cnt, 0, 4*(f+1)), slotptr: sl.at(sc.cnt, 4*(f+1), 4*(f+1))}
	if sl.err != nil {
		return colParts{}, sl.err
	}
	return cp, l.k["sp_col_plan"].Launch(dim(1), dim(1024), 0, l.s, sp.colptr, cp.partptr, cp.slotptr, int32(f),
		int32(spColChunk), int32(spColSlots(s.m, f)))
}

// spCols adds out1[j] += Σ v1·A over unit j's tokens, and out2[j] += Σ v2·A
// when v2 is set; A bf16 [m][h], outputs fp32 [f][h]; cp from spColParts,
// partial sums of busy units through sc.slots.
func (l launcher) spCols(out1, out2 *cuda.Buffer, sp sparseSave, sc mlpScratch, cp colParts, v1, v2, a *cuda.Buffer, m, f, h int) error {
	if err := check(need("sparse gradient output", out1, 4*f*h), need("part offsets", cp.partptr, 4*(f+1)),
		need("column-sum slots", sc.slots, 8*spColSlots(m, f)*h)); err != nil {
		return err
	}
	if v2 != nil {
		if err := need("sparse gradient output", out2, 4*f*h); err != nil {
			return err
		}
	}
	// One wave of the blocks that fit at once: in a longer grid the blocks
	// past the first wave start only as earlier ones finish all their items.
	k, threads := l.k["sp_cols"], vecThreads(h)
	perSM, err := k.MaxActiveBlocksPerSM(threads, 0)
	if err != nil {
		return err
	}
	grid := l.grid
	if perSM > 0 {
		grid = min(grid, perSM*l.sms)
	}
	return inOrder(
		func() error {
			return k.Launch(dim(grid), dim(threads), 0, l.s, out1, optional(out2), sp.colptr,
				sp.coltok, sp.colpos, cp.partptr, cp.slotptr, sc.slots, v1, optional(v2), a, int32(f), int32(h))
		},
		func() error {
			return l.k["sp_col_reduce"].Launch(dim(min(f, l.grid)), dim(vecThreads(h)), 0, l.s, out1, optional(out2),
				cp.partptr, cp.slotptr, sc.slots, int32(f), int32(h))
		},
	)
}
