package twell

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/internal/testutil"
)

var layouts = []Layout{{256, 8}, {256, 4}, {256, 2}, {128, 8}, {128, 4}, {128, 2}}

// randomActs returns rows x cols values where about density of them are
// positive and the rest negative or zero.
func randomActs(r *rand.Rand, rows, cols int, density float64) []float32 {
	a := make([]float32, rows*cols)
	for i := range a {
		if r.Float64() < density {
			a[i] = float32(r.ExpFloat64()) + 1e-3
		} else if r.IntN(2) == 0 {
			a[i] = -float32(r.ExpFloat64())
		}
	}
	return a
}

// reluBF16 is the expected unpacked value of a non-spilled entry.
func reluBF16(v float32) float32 {
	if v > 0 {
		return bf16.Round(v)
	}
	return 0
}

func TestPackUnpackRoundTrip(t *testing.T) {
	r, seed := testutil.Rand(t)
	for iter := 0; iter < 200; iter++ {
		l := layouts[r.IntN(len(layouts))]
		rows := r.IntN(20)
		cols := l.Tile * (1 + r.IntN(6))
		density := []float64{0, 0.005, 0.05, 0.2, 0.5, 1}[r.IntN(6)]
		dense := randomActs(r, rows, cols, density)
		m, err := Pack(l, dense, rows, cols)
		if err != nil {
			t.Fatalf("seed %d: Pack(%v, %dx%d): %v", seed, l, rows, cols, err)
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("seed %d: packed matrix invalid: %v", seed, err)
		}
		got := m.Unpack()
		for row := 0; row < rows; row++ {
			for tile := 0; tile < m.Tiles(); tile++ {
				spilled := m.Spilled(row, tile) != nil
				for c := tile * l.Tile; c < (tile+1)*l.Tile; c++ {
					v := dense[row*cols+c]
					want := reluBF16(v)
					if spilled && v > 0 {
						want = v
					}
					if got[row*cols+c] != want {
						t.Fatalf("seed %d: %v %dx%d density %g: [%d,%d] = %g, want %g (spilled %v)", seed, l, rows, cols, density, row, c, got[row*cols+c], want, spilled)
					}
				}
				n := 0
				for _, v := range dense[row*cols+tile*l.Tile : row*cols+(tile+1)*l.Tile] {
					if v > 0 {
						n++
					}
				}
				if m.Count(row, tile) != n {
					t.Fatalf("seed %d: count(%d,%d) = %d, want true count %d", seed, row, tile, m.Count(row, tile), n)
				}
				if spilled != (n > l.Capacity()) {
					t.Fatalf("seed %d: tile (%d,%d) with %d entries, capacity %d: spilled = %v", seed, row, tile, n, l.Capacity(), spilled)
				}
			}
		}
	}
}

func TestPayloadSortedAndReferenceBits(t *testing.T) {
	m, err := New(DefaultLayout, 1, 1024)
	if err != nil {
		t.Fatal(err)
	}
	vals := make([]float32, 256)
	vals[232] = 0.5 // column 3*256+232 = 1000
	vals[7] = 2
	m.SetTile(0, 3, vals)
	w := m.Words[3*32 : 4*32]
	if w[0] != 2 || w[1] != 0x40000000|uint32(3*256+7) || w[2] != 0x3F0003E8 {
		t.Fatalf("tile words = %#x %#x %#x, want 2, 0x40000307, 0x3F0003E8", w[0], w[1], w[2])
	}
}

func TestOverflowCases(t *testing.T) {
	r, seed := testutil.Rand(t)
	l := DefaultLayout
	cols := 1024
	cases := map[string]func(row []float32){
		"all positive": func(row []float32) {
			for i := range row {
				row[i] = 0.1 + r.Float32()
			}
		},
		"one tile over capacity": func(row []float32) {
			for i := 256; i < 256+l.Capacity()+1; i++ {
				row[i] = 1 + r.Float32()
			}
		},
		"exactly capacity": func(row []float32) {
			for i := 512; i < 512+l.Capacity(); i++ {
				row[i] = 1 + r.Float32()
			}
		},
		"empty": func(row []float32) {
			for i := range row {
				row[i] = -r.Float32()
			}
		},
		"NaN and Inf": func(row []float32) {
			row[3] = float32(math.NaN())
			row[300] = float32(math.Inf(1))
			row[600] = math.MaxFloat32 // rounds to Inf in bf16
			row[900] = 1e-42           // rounds to zero in bf16
		},
	}
	for name, fill := range cases {
		dense := make([]float32, 3*cols)
		for i := range dense {
			dense[i] = -1
		}
		fill(dense[cols : 2*cols])
		m, err := Pack(l, dense, 3, cols)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("%s (seed %d): %v", name, seed, err)
		}
		got := m.Unpack()
		for c := 0; c < cols; c++ {
			v := dense[cols+c]
			g := got[cols+c]
			want := reluBF16(v)
			if m.Spilled(1, c/256) != nil && (v > 0 || v != v) {
				want = v
			}
			if v == 1e-42 {
				want = math.Float32frombits(1 << 16) // smallest bf16 subnormal
			}
			if math.Float32bits(g) != math.Float32bits(want) && !(g != g && want != want) {
				t.Fatalf("%s (seed %d): column %d = %g, want %g", name, seed, c, g, want)
			}
		}
		if name == "exactly capacity" || name == "empty" {
			if len(m.OverflowRows()) != 0 {
				t.Fatalf("%s: overflow rows %v, want none", name, m.OverflowRows())
			}
		} else if rows := m.OverflowRows(); len(rows) != 1 || rows[0] != 1 {
			t.Fatalf("%s: overflow rows %v, want [1]", name, rows)
		}
	}
}

func TestValidateRejectsCorruption(t *testing.T) {
	r, seed := testutil.Rand(t)
	base := func() *Matrix {
		dense := randomActs(r, 4, 512, 0.05)
		dense[1*512+10] = 1 // row 1 tile 0 has at least two entries
		dense[1*512+20] = 2
		m, err := Pack(DefaultLayout, dense, 4, 512)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	cases := []struct {
		name    string
		corrupt func(m *Matrix)
		want    string
	}{
		{"short buffer", func(m *Matrix) { m.Words = m.Words[:len(m.Words)-1] }, "buffer has"},
		{"count over capacity", func(m *Matrix) { m.Words[1*64] = 32 }, "row 1 tile 0: count 32 exceeds capacity"},
		{"count over tile", func(m *Matrix) { m.Words[1*64] = 300 }, "row 1 tile 0: count 300 exceeds the tile width"},
		{"column outside tile", func(m *Matrix) { m.Words[1*64+1] = m.Words[1*64+1]&^0xffff | 300 }, "row 1 tile 0: entry 0 has column 300 outside"},
		{"column repeated", func(m *Matrix) { m.Words[1*64+2] = m.Words[1*64+2]&^0xffff | m.Words[1*64+1]&0xffff }, "row 1 tile 0: entry 1 repeats column"},
		{"negative value", func(m *Matrix) { m.Words[1*64+1] |= 0x8000_0000 }, "not finite and > 0"},
		{"zero value", func(m *Matrix) { m.Words[1*64+1] &= 0xffff }, "not finite and > 0"},
		{"NaN value", func(m *Matrix) { m.Words[1*64+1] = m.Words[1*64+1]&0xffff | 0x7fc0_0000 }, "not finite and > 0"},
		{"bad layout", func(m *Matrix) { m.C = 3 }, "compression factor 3"},
		{"spill outside", func(m *Matrix) { m.Spill = append(m.Spill, SpillTile{Row: 9, Tile: 0, Values: make([]float32, 256)}) }, "outside"},
		{"spill short", func(m *Matrix) { m.Spill = append(m.Spill, SpillTile{Row: 0, Tile: 0, Values: make([]float32, 3)}) }, "spill holds 3 values"},
	}
	for _, c := range cases {
		m := base()
		if err := m.Validate(); err != nil {
			t.Fatalf("seed %d: base matrix invalid: %v", seed, err)
		}
		c.corrupt(m)
		err := m.Validate()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("seed %d: %s: Validate() = %v, want error containing %q", seed, c.name, err, c.want)
		}
	}
}

func TestLayoutErrors(t *testing.T) {
	for _, c := range []struct {
		l    Layout
		cols int
	}{{Layout{256, 8}, 300}, {Layout{256, 8}, 0}, {Layout{200, 8}, 400}, {Layout{256, 16}, 256}, {Layout{256, 8}, 1 << 17}} {
		if _, err := New(c.l, 1, c.cols); err == nil {
			t.Errorf("New(%v, 1, %d) succeeded", c.l, c.cols)
		}
	}
	if _, err := Pack(DefaultLayout, make([]float32, 10), 1, 256); err == nil {
		t.Error("Pack with a short buffer succeeded")
	}
}

func TestHybridRoundTripAndTranspose(t *testing.T) {
	r, seed := testutil.Rand(t)
	for iter := 0; iter < 100; iter++ {
		rows, cols := r.IntN(40), 1+r.IntN(300)
		width := 1 + r.IntN(min(cols, 16))
		density := []float64{0, 0.01, 0.1, 0.5, 1}[r.IntN(5)]
		dense := make([]float32, rows*cols)
		for i := range dense {
			if r.Float64() < density {
				dense[i] = float32(r.NormFloat64())
			}
		}
		h, err := HybridFromDense(dense, rows, cols, HybridOptions{Width: width})
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if err := h.Validate(); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		got := h.Dense()
		for i, v := range dense {
			if got[i] != nonzeroRound(v) {
				t.Fatalf("seed %d: hybrid %dx%d width %d: element %d = %g, want %g", seed, rows, cols, width, i, got[i], v)
			}
		}
		tr, err := h.Transpose(HybridOptions{Width: 1 + r.IntN(8)})
		if err != nil {
			t.Fatalf("seed %d: transpose: %v", seed, err)
		}
		if err := tr.Validate(); err != nil {
			t.Fatalf("seed %d: transposed invalid: %v", seed, err)
		}
		if rows == 0 {
			continue
		}
		td := tr.Dense()
		for i := 0; i < rows; i++ {
			for j := 0; j < cols; j++ {
				if td[j*rows+i] != got[i*cols+j] {
					t.Fatalf("seed %d: transpose [%d,%d] = %g, want %g", seed, j, i, td[j*rows+i], got[i*cols+j])
				}
			}
		}
	}
}

func nonzeroRound(v float32) float32 { return bf16.ToFloat32(nonzeroBF16(v)) }

func TestHybridTailLimitErrors(t *testing.T) {
	dense := make([]float32, 3*8)
	for i := range dense {
		dense[i] = 1
	}
	_, err := HybridFromDense(dense, 3, 8, HybridOptions{Width: 4, MaxTailRows: 2})
	if err == nil || !strings.Contains(err.Error(), "row 2 has 8 nonzeros") {
		t.Fatalf("tail overflow: err = %v, want an error naming row 2", err)
	}
	h, err := HybridFromDense(dense, 3, 8, HybridOptions{Width: 4})
	if err != nil || len(h.TailRows) != 3 {
		t.Fatalf("unbounded tail: %v, %d tail rows", err, len(h.TailRows))
	}
}

func TestHybridFromTwELLMatchesDense(t *testing.T) {
	r, seed := testutil.Rand(t)
	dense := randomActs(r, 50, 512, 0.1)
	for i := 0; i < 512; i++ { // one whole-row overflow
		dense[7*512+i] = 1 + float32(i)
	}
	m, err := Pack(DefaultLayout, dense, 50, 512)
	if err != nil {
		t.Fatal(err)
	}
	h, err := HybridFromTwELL(m, HybridOptions{Width: 40})
	if err != nil {
		t.Fatal(err)
	}
	want := m.Unpack()
	got := h.Dense()
	for i := range want {
		if got[i] != bf16.Round(want[i]) {
			t.Fatalf("seed %d: element %d: hybrid %g, TwELL %g", seed, i, got[i], want[i])
		}
	}
}
