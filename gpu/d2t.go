package gpu

import (
	_ "embed"
	"fmt"
	"slices"
	"sync"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/internal/enum"
	"github.com/twell-ai/twell/twell"
)

// The D2T kernels: mma.sync (any sm_80+ GPU) and wgmma (Hopper).
var (
	//go:embed d2t_mma.cu
	d2tMMASrc []byte
	//go:embed d2t_wgmma.cu
	d2tWGMMASrc []byte
)

// Kernel selects the D2T implementation.
type Kernel int

// D2T kernels.
const (
	// KernelAuto uses KernelWGMMA on Hopper (sm_90a) and KernelMMA
	// elsewhere, or when the wgmma kernel does not compile.
	KernelAuto Kernel = iota
	// KernelWGMMA is the persistent TMA + wgmma kernel whose packing runs
	// in separate packer warps, overlapped with the next tile's mainloop
	// (sm_90a only).
	KernelWGMMA
	// KernelMMA is the simpler mma.sync kernel (any sm_80+ GPU).
	KernelMMA
)

// String returns "auto", "wgmma" or "mma".
func (k Kernel) String() string { return enum.String(k, "Kernel", "auto", "wgmma", "mma") }

// residentClusters returns how many clusters of the persistent wgmma D2T
// kernel fit on the GPU at once (all 66 of an H200; 64, as the reference
// launches, left 4 SMs idle and cost 3%): the static round-robin schedule
// is balanced only if every cluster is resident. Without the occupancy
// query it falls back to 64, which fits whatever the GPCs' SM counts.
func (l *MLP) residentClusters(fn *cuda.Function, cfg cuda.LaunchConfig) int {
	if l.clusters == 0 {
		fallback := max(1, min(64, l.dev.Properties().SMs/2))
		cfg.Grid = cuda.Dim3{uint32(2 * fallback), 1, 1}
		n, err := fn.MaxActiveClusters(cfg)
		if err != nil || n < 1 {
			n = fallback
		}
		l.clusters = n
	}
	return l.clusters
}

// d2tKernel returns the D2T kernel to use and its kind.
func (l *MLP) d2tKernel() (*cuda.Function, Kernel, error) {
	s := l.Layout.S()
	switch l.Kernel {
	case KernelWGMMA:
		f, err := l.k.d2tWGMMA(s)
		return f, KernelWGMMA, err
	case KernelMMA:
		f, err := l.k.d2tMMA(s)
		return f, KernelMMA, err
	}
	// On Hopper the wgmma kernel (2.03-2.28 ms at m = 65536 on an H100),
	// else mma.sync.
	f, err := l.k.d2tWGMMA(s)
	if err == nil {
		return f, KernelWGMMA, nil
	}
	l.wgErr = err
	f, err = l.k.d2tMMA(s)
	return f, KernelMMA, err
}

// D2TKernel returns the D2T kernel this MLP runs, compiling it if needed,
// and, when KernelAuto fell back to mma.sync, why wgmma was not used.
func (l *MLP) D2TKernel() (Kernel, error) {
	_, k, err := l.d2tKernel()
	if err == nil && k == KernelMMA && l.Kernel == KernelAuto {
		return k, l.wgErr
	}
	return k, err
}

// runD2T queues the gate GEMM with ReLU + TwELL packing of the first cols
// units (a multiple of 256: all, or all but the hot ones) into the sparse
// workspace, after zeroing the flags, the overflow count, the sort's bins
// (one memset) and the nnz counter. hot, when not nil, is the dense MLP of
// the units after the first cols (hotSlice): the wgmma kernel then also
// computes their h = relu(gate) up (non-gated relu(up)) into the hot
// workspace's g, unless SeparateHot is set. It reports whether it did (if
// not, hotDense must compute it).
func (l *MLP) runD2T(s *cuda.Stream, x *cuda.Buffer, m, cols int, hot *DenseMLP) (*sparseWS, bool, error) {
	ws, err := l.sparseWorkspace(m)
	if err != nil {
		return nil, false, err
	}
	fn, kind, err := l.d2tKernel()
	if err != nil {
		return nil, false, err
	}
	var hotH *cuda.Buffer
	if hot != nil && l.hotInKernel(kind) {
		if l.ws.hot.g, err = l.realloc(l.ws.hot.g, 2*m*hot.F); err != nil {
			return nil, false, err
		}
		hotH = l.ws.hot.g
	}
	// The flags of the workspace's rows, not only this call's, so that one
	// memset covers them all; D2T's work covers this call's rows only.
	for _, b := range []*cuda.Buffer{ws.clear, l.nnz} {
		if err := l.dev.Memset8(b, 0, s); err != nil {
			return nil, false, err
		}
	}
	l.counted = m
	a := d2tArgs{x: x, w: l.sparseIn(), packed: ws.packed, flags: ws.flags, ovf: ws.ovf, nnz: l.nnz,
		m: m, d: l.D, f: cols, s: l.Layout.S(), rowWords: l.F / l.Layout.C}
	if hotH != nil {
		a.hotH, a.hotUnits, a.hotGated = hotH, l.F-cols, l.Gated
	}
	if kind == KernelWGMMA {
		if l.tmA == nil || l.tmAx != x.Ptr() || l.tmAm != m {
			tm, err := l.dev.EncodeTiled(cuda.TiledTensor{
				DataType: cuda.TensorBFloat16, Global: x.Ptr(),
				Dims: []uint64{uint64(l.D), uint64(m)}, Strides: []uint64{uint64(2 * l.D)},
				Box: []uint32{64, 128}, Swizzle: cuda.Swizzle128B, L2Promotion: cuda.L2Promotion256B,
			})
			if err != nil {
				return nil, false, err
			}
			l.tmA, l.tmAx, l.tmAm = tm, x.Ptr(), m
		}
		err = a.wgmma(fn, s, l.tmA, l.tmB, l.tmU, func(cfg cuda.LaunchConfig) int { return l.residentClusters(fn, cfg) })
	} else {
		err = a.mma(fn, s)
	}
	if err != nil {
		return nil, false, fmt.Errorf("gpu: D2T (%v): %w", kind, err)
	}
	return ws, hotH != nil, nil
}

// QueueD2T queues the D2T kernel alone on stream s (for timing it), as a
// sparse call of m tokens runs it: packing all but the hot units, and on
// the wgmma kernel also computing the hot units' products; the result
// stays in the MLP's workspace. D2T downloads it.
func (l *MLP) QueueD2T(s *cuda.Stream, x *cuda.Buffer, m int) error {
	if err := l.checkIO(nil, x, m); err != nil {
		return err
	}
	cols := l.sparseCols()
	hot, err := l.hotSlice(cols)
	if err != nil {
		return err
	}
	_, _, err = l.runD2T(s, x, m, cols, hot)
	return err
}

// Packed is a TwELL gate downloaded from the GPU. Words is Rows x Cols/C
// uint32 in the reference bit layout (word 0 of a tile the true count,
// then bf16 << 16 | column in column order; words past the count are zero).
// A tile whose count exceeds S-1, or that held NaN or Inf, has its row in
// Overflow; such a tile's payload is incomplete and the MLP recomputes the
// row densely.
type Packed struct {
	Layout     twell.Layout
	Rows, Cols int
	Words      []uint32
	Overflow   []int // flagged rows, ascending
	NNZ        int64 // active entries in all rows (true counts)
}

// D2T runs the gate (or, non-gated, up) GEMM with ReLU and TwELL packing
// of every unit, in the MLP's unit order (UnitOrder), on x (m x D bf16) and
// downloads the result. It synchronises stream s.
func (l *MLP) D2T(s *cuda.Stream, x *cuda.Buffer, m int) (*Packed, error) {
	if err := l.checkIO(nil, x, m); err != nil {
		return nil, err
	}
	ws, _, err := l.runD2T(s, x, m, l.F, nil)
	if err != nil {
		return nil, err
	}
	if err := syncStream(l.dev, s); err != nil {
		return nil, err
	}
	rw := l.F / l.Layout.C
	p := &Packed{Layout: l.Layout, Rows: m, Cols: l.F, Words: make([]uint32, m*rw)}
	if err := l.dev.CopyDtoH(cuda.Bytes(p.Words), ws.packed); err != nil {
		return nil, err
	}
	var cnt [1]int32
	if err := l.dev.CopyDtoH(cuda.Bytes(cnt[:]), ws.ovf); err != nil {
		return nil, err
	}
	if cnt[0] > 0 {
		rows := make([]int32, 1+cnt[0])
		if err := l.dev.CopyDtoH(cuda.Bytes(rows), ws.ovf); err != nil {
			return nil, err
		}
		for _, r := range rows[1:] {
			p.Overflow = append(p.Overflow, int(r))
		}
		slices.Sort(p.Overflow)
	}
	var nnz [1]uint64
	if err := l.dev.CopyDtoH(cuda.Bytes(nnz[:]), l.nnz); err != nil {
		return nil, err
	}
	p.NNZ = int64(nnz[0])
	return p, nil
}

// RowNNZ returns the true number of active entries in row r.
func (p *Packed) RowNNZ(r int) int {
	s, rw := p.Layout.S(), p.Cols/p.Layout.C
	n := 0
	for t := 0; t < p.Cols/p.Layout.Tile; t++ {
		n += int(p.Words[r*rw+t*s])
	}
	return n
}

// bySet is a kernel template of S words per tile (32, 64 and 128: the C of
// 8, 4 and 2), compiled from its file on first use.
type bySet struct {
	once sync.Once
	fns  map[int]*cuda.Function
	err  error
}

// get returns name<s> of file (src), compiling the file's three
// instantiations on first use; a failure is kept and returned again.
func (b *bySet) get(k *kernels, file string, src []byte, name string, s int) (*cuda.Function, error) {
	b.once.Do(func() {
		exprs := []string{name + "<32>", name + "<64>", name + "<128>"}
		fs, err := k.compile(file, src, exprs)
		if err != nil {
			b.err = err
			return
		}
		b.fns = map[int]*cuda.Function{32: fs[exprs[0]], 64: fs[exprs[1]], 128: fs[exprs[2]]}
	})
	if b.err != nil {
		return nil, b.err
	}
	return b.fns[s], nil
}

// d2tMMA returns the mma.sync D2T kernel for S words per tile.
func (k *kernels) d2tMMA(s int) (*cuda.Function, error) {
	return k.mma.get(k, "d2t_mma.cu", d2tMMASrc, "d2t_mma", s)
}

// d2tWGMMA returns the Hopper D2T kernel for S words per tile, compiling
// it on first use (each S alone: a process compiles only what it runs). A
// failure is kept and returned again.
func (k *kernels) d2tWGMMA(s int) (*cuda.Function, error) {
	k.wgMu.Lock()
	defer k.wgMu.Unlock()
	if k.wgErr != nil {
		return nil, k.wgErr
	}
	if f := k.wg[s]; f != nil {
		return f, nil
	}
	if p := k.dev.Properties(); p.Arch != "sm_90a" {
		k.wgErr = fmt.Errorf("gpu: the wgmma D2T kernel needs sm_90a (Hopper); %v is %s", k.dev, p.Arch)
		return nil, k.wgErr
	}
	fs, err := k.compile("d2t_wgmma.cu", d2tWGMMASrc, []string{wgmmaName(s)})
	if err != nil {
		k.wgErr = err
		return nil, err
	}
	if k.wg == nil {
		k.wg = map[int]*cuda.Function{}
	}
	k.wg[s] = fs[wgmmaName(s)]
	return k.wg[s], nil
}

// wgmmaName is the name expression of the wgmma D2T kernel for S words per
// tile.
func wgmmaName(s int) string { return fmt.Sprintf("d2t_wgmma<%d,%d>", s, wgmmaStages) }

// wgmmaExprs are the name expressions of d2t_wgmma.cu's kernels (S of 32,
// 64 and 128).
func wgmmaExprs() []string { return []string{wgmmaName(32), wgmmaName(64), wgmmaName(128)} }

// wgmmaStages is the pipeline depth of d2t_wgmma: its tile of active bf16
// values (66 KiB, addressed by column) leaves room for 3 stages.
const wgmmaStages = 3

// wgmmaScratchRows is twice d2t_wgmma's PIPE_LAST: the warps that pack a
// cluster's last tile (its 3 packer warps and 8 consumer warps), two S-word
// scratch rows each.
const wgmmaScratchRows = 22

// wgmmaSmem returns the dynamic shared memory the wgmma D2T kernel needs,
// with 1024 bytes of slack for aligning the base (see d2t_wgmma.cu).
func wgmmaSmem(s int) int {
	const stage = 16384 + 32768
	return wgmmaStages*stage + 128*132*4 + wgmmaScratchRows*s*4 + 128*8*4 + (2*wgmmaStages+2)*8 + 1024
}

// d2tArgs are the operands of a D2T kernel for one call of m tokens: x
// (m x d bf16) times the first f rows of w (F x d bf16) transposed, packed
// into rowWords words a row (S a tile; F/C, whatever f), with the row flags,
// the overflow list and the active-unit counter.
type d2tArgs struct {
	x, w, packed, flags, ovf, nnz *cuda.Buffer
	m, d, f, s, rowWords          int
	// hotUnits units after the first f (wgmma only; a multiple of 256) are
	// hot: their h goes to hotH (m rows of hotUnits bf16), from their rows
	// of w and, when hotGated, of the up weights.
	hotH     *cuda.Buffer
	hotUnits int
	hotGated bool
}

// mmaSmem is the dynamic shared memory of d2t_mma<S>: three stages of a
// 128-row x tile and a 256-row weight tile, 40 bf16 a row, and the
// 128-row staging tile of packed words.
func mmaSmem(s int) int { return 3*(128+256)*40*2 + 128*s*4 }

// mma launches d2t_mma<S>: one 256-thread block per 128 x 256 output tile.
func (a d2tArgs) mma(fn *cuda.Function, s *cuda.Stream) error {
	mTiles, nTiles := (a.m+127)/128, a.f/256
	return fn.Launch(cuda.Dim3{uint32(mTiles * nTiles), 1, 1}, cuda.Dim3{256, 1, 1}, mmaSmem(a.s), s,
		a.x, a.w, a.packed, a.flags, a.ovf, a.nnz, int32(mTiles), int32(nTiles), int32(a.d), int32(a.rowWords), int32(a.m))
}

// wgmma launches the persistent d2t_wgmma<S, 3> with TMA maps tmA of x,
// tmB of w and tmU of the up weights (used only with hotGated): clusters
// of 2 CTAs of 384 threads, as many clusters as resident returns for the
// launch configuration (at most one per work item, a pair of 128-row tiles
// times a 256-column weight tile: 256 packed units, or 128 hot units'
// gate and up rows, or non-gated 256 hot units).
func (a d2tArgs) wgmma(fn *cuda.Function, s *cuda.Stream, tmA, tmB, tmU *cuda.TensorMap, resident func(cuda.LaunchConfig) int) error {
	mPairs, sparse := padRows(a.m)/256, a.f/256
	nTiles, hotH, gated := sparse, any(cuda.DevicePtr(0)), int32(0)
	if a.hotH != nil {
		hotH = a.hotH
		nTiles += a.hotUnits / 256
		if a.hotGated {
			nTiles += a.hotUnits / 256
			gated = 1
		}
	}
	cfg := cuda.LaunchConfig{Block: cuda.Dim3{384, 1, 1}, SharedBytes: wgmmaSmem(a.s), Stream: s, Cluster: cuda.Dim3{2, 1, 1}}
	nClusters := min(resident(cfg), mPairs*nTiles)
	cfg.Grid = cuda.Dim3{uint32(2 * nClusters), 1, 1}
	return fn.LaunchEx(cfg, tmA, tmB, tmU, a.packed, a.flags, a.ovf, a.nnz, hotH, gated,
		int32(mPairs), int32(nTiles), int32(sparse), int32(a.hotUnits), int32(a.d/64), int32(a.rowWords), int32(a.m))
}
