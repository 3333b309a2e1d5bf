package llm

import (
	"slices"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// TestOrderItems checks orderItems without a GPU on random passes (cached
// keys and new tokens per sequence): the result is a permutation of the
// items, each sequence's items are contiguous and longest first, and the
// sequences come in order of their most keys, the longest first.
func TestOrderItems(t *testing.T) {
	r, seed := testutil.Rand(t)
	for round := range 200 {
		S := 1 + r.IntN(12)
		var work []attnItem
		for s := range S {
			past, n := r.IntN(3)*r.IntN(700), 1+r.IntN(700)
			for q0 := 0; q0 < n; q0 += attnBQ {
				work = append(work, attnItem{s: int32(s), q0: int32(q0), keys: past + min(q0+attnBQ, n)})
			}
		}
		r.Shuffle(len(work), func(i, j int) { work[i], work[j] = work[j], work[i] })
		got := slices.Clone(work)
		orderItems(got, S)
		key := func(a attnItem) [2]int32 { return [2]int32{a.s, a.q0} }
		sorted := func(w []attnItem) [][2]int32 {
			k := make([][2]int32, len(w))
			for i, a := range w {
				k[i] = key(a)
			}
			slices.SortFunc(k, func(x, y [2]int32) int {
				if x[0] != y[0] {
					return int(x[0] - y[0])
				}
				return int(x[1] - y[1])
			})
			return k
		}
		if !slices.Equal(sorted(got), sorted(work)) {
			t.Fatalf("seed %d round %d: the items are not a permutation of the input", seed, round)
		}
		most := make([]int, S)
		for _, a := range work {
			most[a.s] = max(most[a.s], a.keys)
		}
		done := map[int32]bool{}
		for i, a := range got {
			if i == 0 || a.s != got[i-1].s {
				if done[a.s] {
					t.Fatalf("seed %d round %d: sequence %d's items are not contiguous: %v", seed, round, a.s, got)
				}
				done[a.s] = true
				if i > 0 && most[a.s] > most[got[i-1].s] {
					t.Fatalf("seed %d round %d: sequence %d (%d keys) after sequence %d (%d)", seed, round, a.s, most[a.s], got[i-1].s, most[got[i-1].s])
				}
				continue
			}
			if a.keys > got[i-1].keys {
				t.Fatalf("seed %d round %d: sequence %d: an item of %d keys after one of %d", seed, round, a.s, a.keys, got[i-1].keys)
			}
		}
	}
}
