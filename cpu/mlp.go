package cpu

import (
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/twell"
)

// scratch recycles the dense activation buffers of Dense between calls, so
// that the baseline does not pay page faults for fresh memory every time.
var scratch sync.Pool

func getScratch(n int) *[]float32 { return fromPool(&scratch, n) }

// MLP holds one MLP layer's weights in the layouts the CPU kernels want:
// packed panels for the dense GEMMs, and contiguous unit rows (row j of Wu
// and of Wd^T) for the sparse kernels.
//
// Gated:     y = (relu(x Wg^T) * (x Wu^T)) Wd^T
// Non-gated: y = relu(x Wu^T) Wd^T
type MLP struct {
	D, F  int  // hidden size d and MLP width f
	Gated bool // whether the MLP has a gate projection
	// Act is the activation of the gate (or, non-gated, of the up
	// projection). The sparse paths need ReLU; SiLU runs densely.
	Act Activation
	// Path is how Forward runs: mlp.Auto (D2T, then the sparse or the
	// dense finish by measured density), mlp.Sparse or mlp.Dense.
	Path mlp.Path
	// DenseAbove is the density (active units / F) above which Forward
	// under mlp.Auto finishes on the dense path; NewMLP sets it to
	// DefaultDenseAbove.
	DenseAbove float64

	gate, up, down   *PackedB   // Wg [F x D], Wu [F x D], Wd [D x F], packed; see Trim
	upRows, downRows unitRows   // Wu and Wd^T, F x D row-major
	panelsMu         sync.Mutex // guards packing the dense panels again after Trim
	smallBF16        bool       // UseBF16ForSmallM was called: panels packed again get it too
}

// unitRows holds F rows of d weights, one per MLP unit (row j of Wu, or of
// Wd^T), in float32 or, once compact, in bfloat16 alone.
type unitRows struct {
	f32 []float32
	b16 []uint16
	d   int
}

// dot returns x . row j.
func (r unitRows) dot(x []float32, j int) float32 {
	if r.f32 == nil {
		return dotBF16Kernel(x, r.b16[j*r.d:(j+1)*r.d])
	}
	return dotKernel(x, r.f32[j*r.d:(j+1)*r.d])
}

// axpy adds alpha * row j to y.
func (r unitRows) axpy(alpha float32, j int, y []float32) {
	if r.f32 == nil {
		axpyBF16Kernel(alpha, r.b16[j*r.d:(j+1)*r.d], y)
		return
	}
	axpyKernel(alpha, r.f32[j*r.d:(j+1)*r.d], y)
}

// compact keeps the rows in bfloat16 alone when every value is one; it
// reports whether they are compact.
func (r *unitRows) compact() bool {
	if r.f32 == nil {
		return true
	}
	b := exactBF16(r.f32)
	if b == nil {
		return false
	}
	r.b16 = b
	r.f32 = nil
	return true
}

// NewMLP builds an MLP from nn.Linear-layout weights: wg and wu are f x d,
// wd is d x f. wg is nil for a non-gated MLP.
func NewMLP(wg, wu, wd []float32, d, f int) (*MLP, error) {
	if d < 1 || f < 1 {
		return nil, fmt.Errorf("cpu: MLP shape d=%d f=%d: both must be positive", d, f)
	}
	if len(wu) != f*d || len(wd) != d*f || (wg != nil && len(wg) != f*d) {
		return nil, fmt.Errorf("cpu: MLP weights hold %d (gate), %d (up), %d (down) values, want %d each", len(wg), len(wu), len(wd), f*d)
	}
	l := &MLP{D: d, F: f, Gated: wg != nil, DenseAbove: DefaultDenseAbove, upRows: unitRows{f32: wu, d: d}}
	var err error
	if l.Gated {
		if l.gate, err = PackB(wg, f, d); err != nil {
			return nil, err
		}
	}
	if l.up, err = PackB(wu, f, d); err != nil {
		return nil, err
	}
	if l.down, err = PackB(wd, d, f); err != nil {
		return nil, err
	}
	down := make([]float32, f*d)
	parallelFor(f, func(j int) {
		for k := 0; k < d; k++ {
			down[j*d+k] = wd[k*f+j]
		}
	})
	l.downRows = unitRows{f32: down, d: d}
	return l, nil
}

// Compact keeps every weight the MLP holds in bfloat16 alone where all its
// values are bfloat16 values (see PackedB.Compact), so that a layer of a
// bfloat16 checkpoint takes half the memory and decode reads half the
// bytes, with the same results. It reports whether all of them are
// compact. Once its up rows are compact the MLP no longer refers to the wu
// given to NewMLP.
func (l *MLP) Compact() bool {
	all := true
	for _, p := range []*PackedB{l.gate, l.up, l.down} {
		if p != nil && !p.Compact() {
			all = false
		}
	}
	for _, r := range []*unitRows{&l.upRows, &l.downRows} {
		if !r.compact() {
			all = false
		}
	}
	return all
}

// Bytes returns the memory the MLP's weights take, counting the wu given
// to NewMLP while the MLP refers to it.
func (l *MLP) Bytes() int {
	n := 4*(len(l.upRows.f32)+len(l.downRows.f32)) + 2*(len(l.upRows.b16)+len(l.downRows.b16))
	for _, p := range []*PackedB{l.gate, l.up, l.down} {
		if p != nil {
			n += p.Bytes()
		}
	}
	return n
}

// Activation is an MLP activation function.
type Activation int

// The supported activations.
const (
	ReLU Activation = iota
	SiLU
)

func (a Activation) apply(v float32) float32 {
	if a == SiLU {
		return v / (1 + float32(math.Exp(float64(-v))))
	}
	return max(v, 0)
}

// String returns the Hugging Face name of the activation.
func (a Activation) String() string {
	if a == SiLU {
		return "silu"
	}
	return "relu"
}

// DefaultDenseAbove is the density above which Forward takes the dense
// finish: measured on the 2-core AVX-512 machine, the sparse tail then costs
// about as much as the two dense GEMMs it replaces.
const DefaultDenseAbove = 0.06

// UseBF16ForSmallM makes decode-sized calls (at most 16 tokens) read bfloat16
// copies of the packed weights, on the dense and the TwELL path alike: such
// calls are bound by memory bandwidth. See PackedB.UseBF16ForSmallM.
func (l *MLP) UseBF16ForSmallM() {
	l.smallBF16 = true
	for _, p := range []*PackedB{l.gate, l.up, l.down} {
		if p != nil {
			p.UseBF16ForSmallM()
		}
	}
}

// sparseInput returns the projection whose ReLU gives the sparse hidden
// activation: the gate for a gated MLP, the up projection otherwise.
func (l *MLP) sparseInput() *PackedB {
	if l.Gated {
		return l.gate
	}
	return l.up
}

func (l *MLP) check(y, x []float32, m int) error {
	if m < 0 || len(x) != m*l.D {
		return fmt.Errorf("cpu: MLP input has %d values, want %d tokens x %d", len(x), m, l.D)
	}
	if len(y) != m*l.D {
		return fmt.Errorf("cpu: MLP output has %d values, want %d tokens x %d", len(y), m, l.D)
	}
	return nil
}

// DenseActBytes returns the activation memory Dense allocates for m tokens.
func (l *MLP) DenseActBytes(m int) int {
	if l.Gated {
		return 2 * 4 * m * l.F // relu(g) and h
	}
	return 4 * m * l.F // h
}

// Dense computes the MLP with dense GEMMs: the honest baseline. For the
// gated MLP the elementwise product is fused into the up GEMM's epilogue.
func (l *MLP) Dense(y, x []float32, m int) error {
	_, err := l.dense(y, x, m)
	return err
}

// dense is Dense, also returning how many (token, unit) pairs of the
// activation (the gate's, when gated) are non-zero.
func (l *MLP) dense(y, x []float32, m int) (int64, error) {
	if err := l.check(y, x, m); err != nil {
		return 0, err
	}
	up, down, err := l.densePanels()
	if err != nil {
		return 0, err
	}
	f := l.F
	hp := getScratch(m * f)
	defer scratch.Put(hp)
	h := *hp
	var active atomic.Int64 // the epilogues run in parallel
	act := func(out, tile []float32) {
		n := 0
		for j, v := range tile {
			a := l.Act.apply(v)
			out[j] = a
			if a != 0 {
				n++
			}
		}
		active.Add(int64(n))
	}
	if l.Gated {
		gp := getScratch(m * f)
		defer scratch.Put(gp)
		g := *gp
		gemmBlocks(x, m, l.gate, func(i0, rows, j0, cols int, tile []float32) {
			for i := 0; i < rows; i++ {
				act(g[(i0+i)*f+j0:(i0+i)*f+j0+cols], tile[i*tileN:i*tileN+cols])
			}
		})
		gemmBlocks(x, m, up, func(i0, rows, j0, cols int, tile []float32) {
			for i := 0; i < rows; i++ {
				gr := g[(i0+i)*f+j0 : (i0+i)*f+j0+cols]
				out := h[(i0+i)*f+j0 : (i0+i)*f+j0+cols]
				for j, u := range tile[i*tileN : i*tileN+cols] {
					out[j] = gr[j] * u
				}
			}
		})
	} else {
		gemmBlocks(x, m, up, func(i0, rows, j0, cols int, tile []float32) {
			for i := 0; i < rows; i++ {
				act(h[(i0+i)*f+j0:(i0+i)*f+j0+cols], tile[i*tileN:i*tileN+cols])
			}
		})
	}
	return active.Load(), Gemm(y, h, m, down)
}

// Trim drops the GEMM panels of the up and down projections that a ReLU
// MLP off the dense path does not read (the gated MLP's up panels and
// every MLP's down panels): its sparse finish reads the unit rows, which
// hold the same weights, so this saves a third of the MLP's memory. The
// dense finish (mlp.Auto above DenseAbove, mlp.Dense later) packs them
// again from the rows, exactly, the first time it runs.
func (l *MLP) Trim() {
	if l.Act != ReLU || l.Path == mlp.Dense {
		return
	}
	l.panelsMu.Lock()
	defer l.panelsMu.Unlock()
	if l.Gated {
		l.up = nil
	}
	l.down = nil
}

// densePanels returns the up and down projections' panels, packing them
// again from the unit rows where Trim dropped them (in bf16 alone where the
// rows are).
func (l *MLP) densePanels() (up, down *PackedB, err error) {
	l.panelsMu.Lock()
	defer l.panelsMu.Unlock()
	repack := func(rows unitRows, pack func(w []float32) (*PackedB, error)) (*PackedB, error) {
		w := rows.f32
		if w == nil {
			w = make([]float32, len(rows.b16))
			bf16.ToFloat32s(w, rows.b16)
		}
		p, err := pack(w)
		if err != nil {
			return nil, err
		}
		if rows.f32 == nil {
			p.Compact()
		} else if l.smallBF16 {
			p.UseBF16ForSmallM()
		}
		return p, nil
	}
	if l.up == nil {
		if l.up, err = repack(l.upRows, func(w []float32) (*PackedB, error) { return PackB(w, l.F, l.D) }); err != nil {
			return nil, nil, err
		}
	}
	if l.down == nil { // the rows are Wd^T, F x D: PackBT's layout of Wd
		if l.down, err = repack(l.downRows, func(w []float32) (*PackedB, error) { return PackBT(w, l.F, l.D) }); err != nil {
			return nil, nil, err
		}
	}
	return l.up, l.down, nil
}

// D2T computes relu(x w^T) for x (m x K) and packed w (N x K), packing the
// result into TwELL inside the GEMM's epilogue: no dense m x N matrix is
// ever held. N must be a multiple of the layout's tile width.
func D2T(x []float32, m int, w *PackedB, layout twell.Layout) (*twell.Matrix, error) {
	if m < 0 || len(x) != m*w.K {
		return nil, fmt.Errorf("cpu: D2T input has %d values, want %d x %d", len(x), m, w.K)
	}
	out, err := twell.New(layout, m, w.N)
	if err != nil {
		return nil, err
	}
	tw := layout.Tile
	gemmBlocks(x, m, w, func(i0, rows, j0, cols int, tile []float32) {
		for i := 0; i < rows; i++ {
			for c := 0; c < cols; c += tw {
				out.SetTile(i0+i, (j0+c)/tw, tile[i*tileN+c:i*tileN+c+tw])
			}
		}
	})
	return out, nil
}

// rowBlock is how many tokens a T2D work item covers.
const rowBlock = 8

// unitBlock is how many tokens a gated-T2D work item covers: their x and y
// rows (2 x 64 x d floats, 1 MiB at d = 2048) stay in L2 while the block's
// active units are visited in order.
const unitBlock = 64

// entry is one active unit of one token.
type entry struct {
	unit, row int32
	val       float32
}

// t2d computes y = h D for TwELL h (m x F) and down rows D = Wd^T (F x d):
// y[r] = sum over active j of h[r,j] * D[j], over unit rows of any
// precision; the caller checks the sizes.
func t2d(y []float32, h *twell.Matrix, down unitRows) {
	m, d := h.Rows, down.d
	parallelFor((m+rowBlock-1)/rowBlock, func(b int) {
		var cols []int32
		var vals []float32
		for r := b * rowBlock; r < min(m, (b+1)*rowBlock); r++ {
			out := y[r*d : (r+1)*d]
			clear(out)
			cols, vals = h.AppendRow(r, cols[:0], vals[:0])
			for i, j := range cols {
				down.axpy(vals[i], int(j), out)
			}
		}
	})
}

// gatedT2D computes the gated MLP's sparse part from the TwELL gate g
// (m x F, relu already applied): for each active unit j of row r,
// u = x[r] . Wu[j], h = g[r,j] * u, y[r] += h * D[j]. Unit rows may be of
// any precision; the caller checks the sizes.
func gatedT2D(y, x []float32, g *twell.Matrix, up, down unitRows) {
	m, d := g.Rows, up.d
	// Work items are blocks of unitBlock tokens. Inside a block the active
	// entries are grouped by unit, so each unit's two weight rows are read
	// once per block rather than once per token that uses them.
	parallelFor((m+unitBlock-1)/unitBlock, func(b int) {
		r0, r1 := b*unitBlock, min(m, (b+1)*unitBlock)
		var cols []int32
		var vals []float32
		var es []entry
		for r := r0; r < r1; r++ {
			clear(y[r*d : (r+1)*d])
			cols, vals = g.AppendRow(r, cols[:0], vals[:0])
			for i, j := range cols {
				es = append(es, entry{unit: j, row: int32(r), val: vals[i]})
			}
		}
		slices.SortFunc(es, func(a, b entry) int {
			if a.unit != b.unit {
				return int(a.unit - b.unit)
			}
			return int(a.row - b.row)
		})
		for _, e := range es {
			j, r := int(e.unit), int(e.row)
			u := up.dot(x[r*d:(r+1)*d], j)
			down.axpy(e.val*u, j, y[r*d:(r+1)*d])
		}
	})
}

// Sparse computes the MLP through TwELL: D2T on the gate (or, non-gated, the
// up projection), then the gated T2D (or T2D). It returns the packed hidden
// activation for inspection (nonzero counts, overflow rows).
func (l *MLP) Sparse(y, x []float32, m int, layout twell.Layout) (*twell.Matrix, error) {
	if err := l.check(y, x, m); err != nil {
		return nil, err
	}
	if l.Act != ReLU {
		return nil, fmt.Errorf("cpu: the sparse MLP needs a ReLU gate, not %s", l.Act)
	}
	p, err := D2T(x, m, l.sparseInput(), layout)
	if err != nil {
		return nil, err
	}
	l.finishSparse(y, x, p)
	return p, nil
}

// finishSparse computes y from the MLP's packed activation p (from D2T on x).
func (l *MLP) finishSparse(y, x []float32, p *twell.Matrix) {
	if l.Gated {
		gatedT2D(y, x, p, l.upRows, l.downRows)
	} else {
		t2d(y, p, l.downRows)
	}
}

// Forward computes the MLP on the path l.Path asks for. A SiLU MLP, or one
// whose width is not a multiple of the TwELL tile, runs densely, as does
// every MLP under mlp.Dense. Otherwise it first runs D2T; under mlp.Auto it
// then finishes with the sparse T2D when mlp.Choose picks the sparse path
// for the measured density, and with dense GEMMs fed by the unpacked gate
// otherwise, so the gate GEMM is never computed twice. It returns the packed
// activation (nil when D2T did not run), the number of its (token, unit)
// pairs that are non-zero (-1 for an MLP whose activation has no exact
// zeros, SiLU), and the path of the finish.
func (l *MLP) Forward(y, x []float32, m int, layout twell.Layout) (*twell.Matrix, int64, mlp.Path, error) {
	if err := l.check(y, x, m); err != nil {
		return nil, 0, mlp.Dense, err
	}
	if l.Path == mlp.Dense || l.Act != ReLU || layout.Check(l.F) != nil {
		// Asked for, no exact zeros, or a width TwELL cannot tile.
		active, err := l.dense(y, x, m)
		if l.Act != ReLU {
			active = -1
		}
		return nil, active, mlp.Dense, err
	}
	p, err := D2T(x, m, l.sparseInput(), layout)
	if err != nil {
		return nil, 0, mlp.Dense, err
	}
	var nnz int64
	for r := 0; r < m; r++ {
		nnz += int64(p.RowNNZ(r))
	}
	if mlp.Choose(l.Path, float64(nnz)/(float64(m)*float64(l.F)), l.DenseAbove) == mlp.Sparse {
		l.finishSparse(y, x, p)
		return p, nnz, mlp.Sparse, nil
	}
	up, down, err := l.densePanels()
	if err != nil {
		return nil, 0, mlp.Dense, err
	}
	h := p.Unpack()
	if l.Gated {
		f := l.F
		gemmBlocks(x, m, up, func(i0, rows, j0, cols int, tile []float32) {
			for i := 0; i < rows; i++ {
				out := h[(i0+i)*f+j0 : (i0+i)*f+j0+cols]
				for j, u := range tile[i*tileN : i*tileN+cols] {
					out[j] *= u
				}
			}
		})
	}
	return p, nnz, mlp.Dense, Gemm(y, h, m, down)
}
