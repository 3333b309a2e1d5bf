package gpu

import (
	_ "embed"
	"errors"
	"fmt"
	"sync"

	"github.com/twell-ai/twell/cuda"
)

// gemvSrc holds the small-batch sparse MLP and its LIST forms.
//
//go:embed gemv.cu
var gemvSrc []byte

// NormedInput is the input of QueueNormed: one token's residual stream
// (Resid, fp32 [D]), the delta added to it (Delta, bf16 [D]; nil: none),
// the buffer that receives their sum (ResidOut, fp32 [D], not Resid: the
// kernel's other blocks still read Resid while one writes it), and the
// RMSNorm's weights (fp32 [D]) and epsilon.
type NormedInput struct {
	Resid, Delta, ResidOut, Weight *cuda.Buffer
	Eps                            float32
}

// NormFuses reports whether QueueNormed takes an MLP of hidden size d:
// d a multiple of 4, at most 4096 (16 values a thread of a 256-thread
// block, the register-resident RMSNorm of common.cuh).
func NormFuses(d int) bool { return d%4 == 0 && d <= 4096 }

// checkNormed checks the buffers of in for QueueNormed: all there, the
// residual sum not written over its input, and each large enough for one
// token.
func (l *MLP) checkNormed(in NormedInput) error {
	need := 4 * l.D
	switch {
	case in.Resid == nil || in.ResidOut == nil || in.Weight == nil:
		return errors.New("gpu: QueueNormed needs the residual stream, its output buffer and the norm weights")
	case in.Resid == in.ResidOut:
		return errors.New("gpu: QueueNormed writes the residual sum to the buffer it reads")
	case in.Resid.Len() < need || in.ResidOut.Len() < need || in.Weight.Len() < need ||
		(in.Delta != nil && in.Delta.Len() < 2*l.D):
		return fmt.Errorf("gpu: QueueNormed buffers hold fewer than %d values", l.D)
	}
	return nil
}

// QueueNormed queues the sparse MLP of one token whose input is the
// RMSNorm of in.Resid + in.Delta, with the norm fused into the MLP's
// kernel (gemv_mlp, or gemv_act_norm before gemv_down where gemv_mlp does
// not run: see fusedKernel): every block norms the token itself, bit
// for bit as gpu/llm's add_rmsnorm does, and one block writes the sum to
// in.ResidOut. It saves a decode step the norm kernel. Like Queue, it
// keeps no bookkeeping (the form to record into a CUDA graph); y may be
// in.Delta (it is written after every read of it).
func (l *MLP) QueueNormed(s *cuda.Stream, y *cuda.Buffer, in NormedInput) error {
	if !NormFuses(l.D) {
		return fmt.Errorf("gpu: QueueNormed takes hidden sizes that are multiples of 4 up to 4096, not %d", l.D)
	}
	if err := l.checkNormed(in); err != nil {
		return err
	}
	if y == nil || y.Len() < 2*l.D {
		return fmt.Errorf("gpu: MLP output %v holds fewer than %d bytes (1 token x %d bf16)", y, 2*l.D, l.D)
	}
	if l.up == nil {
		return errors.New("gpu: MLP was closed")
	}
	ks, ws, err := l.gemvPrepare(s)
	if err != nil {
		return err
	}
	l.pollFlagged()
	a := l.smallArgs(ws, nil, y, 1)
	if ok, err := l.queueFused(s, ks, a, ws.gbar, in, true); ok || err != nil {
		return err
	}
	act := ks.actNormPlain
	if l.Gated {
		act = ks.actNormGated
	}
	if err := a.launch(act, cuda.Dim3{uint32(l.F / 32), 1, 1}, cuda.Dim3{256, 1, 1}, 2*l.D, s,
		in.Resid, optional(in.Delta), in.ResidOut, in.Weight, in.Eps, a.w, a.up, a.h, a.mask, a.cnt, int32(l.D), int32(l.F)); err != nil {
		return fmt.Errorf("gpu: gemv_act_norm: %w", err)
	}
	if err := a.launchDown(ks.down[1], s); err != nil {
		return fmt.Errorf("gpu: gemv_down: %w", err)
	}
	l.counted = 1
	return nil
}

// smallArgs returns the operands of the small-batch kernels for m tokens
// of x (nil for the normed form) into y, in the workspace ws of
// gemvPrepare: per-block counts of 32 units (gemv_act's).
func (l *MLP) smallArgs(ws *sparseWS, x, y *cuda.Buffer, m int) gemvArgs {
	return gemvArgs{x: x, w: l.sparseIn(), up: l.up, down: l.down, y: y, h: ws.gh, mask: ws.gmask, cnt: ws.gcnt, nnz: l.nnz,
		m: m, d: l.D, f: l.F, ncnt: l.F / 32, early: l.earlyStart()}
}

// gemvPrepare returns the small-batch kernels, compiling them on first
// use, and the workspace grown to hold their h, mask and counts, and
// gemv_mlp's barrier counter (zeroed on s when new).
func (l *MLP) gemvPrepare(s *cuda.Stream) (*gemvSet, *sparseWS, error) {
	ks, err := l.k.gemvKernels(l.GEMVTimeline)
	if err != nil {
		return nil, nil, err
	}
	ws := &l.ws.sp
	words := l.F / 32
	for _, b := range []struct {
		p **cuda.Buffer
		n int
	}{{&ws.gh, 4 * gemvMaxRows * l.F}, {&ws.gmask, 4 * words}, {&ws.gcnt, 4 * l.F / 16}} {
		if *b.p, err = l.realloc(*b.p, b.n); err != nil {
			return nil, nil, err
		}
	}
	if ws.gbar == nil { // grid_sync's counter starts at zero, and stays valid
		if ws.gbar, err = l.realloc(nil, 8); err != nil {
			return nil, nil, err
		}
		if err := l.dev.Memset8(ws.gbar, 0, s); err != nil {
			return nil, nil, err
		}
	}
	return ks, ws, nil
}

// fusedKernel returns the gemv_mlp kernel of instance key for a's call of one
// token, or nil where the two kernels run instead: split by the options,
// no cooperative launches on the device, or not all of its blocks resident
// at once (grid_sync needs them all). The occupancy is asked once per
// kernel.
func (l *MLP) fusedKernel(ks *gemvSet, a gemvArgs, key mlpKey) (*cuda.Function, error) {
	fn := ks.mlp[key]
	if l.SplitGEMV || fn == nil || !l.dev.Properties().CooperativeLaunch {
		return nil, nil
	}
	ok, known := l.fits[key]
	if !known {
		per, err := fn.MaxActiveBlocksPerSM(256, a.mlpShared())
		if err != nil {
			return nil, fmt.Errorf("gpu: gemv_mlp occupancy: %w", err)
		}
		if l.fits == nil {
			l.fits = map[mlpKey]bool{}
		}
		ok = per*l.dev.Properties().SMs >= l.F/32
		l.fits[key] = ok
	}
	if !ok {
		return nil, nil
	}
	return fn, nil
}

// queueFused queues gemv_mlp for a's one token (normed or not) on s and
// reports whether it did; if not, the caller runs the two kernels. A launch
// that the driver refuses as too large for a cooperative grid (fewer SMs
// than the occupancy said, as under MPS) is not an error: the kernel is
// marked as not fitting.
func (l *MLP) queueFused(s *cuda.Stream, ks *gemvSet, a gemvArgs, bar *cuda.Buffer, in NormedInput, normed bool) (bool, error) {
	key := mlpKey{l.Gated, normed}
	fn, err := l.fusedKernel(ks, a, key)
	if fn == nil || err != nil {
		return false, err
	}
	err = a.launchMLP(fn, s, bar, in)
	switch {
	case errors.Is(err, cuda.ErrorCooperativeLaunchTooLarge):
		l.fits[key] = false
		return false, nil
	case err != nil:
		return false, fmt.Errorf("gpu: gemv_mlp: %w", err)
	}
	l.counted = 1
	return true, nil
}

// sparseGEMV queues the small-batch sparse MLP (m <= gemvMaxRows).
func (l *MLP) sparseGEMV(s *cuda.Stream, y, x *cuda.Buffer, m int) error {
	ks, ws, err := l.gemvPrepare(s)
	if err != nil {
		return err
	}
	mb := gemvRows[len(gemvRows)-1]
	for _, r := range gemvRows {
		if m <= r {
			mb = r
			break
		}
	}
	a := l.smallArgs(ws, x, y, m)
	if m == 1 {
		if ok, err := l.queueFused(s, ks, a, ws.gbar, NormedInput{}, false); ok || err != nil {
			return err
		}
	}
	act := ks.actPlain[mb] // nil past gemvFMARows: gemv_act_mma below
	if l.Gated {
		act = ks.actGated[mb]
	}
	launch := a.launchAct
	if m > gemvFMARows {
		a.ncnt = l.F / 16
		act, launch = ks.actMMAPlain, a.launchActMMA
		if l.Gated {
			act = ks.actMMAGated
		}
	}
	if err := launch(act, s); err != nil {
		return fmt.Errorf("gpu: gemv_act: %w", err)
	}
	if err := a.launchDown(ks.down[mb], s); err != nil {
		return fmt.Errorf("gpu: gemv_down: %w", err)
	}
	l.counted = m
	return nil
}

// gemvSet are the kernels of the small-batch sparse MLP (gemv.cu), by
// rows per call (the template's MB: 1, 2 or 4 for act, gated or not, and
// 1, 2, 4 or 8 for down).
type gemvSet struct {
	actGated, actPlain, down map[int]*cuda.Function
	// The LIST forms (MB = 4), which recompute the rows D2T flagged.
	fbActGated, fbActPlain, fbDown *cuda.Function
	// gemv_act_mma, gated and not: act on tensor cores, for more than
	// gemvFMARows tokens.
	actMMAGated, actMMAPlain *cuda.Function
	// gemv_act_norm, gated and not: one token, with the residual add and
	// RMSNorm before the MLP fused in (QueueNormed).
	actNormGated, actNormPlain *cuda.Function
	// gemv_mlp, act and down of one token in one kernel.
	mlp map[mlpKey]*cuda.Function
}

// mlpKey picks a gemv_mlp instance: gated or not, normed or not.
type mlpKey struct{ gated, normed bool }

// gemvFMARows is the largest batch whose act kernel is gemv_act (FMAs);
// larger batches run gemv_act_mma.
const gemvFMARows = 4

// gemvRows are the batch sizes gemv.cu is instantiated for; a call of m
// tokens uses the smallest that holds m.
var gemvRows = []int{1, 2, 4, 8}

// gemvMaxRows is the largest batch the small-batch sparse MLP takes.
const gemvMaxRows = 8

// gemvExprs lists the kernels of gemv.cu: per batch size of gemvRows the
// gated and the plain act (up to gemvFMARows) and down, the same three LIST
// forms, then gated and plain gemv_act_mma and gemv_act_norm, and the four
// gemv_mlp (gated or not, normed or not).
func gemvExprs() []string {
	var exprs []string
	for _, mb := range gemvRows {
		if mb <= gemvFMARows {
			exprs = append(exprs, fmt.Sprintf("gemv_act<%d,true,false>", mb), fmt.Sprintf("gemv_act<%d,false,false>", mb))
		}
		exprs = append(exprs, fmt.Sprintf("gemv_down<%d,false>", mb))
	}
	exprs = append(exprs, fmt.Sprintf("gemv_act<%d,true,true>", fbGroup), fmt.Sprintf("gemv_act<%d,false,true>", fbGroup),
		fmt.Sprintf("gemv_down<%d,true>", fbGroup), "gemv_act_mma<true>", "gemv_act_mma<false>",
		"gemv_act_norm<true>", "gemv_act_norm<false>")
	return append(exprs, mlpExpr(true, false), mlpExpr(false, false), mlpExpr(true, true), mlpExpr(false, true))
}

// mlpExpr names gemv_mlp's instance, gated or not, normed or not.
func mlpExpr(gated, norm bool) string { return fmt.Sprintf("gemv_mlp<%v,%v>", gated, norm) }

// gemvBuild is one build of gemv.cu, compiled on first use: its kernels
// and, for the GEMV_TIMELINE build, its stamps (the module's
// gemv_timeline, read by MLP.GEMVStamps).
type gemvBuild struct {
	once   sync.Once
	set    gemvSet
	stamps *cuda.Buffer
	err    error
}

// gemvKernels compiles gemv.cu once and returns its kernels; with
// timeline, those of its GEMV_TIMELINE build.
func (k *kernels) gemvKernels(timeline bool) (*gemvSet, error) {
	b, opts := &k.gemv, []cuda.CompileOption(nil)
	if timeline {
		b, opts = &k.gemvTL, []cuda.CompileOption{cuda.WithOptions("-DGEMV_TIMELINE")}
	}
	b.once.Do(func() {
		mod, fs, err := k.compileModule("gemv.cu", gemvSrc, gemvExprs(), opts...)
		if err == nil && timeline {
			b.stamps, err = mod.Global("gemv_timeline")
		}
		if err != nil {
			b.err = err
			return
		}
		b.set = newGemvSet(fs)
	})
	return &b.set, b.err
}

// newGemvSet picks gemv.cu's kernels out of its compiled functions fs.
func newGemvSet(fs map[string]*cuda.Function) gemvSet {
	g := gemvSet{actGated: map[int]*cuda.Function{}, actPlain: map[int]*cuda.Function{}, down: map[int]*cuda.Function{}}
	for _, mb := range gemvRows {
		if mb <= gemvFMARows {
			g.actGated[mb] = fs[fmt.Sprintf("gemv_act<%d,true,false>", mb)]
			g.actPlain[mb] = fs[fmt.Sprintf("gemv_act<%d,false,false>", mb)]
		}
		g.down[mb] = fs[fmt.Sprintf("gemv_down<%d,false>", mb)]
	}
	g.fbActGated = fs[fmt.Sprintf("gemv_act<%d,true,true>", fbGroup)]
	g.fbActPlain = fs[fmt.Sprintf("gemv_act<%d,false,true>", fbGroup)]
	g.fbDown = fs[fmt.Sprintf("gemv_down<%d,true>", fbGroup)]
	g.actMMAGated, g.actMMAPlain = fs["gemv_act_mma<true>"], fs["gemv_act_mma<false>"]
	g.actNormGated, g.actNormPlain = fs["gemv_act_norm<true>"], fs["gemv_act_norm<false>"]
	g.mlp = map[mlpKey]*cuda.Function{}
	for _, gated := range []bool{true, false} {
		for _, normed := range []bool{true, false} {
			g.mlp[mlpKey{gated, normed}] = fs[mlpExpr(gated, normed)]
		}
	}
	return g
}

// gemvArgs are the operands of gemv_act and gemv_down (gemv.cu): x (m x d
// bf16), the sparse-input weights w and, gated, up (f x d), down (f x d),
// y (m x d), h (rows x f fp32), the activity mask and the ncnt per-block
// counts of the act kernel, and the active-unit counter. The LIST forms (list set: the
// overflow list) take rows first .. first+cap-1 of it in groups of
// fbGroup, with m = 0 and no cnt or nnz.
type gemvArgs struct {
	x, w, up, down, y *cuda.Buffer
	h, mask, cnt, nnz *cuda.Buffer
	list              *cuda.Buffer
	m, d, f, ncnt     int
	first, cap        int
	// early launches the kernels with early start (they wait with
	// grid_wait), so that their weight loads overlap the kernel before.
	early bool
}

// launch queues fn with a's early-start choice.
func (a gemvArgs) launch(fn *cuda.Function, grid, block cuda.Dim3, shared int, s *cuda.Stream, args ...any) error {
	return fn.LaunchEx(cuda.LaunchConfig{Grid: grid, Block: block, SharedBytes: shared, Stream: s, EarlyStart: a.early}, args...)
}

// rows is how many tokens a block of gemv_act stages in shared memory.
func (a gemvArgs) rows() int {
	if a.list != nil {
		return fbGroup
	}
	return a.m
}

// launchAct launches gemv_act: one block per 32 units.
func (a gemvArgs) launchAct(fn *cuda.Function, s *cuda.Stream) error {
	return a.launch(fn, cuda.Dim3{uint32(a.f / 32), 1, 1}, cuda.Dim3{256, 1, 1}, 2*a.rows()*a.d, s,
		a.x, a.w, a.up, a.h, a.mask, optional(a.cnt), int32(a.m), int32(a.d), int32(a.f),
		optional(a.list), int32(a.first), int32(a.cap))
}

// actCols is the number of columns of a row chunk that gemv_act_mma holds
// in shared memory (gemv.cu's ACT_COLS).
const actCols = 2048

// launchActMMA launches gemv_act_mma: one block per 16 units, holding their
// rows' chunks of min(d, actCols) columns (padded by 8) in shared memory.
func (a gemvArgs) launchActMMA(fn *cuda.Function, s *cuda.Stream) error {
	return a.launch(fn, cuda.Dim3{uint32(a.f / 16), 1, 1}, cuda.Dim3{256, 1, 1}, 2*16*(min(a.d, actCols)+8), s,
		a.x, a.w, a.up, a.down, a.h, a.mask, a.cnt, int32(a.m), int32(a.d), int32(a.f))
}

// mlpShared is gemv_mlp's dynamic shared memory: the larger of the act
// phase's staged tokens and the down phase's lists.
func (a gemvArgs) mlpShared() int {
	return max(2*a.rows()*a.d, downListBytes(a.f))
}

// downListBytes is the shared memory of gemv_down's per-warp lists of
// active units (8 warps, each up to ceil(f/256) mask words of 32 units).
func downListBytes(f int) int { return 8 * ((f/32 + 7) / 8) * 32 * 4 }

// launchMLP launches gemv_mlp (act and down of one token in one kernel,
// F/32 blocks that meet at a grid barrier on bar's counter), normed when
// in holds the residual stream (a.x unused), else on a.x. The launch is
// cooperative, which guarantees that all of its blocks are resident at
// once, also beside other streams' kernels (TestFusedGEMVConcurrentStreams
// runs two at once).
func (a gemvArgs) launchMLP(fn *cuda.Function, s *cuda.Stream, bar *cuda.Buffer, in NormedInput) error {
	return fn.LaunchEx(cuda.LaunchConfig{Grid: cuda.Dim3{uint32(a.f / 32), 1, 1}, Block: cuda.Dim3{256, 1, 1},
		SharedBytes: a.mlpShared(), Stream: s, EarlyStart: a.early, Cooperative: true},
		optional(a.x), optional(in.Resid), optional(in.Delta), optional(in.ResidOut), optional(in.Weight), in.Eps,
		a.w, a.up, a.down, a.h, a.mask, a.cnt, a.y, a.nnz, bar, int32(a.d), int32(a.f))
}

// downCols is the number of output columns of a gemv_down block (gemv.cu's
// DOWN_COLS).
const downCols = 16

// launchDown launches gemv_down: one block per downCols output columns, with
// shared memory for its per-warp lists of active units. Block 0 sums the
// act kernel's ncnt counts (one per 16 units after gemv_act_mma, per 32
// after gemv_act).
func (a gemvArgs) launchDown(fn *cuda.Function, s *cuda.Stream) error {
	return a.launch(fn, cuda.Dim3{uint32(a.d / downCols), 1, 1}, cuda.Dim3{256, 1, 1}, downListBytes(a.f), s,
		a.h, a.mask, a.down, a.y, optional(a.cnt), optional(a.nnz), int32(a.m), int32(a.d), int32(a.f), int32(a.ncnt),
		optional(a.list), int32(a.first), int32(a.cap))
}

// GEMVPoints names the stamps of the GEMV_TIMELINE build, in the order of a
// block's row of GEMVStamps (TL_ENTRY .. TL_END, gemv.cu): the block
// starts, its wait for the kernels before returns, x is staged (normed),
// its first warp's gate sums are done, its h and mask are written, it is
// past gemv_mlp's grid barrier, its down columns are written.
var GEMVPoints = []string{"entry", "waited", "staged", "gate", "act", "synced", "end"}

// tlPoints is TL_POINTS (gemv.cu): a block's words, the stamps and last
// its SM.
const tlPoints = 8

// GEMVStamps returns the GPU's global timer stamps (ns) that the last
// gemv_mlp launch of the GEMV_TIMELINE build left, one row per block of its
// grid (F/32 blocks), in GEMVPoints' order, and the SM each block ran on.
// Call it once that launch has finished (Forward and the MLP's synchronous
// calls return after it). It is an error if l does not run that build
// (GEMVTimeline unset) or no launch left every stamp.
func (l *MLP) GEMVStamps() (stamps [][]uint64, sms []int, err error) {
	if !l.GEMVTimeline {
		return nil, nil, errors.New("gpu: GEMVStamps: the MLP does not run the GEMV_TIMELINE build (Options.GEMVTimeline)")
	}
	if _, err := l.k.gemvKernels(true); err != nil {
		return nil, nil, err
	}
	blocks := l.F / 32
	raw := make([]uint64, blocks*tlPoints)
	src, err := l.k.gemvTL.stamps.Slice(0, 8*len(raw))
	if err == nil {
		err = l.dev.CopyDtoH(cuda.Bytes(raw), src)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("gpu: GEMVStamps: %w", err)
	}
	stamps, sms = make([][]uint64, blocks), make([]int, blocks)
	for b := range stamps {
		row := raw[b*tlPoints : (b+1)*tlPoints]
		stamps[b], sms[b] = row[:len(GEMVPoints)], int(row[tlPoints-1])
		for p, t := range stamps[b] {
			if t == 0 {
				return nil, nil, fmt.Errorf("gpu: GEMVStamps: block %d has no %q stamp: gemv_mlp has not run in this build", b, GEMVPoints[p])
			}
		}
	}
	return stamps, sms, nil
}
