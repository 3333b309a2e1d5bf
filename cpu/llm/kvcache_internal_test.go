package llm

import (
	"errors"
	"math"
	"testing"

	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/model"
)

// checkPool checks the pool's counts against its caches: pages in use are
// the live caches' lengths in pages, idle pages are what the live caches
// and the stash hold past that, and both together stay in the budget.
func checkPool(t *testing.T, seed uint64, step int, p *pagePool, live []*cache) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	inUse, idle := 0, 0
	for _, c := range live {
		m := c.mem
		if m.pages != p.pagesFor(c.n) || m.resident < m.pages {
			t.Fatalf("seed %d step %d: a cache of %d positions counts %d pages, %d resident", seed, step, c.n, m.pages, m.resident)
		}
		if _, ok := p.live[m]; !ok && p.total > 0 {
			t.Fatalf("seed %d step %d: a live cache's memory is not in the pool's live set", seed, step)
		}
		inUse += m.pages
		idle += m.resident - m.pages
	}
	for _, m := range p.stash {
		idle += m.resident
		if m.pages != 0 || m.mem == nil {
			t.Fatalf("seed %d step %d: a stashed mapping counts %d pages in use", seed, step, m.pages)
		}
	}
	if len(p.live) != len(live) && p.total > 0 {
		t.Fatalf("seed %d step %d: the pool knows %d live mappings, there are %d caches", seed, step, len(p.live), len(live))
	}
	if inUse != p.inUse || idle != p.idle || (p.total > 0 && inUse+idle > p.total) {
		t.Fatalf("seed %d step %d: pool counts %d in use, %d idle (budget %d); the caches hold %d and %d", seed, step, p.inUse, p.idle, p.total, inUse, idle)
	}
}

// TestPoolKeepsMemoryWithinBudget drives random NewCache, Forward,
// Truncate and Free calls through an engine with a small budget, so that
// memory is kept, reused and given back: its counts stay consistent and in
// the budget; a Forward fails (with ErrOutOfPages, changing nothing)
// exactly when its new pages exceed Total - InUse; and every Forward's
// logits are those of the same calls on an engine without a budget, bit
// for bit, although reused memory holds earlier caches' values.
func TestPoolKeepsMemoryWithinBudget(t *testing.T) {
	r, seed := testutil.Rand(t)
	bos := 1
	c := model.Config{ModelType: "llama", Architectures: []string{"LlamaForCausalLM"},
		HiddenSize: 32, IntermediateSize: 64, NumHiddenLayers: 2, NumAttentionHeads: 2, NumKeyValueHeads: 1, HeadDim: 16,
		VocabSize: 50, MaxPositionEmbeddings: 96, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: model.ActReLU, TieWordEmbeddings: true, MLPGated: true, BOSTokenID: &bos, EOSTokenIDs: []int{2}}
	m, err := model.New(c, model.RandomWeights(c, r))
	if err != nil {
		t.Fatal(err)
	}
	pageSize := 1 + r.IntN(8)
	total := 6 + r.IntN(30)
	paged, err := New(m, Options{KVPageSize: pageSize, KVMemory: int64(total) * PageBytes(c, pageSize)})
	if err != nil {
		t.Fatal(err)
	}
	flat, err := New(m, Options{})
	if err != nil {
		t.Fatal(err)
	}
	type pair struct{ p, f *cache }
	var live []pair
	caches := func() []*cache {
		out := make([]*cache, len(live))
		for i, l := range live {
			out[i] = l.p
		}
		return out
	}
	tokens := func(n int) []int {
		ids := make([]int, n)
		for i := range ids {
			ids[i] = r.IntN(c.VocabSize)
		}
		return ids
	}
	fails, reused := 0, 0
	for step := 0; step < 300; step++ {
		switch op := r.IntN(10); {
		case op < 2 && len(live) < 6: // a new cache
			capacity := 1 + r.IntN(c.MaxPositionEmbeddings)
			stashed := len(paged.pool.stash)
			pc, err := paged.NewCache(capacity)
			if err != nil {
				t.Fatal(err)
			}
			if len(paged.pool.stash) < stashed {
				reused++
			}
			fc, err := flat.NewCache(capacity)
			if err != nil {
				t.Fatal(err)
			}
			live = append(live, pair{pc.(*cache), fc.(*cache)})
		case op < 3 && len(live) > 0: // free one
			i := r.IntN(len(live))
			live[i].p.Free()
			live[i].f.Free()
			live = append(live[:i], live[i+1:]...)
		case op < 4 && len(live) > 0: // truncate one
			i := r.IntN(len(live))
			n := r.IntN(live[i].p.n + 1)
			live[i].p.Truncate(n)
			live[i].f.Truncate(n)
		case len(live) > 0: // a Forward over some of them
			var pcs, fcs []engine.Cache
			var toks [][]int
			need := 0
			for _, l := range live {
				room := l.p.capacity - l.p.n
				if room == 0 || r.IntN(3) == 0 {
					continue
				}
				k := 1
				if r.IntN(3) == 0 {
					k = 1 + r.IntN(room)
				}
				pcs, fcs = append(pcs, l.p), append(fcs, l.f)
				toks = append(toks, tokens(k))
				need += paged.pool.pagesFor(l.p.n+k) - paged.pool.pagesFor(l.p.n)
			}
			if len(toks) == 0 {
				continue
			}
			ps := paged.KVPages()
			lens := make([]int, len(pcs))
			for i, pc := range pcs {
				lens[i] = pc.Len()
			}
			got, _, err := paged.Forward(pcs, toks, true)
			if fits := need <= ps.Total-ps.InUse; fits != (err == nil) {
				t.Fatalf("seed %d step %d: %d new pages, %d free of %d: err %v", seed, step, need, ps.Total-ps.InUse, ps.Total, err)
			}
			if err != nil {
				if !errors.Is(err, engine.ErrOutOfPages) {
					t.Fatal(err)
				}
				for i, pc := range pcs {
					if pc.Len() != lens[i] {
						t.Fatalf("seed %d step %d: a failed Forward changed a cache's length", seed, step)
					}
				}
				fails++
				break
			}
			want, _, err := flat.Forward(fcs, toks, true)
			if err != nil {
				t.Fatal(err)
			}
			for i := range want {
				for j := range want[i] {
					if math.Float32bits(got[i][j]) != math.Float32bits(want[i][j]) {
						t.Fatalf("seed %d step %d: row %d logit %d: %v with the budget, %v without", seed, step, i, j, got[i][j], want[i][j])
					}
				}
			}
		}
		checkPool(t, seed, step, paged.pool, caches())
	}
	t.Logf("seed %d: %d pages of %d positions, %d Forwards out of pages, %d caches on reused memory", seed, total, pageSize, fails, reused)
	for _, l := range live {
		l.p.Free()
		l.f.Free()
	}
	paged.Close()
	if ps := paged.KVPages(); ps.InUse != 0 || ps.Idle != 0 {
		t.Fatalf("after Free and Close: %d pages in use, %d idle", ps.InUse, ps.Idle)
	}
}
