package twell

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// shufflePayloads permutes every packed tile's payload words, as the
// reference's kernels may leave them.
func shufflePayloads(r *rand.Rand, m *Matrix) {
	s := m.S()
	for off := 0; off < len(m.Words); off += s {
		w := m.Words[off : off+s]
		if n := int(w[0]); n < s {
			p := w[1 : n+1]
			r.Shuffle(len(p), func(i, j int) { p[i], p[j] = p[j], p[i] })
		}
	}
}

// TestShuffledPayloadsAccepted: a buffer whose tiles hold their payload in
// any order validates, unpacks, converts to Hybrid and lists its rows exactly
// as the sorted buffer twell packs; Sort brings back the packed words.
func TestShuffledPayloadsAccepted(t *testing.T) {
	r, seed := testutil.Rand(t)
	for iter := 0; iter < 100; iter++ {
		l := layouts[r.IntN(len(layouts))]
		rows := 1 + r.IntN(12)
		cols := l.Tile * (1 + r.IntN(4))
		density := []float64{0.02, 0.05, 0.1, 0.3}[r.IntN(4)]
		dense := randomActs(r, rows, cols, density)
		m, err := Pack(l, dense, rows, cols)
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		sorted := slices.Clone(m.Words)
		want := m.Unpack()
		shufflePayloads(r, m)
		if err := m.Validate(); err != nil {
			t.Fatalf("seed %d: %v %dx%d: shuffled payload rejected: %v", seed, l, rows, cols, err)
		}
		if got := m.Unpack(); !slices.Equal(got, want) {
			t.Fatalf("seed %d: %v %dx%d: shuffled payload unpacks differently", seed, l, rows, cols)
		}
		var cs []int32
		var vs []float32
		for row := 0; row < rows; row++ {
			cs, vs = m.AppendRow(row, cs[:0], vs[:0])
			if !slices.IsSorted(cs) {
				t.Fatalf("seed %d: row %d: AppendRow columns %v not ascending", seed, row, cs)
			}
		}
		h, err := HybridFromTwELL(m, HybridOptions{Width: 1 + r.IntN(cols)})
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if err := h.Validate(); err != nil {
			t.Fatalf("seed %d: Hybrid from a shuffled TwELL invalid: %v", seed, err)
		}
		hd := h.Dense()
		for i := range want {
			if hd[i] != nonzeroRound(want[i]) {
				t.Fatalf("seed %d: element %d: hybrid %g, TwELL %g", seed, i, hd[i], want[i])
			}
		}
		m.Sort()
		if !slices.Equal(m.Words, sorted) {
			t.Fatalf("seed %d: %v %dx%d: Sort did not restore the packed words", seed, l, rows, cols)
		}
	}
}

// TestReferenceOrderExample is the buffer shape the reference's kernels
// write: a tile whose payload lists column 212 before 209.
func TestReferenceOrderExample(t *testing.T) {
	m, err := New(DefaultLayout, 1, 256)
	if err != nil {
		t.Fatal(err)
	}
	cols := []uint32{3, 17, 40, 41, 90, 100, 150, 200, 212, 209, 255}
	m.Words[0] = uint32(len(cols))
	for i, c := range cols {
		m.Words[1+i] = 0x3f80_0000 | c // 1.0
	}
	if err := m.Validate(); err != nil {
		t.Fatalf("unordered payload rejected: %v", err)
	}
	d := m.Unpack()
	for _, c := range cols {
		if d[c] != 1 {
			t.Fatalf("column %d unpacked as %g, want 1", c, d[c])
		}
	}
	m.Words[2] = 0x3f80_0000 | 212 // now 212 twice
	if err := m.Validate(); err == nil {
		t.Fatal("a repeated column validated")
	}
}

// TestPackersSorted: twell's own packers stay deterministic: the payload of
// every tile they write is strictly ascending.
func TestPackersSorted(t *testing.T) {
	r, seed := testutil.Rand(t)
	for iter := 0; iter < 50; iter++ {
		l := layouts[r.IntN(len(layouts))]
		rows, cols := 1+r.IntN(8), l.Tile*(1+r.IntN(4))
		m, err := Pack(l, randomActs(r, rows, cols, 0.1), rows, cols)
		if err != nil {
			t.Fatal(err)
		}
		s := m.S()
		for off := 0; off < len(m.Words); off += s {
			n := min(int(m.Words[off]), s-1)
			p := m.Words[off+1 : off+1+n]
			for i := 1; i < len(p); i++ {
				if WordCol(p[i]) <= WordCol(p[i-1]) {
					t.Fatalf("seed %d: %v: tile at word %d: payload columns not ascending: %d then %d", seed, l, off, WordCol(p[i-1]), WordCol(p[i]))
				}
			}
		}
	}
}
