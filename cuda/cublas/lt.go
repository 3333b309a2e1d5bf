package cublas

import (
	"fmt"
	"unsafe"

	"github.com/twell-ai/twell/cuda"
)

// cuBLASLt attribute numbers.
const (
	descTransA       = 3 // CUBLASLT_MATMUL_DESC_TRANSA, int32
	descTransB       = 4 // CUBLASLT_MATMUL_DESC_TRANSB, int32
	layoutBatchCount = 5 // CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, int32
	layoutBatchOff   = 6 // CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, int64
	prefMaxWorkspace = 1 // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64
	prefMinAlignA    = 5 // CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, uint32 (B, C, D follow)
	computeType32F   = 68
	scaleType32F     = 0
)

// heuristicResult mirrors cublasLtMatmulHeuristicResult_t (96 bytes).
type heuristicResult struct {
	algo      [64]byte // cublasLtMatmulAlgo_t
	workspace uint64
	state     int32
	waves     float32
	_         [4]int32
}

// planKey is everything that decides the algorithm: the problem and the
// alignment of each pointer (cuBLASLt's kernels assume the alignment they
// were chosen for).
type planKey struct {
	g                  Gemm
	alignA, alignB, aC uint32
}

// plan is a chosen algorithm with its descriptors, reused for every call
// with the same key.
type plan struct {
	desc, la, lb, lc uintptr
	algo             [64]byte
	workspace        uint64
}

func (p *plan) destroy(l *ltLib) {
	if p.desc != 0 {
		l.descDestroy(p.desc)
	}
	for _, x := range []uintptr{p.la, p.lb, p.lc} {
		if x != 0 {
			l.layoutDestroy(x)
		}
	}
}

// alignment returns the largest power of two (≤ 256) dividing p.
func alignment(p cuda.DevicePtr) uint32 {
	a := uint32(256)
	for a > 1 && uint64(p)%uint64(a) != 0 {
		a /= 2
	}
	return a
}

// matmulLt runs D = op(A)·op(B) (+ Beta·C) with cuBLASLt; d may be c.
func (h *Handle) matmulLt(s *cuda.Stream, g Gemm, a, b, c, d *cuda.Buffer) error {
	key := planKey{g: g, alignA: alignment(b.Ptr()), alignB: alignment(a.Ptr()), aC: min(alignment(c.Ptr()), alignment(d.Ptr()))}
	key.g.Alpha, key.g.Beta, key.g.Backend = 0, 0, 0
	h.mu.Lock()
	p, ok := h.plans[key]
	h.mu.Unlock()
	if !ok {
		var err error
		if p, err = h.choosePlan(s, g, key, a, b, c, d); err != nil {
			return err
		}
		h.mu.Lock()
		if old, ok := h.plans[key]; ok { // another goroutine won the race
			h.dev.Do(func() error { p.destroy(h.lt); return nil })
			p = old
		} else {
			h.plans[key] = p
		}
		h.mu.Unlock()
	}
	return h.dev.Do(func() error { return h.runLt(s, g, p, &p.algo, p.workspace, a, b, c, d) })
}

// runLt queues one cuBLASLt product with plan p's descriptors and the
// algorithm algo (needing ws bytes of workspace); called with the context
// current. algo points into a plan or a heuristic result, so that a call
// allocates nothing for it.
func (h *Handle) runLt(s *cuda.Stream, g Gemm, p *plan, algo *[64]byte, ws uint64, a, b, c, d *cuda.Buffer) error {
	alpha, beta := g.Alpha, g.Beta
	wsPtr := uintptr(0)
	if ws > 0 {
		wsPtr = uintptr(h.workspace.Ptr())
	}
	r := callGemm(h.lt.pMatmul, h.ltH, p.desc,
		uintptr(unsafe.Pointer(&alpha)), uintptr(b.Ptr()), p.la, uintptr(a.Ptr()), p.lb,
		uintptr(unsafe.Pointer(&beta)), uintptr(c.Ptr()), p.lc, uintptr(d.Ptr()), p.lc,
		uintptr(unsafe.Pointer(&algo[0])), wsPtr, uintptr(ws), s.Handle())
	if r == 0 { // no error message to build on the hot path
		return nil
	}
	return status(r, "cublasLtMatmul("+g.describe()+")")
}

// newPlan builds the descriptors and asks the heuristic for its
// algorithms, best first by its own ranking: up to maxCandidates that this
// handle's workspace can run, at least one. Called with the context
// current; the plan's algo is the heuristic's first choice.
func (h *Handle) newPlan(g Gemm, key planKey) (*plan, []heuristicResult, error) {
	l := h.lt
	cm := g.colMajor()
	// Every error return hands back a nil plan: the deferred destroy works
	// on p, which the returns leave alone.
	p, built := &plan{}, false
	defer func() {
		if !built {
			p.destroy(l)
		}
	}()
	op := "cublasLt plan " + g.describe()
	set := func(f func(uintptr, int32, unsafe.Pointer, uint64) int32, obj uintptr, attr int32, v unsafe.Pointer, size uint64, what string) error {
		return status(f(obj, attr, v, size), fmt.Sprintf("%s: set %s", op, what))
	}
	if err := status(l.descCreate(&p.desc, computeType32F, scaleType32F), op+": cublasLtMatmulDescCreate"); err != nil {
		return nil, nil, err
	}
	ta, tb := cm.transA, cm.transB
	if err := set(l.descSet, p.desc, descTransA, unsafe.Pointer(&ta), 4, "TRANSA"); err != nil {
		return nil, nil, err
	}
	if err := set(l.descSet, p.desc, descTransB, unsafe.Pointer(&tb), 4, "TRANSB"); err != nil {
		return nil, nil, err
	}
	layout := func(dst *uintptr, typ int32, rows, cols, ld int, stride int64, name string) error {
		if err := status(l.layoutCreate(dst, typ, uint64(rows), uint64(cols), int64(ld)), op+": layout "+name); err != nil {
			return err
		}
		if g.Batch > 1 {
			n := int32(g.Batch)
			if err := set(l.layoutSet, *dst, layoutBatchCount, unsafe.Pointer(&n), 4, name+" batch count"); err != nil {
				return err
			}
			if err := set(l.layoutSet, *dst, layoutBatchOff, unsafe.Pointer(&stride), 8, name+" batch stride"); err != nil {
				return err
			}
		}
		return nil
	}
	if err := layout(&p.la, cm.aType, cm.aRows, cm.aCols, cm.lda, cm.strideA, "B"); err != nil {
		return nil, nil, err
	}
	if err := layout(&p.lb, cm.bType, cm.bRows, cm.bCols, cm.ldb, cm.strideB, "A"); err != nil {
		return nil, nil, err
	}
	if err := layout(&p.lc, cm.cTyp, cm.cRows, cm.cCols, cm.ldc, cm.strideC, "C"); err != nil {
		return nil, nil, err
	}
	var pref uintptr
	if err := status(l.prefCreate(&pref), op+": preference"); err != nil {
		return nil, nil, err
	}
	defer l.prefDestroy(pref)
	ws := uint64(h.workspace.Len())
	if err := set(l.prefSet, pref, prefMaxWorkspace, unsafe.Pointer(&ws), 8, "max workspace"); err != nil {
		return nil, nil, err
	}
	aligns := [4]uint32{key.alignA, key.alignB, key.aC, key.aC}
	for i := range aligns {
		if err := set(l.prefSet, pref, prefMinAlignA+int32(i), unsafe.Pointer(&aligns[i]), 4, "alignment"); err != nil {
			return nil, nil, err
		}
	}
	var results [maxCandidates]heuristicResult
	var count int32
	if err := status(l.heuristic(h.ltH, p.desc, p.la, p.lb, p.lc, p.lc, pref, int32(len(results)), unsafe.Pointer(&results[0]), &count),
		"cublasLtMatmulAlgoGetHeuristic("+g.describe()+")"); err != nil {
		return nil, nil, err
	}
	var cands []heuristicResult
	for _, r := range results[:count] {
		if r.state == 0 && r.workspace <= ws {
			cands = append(cands, r)
		}
	}
	if len(cands) == 0 {
		return nil, nil, &Error{Op: "cublasLtMatmulAlgoGetHeuristic(" + g.describe() + "): no algorithm", Status: 15, Name: "CUBLAS_STATUS_NOT_SUPPORTED"}
	}
	p.algo, p.workspace = cands[0].algo, cands[0].workspace
	built = true
	return p, cands, nil
}
