package llm

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/model"
)

// TestKVOptions checks the page size and budget settings without a GPU:
// the environment variables, and what configure refuses.
func TestKVOptions(t *testing.T) {
	t.Setenv(EnvKVPageSize, "128")
	t.Setenv(EnvKVMemory, "3MiB")
	o, err := OptionsFromEnv()
	if err != nil || o.KVPageSize != 128 || o.KVMemory != 3<<20 {
		t.Fatalf("OptionsFromEnv: %+v, %v; want page size 128, budget 3 MiB", o, err)
	}
	for _, bad := range [][2]string{{"-64", ""}, {"x", ""}, {"", "lots"}, {"", "-1"}, {"", "1.5GiB"}} {
		t.Setenv(EnvKVPageSize, bad[0])
		t.Setenv(EnvKVMemory, bad[1])
		if _, err := OptionsFromEnv(); err == nil {
			t.Errorf("%s=%q %s=%q accepted", EnvKVPageSize, bad[0], EnvKVMemory, bad[1])
		}
	}
	c := testConfig(64, 4, 2, true)
	p := &kvPool{cfg: c}
	if err := p.configure(0, 0); err != nil || p.size != DefaultPageSize || p.total != 0 {
		t.Fatalf("configure(0, 0): %v; page size %d, budget %d pages", err, p.size, p.total)
	}
	if err := p.configure(128, 10*PageBytes(c, 128)+1); err != nil || p.stats().Total != 10 || p.stats().PageBytes != PageBytes(c, 128) {
		t.Fatalf("configure(128, 10 pages + 1 byte): %v; %+v", err, p.stats())
	}
	huge := c
	huge.NumHiddenLayers = 1 << 12
	for _, k := range []struct {
		c      model.Config
		size   int
		memory int64
	}{{c, -64, 0}, {c, 32, 0}, {c, 96, 0}, {c, 64, -1}, {c, 64, PageBytes(c, 64) - 1}, {huge, 1 << 12, 0}} {
		if err := (&kvPool{cfg: k.c}).configure(k.size, k.memory); err == nil {
			t.Errorf("configure(%d, %d) with %d layers accepted", k.size, k.memory, k.c.NumHiddenLayers)
		}
	}
}

// attnKernels returns the attention kernels (Engine.Attention) that run a
// model of head_dim hd on dev: the plain one, mma.sync, the decode kernel
// on every decode step, wgmma on Hopper, and auto.
func attnKernels(dev *cuda.Device, hd int) []string {
	ks := []string{"ref", "auto"}
	if hd == 64 || hd == 128 {
		ks = append(ks, "mma")
	}
	if hd == 64 && dev.Properties().Arch == "sm_90a" {
		ks = append(ks, wgNames()...)
	}
	return ks
}

// pagedEngine returns an engine for m on the dense MLP path (the same
// arithmetic in every pass) with KV pages of pageSize positions and a
// budget of pages pages (0: none).
func pagedEngine(t *testing.T, dev *cuda.Device, m *model.Model, seed uint64, pageSize, pages int) *Engine {
	t.Helper()
	e := engineOnPath(t, dev, m, seed, "dense")
	if err := e.SetKVPages(pageSize, int64(pages)*PageBytes(m.Config, pageSize)); err != nil {
		t.Fatal(err)
	}
	return e
}

// TestPagedAttentionMatchesCPU runs, on every attention kernel, sequences
// whose lengths cross pages: prefills, then chunks that start in the middle
// of a page (one over two blocks of 128 queries, whose first causal block
// starts mid-page), then decode steps that cross into new pages, alone and
// batched. The logits of caches in pages of 64 and of 128 positions must be
// those of caches of one page each, bit for bit, and agree with the CPU
// model's.
func TestPagedAttentionMatchesCPU(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	const capacity = 320 // one page of the whole-cache engine
	for _, c := range []model.Config{testConfig(64, 4, 2, true), testConfig(128, 2, 1, true), testConfig(32, 8, 4, true)} {
		t.Run(fmt.Sprintf("hd%d", c.HeadDim), func(t *testing.T) {
			r, seed := testutil.Rand(t)
			m := sparseModel(t, c, r, seed)
			tok := func(n int) []int { return enginetest.Tokens(r, n, c.VocabSize) }
			// Lengths: a 100 -> 125 -> 131, b 30 -> 63 -> 69, c 50 -> 250.
			passes := [][][]int{{tok(100), tok(30), tok(50)}, {tok(25), tok(33), tok(200)}}
			for range 6 {
				passes = append(passes, [][]int{tok(1), tok(1), tok(1)})
			}
			want := cpuForward(t, m, "dense", capacity, passes...)
			for _, k := range attnKernels(dev, c.HeadDim) {
				run := func(pageSize int) [][]float32 {
					e := pagedEngine(t, dev, m, seed, pageSize, 0)
					e.Attention = k
					return enginetest.Passes(t, e, capacity, passes...)
				}
				whole := run(capacity)
				for _, size := range []int{64, 128} {
					enginetest.SameBits(t, fmt.Sprintf("seed %d: %s: pages of %d vs one page", seed, k, size), run(size), whole)
				}
				d, err := enginetest.RelDiff(whole, want)
				if err != nil || d > bf16Tol {
					t.Errorf("seed %d: %s vs CPU: rel diff %.3g (err %v), want <= %g", seed, k, d, err, bf16Tol)
				}
				t.Logf("seed %d: %s vs CPU rel diff %.2e", seed, k, d)
			}
		})
	}
}

// TestPagedCacheMatchesOnePage drives random batches (prefill chunks,
// decode steps, truncations, on a random attention kernel each) through two
// engines over the same model: one with pages of 64 positions and a small
// budget, where other caches take and give back pages in between (so that
// a cache's pages are scattered and reused with stale contents), and one
// whose caches are one page each. The logits are the same, bit for bit,
// and the pool counts every cache's length in whole pages.
func TestPagedCacheMatchesOnePage(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	c := testConfig(64, 4, 2, true)
	r, seed := testutil.Rand(t)
	m := sparseModel(t, c, r, seed)
	const capacity, seqs = 320, 3
	paged := pagedEngine(t, dev, m, seed, 64, 24)
	whole := pagedEngine(t, dev, m, seed, capacity, 0)
	kernels := attnKernels(dev, c.HeadDim)
	pc := enginetest.Caches(t, paged, seqs, capacity)
	wc := enginetest.Caches(t, whole, seqs, capacity)
	for step := range 60 {
		idx, toks := enginetest.RandomBatch(r, pc, capacity, 150, c.VocabSize)
		var other engine.Cache
		if r.IntN(3) == 0 { // another cache holds pages during the step
			other = enginetest.Caches(t, paged, 1, 128)[0]
			enginetest.Forward(t, paged, []engine.Cache{other}, [][]int{enginetest.Tokens(r, 1+r.IntN(128), c.VocabSize)}, false)
		}
		if len(idx) > 0 {
			k := kernels[r.IntN(len(kernels))]
			paged.Attention, whole.Attention = k, k
			all := r.IntN(2) == 0
			got, _, err := paged.Forward(enginetest.Pick(pc, idx), toks, all)
			if err != nil {
				t.Fatalf("seed %d: step %d: %v", seed, step, err)
			}
			want, _ := enginetest.Forward(t, whole, enginetest.Pick(wc, idx), toks, all)
			enginetest.SameBits(t, fmt.Sprintf("seed %d: step %d (%s): paged vs one page", seed, step, k), got, want)
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
			if err := wc[s].Truncate(n); err != nil {
				t.Fatal(err)
			}
		}
		ps := paged.KVPages()
		want := 0
		for _, cc := range pc {
			want += ps.PagesFor(cc.Len())
			if b := paged.CacheBytes(cc); b != int64(ps.PagesFor(cc.Len()))*ps.PageBytes {
				t.Fatalf("seed %d: step %d: a cache of %d positions takes %d bytes", seed, step, cc.Len(), b)
			}
		}
		if other != nil {
			want += ps.PagesFor(other.Len())
		}
		if ps.InUse != want || ps.InUse+ps.Idle > ps.Total {
			t.Fatalf("seed %d: step %d: %d pages in use and %d idle of %d, the caches' lengths need %d", seed, step, ps.InUse, ps.Idle, ps.Total, want)
		}
		if other != nil {
			other.Free()
		}
	}
}

// TestPageAccounting follows the pool through a budget of 10 pages: pages
// in use are the caches' lengths in whole pages; a Forward that needs more
// than are free fails with engine.ErrOutOfPages and changes no cache, not
// even the others of its batch; Truncate and Free make room; the pages
// given back are reused, not allocated again; a cache dropped without Free
// gives its pages back when it is collected; the page size cannot change
// once pages are taken.
func TestPageAccounting(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	c := testConfig(64, 4, 2, true)
	r, seed := testutil.Rand(t)
	e := pagedEngine(t, dev, sparseModel(t, c, r, seed), seed, 64, 10)
	pb := PageBytes(c, 64)
	if ps := e.KVPages(); ps.Total != 10 || ps.InUse != 0 || ps.Idle != 0 || ps.PageSize != 64 || ps.PageBytes != pb {
		t.Fatalf("pool %+v; want 10 pages of 64 positions, %d bytes, none taken", ps, pb)
	}
	tok := func(n int) []int { return enginetest.Tokens(r, n, c.VocabSize) }
	check := func(what string, inUse, idle int) {
		t.Helper()
		if ps := e.KVPages(); ps.InUse != inUse || ps.Idle != idle {
			t.Fatalf("seed %d: %s: %d pages in use, %d idle; want %d and %d", seed, what, ps.InUse, ps.Idle, inUse, idle)
		}
	}
	cs := enginetest.Caches(t, e, 2, 1024)
	a, b := cs[0], cs[1]
	if e.CacheBytes(a) != 0 {
		t.Fatalf("a new cache takes %d bytes", e.CacheBytes(a))
	}
	enginetest.Forward(t, e, []engine.Cache{a}, [][]int{tok(100)}, false)
	check("100 positions", 2, 8) // the slab is the whole budget
	if got := e.CacheBytes(a); got != 2*pb {
		t.Fatalf("a cache of 100 positions takes %d bytes, want %d", got, 2*pb)
	}
	_, _, err := e.Forward([]engine.Cache{a, b}, [][]int{tok(29), tok(450)}, false) // 1 + 8 pages
	if !errors.Is(err, engine.ErrOutOfPages) {
		t.Fatalf("seed %d: err = %v; want ErrOutOfPages", seed, err)
	}
	if a.Len() != 100 || b.Len() != 0 || e.CacheBytes(b) != 0 {
		t.Fatalf("a failed Forward changed the caches: lengths %d and %d", a.Len(), b.Len())
	}
	check("after ErrOutOfPages", 2, 8)
	if err := a.Truncate(50); err != nil {
		t.Fatal(err)
	}
	check("truncated to 50", 1, 9)
	enginetest.Forward(t, e, []engine.Cache{a, b}, [][]int{tok(29), tok(450)}, false) // 2 + 8 pages
	check("79 and 450 positions", 10, 0)
	enginetest.Forward(t, e, []engine.Cache{a}, [][]int{tok(49)}, false) // 128 positions: no new page
	if _, _, err := e.Forward([]engine.Cache{a}, [][]int{tok(1)}, false); !errors.Is(err, engine.ErrOutOfPages) || a.Len() != 128 {
		t.Fatalf("seed %d: a token past a full budget: err %v, length %d", seed, err, a.Len())
	}
	held := slices.Clone(b.(*cache).pt.pages)
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	check("b freed", 2, 8)
	if err := b.Free(); err == nil {
		t.Error("a second Free: no error")
	}
	if _, _, err := e.Forward([]engine.Cache{a, a}, [][]int{{1}, {2}}, false); err == nil {
		t.Error("the same cache twice in a batch: no error")
	}
	// The pages b gave back serve the next cache; no memory is allocated.
	d := enginetest.Caches(t, e, 1, 1024)[0]
	enginetest.Forward(t, e, []engine.Cache{d}, [][]int{tok(300)}, false)
	for _, pg := range d.(*cache).pt.pages {
		if !slices.Contains(held, pg) {
			t.Errorf("seed %d: a page at %#x, not one b gave back", seed, pg)
		}
	}
	if n := len(e.pool.slabs); n != 1 {
		t.Errorf("%d slabs; want the one", n)
	}
	if err := d.Truncate(0); err != nil {
		t.Fatal(err)
	}
	check("d truncated to 0", 2, 8)
	// A dropped cache: its pages come back once it is collected.
	func() {
		x, err := e.NewCache(256)
		if err != nil {
			t.Fatal(err)
		}
		enginetest.Forward(t, e, []engine.Cache{x}, [][]int{tok(200)}, false)
	}()
	check("a cache dropped", 6, 4)
	for i := 0; e.KVPages().InUse != 2; i++ {
		if i == 1000 {
			t.Fatalf("%d pages in use after a dropped cache was collected; want 2", e.KVPages().InUse)
		}
		runtime.GC()
		time.Sleep(time.Millisecond)
	}
	if err := e.SetKVPages(128, 0); err == nil {
		t.Error("the page size changed with pages taken")
	}
}

// TestPagesWithoutBudget: without a budget the pool reports none, counts
// the pages in use all the same, and keeps the pages given back.
func TestPagesWithoutBudget(t *testing.T) {
	c := testConfig(64, 4, 2, true)
	e, r, seed := gpuEngine(t, c, "dense")
	cs := enginetest.Caches(t, e, 3, 600)
	for i, n := range []int{1, 64, 65} {
		enginetest.Forward(t, e, cs[i:i+1], [][]int{enginetest.Tokens(r, n, c.VocabSize)}, false)
	}
	ps := e.KVPages()
	if ps.Total != 0 || ps.InUse != 4 || ps.PageSize != DefaultPageSize || ps.Free() != 0 {
		t.Fatalf("seed %d: pool %+v; want no budget, 4 pages of %d in use", seed, ps, DefaultPageSize)
	}
	idle := ps.Idle
	if err := cs[2].Free(); err != nil {
		t.Fatal(err)
	}
	if ps := e.KVPages(); ps.InUse != 2 || ps.Idle != idle+2 {
		t.Fatalf("seed %d: after a free: %+v; want 2 in use, %d idle", seed, ps, idle+2)
	}
}

// TestGraphDecodeAcrossPages decodes a batch whose sequences cross into
// new pages (and one that is truncated and grows into other pages again)
// with and without CUDA graphs: the graphs replay with the page tables
// uploaded before each step, so the logits must be bit-identical.
func TestGraphDecodeAcrossPages(t *testing.T) {
	c := testConfig(64, 4, 2, true)
	e, r, seed := gpuEngine(t, c, "")
	prompts := [][]int{enginetest.Tokens(r, 60, c.VocabSize), enginetest.Tokens(r, 126, c.VocabSize), enginetest.Tokens(r, 1, c.VocabSize)}
	next := make([][]int, 24)
	for i := range next {
		next[i] = enginetest.Tokens(r, len(prompts), c.VocabSize)
	}
	other := enginetest.Tokens(r, 70, c.VocabSize)
	decode := func(graphs bool) [][]float32 {
		e.NoGraphs = !graphs
		caches := enginetest.Caches(t, e, len(prompts), 200)
		enginetest.Forward(t, e, caches, prompts, false)
		var out [][]float32
		for i, ids := range next {
			if i == 12 {
				// Back into the first page; another cache takes the page
				// given back, and the sequence crosses into a third one.
				if err := caches[0].Truncate(55); err != nil {
					t.Fatal(err)
				}
				o := enginetest.Caches(t, e, 1, len(other))
				enginetest.Forward(t, e, o, [][]int{other}, false)
			}
			step := make([][]int, len(ids))
			for s, id := range ids {
				step[s] = []int{id}
			}
			l, _, err := e.Forward(caches, step, false)
			if err != nil {
				t.Fatalf("seed %d: step %d: %v", seed, i, err)
			}
			out = append(out, l...)
		}
		return out
	}
	for _, path := range []string{"sparse", "dense"} {
		if err := e.SetMLPPath(pathOf(t, path)); err != nil {
			t.Fatal(err)
		}
		eager := decode(false)
		replays, records := e.GraphReplays(), e.GraphRecords()
		graphed := decode(true)
		if e.GraphError() != nil {
			t.Fatalf("seed %d: %s: recording a graph failed: %v", seed, path, e.GraphError())
		}
		if n := e.GraphReplays() - replays; n < len(next)-2 {
			t.Errorf("seed %d: %s: %d of %d decode steps replayed a graph", seed, path, n, len(next))
		}
		t.Logf("seed %d: %s: %d graphs recorded", seed, path, e.GraphRecords()-records)
		enginetest.SameBits(t, fmt.Sprintf("seed %d: %s path, graph vs eager", seed, path), graphed, eager)
	}
}

// TestPagesRandomBatches checks on the host side (no GPU) that grow and
// release keep the counts: random lengths through a pool whose slabs are
// fake addresses.
func TestPagesRandomBatches(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := testConfig(64, 4, 2, true)
	p := &kvPool{cfg: c}
	if err := p.configure(64, 50*PageBytes(c, 64)); err != nil {
		t.Fatal(err)
	}
	// A slab of the whole budget, as addSlab would make it, without a device.
	for i := range 50 {
		p.idle = append(p.idle, uint64(1<<40+i*int(p.bytes)))
	}
	kcs := make([]*cache, 4)
	for i := range kcs {
		kcs[i] = &cache{cap: 1000, pt: &pageTable{pool: p}}
	}
	for step := range 500 {
		toks := make([][]int, len(kcs))
		for i := range toks {
			toks[i] = make([]int, 1+r.IntN(200))
		}
		before := p.stats()
		err := p.grow(kcs, toks)
		need := 0
		for i, kc := range kcs {
			need += max(0, p.pagesFor(kc.n+len(toks[i]))-len(kc.pt.pages))
		}
		switch {
		case errors.Is(err, engine.ErrOutOfPages):
			if need <= before.Free() || p.stats() != before {
				t.Fatalf("seed %d: step %d: out of pages with %d needed, %d free; pool %+v, was %+v", seed, step, need, before.Free(), p.stats(), before)
			}
		case err != nil:
			t.Fatalf("seed %d: step %d: %v", seed, step, err)
		default:
			for i, kc := range kcs {
				kc.n += len(toks[i])
			}
		}
		if i := r.IntN(len(kcs)); r.IntN(2) == 0 {
			kcs[i].n = r.IntN(kcs[i].n + 1)
			p.release(kcs[i].pt, p.pagesFor(kcs[i].n))
		}
		inUse := 0
		seen := map[uint64]bool{}
		for _, kc := range kcs {
			if len(kc.pt.pages) != p.pagesFor(kc.n) {
				t.Fatalf("seed %d: step %d: %d pages for %d positions", seed, step, len(kc.pt.pages), kc.n)
			}
			inUse += len(kc.pt.pages)
			for _, pg := range kc.pt.pages {
				if seen[pg] {
					t.Fatalf("seed %d: step %d: page %#x held twice", seed, step, pg)
				}
				seen[pg] = true
			}
		}
		if ps := p.stats(); ps.InUse != inUse || ps.InUse+ps.Idle != 50 {
			t.Fatalf("seed %d: step %d: pool %+v; %d pages held", seed, step, ps, inUse)
		}
	}
}

// TestDecodeBufferLayout: for random shapes, the decode attention's views
// lie inside its buffer, one after the other without overlap, each
// 4-byte aligned and as large as the kernel reads.
func TestDecodeBufferLayout(t *testing.T) {
	r, seed := testutil.Rand(t)
	for range 500 {
		c := model.Config{HeadDim: []int{64, 128}[r.IntN(2)], NumAttentionHeads: 1 + r.IntN(64)}
		S := 1 + r.IntN(512)
		l, n := decLayout(c, S), decBytes(c, S)
		runs := S * c.NumAttentionHeads * decSplits
		want := []int{4 * runs * c.HeadDim, 4 * runs, 4 * runs, 4 * S * c.NumAttentionHeads}
		end := 0
		for i, v := range l {
			if v[0] != end || v[1] != want[i] || v[0]%4 != 0 {
				t.Fatalf("seed %d: hd %d, %d heads, %d sequences: view %d at %d of %d bytes (want at %d, %d bytes)",
					seed, c.HeadDim, c.NumAttentionHeads, S, i, v[0], v[1], end, want[i])
			}
			end += v[1]
		}
		if end != n {
			t.Fatalf("seed %d: views end at %d, buffer of %d bytes", seed, end, n)
		}
	}
	if n := decBytes(model.Config{HeadDim: 96, NumAttentionHeads: 8}, 4); n != 0 {
		t.Fatalf("head_dim 96: decode buffer of %d bytes, want none (no decode kernel)", n)
	}
}

// TestDecodeRuns checks the decode attention's run count: 16 while the
// CTAs all fit on the device at once, then halved down to 1, and always
// within the buffer decBytes sizes (decSplits runs).
func TestDecodeRuns(t *testing.T) {
	for _, c := range []struct{ pairs, slots, want int }{
		{32, 792, 16}, {49, 792, 16}, {50, 792, 8}, {99, 792, 8}, {100, 792, 4}, {256, 792, 2}, {396, 792, 2},
		{397, 792, 1}, {2048, 792, 1}, {10000, 792, 1}, {1, 1, 1}, {1, 16, 16},
	} {
		if got := decRunsFor(c.pairs, c.slots); got != c.want || got > decSplits {
			t.Errorf("%d pairs, %d slots: %d runs, want %d", c.pairs, c.slots, got, c.want)
		}
	}
	for slots := 1; slots <= 2000; slots += 7 {
		for pairs := 1; pairs <= 2*slots; pairs += 3 {
			got := decRunsFor(pairs, slots)
			if got < 1 || got > decSplits || got&(got-1) != 0 || (got > 1 && pairs*got > slots) || (got < decSplits && pairs*got*2 <= slots) {
				t.Fatalf("%d pairs, %d slots: %d runs", pairs, slots, got)
			}
		}
	}
}
