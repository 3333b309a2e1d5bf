package gpu

import (
	_ "embed"
	"errors"
	"fmt"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
)

// denseSrc holds the dense path's elementwise kernels and those of the
// gathered dense pass over flagged rows.
//
//go:embed dense.cu
var denseSrc []byte

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

// Dense queues the dense MLP on stream s (DenseMLP.Queue on the MLP's
// weights and workspace): cuBLASLt GEMMs for the gate, up and down
// projections and one elementwise kernel for relu(g) * u, which also counts
// the active units.
func (l *MLP) Dense(s *cuda.Stream, y, x *cuda.Buffer, m int) error {
	if err := l.checkIO(y, x, m); err != nil {
		return err
	}
	if l.blas == nil {
		return errors.New("gpu: dense MLP needs a cuBLAS handle (NewMLP was given nil)")
	}
	dn := DenseMLP{D: l.D, F: l.F, Gated: l.Gated, Act: ActReLU, dev: l.dev, k: l.k, blas: l.blas,
		gate: l.gate, up: l.up, down: l.down, nnz: l.nnz}
	if err := dn.queue(s, y, x, m, &l.ws.dn, l.realloc, false); err != nil {
		return err
	}
	l.counted += m // the count accumulates until the next D2T zeroes it
	return nil
}

// DenseInD2T queues the dense MLP with its gate and up products in the
// wgmma D2T kernel: every unit runs as a hot unit (hot.go), so the kernel's
// epilogue stores h = relu(g) u as bf16 and counts the units that fired,
// where cuBLASLt's GEMMs write g and u for relu_mul to read back (at m =
// 65536 and the SparseLM shape, 2.2 GB of traffic a call); cuBLASLt's down
// product follows. h has the same bits as the dense path's for the same
// bf16 products (store_hot, d2t_wgmma.cu); the products' fp32 sums differ
// from cuBLASLt's in order. It needs the wgmma D2T kernel (Hopper) with
// the hot units in it (not SeparateHot) and a cuBLAS handle.
func (l *MLP) DenseInD2T(s *cuda.Stream, y, x *cuda.Buffer, m int) error {
	if err := l.checkIO(y, x, m); err != nil {
		return err
	}
	if l.blas == nil {
		return errors.New("gpu: dense MLP needs a cuBLAS handle (NewMLP was given nil)")
	}
	if _, kind, err := l.d2tKernel(); err != nil || !l.hotInKernel(kind) {
		return fmt.Errorf("gpu: the dense MLP in D2T needs the wgmma D2T kernel (sm_90a) with the hot units in it; this MLP runs %v (SeparateHot %v, %v)", kind, l.SeparateHot, err)
	}
	dn, err := l.hotSlice(0)
	if err != nil {
		return err
	}
	if _, _, err := l.runD2T(s, x, m, 0, dn); err != nil {
		return err
	}
	return dn.downProduct(s, y, m, l.ws.hot.g, false)
}

// CanDenseInD2T reports whether DenseInD2T runs on this MLP and device.
func (l *MLP) CanDenseInD2T() bool { return l.blas != nil && l.hotInD2T() }

// denseD2TMinRows is the smallest call whose dense arm the automatic path
// runs in D2T (DenseInD2T) rather than on cuBLASLt's three GEMMs. At the
// SparseLM shape DenseInD2T ran at 1.06-1.09x the cuBLASLt path's speed
// from 4096 to 16384 tokens on an H100 and 1.05-1.06x at 65536 on an H200,
// but at 0.96x at 2048 (H100), 0.95x at 1024 and 0.79x at 64 (H200): the
// D2T's rounds of work items cost more than the round trip saves at small
// calls (docs/gpu-twell.md, "The dense arm in the D2T").
const denseD2TMinRows = 4096

// denseInD2T reports whether the automatic path's dense arm runs a call of
// m tokens through DenseInD2T.
func (l *MLP) denseInD2T(m int) bool {
	return !l.DenseOnCuBLAS && m >= denseD2TMinRows && l.CanDenseInD2T()
}

// Activation is the gate activation of a DenseMLP.
type Activation int

// Activations.
const (
	ActReLU Activation = iota
	ActSiLU
)

// DenseMLP is one dense MLP layer on a GPU through cuBLASLt, any shape and
// either activation: the dense path of MLP (which runs it on its own
// weights) and the MLP of model layers that the TwELL kernels do not take.
// Weights are bf16, Wg and Wu as [F, D] and Down = Wd^T as [F, D], as in
// MLP. Its methods queue work on a stream and keep workspace, so a DenseMLP
// must not be used by several goroutines at once.
//
//	gated:     y = (act(x Wg^T) * (x Wu^T)) Wd^T
//	non-gated: y = act(x Wu^T) Wd^T
type DenseMLP struct {
	D, F  int
	Gated bool
	Act   Activation

	dev            *cuda.Device
	k              *kernels
	blas           *cublas.Handle
	gate, up, down *cuda.Buffer
	nnz            *cuda.Buffer // active-unit counter of the ReLU kernels
	own            bool         // Close frees the weights and the counter
	ws             *denseWS     // NewDenseMLP's workspace (MLP passes its own to queue)
}

// denseWS is the dense path's activation memory: the gate and up
// projections (h overwrites the gate's), grown to the largest call.
type denseWS struct {
	g, u  *cuda.Buffer
	refs  int    // DenseMLPs using it (NewDenseMLP's)
	epoch uint64 // reallocations (NewDenseMLP's)
}

// NewDenseMLP uploads a dense MLP layer given in nn.Linear layout (float32,
// row-major): wg and wu are f x d, wd is d x f; wg is nil for a non-gated
// MLP.
func NewDenseMLP(dev *cuda.Device, blas *cublas.Handle, wg, wu, wd []float32, d, f int, act Activation) (*DenseMLP, error) {
	switch {
	case blas == nil:
		return nil, errors.New("gpu: NewDenseMLP needs a cuBLAS handle")
	case d < 1 || f < 1:
		return nil, fmt.Errorf("gpu: dense MLP of hidden size %d and width %d", d, f)
	case len(wu) != f*d || len(wd) != d*f || (wg != nil && len(wg) != f*d):
		return nil, fmt.Errorf("gpu: MLP weights hold %d (gate), %d (up), %d (down) values, want %d each", len(wg), len(wu), len(wd), f*d)
	case act != ActReLU && act != ActSiLU:
		return nil, fmt.Errorf("gpu: activation %d", act)
	}
	l := &DenseMLP{D: d, F: f, Gated: wg != nil, Act: act, dev: dev, k: kernelsFor(dev), blas: blas, own: true,
		ws: &denseWS{refs: 1}}
	var err error
	if l.gate, l.up, l.down, l.nnz, err = uploadMLP(dev, wg, wu, wd, d, f); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// uploadMLP uploads an MLP's weights in nn.Linear layout (wg nil for a
// non-gated MLP) as bf16 gate, up and down = wd^T (f x d), and allocates
// an active-unit counter. After an error the buffers it returns (some may
// be nil) are the caller's to free.
func uploadMLP(dev *cuda.Device, wg, wu, wd []float32, d, f int) (gate, up, down, nnz *cuda.Buffer, err error) {
	upload := func(w []float32) *cuda.Buffer {
		if err != nil || w == nil {
			return nil
		}
		var b *cuda.Buffer
		b, err = uploadBF16(dev, w)
		return b
	}
	t := make([]float32, f*d)
	for k := 0; k < d; k++ {
		for j, v := range wd[k*f : (k+1)*f] {
			t[j*d+k] = v
		}
	}
	gate, up, down = upload(wg), upload(wu), upload(t)
	if err == nil {
		if nnz, err = dev.Alloc(8); err == nil {
			err = dev.Memset8(nnz, 0, nil)
		}
	}
	return gate, up, down, nnz, err
}

// grow returns b if it holds n bytes, else a new buffer of n bytes
// (freeing b), counting the reallocation in *epoch.
func grow(dev *cuda.Device, b *cuda.Buffer, n int, epoch *uint64) (*cuda.Buffer, error) {
	if b != nil && b.Len() >= n {
		return b, nil
	}
	if b != nil {
		if err := b.Free(); err != nil {
			return nil, err
		}
	}
	*epoch++
	return dev.Alloc(n)
}

// Close frees the layer's device memory (the workspace when l is the last
// DenseMLP sharing it).
func (l *DenseMLP) Close() error {
	var errs []error
	if l.own {
		for _, b := range []*cuda.Buffer{l.gate, l.up, l.down, l.nnz} {
			if b != nil {
				errs = append(errs, b.Free())
			}
		}
	}
	l.gate, l.up, l.down, l.nnz = nil, nil, nil, nil
	if ws := l.ws; ws != nil {
		l.ws = nil
		if ws.refs--; ws.refs == 0 {
			for _, b := range []*cuda.Buffer{ws.g, ws.u} {
				if b != nil {
					errs = append(errs, b.Free())
				}
			}
		}
	}
	return errors.Join(errs...)
}

// ShareWorkspace makes l use o's activation workspace instead of its own,
// so that a model's dense layers hold the workspace of their largest call
// once. l and o must have the same D, F and gating and must not run at the
// same time: their calls must be queued on one stream.
func (l *DenseMLP) ShareWorkspace(o *DenseMLP) error {
	switch {
	case l.ws == nil || o.ws == nil:
		return errors.New("gpu: DenseMLP.ShareWorkspace on a closed MLP")
	case l.dev != o.dev || l.D != o.D || l.F != o.F || l.Gated != o.Gated:
		return errors.New("gpu: DenseMLP.ShareWorkspace between MLPs of different devices or shapes")
	case l.ws == o.ws:
		return nil
	}
	if l.ws.refs--; l.ws.refs == 0 {
		for _, b := range []*cuda.Buffer{l.ws.g, l.ws.u} {
			if b != nil {
				if err := b.Free(); err != nil {
					return err
				}
			}
		}
	}
	l.ws = o.ws
	o.ws.refs++
	return nil
}

// WeightBytes returns the device memory the weights take.
func (l *DenseMLP) WeightBytes() int64 {
	n := int64(2 * 2 * l.D * l.F)
	if l.Gated {
		n += int64(2 * l.D * l.F)
	}
	return n
}

// Epoch counts the reallocations of the layer's workspace (shared with the
// DenseMLPs of ShareWorkspace): work recorded into a CUDA graph stays valid
// while it is unchanged.
func (l *DenseMLP) Epoch() uint64 { return l.ws.epoch }

// Reserve grows the workspace to hold calls of m tokens.
func (l *DenseMLP) Reserve(m int) error {
	_, err := l.workspace(m, l.ws, l.realloc)
	return err
}

// realloc returns b if it holds n bytes, else a new buffer (freeing b).
func (l *DenseMLP) realloc(b *cuda.Buffer, n int) (*cuda.Buffer, error) {
	return grow(l.dev, b, n, &l.ws.epoch)
}

// Forward queues the layer on stream s for m tokens: x and y hold m x D
// bf16 values.
func (l *DenseMLP) Forward(s *cuda.Stream, y, x *cuda.Buffer, m int) error {
	switch {
	case l.up == nil:
		return errors.New("gpu: DenseMLP was closed")
	case m < 1:
		return fmt.Errorf("gpu: MLP call with %d tokens; want at least 1", m)
	case x == nil || x.Len() < 2*m*l.D || y == nil || y.Len() < 2*m*l.D:
		return fmt.Errorf("gpu: MLP input %v or output %v holds fewer than %d bytes (%d tokens x %d bf16)", x, y, 2*m*l.D, m, l.D)
	}
	return l.queue(s, y, x, m, l.ws, l.realloc, false)
}

// workspace grows ws to m tokens of l's width with realloc (the hot units'
// workspace of an MLP serves widths that change as Calibrate chooses).
func (l *DenseMLP) workspace(m int, ws *denseWS, realloc func(*cuda.Buffer, int) (*cuda.Buffer, error)) (*denseWS, error) {
	n := 2 * m * l.F
	var err error
	if ws.g, err = realloc(ws.g, n); err != nil {
		return nil, err
	}
	if l.Gated {
		if ws.u, err = realloc(ws.u, n); err != nil {
			return nil, err
		}
	}
	return ws, nil
}

// queue queues the layer on stream s, with workspace ws grown by realloc:
// cuBLASLt GEMMs (bf16 in and out, fp32 accumulate) for the gate, up and
// down projections and one elementwise kernel: for ReLU with F a multiple
// of 8, relu_mul or relu_inplace (8 values per thread), which also count
// the active units into l.nnz; else act_mul. With add, the down product is
// added into y (the hot units of MLP, added to the sparse tail's output).
func (l *DenseMLP) queue(s *cuda.Stream, y, x *cuda.Buffer, m int, ws *denseWS, realloc func(*cuda.Buffer, int) (*cuda.Buffer, error), add bool) error {
	ws, err := l.workspace(m, ws, realloc)
	if err != nil {
		return err
	}
	proj := cublas.Gemm{M: m, N: l.F, K: l.D, TransB: true}
	first := l.up
	if l.Gated {
		first = l.gate
		if err := l.blas.Matmul(s, proj, x, l.up, ws.u); err != nil {
			return err
		}
	}
	if err := l.blas.Matmul(s, proj, x, first, ws.g); err != nil {
		return err
	}
	ek, err := l.k.dense()
	if err != nil {
		return err
	}
	n := int64(m) * int64(l.F)
	sms := l.dev.Properties().SMs
	switch {
	case l.Act == ActReLU && l.F%8 == 0 && l.Gated:
		err = ek.reluMul.Launch(elemGrid(n, sms), cuda.Dim3{256, 1, 1}, 0, s, ws.g, ws.u, ws.g, n, l.nnz)
	case l.Act == ActReLU && l.F%8 == 0:
		err = ek.reluInplace.Launch(elemGrid(n, sms), cuda.Dim3{256, 1, 1}, 0, s, ws.g, n, l.nnz)
	default:
		var u any = cuda.DevicePtr(0)
		gated := int32(0)
		if l.Gated {
			u, gated = ws.u, 1
		}
		grid := cuda.Dim3{uint32(min((n+255)/256, int64(sms*16))), 1, 1}
		err = ek.actMul.Launch(grid, cuda.Dim3{256, 1, 1}, 0, s, ws.g, u, n, int32(l.Act), gated)
	}
	if err != nil {
		return err
	}
	return l.downProduct(s, y, m, ws.g, add)
}

// downProduct queues y = h D (with add, y += h D) for m rows of h.
func (l *DenseMLP) downProduct(s *cuda.Stream, y *cuda.Buffer, m int, h *cuda.Buffer, add bool) error {
	down := cublas.Gemm{M: m, N: l.D, K: l.F}
	if add {
		down.Alpha, down.Beta = 1, 1
	}
	return l.blas.Matmul(s, down, h, l.down, y)
}

// denseSet are the elementwise kernels of the dense MLP (dense.cu).
type denseSet struct {
	reluMul, reluInplace, actMul *cuda.Function
}

// denseExprs are the kernels of dense.cu: the dense MLP's, then the
// gathered dense pass's.
var denseExprs = []string{"relu_mul", "relu_inplace", "act_mul", "gather_rows", "scatter_rows", "act_exact<true>", "act_exact<false>"}

// compileDense compiles dense.cu once: the dense MLP's elementwise kernels
// and those of the gathered dense pass over flagged rows.
func (k *kernels) compileDense() error {
	k.denseOnce.Do(func() {
		exprs := denseExprs
		fs, err := k.compile("dense.cu", denseSrc, exprs)
		if err != nil {
			k.denseErr = err
			return
		}
		k.dn = denseSet{reluMul: fs[exprs[0]], reluInplace: fs[exprs[1]], actMul: fs[exprs[2]]}
		k.gath = gatheredSet{gather: fs[exprs[3]], scatter: fs[exprs[4]], actGated: fs[exprs[5]], actPlain: fs[exprs[6]]}
	})
	return k.denseErr
}

// dense returns the elementwise kernels of the dense MLP.
func (k *kernels) dense() (*denseSet, error) {
	err := k.compileDense()
	return &k.dn, err
}
