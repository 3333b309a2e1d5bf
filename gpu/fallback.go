package gpu

import (
	"encoding/binary"
	"fmt"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
)

// flaggedRows queues the exact recomputation of the flagged rows past the
// first (which the gathered dense pass took): up to fbRows(SMs) of them
// through the LIST forms of the small-batch kernels, which spread each row
// over all SMs, the rest (a call with hundreds of flagged rows, which the
// automatic path soon sends dense) through row_fallback, one CTA per row
// (about 10 ms per row on an H200 where it walks every unit alone).
func (l *MLP) flaggedRows(s *cuda.Stream, set *t2dSet, y, x *cuda.Buffer, ws *sparseWS, first int) error {
	ks, err := l.k.gemvKernels(l.GEMVTimeline)
	if err != nil {
		return err
	}
	capRows := fbRows(l.dev.Properties().SMs)
	act := ks.fbActPlain
	if l.Gated {
		act = ks.fbActGated
	}
	a := gemvArgs{x: x, w: l.sparseIn(), up: l.up, down: l.down, y: y, h: ws.hbuf, mask: ws.fbMask, list: ws.ovf,
		d: l.D, f: l.F, first: first, cap: capRows, early: l.earlyStart()}
	if err := a.launchAct(act, s); err != nil {
		return fmt.Errorf("gpu: flagged rows (gemv_act): %w", err)
	}
	if err := a.launchDown(ks.fbDown, s); err != nil {
		return fmt.Errorf("gpu: flagged rows (gemv_down): %w", err)
	}
	fb := set.fbPlain
	if l.Gated {
		fb = set.fbGated
	}
	if err := a.rowFallback(fb, s, first+capRows, l.dev.Properties().SMs); err != nil {
		return fmt.Errorf("gpu: dense fallback: %w", err)
	}
	return nil
}

// fbRows is how many flagged rows the LIST kernels take per call: the rows
// of h that the sparse workspace's hbuf (SMs x F floats) holds, in whole
// groups.
func fbRows(sms int) int { return sms / fbGroup * fbGroup }

// maxGatheredRows bounds the gathered dense pass (its workspace is
// rows x (2D + 2F) bf16); further flagged rows take the per-row kernel.
const maxGatheredRows = 1024

// gatheredRows returns how many flagged rows the gathered dense pass should
// take for m tokens: 64 before any sparse call has reported its flagged
// rows, none after one that had none, else 1.5x the last rate plus 16,
// rounded up to a multiple of 16.
func (l *MLP) gatheredRows(m int) int {
	if l.blas == nil {
		return 0
	}
	n := 64
	if l.flagKnown {
		if l.flagRate == 0 {
			return 0
		}
		n = int(1.5*l.flagRate*float64(m)) + 16
	}
	n = min(n, m, maxGatheredRows)
	return (n + 15) / 16 * 16
}

// pollFlagged reads the flagged-row count of the last sparse call if it
// has arrived.
func (l *MLP) pollFlagged() {
	if !l.ovfPending {
		return
	}
	if done, err := l.evtOvf.Done(); err != nil || !done {
		return
	}
	l.ovfPending = false
	n := binary.LittleEndian.Uint32(l.hostOvf.Bytes())
	l.flagRate, l.flagKnown = float64(n)/float64(l.ovfM), true
}

// gatheredDense recomputes the first R rows of the overflow list densely:
// it gathers them into an R-row matrix, runs the MLP on it with cuBLASLt
// (bf16 in and out, fp32 accumulate; active as in the exact kernel: > 0 or
// NaN) and scatters the results into y. Rows of the gathered matrix past the
// overflow count hold stale data and are not scattered.
func (l *MLP) gatheredDense(s *cuda.Stream, y, x *cuda.Buffer, ws *sparseWS, R int) error {
	if ws.gRows < R {
		var err error
		for _, b := range []struct {
			p **cuda.Buffer
			n int
		}{{&ws.gx, 2 * R * l.D}, {&ws.gy, 2 * R * l.D}, {&ws.gg, 2 * R * l.F}, {&ws.gu, 2 * R * l.F}} {
			if *b.p, err = l.realloc(*b.p, b.n); err != nil {
				return err
			}
		}
		ws.gRows = R
	}
	g, err := l.k.gathered()
	if err != nil {
		return err
	}
	if err := moveRows(g.gather, s, x, ws.gx, ws.ovf, R, l.D); err != nil {
		return err
	}
	proj := cublas.Gemm{M: R, N: l.F, K: l.D, TransB: true}
	if err := l.blas.Matmul(s, proj, ws.gx, l.sparseIn(), ws.gg); err != nil {
		return err
	}
	act := g.actPlain
	if l.Gated {
		if err := l.blas.Matmul(s, proj, ws.gx, l.up, ws.gu); err != nil {
			return err
		}
		act = g.actGated
	}
	if err := actExact(act, s, ws.gg, ws.gu, ws.gg, int64(R)*int64(l.F), l.dev.Properties().SMs); err != nil {
		return err
	}
	if err := l.blas.Matmul(s, cublas.Gemm{M: R, N: l.D, K: l.F}, ws.gg, l.down, ws.gy); err != nil {
		return err
	}
	return moveRows(g.scatter, s, ws.gy, y, ws.ovf, R, l.D)
}

// rowFallback launches row_fallback (t2d.cu) on the flagged rows from
// index first of the overflow list a.list: one block per multiprocessor,
// each row's h in a.h (one f-vector per block). Like the LIST kernels
// before it, it may start early: in most calls all three find no row.
func (a gemvArgs) rowFallback(fn *cuda.Function, s *cuda.Stream, first, sms int) error {
	return a.launch(fn, cuda.Dim3{uint32(sms), 1, 1}, cuda.Dim3{256, 1, 1}, 4*a.d, s,
		a.x, a.w, a.up, a.down, a.y, a.list, a.h, int32(a.d), int32(a.f), int32(first))
}

// moveRows launches gather_rows or scatter_rows (dense.cu) for the first R
// rows of the overflow list ovf: rows of d bf16 values from src to dst.
func moveRows(fn *cuda.Function, s *cuda.Stream, src, dst, ovf *cuda.Buffer, R, d int) error {
	return fn.Launch(cuda.Dim3{uint32(R), 1, 1}, cuda.Dim3{64, 1, 1}, 0, s, src, dst, ovf, int32(R), int32(d))
}

// actExact launches act_exact<GATED> (dense.cu): h = relu(g) * u (gated)
// or relu(g) over n values, active as in the exact kernel (> 0 or NaN).
func actExact(fn *cuda.Function, s *cuda.Stream, g, u, h *cuda.Buffer, n int64, sms int) error {
	return fn.Launch(elemGrid(n, sms), cuda.Dim3{256, 1, 1}, 0, s, g, u, h, n)
}

// fbGroup is how many flagged rows the LIST forms of gemv.cu take at a time.
const fbGroup = 4

// gatheredSet are the kernels of the gathered dense pass over flagged rows.
type gatheredSet struct {
	gather, scatter    *cuda.Function
	actGated, actPlain *cuda.Function
}

// gathered returns the kernels of the gathered dense pass.
func (k *kernels) gathered() (*gatheredSet, error) {
	return &k.gath, k.compileDense()
}
