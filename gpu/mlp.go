package gpu

import (
	"errors"
	"fmt"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/twell"
)

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
	// which Forward runs the dense path under mlp.Auto (mlp.Choose); with
	// Measure, above measuredBand times it. NewMLP sets it from a cost
	// model of the device (see DefaultDenseAbove); callers may calibrate
	// it.
	DenseAbove float64
	// Measure makes Forward, under mlp.Auto and below measuredBand times
	// DenseAbove, time its calls and run the path measured faster for the
	// batch size (NewMLP sets it; see autopath.go). Off, Forward follows
	// the density rule alone.
	Measure bool
	// Serial launches the small-batch and sorted-tail kernels
	// without early start: each then begins only when the kernel before it
	// has finished (see cuda.LaunchConfig.EarlyStart; early start needs
	// compute capability 9.0 or later and is used there unless Serial is
	// set).
	Serial bool
	// SplitGEMV runs the small-batch MLP of one token as two kernels
	// (act, then down) rather than gemv_mlp's one, which meets at a grid
	// barrier (to compare; the split form also runs where gemv_mlp's blocks
	// do not all fit on the device at once, and for 2 to 8 tokens).
	SplitGEMV bool
	// GEMVTimeline runs the GEMV_TIMELINE build of the small-batch kernels
	// (Options.GEMVTimeline; see GEMVStamps).
	GEMVTimeline bool
	// SeparateHot computes the hot units' gate and up products with
	// cuBLASLt GEMMs of the hot slice, as the mma.sync D2T always does,
	// instead of as extra tiles of the wgmma D2T (see runD2T).
	SeparateHot bool
	// DenseOnCuBLAS runs the automatic path's dense arm on cuBLASLt's
	// three GEMMs and relu_mul at every batch size; otherwise, from
	// denseD2TMinRows tokens on the wgmma D2T kernel, the gate and up
	// products run in D2T (DenseInD2T).
	DenseOnCuBLAS bool

	dev            *cuda.Device
	k              *kernels
	blas           *cublas.Handle
	gate, up, down *cuda.Buffer
	tmB            *cuda.TensorMap // TMA map of the sparse-input weights (gate, or up)
	tmU            *cuda.TensorMap // TMA map of the up weights (the hot units' up products in D2T; tmB when not gated)
	nnz            *cuda.Buffer    // one uint64: active units counted by the last call

	ws    *workspace
	tmA   *cuda.TensorMap
	tmAx  cuda.DevicePtr
	tmAm  int
	wgErr error

	clusters int             // resident clusters of the wgmma D2T kernel (0: not yet asked)
	fits     map[mlpKey]bool // whether each gemv_mlp kernel's blocks are all resident at once

	// hot units (hot.go): the last hotK positions of the unit order; order
	// maps positions to the units given to NewMLP (nil: unchanged); bad is
	// why the weights are unusable (a reorder failed halfway)
	hotK       int
	order      []int
	calibrated bool
	bad        error

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
	var err error
	l.gate, l.up, l.down, l.nnz, err = uploadMLP(dev, wg, wu, wd, d, f)
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
	weightMap := func(w *cuda.Buffer) (*cuda.TensorMap, error) {
		return dev.EncodeTiled(cuda.TiledTensor{
			DataType: cuda.TensorBFloat16, Global: w.Ptr(),
			Dims: []uint64{uint64(d), uint64(f)}, Strides: []uint64{uint64(2 * d)},
			Box: []uint32{64, 128}, Swizzle: cuda.Swizzle128B, L2Promotion: cuda.L2Promotion256B,
		})
	}
	if err == nil {
		l.tmB, err = weightMap(l.sparseIn())
	}
	l.tmU = l.tmB
	if err == nil && l.Gated {
		l.tmU, err = weightMap(l.up)
	}
	if err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
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
	errs = append(errs,
		release(&l.hostNNZ, (*cuda.HostBuffer).Free),
		release(&l.evt, (*cuda.Event).Destroy),
		release(&l.hostOvf, (*cuda.HostBuffer).Free),
		release(&l.evtOvf, (*cuda.Event).Destroy),
		l.destroyEvents())
	return errors.Join(errs...)
}

// release frees *p with free, if it is set, and clears it.
func release[T any](p **T, free func(*T) error) error {
	if *p == nil {
		return nil
	}
	err := free(*p)
	*p = nil
	return err
}

// WeightBytes returns the device memory the weights take.
func (l *MLP) WeightBytes() int64 {
	n := int64(2 * 2 * l.D * l.F)
	if l.Gated {
		n += int64(2 * l.D * l.F)
	}
	return n
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
	if y != nil && y.Ptr() < x.Ptr().Add(need) && x.Ptr() < y.Ptr().Add(need) {
		// The sparse path writes y while later kernels (the hot units'
		// products, the flagged rows' recomputation) still read x.
		return fmt.Errorf("gpu: MLP output %v overlaps its input %v; the output must be a separate buffer", y, x)
	}
	if l.up == nil {
		return errors.New("gpu: MLP was closed")
	}
	return l.bad
}

// Sparse queues the TwELL MLP on stream s (nil: the default stream): D2T,
// then the sparse tail (see Tail), then the hot units' dense part when
// Calibrate chose some (hot.go; D2T and the tail then take the other
// units), then the dense recomputation of every row that D2T flagged: the
// first rows of the overflow list through a gathered cuBLASLt pass sized
// from the flagged rows seen in earlier calls, any others through the exact
// per-row kernel. x and y hold m x D bf16 values and must not overlap;
// m may be any positive count (the kernels pad inside). Batches of at most
// 8 tokens (decode steps) take the small-batch kernels instead (see
// gemv.cu): every gate row is read once and only the active units' up and
// down rows, with no capacity limit and no flagged rows.
func (l *MLP) Sparse(s *cuda.Stream, y, x *cuda.Buffer, m int) error {
	return l.sparse(s, y, x, m, true)
}

// Queue queues the MLP on path p (mlp.Dense, which needs a cuBLAS handle,
// runs the dense arm Forward would; any other value runs sparse) without
// the automatic path's bookkeeping: no timing, and no copies of the active
// or flagged counts to the host. This is the form to record into a CUDA
// graph (see Settled for the path and Epoch for the graph's validity):
// replays rerun exactly the recorded work, and rows D2T flags still get
// exact results (the gathered pass takes as many rows as Sparse would
// give it now, the per-row kernel the rest).
func (l *MLP) Queue(s *cuda.Stream, y, x *cuda.Buffer, m int, p mlp.Path) error {
	if p == mlp.Dense && l.blas != nil {
		return l.dense(s, y, x, m)
	}
	return l.sparse(s, y, x, m, false)
}

// dense queues the dense arm of l.Path: under mlp.Auto from
// denseD2TMinRows tokens DenseInD2T where it runs (see DenseOnCuBLAS),
// else, and always under a fixed mlp.Dense, the cuBLASLt baseline (Dense).
func (l *MLP) dense(s *cuda.Stream, y, x *cuda.Buffer, m int) error {
	if l.Path == mlp.Auto && l.denseInD2T(m) {
		return l.DenseInD2T(s, y, x, m)
	}
	return l.Dense(s, y, x, m)
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
	cols := l.sparseCols()
	hot, err := l.hotSlice(cols)
	if err != nil {
		return err
	}
	ws, projected, err := l.runD2T(s, x, m, cols, hot)
	if err != nil {
		return err
	}
	set, err := l.k.t2dFor(l.D)
	if err != nil {
		return err
	}
	if err := l.tail(s, set, y, x, ws, m, cols); err != nil {
		return err
	}
	if hot != nil {
		if err := l.hotDense(s, y, x, m, hot, projected); err != nil {
			return err
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

// Forward queues the MLP on stream s on l.Path: mlp.Sparse or mlp.Dense
// always, or under mlp.Auto the path expected to be faster. Each call
// counts the active units of its batch (in D2T, or in the dense elementwise
// pass, whose count runs on over consecutive dense calls so that the dense
// path adds no reset) and copies the count back without waiting; under
// mlp.Auto the next call that finds the count arrived passes the density
// (mean active units per token / F) to mlp.Choose with DenseAbove (with
// Measure, measuredBand times it) and runs dense above it. Below it, with
// Measure set, the path measured faster for
// this batch size runs (the first calls of a size time sparse, then dense;
// see autopath.go). Under mlp.Auto the dense arm runs in D2T from
// denseD2TMinRows tokens where it can (DenseInD2T; see DenseOnCuBLAS); a
// fixed mlp.Dense always runs the cuBLASLt baseline. It returns the path
// it ran (mlp.Sparse or mlp.Dense).
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
		err = l.dense(s, y, x, m)
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
