package gpu

import (
	"errors"
	"fmt"

	"github.com/twell-ai/twell/cuda"
)

// workspace is the activation memory of MLP calls, grown to the largest
// call. MLPs of one shape that run one after another on one stream (the
// layers of a model) may share one: see ShareWorkspace.
type workspace struct {
	sp    sparseWS
	dn    denseWS
	hot   denseWS // the hot units' dense part of sparse calls (hot.go)
	refs  int     // MLPs using it
	epoch uint64  // buffer reallocations so far
}

type sparseWS struct {
	mPad              int
	packed, hbuf, cnt *cuda.Buffer
	// ctl holds, as int32, the length bins and their fill counts of
	// TailSorted's sort (lenBins each), the row flags (mPad) and the
	// overflow list (its count, then mPad rows), in that order, so that a
	// sparse call zeroes all but the list with one memset (clear); the
	// others are views of it.
	ctl, clear, lenBins, lenCur, flags, ovf *cuda.Buffer
	// TailSorted: the token order (mPad ints)
	order *cuda.Buffer
	// small-batch path (gemv.cu): h, gemvMaxRows x F fp32; the activity
	// mask and the per-block counts, F/32 words each; gemv_mlp's grid
	// barrier, a 64-bit counter (its grid is F/32 blocks for every MLP
	// sharing the workspace, as grid_sync needs)
	gh, gmask, gcnt, gbar *cuda.Buffer
	// activity masks of the flagged rows' groups (flaggedRows)
	fbMask *cuda.Buffer
	// gathered dense pass over flagged rows: rows x D inputs and outputs,
	// rows x F gate and up
	gRows          int
	gx, gg, gu, gy *cuda.Buffer
}

// dropWorkspace releases l's use of its workspace, freeing the buffers when
// l was the last MLP using them.
func (l *MLP) dropWorkspace() error {
	ws := l.ws
	if ws == nil {
		return nil
	}
	l.ws = nil
	if ws.refs--; ws.refs > 0 {
		return nil
	}
	var errs []error
	for _, b := range []*cuda.Buffer{ws.sp.packed, ws.sp.ctl, ws.sp.hbuf, ws.sp.cnt, ws.sp.order,
		ws.sp.gx, ws.sp.gg, ws.sp.gu, ws.sp.gy, ws.sp.gh, ws.sp.gmask, ws.sp.gcnt, ws.sp.gbar, ws.sp.fbMask, ws.dn.g, ws.dn.u,
		ws.hot.g, ws.hot.u} {
		if b != nil {
			errs = append(errs, b.Free())
		}
	}
	return errors.Join(errs...)
}

// ShareWorkspace makes l use o's activation workspace (the packed gate, the
// fallback scratch, the dense path's projections) instead of its own, so
// that a model's layers hold the workspace of their largest call once rather
// than once per layer. l and o must have the same shape and layout and must
// not run at the same time: their calls must be queued on one stream.
func (l *MLP) ShareWorkspace(o *MLP) error {
	switch {
	case l.up == nil || o.up == nil:
		return errors.New("gpu: ShareWorkspace on a closed MLP")
	case l.dev != o.dev:
		return errors.New("gpu: ShareWorkspace across devices")
	case l.D != o.D || l.F != o.F || l.Gated != o.Gated || l.Layout != o.Layout:
		return fmt.Errorf("gpu: ShareWorkspace between MLPs of different shapes (d %d/%d, f %d/%d, gated %v/%v, layout %v/%v)",
			l.D, o.D, l.F, o.F, l.Gated, o.Gated, l.Layout, o.Layout)
	case l.ws == o.ws:
		return nil
	}
	if err := l.dropWorkspace(); err != nil {
		return err
	}
	l.ws = o.ws
	o.ws.refs++
	return nil
}

func padRows(m int) int { return (m + 255) / 256 * 256 }

// SparseActBytes returns the activation memory the sparse path allocates for
// m tokens: the packed gate, the row flags and the overflow list (the
// fallback scratch is fixed, one f-vector per multiprocessor), the split
// tail's list lengths, and the gathered dense pass at its current size; for
// m <= gemvMaxRows, the small-batch kernels' h, mask and counts; and the
// hot units' gate and up products (hot.go).
func (l *MLP) SparseActBytes(m int) int64 {
	if m <= gemvMaxRows {
		return int64(4*gemvMaxRows*l.F + 2*4*(l.F/32))
	}
	mp := padRows(m)
	var g int64
	if l.ws != nil {
		g = int64(l.ws.sp.gRows) * int64(2*2*l.D+2*2*l.F)
	}
	return int64(mp)*int64(l.F/l.Layout.C)*4 + 3*int64(mp)*4 + int64(mp+1)*4 + int64(l.dev.Properties().SMs*l.F*4) +
		2*lenBins*4 + g + l.hotActBytes(m)
}

// DenseActBytes returns the activation memory the dense path allocates for m
// tokens: the bf16 gate and up projections (h overwrites one of them).
func (l *MLP) DenseActBytes(m int) int64 {
	if l.Gated {
		return 2 * 2 * int64(m) * int64(l.F)
	}
	return 2 * int64(m) * int64(l.F)
}

// realloc returns b if it holds n bytes, else a new buffer (freeing b).
func (l *MLP) realloc(b *cuda.Buffer, n int) (*cuda.Buffer, error) {
	return grow(l.dev, b, n, &l.ws.epoch)
}

// Epoch counts the reallocations of the MLP's device workspace (shared
// with the MLPs of ShareWorkspace). Work recorded into a CUDA graph from
// Queue reads and writes that workspace: it stays valid while Epoch is
// unchanged.
func (l *MLP) Epoch() uint64 { return l.ws.epoch }

func (l *MLP) sparseWorkspace(m int) (*sparseWS, error) {
	mp := padRows(m)
	ws := &l.ws.sp
	if ws.mPad >= mp {
		return ws, nil
	}
	var err error
	if ws.packed, err = l.realloc(ws.packed, mp*(l.F/l.Layout.C)*4); err != nil {
		return nil, err
	}
	if ws.ctl, err = l.realloc(ws.ctl, 4*(2*lenBins+2*mp+1)); err != nil {
		return nil, err
	}
	if err := ws.ctlViews(mp); err != nil {
		return nil, err
	}
	if ws.hbuf, err = l.realloc(ws.hbuf, l.dev.Properties().SMs*l.F*4); err != nil {
		return nil, err
	}
	if ws.fbMask, err = l.realloc(ws.fbMask, l.F/32*4*fbRows(l.dev.Properties().SMs)/fbGroup); err != nil {
		return nil, err
	}
	if ws.cnt, err = l.realloc(ws.cnt, mp*4); err != nil {
		return nil, err
	}
	if ws.order, err = l.realloc(ws.order, mp*4); err != nil {
		return nil, err
	}
	ws.mPad = mp
	return ws, nil
}

// ctlViews cuts ws.ctl, sized for mp rows, into its views.
func (ws *sparseWS) ctlViews(mp int) error {
	views := []struct {
		b        **cuda.Buffer
		off, len int // int32s
	}{
		{&ws.lenBins, 0, lenBins}, {&ws.lenCur, lenBins, lenBins}, {&ws.flags, 2 * lenBins, mp},
		{&ws.ovf, 2*lenBins + mp, mp + 1}, {&ws.clear, 0, 2*lenBins + mp + 1},
	}
	for _, v := range views {
		var err error
		if *v.b, err = ws.ctl.Slice(4*v.off, 4*v.len); err != nil {
			return err
		}
	}
	return nil
}
