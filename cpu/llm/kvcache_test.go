package llm_test

import (
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/mlp"
)

// TestPagedCacheMatchesContiguous drives random batches (prefill chunks,
// decode steps, truncations) through two engines over the same model: one
// whose caches are a single page each (contiguous) and one with small pages
// and a budget, where other caches take and give back pages in between. The
// logits are the same, bit for bit, and the pool counts every cache's
// length in whole pages.
func TestPagedCacheMatchesContiguous(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.02)
	const capacity, seqs = 120, 3
	pageSize := []int{1, 3, 5, 8, 16, 0}[r.IntN(6)]
	paged := newEngine(t, m, llm.Options{MLPPath: mlp.Sparse, KVPageSize: pageSize, KVMemory: 40 * llm.PageBytes(c, max(pageSize, llm.DefaultPageSize(c)))})
	flat := newEngine(t, m, llm.Options{MLPPath: mlp.Sparse, KVPageSize: capacity})
	ps := paged.KVPages()
	if pageSize == 0 && ps.PageSize != llm.DefaultPageSize(c) || pageSize > 0 && ps.PageSize != pageSize {
		t.Fatalf("seed %d: page size %d, asked %d", seed, ps.PageSize, pageSize)
	}
	pc := enginetest.Caches(t, paged, seqs, capacity)
	fc := enginetest.Caches(t, flat, seqs, capacity)
	for step := 0; step < 40; step++ {
		idx, toks := enginetest.RandomBatch(r, pc, capacity, 40, c.VocabSize)
		var other engine.Cache
		if r.IntN(3) == 0 { // another cache holds pages during the step
			other = enginetest.Caches(t, paged, 1, 64)[0]
			enginetest.Forward(t, paged, []engine.Cache{other}, [][]int{enginetest.Tokens(r, 1+r.IntN(30), c.VocabSize)}, false)
		}
		if len(idx) > 0 {
			all := r.IntN(2) == 0
			got, _ := enginetest.Forward(t, paged, enginetest.Pick(pc, idx), toks, all)
			want, _ := enginetest.Forward(t, flat, enginetest.Pick(fc, idx), toks, all)
			enginetest.SameBits(t, "paged vs contiguous (seed in the log)", got, want)
		}
		if other != nil && r.IntN(2) == 0 {
			other.Free()
			other = nil
		}
		if s := r.IntN(seqs); r.IntN(5) == 0 && pc[s].Len() > 0 {
			n := r.IntN(pc[s].Len())
			if err := pc[s].Truncate(n); err != nil {
				t.Fatal(err)
			}
			if err := fc[s].Truncate(n); err != nil {
				t.Fatal(err)
			}
		}
		want := 0
		for _, cc := range pc {
			want += ps.PagesFor(cc.Len())
		}
		if other != nil {
			want += ps.PagesFor(other.Len())
		}
		if got := paged.KVPages().InUse; got != want {
			t.Fatalf("seed %d: step %d: %d pages in use, the caches' lengths need %d", seed, step, got, want)
		}
		if other != nil {
			other.Free()
		}
	}
}

// TestPagesOutOfBudget: a Forward that needs more pages than are free fails
// with engine.ErrOutOfPages and changes no cache, not even the others of
// its batch; Truncate and Free make room; a cache dropped without Free
// gives its pages back when it is collected.
func TestPagesOutOfBudget(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.02)
	const page = 4
	e := newEngine(t, m, llm.Options{KVPageSize: page, KVMemory: 10*llm.PageBytes(c, page) + 1})
	if ps := e.KVPages(); ps.Total != 10 || ps.InUse != 0 || ps.PageBytes != llm.PageBytes(c, page) {
		t.Fatalf("pool %+v; want 10 pages of %d bytes, none in use", ps, llm.PageBytes(c, page))
	}
	cs := enginetest.Caches(t, e, 2, 64)
	a, b := cs[0], cs[1]
	enginetest.Forward(t, e, []engine.Cache{a}, [][]int{enginetest.Tokens(r, 25, c.VocabSize)}, false) // 7 pages
	before := e.KVPages().InUse
	_, _, err := e.Forward([]engine.Cache{a, b}, [][]int{{1, 2, 3, 4}, enginetest.Tokens(r, 9, c.VocabSize)}, false) // 1 + 3 pages
	if !errors.Is(err, engine.ErrOutOfPages) {
		t.Fatalf("seed %d: err = %v; want ErrOutOfPages", seed, err)
	}
	if a.Len() != 25 || b.Len() != 0 || e.KVPages().InUse != before {
		t.Fatalf("a failed Forward changed the caches: lengths %d and %d, %d pages in use (was %d)", a.Len(), b.Len(), e.KVPages().InUse, before)
	}
	if err := a.Truncate(12); err != nil { // 3 pages
		t.Fatal(err)
	}
	if got := e.KVPages().InUse; got != 3 {
		t.Fatalf("%d pages in use after truncating to 12 positions; want 3", got)
	}
	enginetest.Forward(t, e, []engine.Cache{a, b}, [][]int{{1, 2, 3}, enginetest.Tokens(r, 9, c.VocabSize)}, false)
	if got := e.KVPages().InUse; got != 7 {
		t.Fatalf("%d pages in use; want 4 + 3", got)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if got, free := e.KVPages().InUse, e.KVPages().Free(); got != 4 || free != 6 {
		t.Fatalf("%d pages in use, %d free after Free; want 4 and 6", got, free)
	}
	if err := b.Free(); err == nil {
		t.Error("a second Free: no error")
	}
	if _, _, err := e.Forward([]engine.Cache{a, a}, [][]int{{1}, {2}}, false); err == nil {
		t.Error("the same cache twice in a batch: no error")
	}
	// A dropped cache: its pages come back once it is collected.
	func() {
		d, err := e.NewCache(32)
		if err != nil {
			t.Fatal(err)
		}
		enginetest.Forward(t, e, []engine.Cache{d}, [][]int{enginetest.Tokens(r, 20, c.VocabSize)}, false)
	}()
	for i := 0; e.KVPages().InUse != 4; i++ {
		if i == 1000 {
			t.Fatalf("%d pages in use after a dropped cache was collected; want 4", e.KVPages().InUse)
		}
		runtime.GC()
		time.Sleep(time.Millisecond)
	}
}

// TestKVOptionsChecked: a negative page size or budget, a budget under one
// page and a page past any memory are refused.
func TestKVOptionsChecked(t *testing.T) {
	r, _ := testutil.Rand(t)
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.02)
	for _, o := range []llm.Options{{KVPageSize: -1}, {KVMemory: -5}, {KVPageSize: 16, KVMemory: llm.PageBytes(c, 16) - 1}, {KVPageSize: 1 << 45}} {
		if _, err := llm.New(m, o); err == nil {
			t.Errorf("options %+v: no error", o)
		}
	}
}
