package trainer

import (
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
)

// TestMLPSaveLayout: on random shapes, a layer's saved region holds the
// views of either path, each the size its kernels read (every unit of
// every token firing, on the sparse path) and 16-byte aligned; the count
// buffer holds each of its uses.
func TestMLPSaveLayout(t *testing.T) {
	r, seed := testutil.Rand(t)
	for range 200 {
		s := mlpShape{m: 1 + r.IntN(5000), h: 8 * (1 + r.IntN(300)), f: 8 * (1 + r.IntN(2000)), gated: r.IntN(2) == 0}
		nnz := s.m * s.f
		sp := s.sparseSizes()
		want := []int{4 * (s.m + 1), 4 * (s.f + 1), 4 * nnz, 4 * nnz, 4 * nnz, 2 * nnz}
		if s.gated {
			want = append(want, 2*nnz, 2*nnz)
		}
		for i := range want {
			if sp[i] != want[i] {
				t.Fatalf("seed %d: %+v: sparse view %d of %d bytes, want %d", seed, s, i, sp[i], want[i])
			}
		}
		for _, p := range []mlp.Path{mlp.Auto, mlp.Sparse, mlp.Dense} {
			region := s.saveBytes(p)
			if region < s.denseSaveBytes() || (p != mlp.Dense && region < s.sparseSaveBytes()) {
				t.Fatalf("seed %d: %+v: %v region of %d bytes, dense needs %d, sparse %d", seed, s, p, region, s.denseSaveBytes(), s.sparseSaveBytes())
			}
		}
		per := 14 // bytes per token and unit: column, token, position, P
		if s.gated {
			per = 18 // and R, T
		}
		if got := carvedBytes(sp); got%16 != 0 || got < per*nnz {
			t.Fatalf("seed %d: %+v: sparse region %d bytes", seed, s, got)
		}
		if c := countBytes(s.m, s.f); c < carvedBytes(rowCountSizes(s.m)) || c < 4*(4*s.f+2) {
			t.Fatalf("seed %d: %+v: count buffer of %d bytes", seed, s, c)
		}
		if c := stashCap(s.m, s.f); align16(4*s.m*c)+2*s.m*c > 2*s.m*s.f || c > spStashCap ||
			(c < spStashCap && 6*s.m*(c+1)+16 <= 2*s.m*s.f) {
			t.Fatalf("seed %d: %+v: stash of %d entries a row in %d bytes", seed, s, c, 2*s.m*s.f)
		}
		if v := vecThreads(s.h); v%32 != 0 || v < 32 || v > 256 || (v < 256 && 8*v < s.h) {
			t.Fatalf("seed %d: h %d: %d threads", seed, s.h, v)
		}
	}
}

// TestSparseOK: the sparse path refuses, naming the cause, the shapes its
// kernels cannot take.
func TestSparseOK(t *testing.T) {
	const hopper = 227 << 10
	for _, c := range []struct {
		m, h, f, smem int
		want          string // "" accepted
	}{
		{16384, 2048, 5632, hopper, ""},
		{16384, 2048, 5632, 48 << 10, ""},
		{1, 8, 8, 48 << 10, ""},
		{16384, 2044, 5632, hopper, "divisible by 8"},
		{16384, 2048, 5630, hopper, "divisible by 8"},
		{1 << 20, 2048, 4096, hopper, "2^31 - 1"},
		{16384, 2048, 16384, 48 << 10, "shared memory"},
		{16384, 2048, 58112, hopper, ""},
		{16384, 2048, 58120, hopper, "shared memory"},
	} {
		err := sparseOK(c.m, c.h, c.f, c.smem)
		if (err == nil) != (c.want == "") || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("sparseOK(%d, %d, %d, %d) = %v, want %q", c.m, c.h, c.f, c.smem, err, c.want)
		}
	}
}

// TestLogitRowsFor: the default logit chunks are even, within the budget
// (one row at least), and as few as the budget allows; a chosen row count
// is kept up to the micro-batch.
func TestLogitRowsFor(t *testing.T) {
	r, seed := testutil.Rand(t)
	for range 1000 {
		c := model.Config{VocabSize: 1 + r.IntN(300000)}
		rows := 1 + r.IntN(1<<17)
		got := logitRowsFor(c, rows, 0)
		most := max(1, logitBudget/(4*c.VocabSize))
		chunks := ceil(rows, got)
		if got < 1 || got > rows || got > most || chunks != ceil(rows, most) || got*chunks-rows >= chunks {
			t.Fatalf("seed %d: vocab %d, %d rows: %d rows a chunk (%d chunks, at most %d rows fit)", seed, c.VocabSize, rows, got, chunks, most)
		}
		if o := 1 + r.IntN(2*rows); logitRowsFor(c, rows, o) != min(o, rows) {
			t.Fatalf("seed %d: %d rows, chosen %d: got %d", seed, rows, o, logitRowsFor(c, rows, o))
		}
	}
}
