package gpu

import (
	_ "embed"
	"fmt"
	"sync"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
)

// unionSrc holds the union path's kernels.
//
//go:embed union.cu
var unionSrc []byte

// The union path's shapes (union.cu's UA_* and UD_* constants).
const (
	unionMaxRows    = 64 // UA_TOK: the most tokens a call takes
	unionUnits      = 64 // UA_UNITS: units of a union_act block
	unionChunk      = 256
	unionStride     = unionChunk + 8 // UA_LD
	unionHStride    = unionMaxRows + 8
	unionDownCols   = 16 // UD_COLS
	unionStages     = 4  // UD_STAGES
	unionDownStride = 24 // UD_DLD: row stride of a down tile
	// unionStatic bounds the kernels' static shared memory (union_act's
	// per-warp live words and counts and its list of live units).
	unionStatic = 512
)

// unionActShared returns union_act's dynamic shared memory for m tokens
// with the given number of pipeline stages (0 for the non-gated kernel,
// which reads no up rows).
func unionActShared(m, stages int) int {
	xrows := (m + 15) / 16 * 16
	return 2*unionMaxRows*unionUnits + 2*unionUnits*unionHStride + stages*(xrows+unionUnits)*unionStride*2
}

// unionDownShared returns union_down's dynamic shared memory for width f.
func unionDownShared(f int) int {
	return (f+7)/8*8*2 + 8*unionStages*16*(unionDownStride+unionHStride)*2
}

// unionPlan says whether the union path, set to take batches of from to
// unionMaxRows tokens, takes a call of m tokens on an MLP of hidden size d
// and width f, on a device whose blocks may opt in to optin bytes of
// shared memory, with a cuBLAS handle for the gate GEMM or not; and with
// how many pipeline stages union_act runs (3, or 2 where three do not
// fit). reason says why not.
func unionPlan(m, from, d, f int, blas bool, optin int) (stages int, reason string) {
	switch {
	case from < 1:
		return 0, "the union path is off"
	case m < from || m > unionMaxRows:
		return 0, fmt.Sprintf("%d tokens: the union path takes %d to %d", m, from, unionMaxRows)
	case !blas:
		return 0, "no cuBLAS handle for the gate GEMM"
	case d%64 != 0:
		return 0, fmt.Sprintf("hidden size %d is not a multiple of 64", d)
	case f%unionUnits != 0 || f > 1<<16:
		return 0, fmt.Sprintf("width %d is not a multiple of %d up to 65536", f, unionUnits)
	case unionDownShared(f)+unionStatic > optin:
		return 0, fmt.Sprintf("union_down needs %d bytes of shared memory, the device gives %d", unionDownShared(f)+unionStatic, optin)
	}
	for _, s := range []int{3, 2} {
		if unionActShared(unionMaxRows, s)+unionStatic <= optin {
			return s, ""
		}
	}
	return 0, fmt.Sprintf("union_act needs %d bytes of shared memory, the device gives %d", unionActShared(unionMaxRows, 2)+unionStatic, optin)
}

// unionStages returns the pipeline stages of union_act for m tokens, or 0
// when the union path does not take the call (see unionPlan).
func (l *MLP) unionStages(m int) int {
	if l.UnionFrom < 1 {
		return 0
	}
	s, _ := unionPlan(m, l.UnionFrom, l.D, l.F, l.blas != nil, l.dev.Properties().SharedPerBlockOptin)
	return s
}

// unionSet are the union path's kernels (union.cu).
type unionSet struct {
	gated [4]*cuda.Function // union_act, gated, by pipeline stages (2 or 3)
	plain *cuda.Function    // union_act, non-gated (no pipeline)
	down  *cuda.Function
	once  sync.Once
	err   error
}

// unionExprs are union.cu's kernels: union_act gated with 2 and 3 stages,
// non-gated, then union_down.
var unionExprs = []string{"union_act<true, 2>", "union_act<true, 3>", "union_act<false, 2>", "union_down"}

// unionKernels compiles union.cu once and returns its kernels.
func (k *kernels) unionKernels() (*unionSet, error) {
	u := &k.union
	u.once.Do(func() {
		exprs := unionExprs
		fs, err := k.compile("union.cu", unionSrc, exprs)
		if err != nil {
			u.err = err
			return
		}
		u.gated[2], u.gated[3], u.plain, u.down = fs[exprs[0]], fs[exprs[1]], fs[exprs[2]], fs[exprs[3]]
	})
	return u, u.err
}

// sparseUnion queues the union path for m tokens (unionStages(m) > 0): the
// gate GEMM on cuBLASLt into bf16 g, then union_act and union_down
// (union.cu). Only the up and down rows of units active in some token are
// read.
func (l *MLP) sparseUnion(s *cuda.Stream, y, x *cuda.Buffer, m, stages int) error {
	ks, err := l.k.unionKernels()
	if err != nil {
		return err
	}
	ws := &l.ws.sp
	blocks := l.F / unionUnits
	for _, b := range []struct {
		p **cuda.Buffer
		n int
	}{{&ws.ug, 2 * unionMaxRows * l.F}, {&ws.uh, 2 * unionMaxRows * l.F}, {&ws.umask, 8 * blocks}, {&ws.ucnt, 4 * blocks}} {
		if *b.p, err = l.realloc(*b.p, b.n); err != nil {
			return err
		}
	}
	if err := l.blas.Matmul(s, cublas.Gemm{M: m, N: l.F, K: l.D, TransB: true}, x, l.sparseIn(), ws.ug); err != nil {
		return fmt.Errorf("gpu: union gate GEMM: %w", err)
	}
	act, shared := ks.gated[stages], unionActShared(m, stages)
	if !l.Gated {
		act, shared = ks.plain, unionActShared(m, 0)
	}
	if err := act.Launch(cuda.Dim3{uint32(blocks), 1, 1}, cuda.Dim3{256, 1, 1}, shared, s,
		ws.ug, x, l.up, l.down, ws.uh, ws.umask, ws.ucnt, int32(m), int32(l.D), int32(l.F)); err != nil {
		return fmt.Errorf("gpu: union_act: %w", err)
	}
	if err := ks.down.LaunchEx(cuda.LaunchConfig{Grid: cuda.Dim3{uint32(l.D / unionDownCols), 1, 1}, Block: cuda.Dim3{256, 1, 1},
		SharedBytes: unionDownShared(l.F), Stream: s, EarlyStart: l.earlyStart()},
		ws.uh, ws.umask, l.down, y, ws.ucnt, l.nnz, int32(m), int32(l.D), int32(l.F)); err != nil {
		return fmt.Errorf("gpu: union_down: %w", err)
	}
	l.counted = m
	return nil
}
