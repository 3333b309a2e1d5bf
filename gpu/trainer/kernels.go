package trainer

import (
	_ "embed"
	"fmt"
	"sync"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/gpu"
)

var (
	//go:embed layers.cu
	layersSrc []byte
	//go:embed optim.cu
	optimSrc []byte
	//go:embed sparse.cu
	sparseSrc []byte
)

// kernelFiles are this package's .cu files (but attention's, which its own
// launcher compiles) and the kernels looked up in each.
var kernelFiles = []struct {
	name    string
	src     *[]byte
	kernels []string
}{
	{"layers.cu", &layersSrc, []string{"sum_f64", "embed_fwd", "sort_pass", "embed_seg", "embed_join", "rmsnorm_fwd",
		"rmsnorm_bwd1", "rmsnorm_bwd2", "rmsnorm_bwd4", "rmsnorm_dw_sum", "rope_bf16", "relu_fwd", "relu_bwd", "ce_chunk"}},
	{"optim.cu", &optimSrc, []string{"sumsq", "adamw", "to_bf16", "reinit_rows"}},
	{"sparse.cu", &sparseSrc, []string{"sp_row_count", "sp_row_write", "sp_scan", "sp_col_count", "sp_col_prefix", "sp_col_fill",
		"sp_up", "sp_grad", "sp_rows", "sp_col_plan", "sp_cols", "sp_col_reduce"}},
}

// kernels are the compiled functions of kernelFiles on one device, by name.
type kernels map[string]*cuda.Function

var (
	kernMu  sync.Mutex
	kernTab = map[*cuda.Device]kernels{}
)

// kernelsFor compiles kernelFiles for dev with package gpu's headers (once
// per process; NVRTC's output is also cached on disk) and looks their
// kernels up.
func kernelsFor(dev *cuda.Device) (kernels, error) {
	kernMu.Lock()
	defer kernMu.Unlock()
	if k := kernTab[dev]; k != nil {
		return k, nil
	}
	k := kernels{}
	for _, file := range kernelFiles {
		mod, err := dev.Compile(file.name, *file.src, gpu.Headers()...)
		if err != nil {
			return nil, fmt.Errorf("trainer: compiling %s: %w", file.name, err)
		}
		for _, name := range file.kernels {
			if k[name], err = mod.Function(name); err != nil {
				return nil, fmt.Errorf("trainer: kernel %s: %w", name, err)
			}
		}
	}
	kernTab[dev] = k
	return k, nil
}

// Launch geometry, in one place.
const (
	rowBlock  = 256  // threads of a one-block-per-row kernel (sp_up and sp_grad are built for at most 256)
	wideBlock = 1024 // threads of ce_chunk (rows of a vocabulary)
	flatBlock = 256  // threads of a grid-stride kernel
	flatGrid  = 1024 // at most this many blocks for a grid-stride kernel
	rowsPer   = 64   // rows each block of a column-parallel reduction takes
	normParts = 256  // at most this many partial sums of an RMSNorm gain gradient (blocks of rmsnorm_bwd)
	normVec   = 4    // float4 columns an RMSNorm thread keeps (layers.cu's NORM_VEC)
	sortTile  = 1024 // keys per block of sort_pass (its threads)
	embChunk  = 256  // sorted tokens per block of embed_seg and embed_join (their threads)
)

func dim(x int) cuda.Dim3     { return cuda.Dim3{uint32(x), 1, 1} }
func dim2(x, y int) cuda.Dim3 { return cuda.Dim3{uint32(x), uint32(y), 1} }
func ceil(a, b int) int       { return (a + b - 1) / b }
func flatBlocks(n int) int    { return max(1, min(flatGrid, ceil(n, flatBlock))) }
func flat(n int) cuda.Dim3    { return dim(flatBlocks(n)) }
func optional(b *cuda.Buffer) any {
	if b == nil {
		return cuda.DevicePtr(0)
	}
	return b
}

// need checks that buffer b (named what) holds at least n bytes.
func need(what string, b *cuda.Buffer, n int) error {
	if b == nil {
		return fmt.Errorf("trainer: %s buffer is nil", what)
	}
	if b.Len() < n {
		return fmt.Errorf("trainer: %s buffer has %d bytes, needs %d", what, b.Len(), n)
	}
	return nil
}

func check(checks ...error) error {
	for _, e := range checks {
		if e != nil {
			return e
		}
	}
	return nil
}

// launcher queues this package's kernels on one stream.
type launcher struct {
	k kernels
	s *cuda.Stream
	// grid is the block count of the persistent kernels (those that loop
	// over their work items): enough 256-thread blocks to fill the GPU.
	grid int
	sms  int // the device's multiprocessors
}

// newLauncher returns the launcher of kernels k on stream s of dev, its
// persistent grid enough 256-thread blocks to fill dev.
func newLauncher(k kernels, s *cuda.Stream, dev *cuda.Device) launcher {
	sms := max(1, dev.Properties().SMs)
	return launcher{k: k, s: s, grid: 8 * sms, sms: sms}
}

// embedFwd sets x[t] = table[ids[t]] for n tokens of h values (fp32).
func (l launcher) embedFwd(x, table, ids *cuda.Buffer, n, h int) error {
	if err := check(need("embedding output", x, 4*n*h), need("token ids", ids, 4*n)); err != nil {
		return err
	}
	return l.k["embed_fwd"].Launch(dim(n), dim(rowBlock), 0, l.s, table, ids, x, int32(h))
}

// sumF64 adds, for q < k, the n fp64 partial sums part[q·n:(q+1)·n] into
// out[q], in a fixed order.
func (l launcher) sumF64(out, part *cuda.Buffer, n, k int) error {
	if err := check(need("sums", out, 8*k), need("partial sums", part, 8*n*k)); err != nil {
		return err
	}
	return l.k["sum_f64"].Launch(dim(k), dim(wideBlock), 0, l.s, out, part, int32(n))
}

// embedSizes are the byte sizes of embedBwd's work views for n tokens of h
// values, in carving order: two buffers of sorted ids and two of their
// positions (the sort's passes alternate), the tiles' digit counts and
// their prefix, and the pieces of the runs that cross chunks ([chunks][2][h]
// fp32).
func embedSizes(n, h int) []int {
	tiles := ceil(n, sortTile)
	return []int{4 * n, 4 * n, 4 * n, 4 * n, 4 * 256 * tiles, 4 * (256*tiles + 1), 8 * ceil(n, embChunk) * h}
}

// embedBwd adds dx[t] into gtable[ids[t]] for n tokens of ids below V, in a
// fixed order (see layers.cu): a radix sort of the positions by id, 8 bits
// a pass, then the sums of each id's rows in position order. work holds
// embedSizes(n, h).
func (l launcher) embedBwd(gtable, ids, dx, work *cuda.Buffer, n, h, V int) error {
	if err := check(need("embedding gradient input", dx, 4*n*h), need("token ids", ids, 4*n),
		need("embedding gradient", gtable, 4*V*h)); err != nil {
		return err
	}
	sl := &slicer{}
	v := carve(sl, work, embedSizes(n, h))
	if sl.err != nil {
		return sl.err
	}
	tiles := ceil(n, sortTile)
	var kin, vin any = ids, cuda.DevicePtr(0) // the first pass's values are the positions
	for shift, p := 0, 0; p == 0 || (V-1)>>shift != 0; shift, p = shift+8, p+1 {
		kout, vout := v[p&1], v[2+(p&1)]
		err := inOrder(
			func() error {
				return l.k["sort_pass"].Launch(dim(tiles), dim(sortTile), 0, l.s, kin, vin, cuda.DevicePtr(0), cuda.DevicePtr(0),
					v[4], cuda.DevicePtr(0), int32(n), int32(shift))
			},
			func() error { return l.k["sp_scan"].Launch(dim(1), dim(1024), 0, l.s, v[4], v[5], int32(256*tiles)) },
			func() error {
				return l.k["sort_pass"].Launch(dim(tiles), dim(sortTile), 0, l.s, kin, vin, kout, vout, cuda.DevicePtr(0), v[5],
					int32(n), int32(shift))
			})
		if err != nil {
			return err
		}
		kin, vin = kout, vout
	}
	grid := dim2(ceil(n, embChunk), ceil(h, embChunk))
	return inOrder(
		func() error {
			return l.k["embed_seg"].Launch(grid, dim(embChunk), 0, l.s, gtable, kin, vin, dx, v[6], int32(n), int32(h))
		},
		func() error {
			return l.k["embed_join"].Launch(grid, dim(embChunk), 0, l.s, gtable, kin, v[6], int32(n), int32(h))
		})
}

// rmsNormFwd sets y (bf16) and rstd (fp32) from x (fp32), rows of h.
func (l launcher) rmsNormFwd(y, rstd, x, w *cuda.Buffer, rows, h int, eps float64) error {
	if err := check(normWidth(h), need("norm output", y, 2*rows*h), need("norm rstd", rstd, 4*rows),
		need("norm input", x, 4*rows*h), need("norm gain", w, 4*h)); err != nil {
		return err
	}
	return l.k["rmsnorm_fwd"].Launch(dim(rows), dim(normThreads(h)), 0, l.s, x, w, y, rstd, int32(h), float32(eps))
}

// normThreads is the block size of the RMSNorm kernels for rows of h
// values: each thread keeps at most normVec float4 of a row; at least 256
// threads, a multiple of 32.
func normThreads(h int) int { return max(256, 32*ceil(ceil(h/4, normVec), 32)) }

// maxNormWidth is the widest row the RMSNorm kernels take (layers.cu's
// NORM_THREADS threads of normVec float4).
const maxNormWidth = 4 * normVec * 512

// normWidth returns an error unless the RMSNorm kernels take rows of h
// values: a multiple of 4 (16-byte loads) up to maxNormWidth.
func normWidth(h int) error {
	if h <= 0 || h%4 != 0 || h > maxNormWidth {
		return fmt.Errorf("trainer: hidden size %d: the GPU RMSNorm kernels take multiples of 4 up to %d", h, maxNormWidth)
	}
	return nil
}

// normBwdKernel names the RMSNorm backward kernel for rows of h values:
// the one whose threads keep as many float4 columns as normThreads(h)
// threads need (rmsnorm_bwd1 and rmsnorm_bwd2 run only where that is 256).
func normBwdKernel(h int) string {
	switch ceil(h/4, normThreads(h)) {
	case 1:
		return "rmsnorm_bwd1"
	case 2:
		return "rmsnorm_bwd2"
	}
	return "rmsnorm_bwd4"
}

// rmsNormBwd adds the input gradient into dx and the gain's into dw, from
// dy (fp32) and the forward's x and rstd, and writes bf16(dx) into dxb
// unless it is nil, in one pass over dy, x and dx:
// min(rows, normParts) blocks of consecutive rows each write their partial
// sums of the gain gradient into part (fp32 [normParts][h]), which
// rmsnorm_dw_sum then adds up in a fixed order.
func (l launcher) rmsNormBwd(dx, dxb, dw, dy, x, w, rstd, part *cuda.Buffer, rows, h int) error {
	per := ceil(rows, normParts)
	parts := ceil(rows, per)
	if err := check(normWidth(h), need("norm dx", dx, 4*rows*h), need("norm dy", dy, 4*rows*h),
		need("norm input", x, 4*rows*h), need("norm rstd", rstd, 4*rows), need("norm gain gradient", dw, 4*h),
		need("norm gain partial sums", part, 4*parts*h)); err != nil {
		return err
	}
	if dxb != nil {
		if err := need("norm bf16 dx", dxb, 2*rows*h); err != nil {
			return err
		}
	}
	return inOrder(
		func() error {
			return l.k[normBwdKernel(h)].Launch(dim(parts), dim(normThreads(h)), 0, l.s, dx, optional(dxb), part, dy, x, w, rstd,
				int32(rows), int32(h), int32(per))
		},
		func() error {
			return l.k["rmsnorm_dw_sum"].Launch(dim(ceil(h, 32)), dim(rowBlock), 0, l.s, dw, part, int32(parts), int32(h))
		})
}

// ropeBF16 rotates the first nrot heads of hd values of n bf16 rows of
// width values in place (the backward turns them back in the attention
// kernels' stores: attention.cuh's GradOut). The kernel takes four values
// at a time: hd % 8 == 0.
func (l launcher) ropeBF16(x, cos, sin *cuda.Buffer, n, seq, nrot, hd, width int) error {
	if hd%8 != 0 || nrot*hd > width {
		return fmt.Errorf("trainer: rope over %d heads of %d in rows of %d: want heads of a multiple of 8 within the row", nrot, hd, width)
	}
	if err := check(need("rope rows", x, 2*n*width), need("rope cos", cos, 4*seq*hd/2),
		need("rope sin", sin, 4*seq*hd/2)); err != nil {
		return err
	}
	return l.k["rope_bf16"].Launch(dim(n), dim(rowBlock), 0, l.s, x, cos, sin, int32(seq), int32(nrot), int32(hd),
		int32(width))
}

// reluArgs are the operands of the MLP activation of m rows of f units:
// gu the fp32 pre-activations (gated: [m][2f], gate then up; else [m][f]).
type reluArgs struct {
	gu    *cuda.Buffer
	m, f  int
	gated bool
}

func (a reluArgs) check() error {
	w := a.f
	if a.gated {
		w *= 2
	}
	return need("MLP pre-activations", a.gu, 4*a.m*w)
}

func b2i(b bool) int32 {
	if b {
		return 1
	}
	return 0
}

// reluFwd writes h (bf16 [m][f]) and adds the firing counts into active
// (int32 [f]) and l1Scale·Σ|h|, l0Scale·(units fired) into stats[0], stats[1]
// (fp64), through per-block partial sums in part.
func (l launcher) reluFwd(a reluArgs, h, active, stats, part *cuda.Buffer, l1Scale, l0Scale float64) error {
	nb := ceil(a.f, rowBlock) * ceil(a.m, rowsPer)
	if err := check(a.check(), need("MLP hidden", h, 2*a.m*a.f), need("firing counts", active, 4*a.f),
		need("statistics", stats, 16), need("statistics partial sums", part, 16*nb)); err != nil {
		return err
	}
	return inOrder(
		func() error {
			return l.k["relu_fwd"].Launch(dim2(ceil(a.f, rowBlock), ceil(a.m, rowsPer)), dim(rowBlock), 0, l.s,
				a.gu, h, active, part, int32(a.m), int32(a.f), b2i(a.gated), int32(rowsPer), l1Scale, l0Scale)
		},
		func() error { return l.sumF64(stats, part, nb, 2) })
}

// reluBwd writes dgu (bf16, gu's layout) from dh (fp32 [m][f]) plus
// l1Grad·sign(h).
func (l launcher) reluBwd(a reluArgs, dgu, dh *cuda.Buffer, l1Grad float32) error {
	w := a.f
	if a.gated {
		w *= 2
	}
	if err := check(a.check(), need("MLP pre-activation gradient", dgu, 2*a.m*w), need("MLP hidden gradient", dh, 4*a.m*a.f)); err != nil {
		return err
	}
	return l.k["relu_bwd"].Launch(flat(a.m*a.f), dim(flatBlock), 0, l.s, a.gu, dh, dgu, int32(a.m), int32(a.f),
		b2i(a.gated), l1Grad)
}

// crossEntropy writes lossScale·NLL of each row of fp32 logits [rows][V]
// into loss (fp64 [rows], for sumF64) and, with dlogits set,
// gradScale·(softmax - onehot) into dlogits (bf16).
func (l launcher) crossEntropy(logits, targets, dlogits, loss *cuda.Buffer, rows, V int, gradScale float32, lossScale float64) error {
	if err := check(need("logits", logits, 4*rows*V), need("targets", targets, 4*rows), need("loss", loss, 8*rows)); err != nil {
		return err
	}
	if dlogits != nil {
		if err := need("logit gradient", dlogits, 2*rows*V); err != nil {
			return err
		}
	}
	return l.k["ce_chunk"].Launch(dim(rows), dim(wideBlock), 0, l.s, logits, targets, optional(dlogits), loss,
		int32(V), gradScale, lossScale)
}

// sumSq adds Σ x² over n fp32 values into out (fp64), through per-block
// partial sums in part (fp64, flatGrid at most).
func (l launcher) sumSq(out, part, x *cuda.Buffer, n int) error {
	nb := flatBlocks(n)
	if err := check(need("sum of squares input", x, 4*n), need("sum of squares", out, 8),
		need("sum of squares partial sums", part, 8*nb)); err != nil {
		return err
	}
	return inOrder(
		func() error { return l.k["sumsq"].Launch(dim(nb), dim(flatBlock), 0, l.s, x, int64(n), part) },
		func() error { return l.sumF64(out, part, nb, 1) })
}

// adamWArgs are the per-tensor operands of an AdamW step; gradScale
// multiplies the gradient as it is read (the clipping factor).
type adamWArgs struct {
	gradScale, b1, b2, wd, stepSize, invB2c, eps float32
}

// adamW applies one step to n values of w (fp32) with gradient g (times
// a.gradScale) and moments m, v, and refreshes wb (bf16).
func (l launcher) adamW(w, wb, g, m, v *cuda.Buffer, n int, a adamWArgs) error {
	if err := check(need("weights", w, 4*n), need("bf16 weights", wb, 2*n), need("gradient", g, 4*n),
		need("first moment", m, 4*n), need("second moment", v, 4*n)); err != nil {
		return err
	}
	return l.k["adamw"].Launch(flat(ceil(n, 4)), dim(flatBlock), 0, l.s, w, wb, g, m, v, int64(n), a.gradScale, a.b1, a.b2, a.wd,
		a.stepSize, a.invB2c, a.eps)
}

// toBF16 refreshes wb = bf16(w) for n values.
func (l launcher) toBF16(wb, w *cuda.Buffer, n int) error {
	if err := check(need("weights", w, 4*n), need("bf16 weights", wb, 2*n)); err != nil {
		return err
	}
	return l.k["to_bf16"].Launch(flat(n), dim(flatBlock), 0, l.s, w, wb, int64(n))
}

// reinitRows gives rows units (int32 [n]) of a tensor of rows of h values
// the values rows ([n][h] fp32; nil: zeros) and zero moments. The moment
// buffers m and v hold the tensor's values [mlo, mhi) only (a rank's
// shard); moments outside it are left to their ranks.
func (l launcher) reinitRows(w, wb, m, v, rows, units *cuda.Buffer, n, h, mlo, mhi int) error {
	if err := need("unit ids", units, 4*n); err != nil {
		return err
	}
	return l.k["reinit_rows"].Launch(dim(n), dim(rowBlock), 0, l.s, w, wb, m, v, optional(rows), units, int32(h),
		int64(mlo), int64(mhi))
}
