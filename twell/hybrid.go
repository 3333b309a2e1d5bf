package twell

import (
	"fmt"

	"github.com/twell-ai/twell/bf16"
)

// DefaultHybridWidth is the default ELL width of a Hybrid matrix.
const DefaultHybridWidth = 128

// Hybrid is a sparse Rows x Cols matrix for training: per row an ELL part of
// Width slots (uint16 columns, bf16 values, ascending by column) and the true
// count, plus a dense tail holding, in full, every row with more than Width
// nonzeros. No row is ever dropped: the tail grows as needed, or, when
// MaxTailRows would be exceeded, the builder returns an error before anything
// is lost. Values may have any sign (the hidden activation relu(g)*u does).
type Hybrid struct {
	Rows, Cols, Width int
	Count             []int32  // true nonzeros per row (may exceed Width)
	ColIdx            []uint16 // Rows x Width columns; slots past Count unused
	Vals              []uint16 // Rows x Width bf16 values
	TailSlot          []int32  // per row: its row in Tail, or -1
	TailRows          []int32  // per tail row: the source row
	Tail              []uint16 // len(TailRows) x Cols bf16, dense
}

// HybridOptions configure the hybrid builders.
type HybridOptions struct {
	Width       int // ELL slots per row; 0 means DefaultHybridWidth
	MaxTailRows int // most rows the dense tail may hold; 0 means no limit
}

func (o HybridOptions) width() int {
	if o.Width == 0 {
		return DefaultHybridWidth
	}
	return o.Width
}

func newHybrid(rows, cols int, o HybridOptions) (*Hybrid, error) {
	w := o.width()
	switch {
	case rows < 0:
		return nil, fmt.Errorf("twell: hybrid: negative row count %d", rows)
	case cols < 1 || cols > MaxCols:
		return nil, fmt.Errorf("twell: hybrid: width %d outside [1, %d] (columns are 16-bit)", cols, MaxCols)
	case w < 1 || w > cols:
		return nil, fmt.Errorf("twell: hybrid: ELL width %d outside [1, %d]", w, cols)
	case o.MaxTailRows < 0:
		return nil, fmt.Errorf("twell: hybrid: negative tail limit %d", o.MaxTailRows)
	}
	h := &Hybrid{
		Rows: rows, Cols: cols, Width: w,
		Count:    make([]int32, rows),
		ColIdx:   make([]uint16, rows*w),
		Vals:     make([]uint16, rows*w),
		TailSlot: make([]int32, rows),
	}
	for i := range h.TailSlot {
		h.TailSlot[i] = -1
	}
	return h, nil
}

// setRow stores row r given its nonzeros (ascending columns) and, for the
// tail, a function that writes the dense row.
func (h *Hybrid) setRow(r int, cols []int32, vals []float32, o HybridOptions) error {
	n := len(cols)
	h.Count[r] = int32(n)
	k := min(n, h.Width)
	for i := 0; i < k; i++ {
		h.ColIdx[r*h.Width+i] = uint16(cols[i])
		h.Vals[r*h.Width+i] = nonzeroBF16(vals[i])
	}
	if n <= h.Width {
		return nil
	}
	if o.MaxTailRows > 0 && len(h.TailRows) >= o.MaxTailRows {
		return fmt.Errorf("twell: hybrid: row %d has %d nonzeros (ELL width %d) and the dense tail is full (%d rows)", r, n, h.Width, o.MaxTailRows)
	}
	h.TailSlot[r] = int32(len(h.TailRows))
	h.TailRows = append(h.TailRows, int32(r))
	base := len(h.Tail)
	h.Tail = append(h.Tail, make([]uint16, h.Cols)...)
	for i, c := range cols {
		h.Tail[base+int(c)] = nonzeroBF16(vals[i])
	}
	return nil
}

// HybridFromDense builds a Hybrid matrix from a dense row-major rows x cols
// matrix, keeping every nonzero value.
func HybridFromDense(dense []float32, rows, cols int, o HybridOptions) (*Hybrid, error) {
	if rows < 0 || cols < 0 || len(dense) != rows*cols {
		return nil, fmt.Errorf("twell: hybrid: dense buffer has %d values, want %d x %d", len(dense), rows, cols)
	}
	h, err := newHybrid(rows, cols, o)
	if err != nil {
		return nil, err
	}
	var cs []int32
	var vs []float32
	for r := 0; r < rows; r++ {
		cs, vs = cs[:0], vs[:0]
		for c, v := range dense[r*cols : (r+1)*cols] {
			if v != 0 {
				cs = append(cs, int32(c))
				vs = append(vs, v)
			}
		}
		if err := h.setRow(r, cs, vs, o); err != nil {
			return nil, err
		}
	}
	return h, nil
}

// HybridFromTwELL converts a TwELL matrix (spilled tiles included) to the
// hybrid format.
func HybridFromTwELL(m *Matrix, o HybridOptions) (*Hybrid, error) {
	h, err := newHybrid(m.Rows, m.Cols, o)
	if err != nil {
		return nil, err
	}
	var cs []int32
	var vs []float32
	for r := 0; r < m.Rows; r++ {
		cs, vs = m.AppendRow(r, cs[:0], vs[:0])
		if err := h.setRow(r, cs, vs, o); err != nil {
			return nil, err
		}
	}
	return h, nil
}

// AppendRow appends the nonzeros of row r, ascending by column, to cols and
// vals and returns them.
func (h *Hybrid) AppendRow(r int, cols []int32, vals []float32) ([]int32, []float32) {
	if s := h.TailSlot[r]; s >= 0 {
		for c, b := range h.Tail[int(s)*h.Cols : int(s+1)*h.Cols] {
			if b&0x7fff != 0 {
				cols = append(cols, int32(c))
				vals = append(vals, bf16.ToFloat32(b))
			}
		}
		return cols, vals
	}
	n := int(h.Count[r])
	for i := 0; i < n; i++ {
		cols = append(cols, int32(h.ColIdx[r*h.Width+i]))
		vals = append(vals, bf16.ToFloat32(h.Vals[r*h.Width+i]))
	}
	return cols, vals
}

// Dense returns the dense row-major Rows x Cols matrix that h holds.
func (h *Hybrid) Dense() []float32 {
	out := make([]float32, h.Rows*h.Cols)
	var cs []int32
	var vs []float32
	for r := 0; r < h.Rows; r++ {
		cs, vs = h.AppendRow(r, cs[:0], vs[:0])
		for i, c := range cs {
			out[r*h.Cols+int(c)] = vs[i]
		}
	}
	return out
}

// Transpose returns the unit-major form (Cols x Rows) of h, for backward
// products such as dW = h^T dy. Rows must be at most MaxCols.
func (h *Hybrid) Transpose(o HybridOptions) (*Hybrid, error) {
	if h.Rows > MaxCols {
		return nil, fmt.Errorf("twell: hybrid: cannot transpose %d rows: the transposed columns are 16-bit (at most %d)", h.Rows, MaxCols)
	}
	// Count per column, then fill column lists in ascending row order.
	counts := make([]int32, h.Cols)
	var cs []int32
	var vs []float32
	for r := 0; r < h.Rows; r++ {
		cs, vs = h.AppendRow(r, cs[:0], vs[:0])
		for _, c := range cs {
			counts[c]++
		}
	}
	start := make([]int, h.Cols+1)
	for c, n := range counts {
		start[c+1] = start[c] + int(n)
	}
	rowsOf := make([]int32, start[h.Cols])
	valsOf := make([]float32, start[h.Cols])
	next := append([]int(nil), start[:h.Cols]...)
	for r := 0; r < h.Rows; r++ {
		cs, vs = h.AppendRow(r, cs[:0], vs[:0])
		for i, c := range cs {
			rowsOf[next[c]] = int32(r)
			valsOf[next[c]] = vs[i]
			next[c]++
		}
	}
	o.Width = min(o.width(), max(h.Rows, 1))
	t, err := newHybrid(h.Cols, max(h.Rows, 1), o)
	if err != nil {
		return nil, err
	}
	t.Cols = h.Rows
	for c := 0; c < h.Cols; c++ {
		if err := t.setRow(c, rowsOf[start[c]:start[c+1]], valsOf[start[c]:start[c+1]], o); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// Validate checks that h is well formed: sizes, counts, ELL columns in range
// and strictly ascending, and the tail maps consistent. The error names the
// row at fault.
func (h *Hybrid) Validate() error {
	switch {
	case h.Rows < 0 || h.Cols < 0 || h.Cols > MaxCols:
		return fmt.Errorf("twell: hybrid: bad shape %d x %d", h.Rows, h.Cols)
	case h.Width < 1:
		return fmt.Errorf("twell: hybrid: ELL width %d < 1", h.Width)
	case len(h.Count) != h.Rows || len(h.TailSlot) != h.Rows:
		return fmt.Errorf("twell: hybrid: %d counts and %d tail slots for %d rows", len(h.Count), len(h.TailSlot), h.Rows)
	case len(h.ColIdx) != h.Rows*h.Width || len(h.Vals) != h.Rows*h.Width:
		return fmt.Errorf("twell: hybrid: ELL buffers hold %d columns and %d values, want %d", len(h.ColIdx), len(h.Vals), h.Rows*h.Width)
	case len(h.Tail) != len(h.TailRows)*h.Cols:
		return fmt.Errorf("twell: hybrid: tail holds %d values, want %d rows x %d", len(h.Tail), len(h.TailRows), h.Cols)
	}
	for s, r := range h.TailRows {
		if r < 0 || int(r) >= h.Rows || h.TailSlot[r] != int32(s) {
			return fmt.Errorf("twell: hybrid: tail row %d names source row %d, which does not point back", s, r)
		}
	}
	for r := 0; r < h.Rows; r++ {
		n := int(h.Count[r])
		if n < 0 || n > h.Cols {
			return fmt.Errorf("twell: hybrid: row %d: count %d outside [0, %d]", r, n, h.Cols)
		}
		slot := int(h.TailSlot[r])
		if n > h.Width && slot < 0 {
			return fmt.Errorf("twell: hybrid: row %d: %d nonzeros exceed the ELL width %d and the row has no tail copy", r, n, h.Width)
		}
		if slot >= len(h.TailRows) || slot < -1 {
			return fmt.Errorf("twell: hybrid: row %d: tail slot %d outside [-1, %d)", r, slot, len(h.TailRows))
		}
		prev := -1
		for i := 0; i < min(n, h.Width); i++ {
			c := int(h.ColIdx[r*h.Width+i])
			if c >= h.Cols || c <= prev {
				return fmt.Errorf("twell: hybrid: row %d: entry %d has column %d (previous %d, width %d)", r, i, c, prev, h.Cols)
			}
			prev = c
			if h.Vals[r*h.Width+i]&0x7fff == 0 {
				return fmt.Errorf("twell: hybrid: row %d: entry %d (column %d) holds zero", r, i, c)
			}
		}
	}
	return nil
}

// nonzeroBF16 rounds v to bf16, keeping nonzero values nonzero: a value under
// bf16's smallest subnormal becomes that subnormal, with v's sign.
func nonzeroBF16(v float32) uint16 {
	b := bf16.FromFloat32(v)
	if b&0x7fff == 0 && v != 0 {
		b |= 1
	}
	return b
}
