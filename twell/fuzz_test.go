package twell

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/bf16"
)

// floatsFrom reads float32 values from raw fuzz bytes.
func floatsFrom(data []byte) []float32 {
	out := make([]float32, len(data)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:]))
	}
	return out
}

func FuzzPackUnpack(f *testing.F) {
	f.Add(uint8(0), uint8(1), []byte{0, 0, 128, 63, 0, 0, 0, 192})
	f.Add(uint8(5), uint8(3), make([]byte, 64))
	f.Fuzz(func(t *testing.T, layoutSel, rowsSel uint8, data []byte) {
		l := layouts[int(layoutSel)%len(layouts)]
		rows := int(rowsSel % 4)
		cols := l.Tile * (1 + int(layoutSel/8)%3)
		vals := floatsFrom(data)
		dense := make([]float32, rows*cols)
		for i := range dense {
			if len(vals) > 0 {
				dense[i] = vals[i%len(vals)]
			}
		}
		m, err := Pack(l, dense, rows, cols)
		if err != nil {
			t.Fatal(err)
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("Pack produced an invalid matrix: %v", err)
		}
		got := m.Unpack()
		for i, v := range dense {
			g := got[i]
			switch {
			case v != v:
				if g == g {
					t.Fatalf("element %d: NaN unpacked as %g", i, g)
				}
			case v <= 0:
				if g != 0 {
					t.Fatalf("element %d: %g unpacked as %g, want 0", i, v, g)
				}
			default:
				if g <= 0 || math.Abs(float64(g-v)) > math.Abs(float64(v))/128+1e-38 {
					t.Fatalf("element %d: %g unpacked as %g", i, v, g)
				}
			}
		}
		h, err := HybridFromTwELL(m, HybridOptions{Width: 1 + int(rowsSel)%8})
		if err != nil {
			t.Fatal(err)
		}
		if err := h.Validate(); err != nil {
			t.Fatalf("HybridFromTwELL produced an invalid matrix: %v", err)
		}
		if _, err := h.Transpose(HybridOptions{}); err != nil {
			t.Fatal(err)
		}
	})
}

func FuzzValidate(f *testing.F) {
	f.Add(uint8(0), []byte{1, 0, 0, 0, 7, 0, 128, 63})
	f.Fuzz(func(t *testing.T, layoutSel uint8, data []byte) {
		l := layouts[int(layoutSel)%len(layouts)]
		words := make([]uint32, len(data)/4)
		for i := range words {
			words[i] = binary.LittleEndian.Uint32(data[4*i:])
		}
		rw := l.Tile / l.C
		m := &Matrix{Layout: l, Rows: len(words) / rw, Cols: l.Tile, Words: words[:len(words)/rw*rw]}
		if m.Validate() == nil {
			// A valid matrix must unpack to values > 0 in its own tiles.
			for _, v := range m.Unpack() {
				if v < 0 || v != v {
					t.Fatalf("valid matrix unpacked to %g", v)
				}
			}
		}
		h := &Hybrid{Rows: 1, Cols: 4, Width: 2, Count: []int32{int32(layoutSel % 6)}, ColIdx: []uint16{uint16(len(data) % 5), 3}, Vals: []uint16{0x3f80, 0x3f80}, TailSlot: []int32{-1}}
		_ = h.Validate()
	})
}

func FuzzHybridFromDense(f *testing.F) {
	f.Add(uint8(3), uint8(5), []byte{0, 0, 128, 63, 0, 0, 0, 0, 0, 0, 0, 192})
	f.Fuzz(func(t *testing.T, widthSel, colsSel uint8, data []byte) {
		vals := floatsFrom(data)
		cols := 1 + int(colsSel)%40
		rows := len(vals) / cols
		dense := vals[:rows*cols]
		h, err := HybridFromDense(dense, rows, cols, HybridOptions{Width: 1 + int(widthSel)%cols, MaxTailRows: int(widthSel) % 3})
		if err != nil {
			if !strings.Contains(err.Error(), "dense tail is full") {
				t.Fatalf("unexpected error: %v", err)
			}
			return
		}
		if err := h.Validate(); err != nil {
			t.Fatalf("HybridFromDense produced an invalid matrix: %v", err)
		}
		got := h.Dense()
		for i, v := range dense {
			w := bf16.ToFloat32(nonzeroBF16(v))
			if got[i] != w && !(v != v && got[i] != got[i]) {
				t.Fatalf("element %d: %g came back as %g, want %g", i, v, got[i], w)
			}
		}
		tr, err := h.Transpose(HybridOptions{Width: 1 + int(widthSel)%5})
		if err != nil {
			t.Fatal(err)
		}
		if err := tr.Validate(); err != nil {
			t.Fatalf("Transpose produced an invalid matrix: %v", err)
		}
	})
}

// FuzzMatrixBuffer builds a Matrix from arbitrary fields and words, as a
// buffer from outside would arrive: Validate, Unpack, AppendRow and Sort
// must never panic; when Validate accepts it, shuffling its payloads or
// sorting them changes neither validity nor the unpacked matrix, and the
// hybrid conversion is valid.
func FuzzMatrixBuffer(f *testing.F) {
	f.Add(uint8(0), int16(1), int32(256), []byte{2, 0, 0, 0, 212, 0, 128, 63, 209, 0, 128, 63}, []byte{})
	f.Add(uint8(3), int16(2), int32(128), make([]byte, 128), []byte{0, 0, 1, 2, 3})
	f.Add(uint8(7), int16(-1), int32(0), []byte{1}, []byte{9, 9})
	f.Fuzz(func(t *testing.T, sel uint8, rows int16, cols int32, data, spill []byte) {
		l := Layout{Tile: 256, C: 8}
		if sel < 6*8 {
			l = layouts[int(sel)%len(layouts)]
		} else {
			l = Layout{Tile: int(sel % 7 * 64), C: int(sel % 5)}
		}
		words := make([]uint32, len(data)/4)
		for i := range words {
			words[i] = binary.LittleEndian.Uint32(data[4*i:])
		}
		if sel%2 == 1 && l.Tile > 0 && l.C > 0 && l.Tile/l.C > 0 {
			// Give the shape a fair chance to agree with the buffer.
			cols = int32(l.Tile * (1 + int(sel/2)%3))
			rows = int16(len(words) / (int(cols) / l.C))
			words = words[:int(rows)*int(cols)/l.C]
		}
		m := &Matrix{Layout: l, Rows: int(rows), Cols: int(cols), Words: words}
		for i := 0; i+2 < len(spill); i += 3 {
			vals := make([]float32, int(spill[i+2])%(l.Tile+2))
			for j := range vals {
				vals[j] = float32(j%3) - 0.5
			}
			m.Spill = append(m.Spill, SpillTile{Row: int(int8(spill[i])), Tile: int(int8(spill[i+1])), Values: vals})
		}
		err := m.Validate()
		d := m.Unpack()
		m.AppendRow(int(rows)-1, nil, nil)
		m.AppendRow(0, nil, nil)
		if err != nil {
			m.Sort()
			return
		}
		if len(d) != m.Rows*m.Cols {
			t.Fatalf("valid %dx%d matrix unpacked to %d values", m.Rows, m.Cols, len(d))
		}
		for _, v := range d {
			if v < 0 {
				t.Fatalf("valid matrix unpacked to %g", v)
			}
		}
		shufflePayloads(rand.New(rand.NewPCG(uint64(len(data)), uint64(sel))), m)
		if err := m.Validate(); err != nil {
			t.Fatalf("shuffled payload of a valid matrix rejected: %v", err)
		}
		if !slices.Equal(floatBits(m.Unpack()), floatBits(d)) {
			t.Fatal("shuffled payload unpacks differently")
		}
		m.Sort()
		if err := m.Validate(); err != nil {
			t.Fatalf("sorted payload of a valid matrix rejected: %v", err)
		}
		if !slices.Equal(floatBits(m.Unpack()), floatBits(d)) {
			t.Fatal("sorted payload unpacks differently")
		}
		h, err := HybridFromTwELL(m, HybridOptions{})
		if err != nil {
			return // e.g. a width under the default ELL width
		}
		if err := h.Validate(); err != nil {
			t.Fatalf("HybridFromTwELL of a valid matrix is invalid: %v", err)
		}
	})
}

// floatBits returns the bits of vs, so that NaN compares equal to itself.
func floatBits(vs []float32) []uint32 {
	out := make([]uint32, len(vs))
	for i, v := range vs {
		out[i] = math.Float32bits(v)
	}
	return out
}
