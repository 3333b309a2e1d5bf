package gpu

import (
	_ "embed"
	"fmt"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/internal/enum"
)

// t2dSrc holds the tail kernels (t2d, t2u, t2d_ws, the len_* sort) and
// row_fallback.
//
//go:embed t2d.cu
var t2dSrc []byte

// Tail selects the kernels of the sparse path after D2T.
type Tail int

// Tails.
const (
	// TailAuto runs TailSorted when the batch has enough active pairs to
	// amortize loading the down projection into shared memory, TailWarp
	// otherwise.
	TailAuto Tail = iota
	// TailWarp is the gated T2D (or T2D) with one warp per token, which
	// reads each active unit's up and down rows from L2.
	TailWarp
	// TailSorted is t2u (up projection per token, writing a compact list
	// and counting its length), a counting sort of the tokens by list
	// length (longest first; len_scatter), then t2d_ws (weight-stationary
	// down projection: each block keeps W columns of every down row in
	// shared memory), so that the tokens a warp takes in one round have
	// lists of about the same length. (1.66 ms against 1.81 without the sort, same results bit
	// for bit, at m = 65536, 0.5%, on an H200.)
	TailSorted
)

// String returns "auto", "warp" or "sorted".
func (t Tail) String() string { return enum.String(t, "Tail", "auto", "warp", "sorted") }

// TailFor returns the tail kernels the sparse path runs for m tokens now
// (TailSorted or TailWarp).
func (l *MLP) TailFor(m int) Tail {
	if l.splitWidth() == 0 || !l.useSplit(m) {
		return TailWarp
	}
	return TailSorted
}

// KernelsFor names the kernels the sparse path runs for m tokens now:
// "small-batch" (gemv.cu), or after D2T the tail TailFor(m) picks ("sorted"
// or "warp"), with "+hot" when the hot units run densely (hot.go).
func (l *MLP) KernelsFor(m int) string {
	if m <= gemvMaxRows {
		return "small-batch"
	}
	if l.hotK > 0 {
		return l.TailFor(m).String() + "+hot"
	}
	return l.TailFor(m).String()
}

// lenBins is the number of list-length bins of the TailSorted order
// (LEN_BINS in t2d.cu).
const lenBins = 1024

// lengthOrder queues len_scatter, which orders the a.m tokens by the length
// of their compact lists (a.cnt, written by t2u, which also counts them
// into the bins a.lenBins) into a.order; a.lenCur must be zero.
func (l *MLP) lengthOrder(s *cuda.Stream, set *t2dSet, a tailArgs) error {
	blocks := cuda.Dim3{uint32(min((a.m+255)/256, 4*l.dev.Properties().SMs)), 1, 1}
	if err := a.launch(set.lenScatter, blocks, cuda.Dim3{256, 1, 1}, 0, s, a.cnt, int32(a.m), a.lenBins, a.lenCur, a.order); err != nil {
		return fmt.Errorf("gpu: len_scatter: %w", err)
	}
	return nil
}

// splitWidth returns the columns per block of the weight-stationary down
// kernel (16 or 8, so that F rows of them fit in shared memory), or 0 when
// they do not fit.
func (l *MLP) splitWidth() int {
	limit := l.dev.Properties().SharedPerBlockOptin
	for _, w := range []int{16, 8} {
		if l.F*w*2 <= limit {
			return w
		}
	}
	return 0
}

// useSplit reports whether the split tail should run for m tokens: when
// the batch's active pairs outnumber the down rows each block loads (the
// mean active units per token is the last measured, or 1).
func (l *MLP) useSplit(m int) bool {
	switch l.Tail {
	case TailWarp:
		return false
	case TailSorted:
		return true
	}
	a := 1.0
	if l.lastKnown {
		a = max(a, l.lastNNZ)
	}
	return float64(m)*a >= 4*float64(l.F)
}

type t2dSet struct {
	gated, plain       *cuda.Function // one warp per token (TailWarp)
	t2uGated, t2uPlain *cuda.Function // TailSorted: up projection and compaction
	ws16, ws8          *cuda.Function // TailSorted: weight-stationary down projection
	lenScatter         *cuda.Function // TailSorted's order of the tokens by list length
	fbGated, fbPlain   *cuda.Function
	err                error
}

// t2dExprs are the kernels of t2d.cu, in the order t2dFor reads them.
var t2dExprs = []string{"t2d<true>", "t2d<false>", "row_fallback<true>", "row_fallback<false>",
	"t2u<true>", "t2u<false>", "t2d_ws<16>", "t2d_ws<8>", "len_scatter"}

// t2dFor returns the T2D and fallback kernels for hidden size d.
func (k *kernels) t2dFor(d int) (*t2dSet, error) {
	nch := (d + 255) / 256
	k.t2dMu.Lock()
	defer k.t2dMu.Unlock()
	if set, ok := k.t2d[nch]; ok {
		return set, set.err
	}
	exprs := t2dExprs
	set := &t2dSet{}
	fs, err := k.compile("t2d.cu", t2dSrc, exprs, cuda.WithOptions(fmt.Sprintf("-DTW_NCH=%d", nch)))
	if err != nil {
		set.err = err
	} else {
		set.gated, set.plain, set.fbGated, set.fbPlain = fs[exprs[0]], fs[exprs[1]], fs[exprs[2]], fs[exprs[3]]
		set.t2uGated, set.t2uPlain = fs[exprs[4]], fs[exprs[5]]
		set.ws16, set.ws8 = fs[exprs[6]], fs[exprs[7]]
		set.lenScatter = fs[exprs[8]]
	}
	k.t2d[nch] = set
	return set, set.err
}

// tailArgs are the operands of the tail kernels (t2d.cu) for one call of m
// tokens: x and y m x d bf16, the packed gate (rowWords words a row, S per
// tile) and its row flags from D2T, the up and down weights (f x d bf16),
// and TailSorted's list lengths, token order, length bins and the bins'
// fill counts. early launches TailSorted's kernels with early start (they
// wait with grid_wait).
type tailArgs struct {
	x, y, packed, flags, up, down *cuda.Buffer
	cnt, order, lenBins, lenCur   *cuda.Buffer
	m, d, f, s, rowWords          int
	early                         bool
}

// launch queues fn with a's early-start choice.
func (a tailArgs) launch(fn *cuda.Function, grid, block cuda.Dim3, shared int, s *cuda.Stream, args ...any) error {
	return fn.LaunchEx(cuda.LaunchConfig{Grid: grid, Block: block, SharedBytes: shared, Stream: s, EarlyStart: a.early}, args...)
}

// warpGrid is the grid of the one-warp-per-token kernels t2d and t2u: 8
// warps (tokens) per 256-thread block.
func (a tailArgs) warpGrid() cuda.Dim3 { return cuda.Dim3{uint32((a.m + 7) / 8), 1, 1} }

// t2d launches t2d<GATED>: the whole tail, one warp per token.
func (a tailArgs) t2d(fn *cuda.Function, s *cuda.Stream) error {
	return fn.Launch(a.warpGrid(), cuda.Dim3{256, 1, 1}, 0, s, a.x, a.packed, a.up, a.down, a.y, a.flags,
		int32(a.m), int32(a.d), int32(a.s), int32(a.f/256), int32(a.rowWords))
}

// t2u launches t2u<GATED>: the up projection per token, rewriting each
// packed row as a compact list of cnt[r] words; it also counts the lists'
// lengths into the sort's bins.
func (a tailArgs) t2u(fn *cuda.Function, s *cuda.Stream) error {
	return a.launch(fn, a.warpGrid(), cuda.Dim3{256, 1, 1}, 0, s, a.x, a.packed, a.up, a.cnt, a.flags,
		int32(a.m), int32(a.d), int32(a.s), int32(a.f/256), int32(a.rowWords), a.lenBins)
}

// t2dWS launches t2d_ws<w>, the weight-stationary down projection: d/w
// column slices, each spread over enough blocks to fill the sms
// multiprocessors; each block holds w columns of all f down rows in
// shared memory.
func (a tailArgs) t2dWS(fn *cuda.Function, s *cuda.Stream, w, sms int) error {
	slices := a.d / w
	split := max(1, sms/slices)
	per := (a.m + split - 1) / split
	return a.launch(fn, cuda.Dim3{uint32(slices), uint32(split), 1}, cuda.Dim3{1024, 1, 1}, a.f*w*2, s,
		a.packed, a.cnt, a.order, a.down, a.y, int32(a.m), int32(a.d), int32(a.f), int32(a.rowWords), int32(per))
}

// tail queues the sparse kernels after D2T for m tokens over the first
// cols units, the ones D2T packed (see TailFor).
func (l *MLP) tail(s *cuda.Stream, set *t2dSet, y, x *cuda.Buffer, ws *sparseWS, m, cols int) error {
	a := tailArgs{x: x, y: y, packed: ws.packed, flags: ws.flags, up: l.up, down: l.down,
		cnt: ws.cnt, order: ws.order, lenBins: ws.lenBins, lenCur: ws.lenCur, m: m, d: l.D, f: cols, s: l.Layout.S(), rowWords: l.F / l.Layout.C,
		early: l.earlyStart()}
	if l.TailFor(m) != TailSorted {
		t2d := set.plain
		if l.Gated {
			t2d = set.gated
		}
		if err := a.t2d(t2d, s); err != nil {
			return fmt.Errorf("gpu: T2D: %w", err)
		}
		return nil
	}
	t2u := set.t2uPlain
	if l.Gated {
		t2u = set.t2uGated
	}
	if err := a.t2u(t2u, s); err != nil {
		return fmt.Errorf("gpu: t2u: %w", err)
	}
	if err := l.lengthOrder(s, set, a); err != nil {
		return err
	}
	w := l.splitWidth()
	fn := set.ws16
	if w == 8 {
		fn = set.ws8
	}
	if err := a.t2dWS(fn, s, w, l.dev.Properties().SMs); err != nil {
		return fmt.Errorf("gpu: t2d_ws: %w", err)
	}
	return nil
}
