// Package twell implements the TwELL (tile-wise ELLPACK) format for sparse
// MLP activations, and the hybrid ELL + dense-tail format used in training.
//
// # TwELL
//
// A TwELL matrix holds the positive entries of a Rows x Cols activation
// matrix (Cols = MLP width). Each row is cut into tiles of Tile columns (256,
// or 128); each (row, tile) pair owns S = Tile/C uint32 words, where C is the
// compression factor (2, 4 or 8):
//
//	word 0          the true number of active entries in that row's tile
//	words 1..S-1    bf16(value) << 16 | global column, one word per entry
//
// The bits are those of the reference kernels, so buffers interoperate. The
// reference's kernels write a tile's payload words in no particular order
// (their packing is not deterministic); twell's packers write them ascending
// by column. Every reader here accepts any order: [Matrix.Validate] rejects
// only a column repeated within a tile, [Matrix.AppendRow] and
// [Matrix.Unpack] return the same result for any order, and [Matrix.Sort]
// rewrites a buffer into the canonical ascending order for code that reads
// Words directly and needs it.
//
// A tile can hold at most S-1 entries. Overflow is never silent: the count
// word keeps the true number, the exact activations of every overflowing
// tile are kept in a spill list, and consumers read such tiles from the spill
// (the exact dense fallback). Tiles holding NaN or a value too large for bf16
// are spilled the same way, so results match a dense computation.
package twell

import (
	"fmt"
	"math"
	"slices"
	"sync"

	"github.com/twell-ai/twell/bf16"
)

// Layout is the shape of a TwELL tile: its width in columns and its
// compression factor.
type Layout struct {
	Tile int // columns per tile: 256 (default) or 128
	C    int // compression factor: 2, 4 or 8
}

// DefaultLayout is the reference layout: 256-column tiles, C = 8 (31 entries
// per tile, a quarter of dense bf16 size).
var DefaultLayout = Layout{Tile: 256, C: 8}

// MaxTile is the widest tile a Layout may have.
const MaxTile = 256

// MaxCols is the widest matrix TwELL can hold: columns are 16-bit.
const MaxCols = 1 << 16

// S returns the number of uint32 words per (row, tile).
func (l Layout) S() int { return l.Tile / l.C }

// Capacity returns how many entries fit in one (row, tile): S - 1.
func (l Layout) Capacity() int { return l.S() - 1 }

// Check reports whether the layout is supported and fits cols columns.
func (l Layout) Check(cols int) error {
	if l.Tile != 256 && l.Tile != 128 {
		return fmt.Errorf("twell: tile width %d not supported (want 256 or 128)", l.Tile)
	}
	if l.C != 2 && l.C != 4 && l.C != 8 {
		return fmt.Errorf("twell: compression factor %d not supported (want 2, 4 or 8)", l.C)
	}
	if cols < l.Tile || cols%l.Tile != 0 {
		return fmt.Errorf("twell: width %d is not a positive multiple of the tile width %d", cols, l.Tile)
	}
	if cols > MaxCols {
		return fmt.Errorf("twell: width %d exceeds %d (columns are 16-bit)", cols, MaxCols)
	}
	return nil
}

// SpillTile holds the exact activations of one (row, tile) that did not fit
// the packed words: more than Capacity entries, a NaN, or a value that bf16
// cannot hold. Values has Tile entries (post-ReLU: zeros where inactive).
type SpillTile struct {
	Row, Tile int
	Values    []float32
}

// Matrix is a TwELL-packed Rows x Cols activation matrix.
type Matrix struct {
	Layout
	Rows, Cols int
	// Words holds Rows x Cols/C words: row r, tile t starts at r*Cols/C + t*S.
	Words []uint32
	// Spill holds the spilled tiles. Spilled and OverflowRows sort it by
	// (Row, Tile).
	Spill []SpillTile

	mu         sync.Mutex
	spillIndex map[int]int // Row*Tiles+Tile -> index into Spill; nil until needed
}

// New returns an empty TwELL matrix (all counts zero).
func New(l Layout, rows, cols int) (*Matrix, error) {
	if err := l.Check(cols); err != nil {
		return nil, err
	}
	if rows < 0 {
		return nil, fmt.Errorf("twell: negative row count %d", rows)
	}
	return &Matrix{Layout: l, Rows: rows, Cols: cols, Words: make([]uint32, rows*cols/l.C)}, nil
}

// RowWords returns the number of words per row: Cols / C.
func (m *Matrix) RowWords() int { return m.Cols / m.C }

// Tiles returns the number of tiles per row.
func (m *Matrix) Tiles() int { return m.Cols / m.Tile }

// Bytes returns the memory the packed words take.
func (m *Matrix) Bytes() int { return 4 * len(m.Words) }

// Pack packs a dense row-major rows x cols matrix, keeping the values > 0
// (ReLU is part of packing). Tiles over capacity are spilled exactly; their
// rows are listed by OverflowRows.
func Pack(l Layout, dense []float32, rows, cols int) (*Matrix, error) {
	if rows < 0 || len(dense) != rows*cols {
		return nil, fmt.Errorf("twell: dense buffer has %d values, want %d x %d", len(dense), rows, cols)
	}
	m, err := New(l, rows, cols)
	if err != nil {
		return nil, err
	}
	for r := 0; r < rows; r++ {
		for t := 0; t < cols/l.Tile; t++ {
			m.SetTile(r, t, dense[r*cols+t*l.Tile:r*cols+(t+1)*l.Tile])
		}
	}
	return m, nil
}

// WordValue returns the value held in payload word w.
func WordValue(w uint32) float32 { return math.Float32frombits(w &^ 0xffff) }

// WordCol returns the global column held in payload word w.
func WordCol(w uint32) int { return int(w & 0xffff) }

// SetTile packs the activations vals (len Tile) of row r, tile t, keeping the
// values > 0, with the payload ascending by column. It is safe to call concurrently for distinct (r, t). It reports
// whether the tile was spilled.
func (m *Matrix) SetTile(r, t int, vals []float32) (spilled bool) {
	s := m.S()
	w := m.Words[r*m.RowWords()+t*s : r*m.RowWords()+(t+1)*s]
	base := t * m.Tile
	n := 0
	bad := false
	for i, v := range vals[:m.Tile] {
		if v > 0 || v != v { // active: positive, or NaN (kept so that it propagates)
			n++
			b := bf16.FromFloat32(v)
			switch {
			case b == 0: // positive but under bf16's smallest subnormal: keep it > 0
				b = 1
			case b >= 0x7f80: // +Inf or NaN in bf16: only the spill holds it
				bad = true
			}
			if n < s {
				w[n] = uint32(b)<<16 | uint32(base+i)
			}
		}
	}
	w[0] = uint32(n)
	if n < s && !bad {
		return false
	}
	exact := make([]float32, m.Tile)
	for i, v := range vals[:m.Tile] {
		if v > 0 || v != v {
			exact[i] = v
		}
	}
	m.mu.Lock()
	m.Spill = append(m.Spill, SpillTile{Row: r, Tile: t, Values: exact})
	m.spillIndex = nil
	m.mu.Unlock()
	return true
}

// index returns the spill lookup, sorting Spill and building the map on first
// use after a change.
func (m *Matrix) index() map[int]int {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.spillIndex == nil {
		slices.SortFunc(m.Spill, func(a, b SpillTile) int {
			if a.Row != b.Row {
				return a.Row - b.Row
			}
			return a.Tile - b.Tile
		})
		m.spillIndex = make(map[int]int, len(m.Spill))
		for i, sp := range m.Spill {
			m.spillIndex[sp.Row*m.Tiles()+sp.Tile] = i
		}
	}
	return m.spillIndex
}

// Spilled returns the exact activations of row r, tile t if that tile was
// spilled, else nil.
func (m *Matrix) Spilled(r, t int) []float32 {
	if len(m.Spill) == 0 {
		return nil
	}
	if i, ok := m.index()[r*m.Tiles()+t]; ok {
		return m.Spill[i].Values
	}
	return nil
}

// OverflowRows returns the rows that have at least one spilled tile, ascending.
func (m *Matrix) OverflowRows() []int {
	m.index() // sorts Spill
	var rows []int
	for _, sp := range m.Spill {
		if len(rows) == 0 || rows[len(rows)-1] != sp.Row {
			rows = append(rows, sp.Row)
		}
	}
	return rows
}

// Count returns the true number of active entries in row r, tile t.
func (m *Matrix) Count(r, t int) int { return int(m.Words[r*m.RowWords()+t*m.S()]) }

// RowNNZ returns the true number of active entries in row r.
func (m *Matrix) RowNNZ(r int) int {
	n := 0
	row := m.Words[r*m.RowWords() : (r+1)*m.RowWords()]
	for i := 0; i < len(row); i += m.S() {
		n += int(row[i])
	}
	return n
}

// AppendRow appends the active entries of row r, ascending by column, to cols
// and vals and returns them, whatever the order of the payload words. Packed
// entries come back bf16-rounded; spilled tiles come back exactly. It never
// panics: on a matrix whose shape is wrong (see [Matrix.Validate]) or a row
// outside it, it appends nothing.
func (m *Matrix) AppendRow(r int, cols []int32, vals []float32) ([]int32, []float32) {
	if !m.shapeOK() || r < 0 || r >= m.Rows {
		return cols, vals
	}
	s := m.S()
	row := m.Words[r*m.RowWords() : (r+1)*m.RowWords()]
	for t := 0; t < m.Tiles(); t++ {
		w := row[t*s : (t+1)*s]
		n := int(w[0])
		if n == 0 {
			continue
		}
		if ex := m.Spilled(r, t); ex != nil {
			for i, v := range ex[:min(len(ex), m.Tile)] {
				if v != 0 {
					cols = append(cols, int32(t*m.Tile+i))
					vals = append(vals, v)
				}
			}
			continue
		}
		// A count over capacity without a spill only occurs in an invalid
		// matrix (Validate rejects it); keep what the words hold.
		start := len(cols)
		for _, x := range w[1 : min(n, s-1)+1] {
			cols = append(cols, int32(x&0xffff))
			vals = append(vals, math.Float32frombits(x&^0xffff))
		}
		sortEntries(cols[start:], vals[start:])
	}
	return cols, vals
}

// shapeOK reports whether the layout, row count and buffer size agree, so
// that every (row, tile) of the words can be indexed.
func (m *Matrix) shapeOK() bool {
	if m.Layout.Check(m.Cols) != nil || m.Rows < 0 {
		return false
	}
	rw := m.RowWords()
	return m.Rows <= len(m.Words)/rw && len(m.Words) == m.Rows*rw
}

// sortEntries sorts one tile's entries by column in place (insertion sort: a
// tile holds at most 127 entries, and twell's own are already in order, which
// costs one pass).
func sortEntries(cols []int32, vals []float32) {
	for i := 1; i < len(cols); i++ {
		c, v := cols[i], vals[i]
		j := i
		for ; j > 0 && cols[j-1] > c; j-- {
			cols[j], vals[j] = cols[j-1], vals[j-1]
		}
		cols[j], vals[j] = c, v
	}
}

// sortWords sorts payload words by their column (the low 16 bits) in place.
func sortWords(w []uint32) {
	for i := 1; i < len(w); i++ {
		x := w[i]
		j := i
		for ; j > 0 && w[j-1]&0xffff > x&0xffff; j-- {
			w[j] = w[j-1]
		}
		w[j] = x
	}
}

// Sort rewrites every packed tile's payload in the canonical order,
// ascending by column, the order twell's own packers write. Buffers packed
// elsewhere (the reference's kernels) may hold any order; AppendRow, Unpack
// and Validate do not need Sort, but code that reads Words directly and
// relies on column order (a merge, a binary search, a byte comparison) must
// call it first. Words past the count and tiles whose count exceeds the
// capacity (those are read from the spill) are left as they are. Sort does
// not validate (call Validate first for a buffer from outside), and does
// nothing to a matrix whose layout Layout.Check rejects.
func (m *Matrix) Sort() {
	if m.Layout.Check(m.Cols) != nil {
		return
	}
	s := m.S()
	for off := 0; off+s <= len(m.Words); off += s {
		w := m.Words[off : off+s]
		if n := int(w[0]); n >= 2 && n < s {
			sortWords(w[1 : n+1])
		}
	}
}

// Unpack returns the dense row-major Rows x Cols matrix that m holds,
// whatever the order of the payload words. It never panics: on a matrix
// whose shape is wrong it returns nil, and entries whose column lies outside
// the matrix are dropped (Validate rejects both).
func (m *Matrix) Unpack() []float32 {
	if !m.shapeOK() {
		return nil
	}
	dense := make([]float32, m.Rows*m.Cols)
	var cols []int32
	var vals []float32
	for r := 0; r < m.Rows; r++ {
		cols, vals = m.AppendRow(r, cols[:0], vals[:0])
		out := dense[r*m.Cols : (r+1)*m.Cols]
		for i, c := range cols {
			if int(c) < len(out) {
				out[c] = vals[i]
			}
		}
	}
	return dense
}

// Validate checks that m is a well-formed TwELL matrix: buffer sizes, counts
// within capacity or the tile spilled, payload columns inside their tile and
// each at most once (in any order: see the package doc), payload values
// finite and > 0, and spill entries in range. The error names the row and
// tile at fault.
func (m *Matrix) Validate() error {
	if err := m.Layout.Check(m.Cols); err != nil {
		return err
	}
	if m.Rows < 0 {
		return fmt.Errorf("twell: negative row count %d", m.Rows)
	}
	if !m.shapeOK() {
		return fmt.Errorf("twell: buffer has %d words, want %d rows x %d words", len(m.Words), m.Rows, m.RowWords())
	}
	spilled := make(map[int]bool, len(m.Spill))
	for i, sp := range m.Spill {
		if sp.Row < 0 || sp.Row >= m.Rows || sp.Tile < 0 || sp.Tile >= m.Tiles() {
			return fmt.Errorf("twell: spill entry %d names row %d tile %d, outside %d rows x %d tiles", i, sp.Row, sp.Tile, m.Rows, m.Tiles())
		}
		if len(sp.Values) != m.Tile {
			return fmt.Errorf("twell: row %d tile %d: spill holds %d values, want %d", sp.Row, sp.Tile, len(sp.Values), m.Tile)
		}
		key := sp.Row*m.Tiles() + sp.Tile
		if spilled[key] {
			return fmt.Errorf("twell: row %d tile %d: spilled twice", sp.Row, sp.Tile)
		}
		spilled[key] = true
	}
	s, capacity := m.S(), m.Capacity()
	for r := 0; r < m.Rows; r++ {
		for t := 0; t < m.Tiles(); t++ {
			w := m.Words[r*m.RowWords()+t*s : r*m.RowWords()+(t+1)*s]
			n := int(w[0])
			if n > m.Tile {
				return fmt.Errorf("twell: row %d tile %d: count %d exceeds the tile width %d", r, t, n, m.Tile)
			}
			if spilled[r*m.Tiles()+t] {
				continue // consumers read the spill, not the payload
			}
			if n > capacity {
				return fmt.Errorf("twell: row %d tile %d: count %d exceeds capacity %d and the tile is not spilled", r, t, n, capacity)
			}
			var seen [MaxTile / 64]uint64 // columns of this tile already listed
			for i, x := range w[1 : min(n, capacity)+1] {
				col := int(x & 0xffff)
				if col < t*m.Tile || col >= (t+1)*m.Tile {
					return fmt.Errorf("twell: row %d tile %d: entry %d has column %d outside the tile [%d, %d)", r, t, i, col, t*m.Tile, (t+1)*m.Tile)
				}
				k := col - t*m.Tile
				if seen[k/64]&(1<<(k%64)) != 0 {
					return fmt.Errorf("twell: row %d tile %d: entry %d repeats column %d", r, t, i, col)
				}
				seen[k/64] |= 1 << (k % 64)
				b := uint16(x >> 16)
				if b&0x8000 != 0 || b == 0 || b >= 0x7f80 {
					return fmt.Errorf("twell: row %d tile %d: entry %d (column %d) has value bits %#04x: not finite and > 0", r, t, i, col, b)
				}
			}
		}
	}
	return nil
}
