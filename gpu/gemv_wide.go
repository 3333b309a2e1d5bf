package gpu

import (
	_ "embed"
	"fmt"

	"github.com/twell-ai/twell/cuda"
)

// gemvWideSrc holds the sparse MLP for decode steps of 9 to 64 tokens.
//
//go:embed gemv_wide.cu
var gemvWideSrc []byte

// The shapes of gemv_wide.cu (its WIDE_ constants).
const (
	wideMaxRows = 64   // most tokens a call
	wideUnits   = 32   // units a gemv_act_wide CTA takes
	wideStages  = 6    // 64-column steps in flight
	wideTile    = 8192 // bytes of a 64 x 64 bf16 tile (x's, or the gate and up rows')
	wideSplit   = 3    // unit ranges of gemv_down_wide
	wideCols    = 16   // output columns of a gemv_down_wide CTA
)

// wideSet are the kernels of gemv_wide.cu.
type wideSet struct{ act, down *cuda.Function }

// wideKernels compiles gemv_wide.cu once (sm_90a only) and returns its
// kernels.
func (k *kernels) wideKernels() (*wideSet, error) {
	k.wideOnce.Do(func() {
		if a := k.dev.Properties().Arch; a != "sm_90a" {
			k.wideErr = fmt.Errorf("gpu: the wide small-batch kernels need sm_90a (Hopper); %v is %s", k.dev, a)
			return
		}
		fs, err := k.compile("gemv_wide.cu", gemvWideSrc, wideExprs)
		if err != nil {
			k.wideErr = err
			return
		}
		k.wide = wideSet{act: fs[wideExprs[0]], down: fs[wideExprs[1]]}
	})
	return &k.wide, k.wideErr
}

// wideExprs are the kernels of gemv_wide.cu.
var wideExprs = []string{"gemv_act_wide", "gemv_down_wide"}

// wideTakes reports whether the sparse path runs a call of m tokens on the
// wide kernels: Options.Wide set, a gated MLP, more tokens than the
// small-batch kernels take and at most wideMaxRows, on sm_90a.
func (l *MLP) wideTakes(m int) bool {
	return l.Wide && l.Gated && m > gemvMaxRows && m <= wideMaxRows && l.dev.Properties().Arch == "sm_90a"
}

// wideWS is the wide kernels' workspace: h unit-major (F x 64 fp32), a
// token mask a unit (F uint64), a record a unit (F uint32 and F x 4 fp32),
// the activity words and counts (F/32 each), the unit ranges' partial sums
// (wideSplit x 64 x D fp32) and a counter a column block (back at zero
// after each call).
type wideWS struct {
	ht, tm, meta, rh, mask, cnt, part, done *cuda.Buffer
}

// wideActBytes is the activation memory of the wide kernels.
func (l *MLP) wideActBytes() int64 {
	return int64(4*wideMaxRows*l.F + 8*l.F + 4*l.F + 16*l.F + 2*4*(l.F/32) + 4*wideSplit*wideMaxRows*l.D + 4*(l.D/wideCols))
}

// widePrepare returns the wide kernels, compiling them on first use, and
// the workspace grown to hold their buffers (the counters zeroed when new).
func (l *MLP) widePrepare(s *cuda.Stream) (*wideSet, *wideWS, error) {
	ks, err := l.k.wideKernels()
	if err != nil {
		return nil, nil, err
	}
	ws := &l.ws.sp.wide
	for _, b := range []struct {
		p **cuda.Buffer
		n int
	}{{&ws.ht, 4 * wideMaxRows * l.F}, {&ws.tm, 8 * l.F}, {&ws.meta, 4 * l.F}, {&ws.rh, 16 * l.F},
		{&ws.mask, 4 * (l.F / 32)}, {&ws.cnt, 4 * (l.F / 32)},
		{&ws.part, 4 * wideSplit * wideMaxRows * l.D}} {
		if *b.p, err = l.realloc(*b.p, b.n); err != nil {
			return nil, nil, err
		}
	}
	old := ws.done
	if ws.done, err = l.realloc(ws.done, 4*(l.D/wideCols)); err != nil {
		return nil, nil, err
	}
	if ws.done != old {
		if err := l.dev.Memset8(ws.done, 0, s); err != nil {
			return nil, nil, err
		}
	}
	if l.tmG == nil {
		enc := func(w *cuda.Buffer) (*cuda.TensorMap, error) {
			return l.dev.EncodeTiled(cuda.TiledTensor{
				DataType: cuda.TensorBFloat16, Global: w.Ptr(),
				Dims: []uint64{uint64(l.D), uint64(l.F)}, Strides: []uint64{uint64(2 * l.D)},
				Box: []uint32{64, wideUnits}, Swizzle: cuda.Swizzle128B, L2Promotion: cuda.L2Promotion256B,
			})
		}
		if l.tmG, err = enc(l.sparseIn()); err != nil {
			return nil, nil, err
		}
		if l.tmU, err = enc(l.up); err != nil {
			return nil, nil, err
		}
	}
	return ks, ws, nil
}

// sparseWide queues the wide sparse MLP of m tokens (wideTakes(m)): x's
// TMA map (kept while x and m stay), gemv_act_wide, then gemv_down_wide.
func (l *MLP) sparseWide(s *cuda.Stream, y, x *cuda.Buffer, m int) error {
	ks, ws, err := l.widePrepare(s)
	if err != nil {
		return err
	}
	if l.tmWX == nil || l.tmWXp != x.Ptr() || l.tmWXm != m {
		tm, err := l.dev.EncodeTiled(cuda.TiledTensor{
			DataType: cuda.TensorBFloat16, Global: x.Ptr(),
			Dims: []uint64{uint64(l.D), uint64(m)}, Strides: []uint64{uint64(2 * l.D)},
			Box: []uint32{64, wideMaxRows}, Swizzle: cuda.Swizzle128B, L2Promotion: cuda.L2Promotion256B,
		})
		if err != nil {
			return err
		}
		l.tmWX, l.tmWXp, l.tmWXm = tm, x.Ptr(), m
	}
	early := l.earlyStart()
	act := cuda.LaunchConfig{Grid: cuda.Dim3{uint32(l.F / wideUnits), 1, 1}, Block: cuda.Dim3{128, 1, 1},
		SharedBytes: 2*wideStages*wideTile + 1024, Stream: s, EarlyStart: early}
	if err := ks.act.LaunchEx(act, l.tmWX, l.tmG, l.tmU, l.down, ws.ht, ws.tm, ws.meta, ws.rh, ws.mask, ws.cnt,
		int32(m), int32(l.D)); err != nil {
		return fmt.Errorf("gpu: gemv_act_wide: %w", err)
	}
	words := l.F / 32
	down := cuda.LaunchConfig{Grid: cuda.Dim3{uint32(l.D / wideCols), wideSplit, 1}, Block: cuda.Dim3{256, 1, 1},
		SharedBytes: 4*16*wideMaxRows*wideCols + 4*32*((words+wideSplit-1)/wideSplit+1), Stream: s, EarlyStart: early}
	if err := ks.down.LaunchEx(down, ws.ht, ws.tm, ws.meta, ws.rh, ws.mask, l.down, ws.part, ws.done, y, ws.cnt, l.nnz,
		int32(m), int32(l.D), int32(l.F)); err != nil {
		return fmt.Errorf("gpu: gemv_down_wide: %w", err)
	}
	l.counted = m
	return nil
}
