package gpu

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/twell"
)

// Kernel selects the D2T implementation.
type Kernel int

// D2T kernels.
const (
	// KernelAuto uses KernelWGMMA on Hopper (sm_90a) and KernelMMA
	// elsewhere, or when the wgmma kernel does not compile.
	KernelAuto Kernel = iota
	// KernelWGMMA is the persistent TMA + wgmma kernel whose epilogue runs
	// in separate packer warps, overlapped with the next tile's mainloop
	// (sm_90a only).
	KernelWGMMA
	// KernelMMA is the simpler mma.sync kernel (any sm_80+ GPU).
	KernelMMA
)

// String returns "auto", "wgmma" or "mma".
func (k Kernel) String() string {
	switch k {
	case KernelAuto:
		return "auto"
	case KernelWGMMA:
		return "wgmma"
	case KernelMMA:
		return "mma"
	}
	return fmt.Sprintf("Kernel(%d)", int(k))
}

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
	// TailSorted is t2u (up projection per token, writing a compact list),
	// a counting sort of the tokens by list length (longest first; len_*
	// kernels in t2d.cu), then t2d_ws (weight-stationary down projection:
	// each block keeps W columns of every down row in shared memory), so
	// that the tokens a warp takes in one round have lists of about the
	// same length. (1.66 ms against 1.81 without the sort, same results bit
	// for bit, at m = 65536, 0.5%, on an H200.)
	TailSorted
)

// String returns "auto", "warp" or "sorted".
func (t Tail) String() string {
	switch t {
	case TailAuto:
		return "auto"
	case TailWarp:
		return "warp"
	case TailSorted:
		return "sorted"
	}
	return fmt.Sprintf("Tail(%d)", int(t))
}

// MaxD is the largest hidden size the T2D kernels take (their per-lane
// register arrays grow with d).
const MaxD = 8192

// MLP is one MLP layer's weights on a GPU, bf16, stored once in the layout
// both paths use: Wg and Wu as [F, D] and Down = Wd^T as [F, D]. Its methods
// queue work on a stream and keep per-call workspace, so an MLP must not be
// used by several goroutines at once.
type MLP struct {
	D, F   int  // hidden size (a multiple of 64) and MLP width (a multiple of 256)
	Gated  bool // whether the MLP has a gate projection
	Layout twell.Layout
	// Kernel picks the D2T kernel (zero: the fastest the device supports).
	Kernel Kernel
	// Tail picks the sparse kernels after D2T (zero: by batch size).
	Tail Tail
	// Path is the path Forward runs: mlp.Auto (the zero value: by density
	// and timings, see Forward), mlp.Sparse or mlp.Dense (always; Dense
	// needs a cuBLAS handle).
	Path mlp.Path
	// DenseAbove is the density (mean active units per token / F) above
	// which Forward runs the dense path under mlp.Auto (mlp.Choose). NewMLP
	// sets it from a cost model of the device (see DefaultDenseAbove);
	// callers may calibrate it.
	DenseAbove float64
	// Measure makes Forward, under mlp.Auto and below DenseAbove, time its
	// calls and run the path measured faster for the batch size (NewMLP
	// sets it; see autopath.go). Off, Forward follows the density rule
	// alone.
	Measure bool

	dev            *cuda.Device
	k              *kernels
	blas           *cublas.Handle
	gate, up, down *cuda.Buffer
	tmB            *cuda.TensorMap // TMA map of the sparse-input weights (gate, or up)
	nnz            *cuda.Buffer    // one uint64: active units counted by the last call

	ws    *workspace
	tmA   *cuda.TensorMap
	tmAx  cuda.DevicePtr
	tmAm  int
	wgErr error

	clusters int // resident clusters of the wgmma D2T kernel (0: not yet asked)

	// automatic path state
	next      mlp.Path // the density rule's path (mlp.Sparse or mlp.Dense)
	pending   bool
	pendingM  int
	hostNNZ   *cuda.HostBuffer
	evt       *cuda.Event
	lastNNZ   float64
	lastKnown bool
	counted   int // tokens whose active units the nnz counter holds

	// flagged-row history of the sparse path, for sizing the gathered
	// dense pass
	hostOvf    *cuda.HostBuffer
	evtOvf     *cuda.Event
	ovfPending bool
	ovfM       int
	flagRate   float64 // flagged rows per token in the last measured sparse call
	flagKnown  bool

	// measured path choice (autopath.go)
	fwdCalls, sparseCalls int
	times                 map[int]*bucketTimes
	inflight              []timedCall
	evFree                []*cuda.Event
}

// workspace is the activation memory of MLP calls, grown to the largest
// call. MLPs of one shape that run one after another on one stream (the
// layers of a model) may share one: see ShareWorkspace.
type workspace struct {
	sp    sparseWS
	dn    denseWS
	refs  int    // MLPs using it
	epoch uint64 // buffer reallocations so far
}

type sparseWS struct {
	mPad                          int
	packed, flags, ovf, hbuf, cnt *cuda.Buffer
	// TailSorted: the token order (mPad ints) and the length bins
	order, lenBins *cuda.Buffer
	// small-batch path (gemv.cu): h, gemvMaxRows x F fp32; the activity
	// mask and the per-block counts, F/32 words each
	gh, gmask, gcnt *cuda.Buffer
	// activity masks of the flagged rows' groups (flaggedRows)
	fbMask *cuda.Buffer
	// gathered dense pass over flagged rows: rows x D inputs and outputs,
	// rows x F gate and up
	gRows          int
	gx, gg, gu, gy *cuda.Buffer
}

type denseWS struct {
	m    int
	g, u *cuda.Buffer
}

// NewMLP uploads an MLP layer given in nn.Linear layout (float32, row-major):
// wg and wu are f x d, wd is d x f; wg is nil for a non-gated MLP. blas runs
// the dense path; it may be nil, and then only the sparse path works. Only
// 256-column TwELL tiles are supported on the GPU.
func NewMLP(dev *cuda.Device, blas *cublas.Handle, wg, wu, wd []float32, d, f int, layout twell.Layout) (*MLP, error) {
	switch {
	case d < 64 || d%64 != 0 || d > MaxD:
		return nil, fmt.Errorf("gpu: hidden size d=%d must be a positive multiple of 64, at most %d", d, MaxD)
	case layout.Tile != 256:
		return nil, fmt.Errorf("gpu: TwELL tile width %d not supported on the GPU (want 256)", layout.Tile)
	}
	if err := layout.Check(f); err != nil {
		return nil, fmt.Errorf("gpu: %w", err)
	}
	if len(wu) != f*d || len(wd) != d*f || (wg != nil && len(wg) != f*d) {
		return nil, fmt.Errorf("gpu: MLP weights hold %d (gate), %d (up), %d (down) values, want %d each", len(wg), len(wu), len(wd), f*d)
	}
	l := &MLP{D: d, F: f, Gated: wg != nil, Layout: layout, dev: dev, k: kernelsFor(dev), blas: blas,
		ws: &workspace{refs: 1}, Measure: true, next: mlp.Sparse}
	l.DenseAbove = DefaultDenseAbove(d, f, l.Gated)
	down := make([]float32, f*d)
	for k := 0; k < d; k++ {
		row := wd[k*f : (k+1)*f]
		for j, v := range row {
			down[j*d+k] = v
		}
	}
	var err error
	upload := func(w []float32) *cuda.Buffer {
		if err != nil || w == nil {
			return nil
		}
		var b *cuda.Buffer
		b, err = uploadBF16(dev, w)
		return b
	}
	l.gate, l.up, l.down = upload(wg), upload(wu), upload(down)
	if err == nil {
		l.nnz, err = dev.Alloc(8)
	}
	if err == nil {
		err = dev.Memset8(l.nnz, 0, nil)
	}
	if err == nil {
		l.hostNNZ, err = dev.AllocHost(8)
	}
	if err == nil {
		l.evt, err = dev.NewEvent()
	}
	if err == nil {
		l.hostOvf, err = dev.AllocHost(8)
	}
	if err == nil {
		l.evtOvf, err = dev.NewEvent()
	}
	if err == nil {
		l.tmB, err = dev.EncodeTiled(cuda.TiledTensor{
			DataType: cuda.TensorBFloat16, Global: l.sparseIn().Ptr(),
			Dims: []uint64{uint64(d), uint64(f)}, Strides: []uint64{uint64(2 * d)},
			Box: []uint32{64, 128}, Swizzle: cuda.Swizzle128B, L2Promotion: cuda.L2Promotion256B,
		})
	}
	if err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// DefaultDenseAbove returns the density (active units per token / f) above
// which the dense MLP is expected to beat the sparse one on an
// H100/H200-class GPU: the sparse path costs one GEMM (D2T) plus a per-unit
// cost bound by reading each active unit's weight rows from L2; the dense
// path costs every GEMM plus the elementwise pass. The rates are those
// measured on an H200 (see docs/gpu-twell.md).
func DefaultDenseAbove(d, f int, gated bool) float64 {
	const (
		gemmRate = 680e12 // FLOP/s, bf16 GEMM through cuBLASLt (H200, run 2)
		hbm      = 3.5e12 // B/s, the elementwise pass
		l2       = 6.2e12 // B/s, weight rows gathered from L2 in T2D (H200, run 2)
	)
	gemm := 2 * float64(d) * float64(f) / gemmRate
	dense, rows := 2*gemm+3*2*float64(f)/hbm, 1.0
	if gated {
		dense, rows = 3*gemm+3*2*float64(f)/hbm, 2
	}
	sparse := 1.15 * gemm // D2T: the GEMM plus its packing epilogue
	pair := rows * 2 * float64(d) / l2
	return max(0, (dense-sparse)/pair) / float64(f)
}

func uploadBF16(dev *cuda.Device, w []float32) (*cuda.Buffer, error) {
	h := make([]uint16, len(w))
	bf16.FromFloat32s(h, w)
	b, err := dev.Alloc(2 * len(h))
	if err != nil {
		return nil, err
	}
	if err := dev.CopyHtoD(b, cuda.Bytes(h)); err != nil {
		b.Free()
		return nil, err
	}
	return b, nil
}

// sparseIn returns the weights whose ReLU'd product is the sparse activation.
func (l *MLP) sparseIn() *cuda.Buffer {
	if l.Gated {
		return l.gate
	}
	return l.up
}

// Close frees the MLP's device memory.
func (l *MLP) Close() error {
	var errs []error
	for _, b := range []*cuda.Buffer{l.gate, l.up, l.down, l.nnz} {
		if b != nil {
			errs = append(errs, b.Free())
		}
	}
	l.gate, l.up, l.down, l.nnz = nil, nil, nil, nil
	errs = append(errs, l.dropWorkspace())
	if l.hostNNZ != nil {
		errs = append(errs, l.hostNNZ.Free())
		l.hostNNZ = nil
	}
	if l.evt != nil {
		errs = append(errs, l.evt.Destroy())
		l.evt = nil
	}
	if l.hostOvf != nil {
		errs = append(errs, l.hostOvf.Free())
		l.hostOvf = nil
	}
	if l.evtOvf != nil {
		errs = append(errs, l.evtOvf.Destroy())
		l.evtOvf = nil
	}
	errs = append(errs, l.destroyEvents())
	return errors.Join(errs...)
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
	for _, b := range []*cuda.Buffer{ws.sp.packed, ws.sp.flags, ws.sp.ovf, ws.sp.hbuf, ws.sp.cnt, ws.sp.order, ws.sp.lenBins,
		ws.sp.gx, ws.sp.gg, ws.sp.gu, ws.sp.gy, ws.sp.gh, ws.sp.gmask, ws.sp.gcnt, ws.sp.fbMask, ws.dn.g, ws.dn.u} {
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

// WeightBytes returns the device memory the weights take.
func (l *MLP) WeightBytes() int64 {
	n := int64(2 * 2 * l.D * l.F)
	if l.Gated {
		n += int64(2 * l.D * l.F)
	}
	return n
}

func padRows(m int) int { return (m + 255) / 256 * 256 }

// SparseActBytes returns the activation memory the sparse path allocates for
// m tokens: the packed gate, the row flags and the overflow list (the
// fallback scratch is fixed, one f-vector per multiprocessor), the split
// tail's list lengths, and the gathered dense pass at its current size; for
// m <= 4, the small-batch kernels' h, mask and counts.
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
		lenBins*4 + g
}

// DenseActBytes returns the activation memory the dense path allocates for m
// tokens: the bf16 gate and up projections (h overwrites one of them).
func (l *MLP) DenseActBytes(m int) int64 {
	if l.Gated {
		return 2 * 2 * int64(m) * int64(l.F)
	}
	return 2 * int64(m) * int64(l.F)
}

func (l *MLP) checkIO(y, x *cuda.Buffer, m int) error {
	if m < 1 {
		return fmt.Errorf("gpu: MLP call with %d tokens; want at least 1", m)
	}
	if m > 1<<24 {
		return fmt.Errorf("gpu: MLP call with %d tokens; at most %d per call", m, 1<<24)
	}
	need := 2 * m * l.D
	if x == nil || x.Len() < need {
		return fmt.Errorf("gpu: MLP input %v holds fewer than %d bytes (%d tokens x %d bf16)", x, need, m, l.D)
	}
	if y != nil && y.Len() < need {
		return fmt.Errorf("gpu: MLP output %v holds fewer than %d bytes (%d tokens x %d bf16)", y, need, m, l.D)
	}
	if l.up == nil {
		return errors.New("gpu: MLP was closed")
	}
	return nil
}

// realloc returns b if it holds n bytes, else a new buffer (freeing b).
func (l *MLP) realloc(b *cuda.Buffer, n int) (*cuda.Buffer, error) {
	if b != nil && b.Len() >= n {
		return b, nil
	}
	if b != nil {
		if err := b.Free(); err != nil {
			return nil, err
		}
	}
	l.ws.epoch++
	return l.dev.Alloc(n)
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
	if ws.flags, err = l.realloc(ws.flags, mp*4); err != nil {
		return nil, err
	}
	if ws.ovf, err = l.realloc(ws.ovf, (mp+1)*4); err != nil {
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
	if ws.lenBins, err = l.realloc(ws.lenBins, lenBins*4); err != nil {
		return nil, err
	}
	ws.mPad = mp
	return ws, nil
}

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
	// On Hopper the wgmma kernel (about 2.3 ms at m = 65536 on an H200),
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

// runD2T queues the gate GEMM with ReLU + TwELL packing into the sparse
// workspace, after zeroing the flags, the overflow count and the nnz counter.
func (l *MLP) runD2T(s *cuda.Stream, x *cuda.Buffer, m int) (*sparseWS, error) {
	ws, err := l.sparseWorkspace(m)
	if err != nil {
		return nil, err
	}
	fn, kind, err := l.d2tKernel()
	if err != nil {
		return nil, err
	}
	// This call's rows, not the workspace's capacity: a workspace sized by
	// a large prefill must not make every later decode step do its work.
	mp := padRows(m)
	flags, err := ws.flags.Slice(0, 4*mp)
	if err != nil {
		return nil, err
	}
	ovf0, err := ws.ovf.Slice(0, 4)
	if err != nil {
		return nil, err
	}
	for _, b := range []*cuda.Buffer{flags, ovf0, l.nnz} {
		if err := l.dev.Memset8(b, 0, s); err != nil {
			return nil, err
		}
	}
	l.counted = m
	S, C := l.Layout.S(), l.Layout.C
	nTiles := l.F / 256
	switch kind {
	case KernelWGMMA:
		if l.tmA == nil || l.tmAx != x.Ptr() || l.tmAm != m {
			tm, err := l.dev.EncodeTiled(cuda.TiledTensor{
				DataType: cuda.TensorBFloat16, Global: x.Ptr(),
				Dims: []uint64{uint64(l.D), uint64(m)}, Strides: []uint64{uint64(2 * l.D)},
				Box: []uint32{64, 128}, Swizzle: cuda.Swizzle128B, L2Promotion: cuda.L2Promotion256B,
			})
			if err != nil {
				return nil, err
			}
			l.tmA, l.tmAx, l.tmAm = tm, x.Ptr(), m
		}
		smem := wgmmaSmem(S)
		mPairs := mp / 256
		cfg := cuda.LaunchConfig{Block: cuda.Dim3{384, 1, 1}, SharedBytes: smem, Stream: s, Cluster: cuda.Dim3{2, 1, 1}}
		nClusters := min(l.residentClusters(fn, cfg), mPairs*nTiles)
		cfg.Grid = cuda.Dim3{uint32(2 * nClusters), 1, 1}
		err = fn.LaunchEx(cfg, l.tmA, l.tmB, ws.packed, ws.flags, ws.ovf, l.nnz,
			int32(mPairs), int32(nTiles), int32(l.D/64), int32(l.F/C), int32(m))
	default:
		mTiles := (m + 127) / 128
		smem := 3*(128+256)*40*2 + 128*S*4
		err = fn.Launch(cuda.Dim3{uint32(mTiles * nTiles), 1, 1}, cuda.Dim3{256, 1, 1}, smem, s,
			x, l.sparseIn(), ws.packed, ws.flags, ws.ovf, l.nnz,
			int32(mTiles), int32(nTiles), int32(l.D), int32(l.F/C), int32(m))
	}
	if err != nil {
		return nil, fmt.Errorf("gpu: D2T (%v): %w", kind, err)
	}
	return ws, nil
}

// QueueD2T queues the D2T kernel alone on stream s (for timing it); the
// result stays in the MLP's workspace. D2T downloads it.
func (l *MLP) QueueD2T(s *cuda.Stream, x *cuda.Buffer, m int) error {
	if err := l.checkIO(nil, x, m); err != nil {
		return err
	}
	_, err := l.runD2T(s, x, m)
	return err
}

// Sparse queues the TwELL MLP on stream s (nil: the default stream): D2T,
// then the sparse tail (see Tail), then the dense recomputation of every row
// that D2T flagged: the first rows of the overflow list through a gathered
// cuBLASLt pass sized from the flagged rows seen in earlier calls, any
// others through the exact per-row kernel. x and y hold m x D bf16 values;
// m may be any positive count (the kernels pad inside). Batches of at most
// 4 tokens (decode steps) take the small-batch kernels instead (see
// gemv.cu): every gate row is read once and only the active units' up and
// down rows, with no capacity limit and no flagged rows.
func (l *MLP) Sparse(s *cuda.Stream, y, x *cuda.Buffer, m int) error {
	return l.sparse(s, y, x, m, true)
}

// Queue queues the MLP on path p (mlp.Dense needs a cuBLAS handle; any
// other value runs sparse) without
// the automatic path's bookkeeping: no timing, and no copies of the active
// or flagged counts to the host. This is the form to record into a CUDA
// graph (see Settled for the path and Epoch for the graph's validity):
// replays rerun exactly the recorded work, and rows D2T flags still get
// exact results (the gathered pass takes as many rows as Sparse would
// give it now, the per-row kernel the rest).
func (l *MLP) Queue(s *cuda.Stream, y, x *cuda.Buffer, m int, p mlp.Path) error {
	if p == mlp.Dense && l.blas != nil {
		return l.Dense(s, y, x, m)
	}
	return l.sparse(s, y, x, m, false)
}

// sparse queues the TwELL MLP; with report it copies the flagged-row count
// back on sampled calls, for sizing the gathered pass.
func (l *MLP) sparse(s *cuda.Stream, y, x *cuda.Buffer, m int, report bool) error {
	if err := l.checkIO(y, x, m); err != nil {
		return err
	}
	l.pollFlagged()
	if m <= gemvMaxRows {
		return l.sparseGEMV(s, y, x, m)
	}
	ws, err := l.runD2T(s, x, m)
	if err != nil {
		return err
	}
	set, err := l.k.t2dFor(l.D)
	if err != nil {
		return err
	}
	S, rw, tiles := l.Layout.S(), l.F/l.Layout.C, l.F/256
	if l.TailFor(m) == TailSorted {
		w := l.splitWidth()
		t2u := set.t2uPlain
		if l.Gated {
			t2u = set.t2uGated
		}
		if err := t2u.Launch(cuda.Dim3{uint32((m + 7) / 8), 1, 1}, cuda.Dim3{256, 1, 1}, 0, s,
			x, ws.packed, l.up, ws.cnt, ws.flags, int32(m), int32(l.D), int32(S), int32(tiles), int32(rw)); err != nil {
			return fmt.Errorf("gpu: t2u: %w", err)
		}
		if err := l.lengthOrder(s, set, ws, m); err != nil {
			return err
		}
		fn := set.ws16
		if w == 8 {
			fn = set.ws8
		}
		slices := l.D / w
		split := max(1, l.dev.Properties().SMs/slices)
		per := (m + split - 1) / split
		if err := fn.Launch(cuda.Dim3{uint32(slices), uint32(split), 1}, cuda.Dim3{1024, 1, 1}, l.F*w*2, s,
			ws.packed, ws.cnt, ws.order, l.down, y, int32(m), int32(l.D), int32(l.F), int32(rw), int32(per)); err != nil {
			return fmt.Errorf("gpu: t2d_ws: %w", err)
		}
	} else {
		t2d := set.plain
		if l.Gated {
			t2d = set.gated
		}
		if err := t2d.Launch(cuda.Dim3{uint32((m + 7) / 8), 1, 1}, cuda.Dim3{256, 1, 1}, 0, s,
			x, ws.packed, l.up, l.down, y, ws.flags,
			int32(m), int32(l.D), int32(S), int32(tiles), int32(rw)); err != nil {
			return fmt.Errorf("gpu: T2D: %w", err)
		}
	}
	first := l.gatheredRows(m)
	if first > 0 {
		if err := l.gatheredDense(s, y, x, ws, first); err != nil {
			return fmt.Errorf("gpu: gathered dense fallback: %w", err)
		}
	}
	if err := l.flaggedRows(s, set, y, x, ws, first); err != nil {
		return err
	}
	if !report {
		return nil
	}
	if l.sparseCalls++; !sampled(l.sparseCalls) {
		return nil
	}
	ovf0, err := ws.ovf.Slice(0, 4)
	if err != nil {
		return err
	}
	if err := l.dev.CopyDtoHAsync(l.hostOvf.Bytes()[:4], ovf0, s); err != nil {
		return err
	}
	if err := l.evtOvf.Record(s); err != nil {
		return err
	}
	l.ovfPending, l.ovfM = true, m
	return nil
}

// flaggedRows queues the exact recomputation of the flagged rows past the
// first (which the gathered dense pass took): up to fbRows(SMs) of them
// through the LIST forms of the small-batch kernels, which spread each row
// over all SMs, the rest (a call with hundreds of flagged rows, which the
// automatic path soon sends dense) through row_fallback, one CTA per row
// (about 10 ms per row on an H200 where it walks every unit alone).
func (l *MLP) flaggedRows(s *cuda.Stream, set *t2dSet, y, x *cuda.Buffer, ws *sparseWS, first int) error {
	ks, err := l.k.gemvKernels()
	if err != nil {
		return err
	}
	words := l.F / 32
	capRows := fbRows(l.dev.Properties().SMs)
	act := ks.fbActPlain
	if l.Gated {
		act = ks.fbActGated
	}
	var none cuda.DevicePtr
	if err := act.Launch(cuda.Dim3{uint32(words), 1, 1}, cuda.Dim3{256, 1, 1}, 2*fbGroup*l.D, s,
		x, l.sparseIn(), l.up, ws.hbuf, ws.fbMask, none, int32(0), int32(l.D), int32(l.F),
		ws.ovf, int32(first), int32(capRows)); err != nil {
		return fmt.Errorf("gpu: flagged rows (gemv_act): %w", err)
	}
	lists := 8 * ((words + 7) / 8) * 32 * 4
	if err := ks.fbDown.Launch(cuda.Dim3{uint32(l.D / 64), 1, 1}, cuda.Dim3{256, 1, 1}, lists, s,
		ws.hbuf, ws.fbMask, l.down, y, none, none, int32(0), int32(l.D), int32(l.F),
		ws.ovf, int32(first), int32(capRows)); err != nil {
		return fmt.Errorf("gpu: flagged rows (gemv_down): %w", err)
	}
	fb := set.fbPlain
	if l.Gated {
		fb = set.fbGated
	}
	if err := fb.Launch(cuda.Dim3{uint32(l.dev.Properties().SMs), 1, 1}, cuda.Dim3{256, 1, 1}, 4*l.D, s,
		x, l.sparseIn(), l.up, l.down, y, ws.ovf, ws.hbuf, int32(l.D), int32(l.F), int32(first+capRows)); err != nil {
		return fmt.Errorf("gpu: dense fallback: %w", err)
	}
	return nil
}

// fbRows is how many flagged rows the LIST kernels take per call: the rows
// of h that the sparse workspace's hbuf (SMs x F floats) holds, in whole
// groups.
func fbRows(sms int) int { return sms / fbGroup * fbGroup }

// sparseGEMV queues the small-batch sparse MLP (m <= gemvMaxRows).
func (l *MLP) sparseGEMV(s *cuda.Stream, y, x *cuda.Buffer, m int) error {
	ks, err := l.k.gemvKernels()
	if err != nil {
		return err
	}
	ws := &l.ws.sp
	words := l.F / 32
	var none cuda.DevicePtr
	for _, b := range []struct {
		p **cuda.Buffer
		n int
	}{{&ws.gh, 4 * gemvMaxRows * l.F}, {&ws.gmask, 4 * words}, {&ws.gcnt, 4 * words}} {
		if *b.p, err = l.realloc(*b.p, b.n); err != nil {
			return err
		}
	}
	mb := gemvRows[len(gemvRows)-1]
	for _, r := range gemvRows {
		if m <= r {
			mb = r
			break
		}
	}
	act := ks.actPlain[mb]
	if l.Gated {
		act = ks.actGated[mb]
	}
	if err := act.Launch(cuda.Dim3{uint32(words), 1, 1}, cuda.Dim3{256, 1, 1}, 2*m*l.D, s,
		x, l.sparseIn(), l.up, ws.gh, ws.gmask, ws.gcnt, int32(m), int32(l.D), int32(l.F), none, int32(0), int32(0)); err != nil {
		return fmt.Errorf("gpu: gemv_act: %w", err)
	}
	lists := 8 * ((words + 7) / 8) * 32 * 4 // gemv_down's per-warp lists of active units
	if err := ks.down[mb].Launch(cuda.Dim3{uint32(l.D / 64), 1, 1}, cuda.Dim3{256, 1, 1}, lists, s,
		ws.gh, ws.gmask, l.down, y, ws.gcnt, l.nnz, int32(m), int32(l.D), int32(l.F), none, int32(0), int32(0)); err != nil {
		return fmt.Errorf("gpu: gemv_down: %w", err)
	}
	l.counted = m
	return nil
}

// TailFor returns the tail kernels the sparse path runs for m tokens now
// (TailSorted or TailWarp).
func (l *MLP) TailFor(m int) Tail {
	if l.splitWidth() == 0 || !l.useSplit(m) {
		return TailWarp
	}
	return TailSorted
}

// lenBins is the number of list-length bins of the TailSorted order
// (LEN_BINS in t2d.cu).
const lenBins = 1024

// lengthOrder queues the counting sort that orders the m tokens by the
// length of their compact lists (ws.cnt, written by t2u) into ws.order.
func (l *MLP) lengthOrder(s *cuda.Stream, set *t2dSet, ws *sparseWS, m int) error {
	if err := l.dev.Memset32(ws.lenBins, 0, s); err != nil {
		return err
	}
	blocks := cuda.Dim3{uint32(min((m+255)/256, 4*l.dev.Properties().SMs)), 1, 1}
	if err := set.lenHist.Launch(blocks, cuda.Dim3{256, 1, 1}, 0, s, ws.cnt, int32(m), ws.lenBins); err != nil {
		return fmt.Errorf("gpu: len_hist: %w", err)
	}
	if err := set.lenOffsets.Launch(cuda.Dim3{1, 1, 1}, cuda.Dim3{lenBins, 1, 1}, 0, s, ws.lenBins); err != nil {
		return fmt.Errorf("gpu: len_offsets: %w", err)
	}
	if err := set.lenScatter.Launch(blocks, cuda.Dim3{256, 1, 1}, 0, s, ws.cnt, int32(m), ws.lenBins, ws.order); err != nil {
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
	if err := g.gather.Launch(cuda.Dim3{uint32(R), 1, 1}, cuda.Dim3{64, 1, 1}, 0, s,
		x, ws.gx, ws.ovf, int32(R), int32(l.D)); err != nil {
		return err
	}
	proj := cublas.Gemm{M: R, N: l.F, K: l.D, TransB: true}
	n := int64(R) * int64(l.F)
	grid := cuda.Dim3{uint32(min((n/8+255)/256, int64(l.dev.Properties().SMs*16))), 1, 1}
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
	if err := act.Launch(grid, cuda.Dim3{256, 1, 1}, 0, s, ws.gg, ws.gu, ws.gg, n); err != nil {
		return err
	}
	if err := l.blas.Matmul(s, cublas.Gemm{M: R, N: l.D, K: l.F}, ws.gg, l.down, ws.gy); err != nil {
		return err
	}
	return g.scatter.Launch(cuda.Dim3{uint32(R), 1, 1}, cuda.Dim3{64, 1, 1}, 0, s,
		ws.gy, y, ws.ovf, int32(R), int32(l.D))
}

func (l *MLP) denseWorkspace(m int) (*denseWS, error) {
	ws := &l.ws.dn
	if ws.m >= m {
		return ws, nil
	}
	n := 2 * m * l.F
	var err error
	if ws.g, err = l.realloc(ws.g, n); err != nil {
		return nil, err
	}
	if l.Gated {
		if ws.u, err = l.realloc(ws.u, n); err != nil {
			return nil, err
		}
	}
	ws.m = m
	return ws, nil
}

// Dense queues the dense MLP on stream s: cuBLASLt GEMMs (bf16 in and out,
// fp32 accumulate) for the gate, up and down projections and one
// elementwise kernel for relu(g) * u, which also counts the active units.
func (l *MLP) Dense(s *cuda.Stream, y, x *cuda.Buffer, m int) error {
	if err := l.checkIO(y, x, m); err != nil {
		return err
	}
	if l.blas == nil {
		return errors.New("gpu: dense MLP needs a cuBLAS handle (NewMLP was given nil)")
	}
	ws, err := l.denseWorkspace(m)
	if err != nil {
		return err
	}
	reluMul, reluInplace, err := l.k.dense()
	if err != nil {
		return err
	}
	proj := cublas.Gemm{M: m, N: l.F, K: l.D, TransB: true}
	n := int64(m) * int64(l.F)
	grid := cuda.Dim3{uint32(min((n/8+255)/256, int64(l.dev.Properties().SMs*16))), 1, 1}
	if l.Gated {
		if err := l.blas.Matmul(s, proj, x, l.gate, ws.g); err != nil {
			return err
		}
		if err := l.blas.Matmul(s, proj, x, l.up, ws.u); err != nil {
			return err
		}
		if err := reluMul.Launch(grid, cuda.Dim3{256, 1, 1}, 0, s, ws.g, ws.u, ws.g, n, l.nnz); err != nil {
			return err
		}
	} else {
		if err := l.blas.Matmul(s, proj, x, l.up, ws.g); err != nil {
			return err
		}
		if err := reluInplace.Launch(grid, cuda.Dim3{256, 1, 1}, 0, s, ws.g, n, l.nnz); err != nil {
			return err
		}
	}
	l.counted += m // the count accumulates until the next D2T zeroes it
	return l.blas.Matmul(s, cublas.Gemm{M: m, N: l.D, K: l.F}, ws.g, l.down, y)
}

// Forward queues the MLP on stream s on l.Path: mlp.Sparse or mlp.Dense
// always, or under mlp.Auto the path expected to be faster. Each call
// counts the active units of its batch (in D2T, or in the dense elementwise
// pass, whose count runs on over consecutive dense calls so that the dense
// path adds no reset) and copies the count back without waiting; under
// mlp.Auto the next call that finds the count arrived passes the density
// (mean active units per token / F) to mlp.Choose with DenseAbove and runs
// dense above it. Below it, with Measure set, the path measured faster for
// this batch size runs (the first calls of a size time sparse, then dense;
// see autopath.go). It returns the path it ran (mlp.Sparse or mlp.Dense).
func (l *MLP) Forward(s *cuda.Stream, y, x *cuda.Buffer, m int) (mlp.Path, error) {
	if err := l.checkIO(y, x, m); err != nil {
		return mlp.Sparse, err
	}
	l.poll()
	l.pollTimes()
	path, timeIt := l.Path, false
	if path == mlp.Auto {
		path, timeIt = l.choose(m, l.next)
	}
	var start *cuda.Event
	if timeIt {
		start = l.startTiming(s)
	}
	var err error
	if path == mlp.Dense && l.blas != nil {
		err = l.Dense(s, y, x, m)
	} else {
		path = mlp.Sparse
		err = l.Sparse(s, y, x, m)
	}
	if err != nil {
		return path, err
	}
	l.endTiming(s, start, path, m)
	if l.fwdCalls++; !sampled(l.fwdCalls) {
		return path, nil
	}
	if err := l.dev.CopyDtoHAsync(l.hostNNZ.Bytes(), l.nnz, s); err != nil {
		return path, err
	}
	if err := l.evt.Record(s); err != nil {
		return path, err
	}
	l.pending, l.pendingM = true, l.counted
	return path, nil
}

// poll reads the active-unit count of the last call if it has arrived and
// chooses the next path.
func (l *MLP) poll() {
	l.pollFlagged()
	if !l.pending {
		return
	}
	done, err := l.evt.Done()
	if err != nil || !done {
		return
	}
	l.pending = false
	n := binary.LittleEndian.Uint64(l.hostNNZ.Bytes())
	l.lastNNZ, l.lastKnown = float64(n)/float64(l.pendingM), true
	l.next = mlp.Choose(mlp.Auto, l.lastNNZ/float64(l.F), l.DenseAbove)
	if l.flagKnown && l.flagRate > maxSparseFlagRate {
		l.next = mlp.Dense
	}
}

// maxSparseFlagRate is the share of flagged rows above which the automatic
// path runs dense: each flagged row costs the sparse path a dense row on top.
const maxSparseFlagRate = 0.25

// LastActive returns the mean number of active units per token that the
// automatic path last measured, and whether it has measured any.
func (l *MLP) LastActive() (float64, bool) {
	l.poll()
	return l.lastNNZ, l.lastKnown
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
// on x (m x D bf16) and downloads the result. It synchronises stream s.
func (l *MLP) D2T(s *cuda.Stream, x *cuda.Buffer, m int) (*Packed, error) {
	if err := l.checkIO(nil, x, m); err != nil {
		return nil, err
	}
	ws, err := l.runD2T(s, x, m)
	if err != nil {
		return nil, err
	}
	if s != nil {
		if err := s.Synchronize(); err != nil {
			return nil, err
		}
	} else if err := l.dev.Synchronize(); err != nil {
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

// Upload converts float32 values to bf16 and copies them into a new device
// buffer (for activations: x is m x D).
func Upload(dev *cuda.Device, v []float32) (*cuda.Buffer, error) { return uploadBF16(dev, v) }

// Download copies n bf16 values from b and returns them as float32.
func Download(dev *cuda.Device, b *cuda.Buffer, n int) ([]float32, error) {
	h := make([]uint16, n)
	if err := dev.CopyDtoH(cuda.Bytes(h), b); err != nil {
		return nil, err
	}
	out := make([]float32, n)
	bf16.ToFloat32s(out, h)
	return out, nil
}
