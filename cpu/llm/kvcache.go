package llm

import (
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"sync"
	"unsafe"

	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/model"
)

// The KV cache in pages.
//
// A cache reserves address space for its whole capacity at NewCache: per
// layer, one region of keys and one of values, each [capacity][kvHeads *
// headDim] float32, contiguous, so that the attention kernel of package cpu
// reads it as it always has (and the logits are the same, bit for bit).
// Physical memory is another matter: on Linux the regions are anonymous
// mappings that take memory only where they are written, page by page of
// the operating system, and a cache gives the memory of the positions it
// drops back at once (madvise MADV_DONTNEED on Truncate, munmap on Free).
// So the memory of a cache follows the tokens it holds, not its capacity.
//
// The engine counts that memory in pages of PageSize positions (keys and
// values of every layer) in one pool: a Forward takes the pages its new
// tokens need from the pool before it writes them, and fails with
// engine.ErrOutOfPages, changing no cache, when the pool's budget
// (Options.KVMemory) has too few left. Truncate and Free give pages back.
// The default page size is a whole number of operating-system pages per
// layer, so that the pages counted are the memory held.
//
// Without a budget the memory of the pages given back goes back to the
// operating system at once. With one, it is kept for the caches to come, up
// to the budget: writing to memory the process holds costs nothing, while a
// page the kernel must fault in again costs about 20 us on the development
// machine (BenchmarkKVMemory: 5-7 ms per MiB). Truncate then only counts
// the pages past the new length as idle; Free puts the cache's mapping in a
// stash that NewCache takes from (every mapping is then made for the
// model's whole context, so that any cache fits in any); and a Forward that
// needs more memory than the budget has left besides the idle pages gives
// idle memory back (the stash's oldest mappings first, then the idle pages
// of live caches). Pages in use never count idle ones, so a Forward that
// needs no more pages than Total - InUse always finds them.
//
// Elsewhere than Linux the regions are ordinary Go memory, allocated whole:
// the pages are counted as on Linux, but memory is given back only when the
// cache is freed.

// defaultPageSize is the page size the engine starts from: 16 positions,
// more where a layer's keys for 16 positions would not fill a page of the
// operating system.
const defaultPageSize = 16

// DefaultPageSize returns the page size of an engine for c when
// Options.KVPageSize is 0: 16 positions, or the fewest that make one
// layer's keys of a page a whole number of pages of the operating system
// (64 positions for 2 KV heads of 8 values and 4 KiB pages).
func DefaultPageSize(c model.Config) int {
	rowBytes := 4 * c.NumKeyValueHeads * c.HeadDim
	osPage := os.Getpagesize()
	if rowBytes < 1 || osPage < 1 {
		return defaultPageSize
	}
	p := defaultPageSize
	for p*rowBytes%osPage != 0 && p < 1<<20 {
		p *= 2
	}
	if p*rowBytes%osPage != 0 {
		return defaultPageSize
	}
	return p
}

// PageBytes returns the memory of one page of pageSize positions of a model
// of config c: keys and values of every layer, float32.
func PageBytes(c model.Config, pageSize int) int64 {
	return int64(pageSize) * int64(c.NumKeyValueHeads*c.HeadDim) * 4 * 2 * int64(c.NumHiddenLayers)
}

// pagePool counts the pages the engine's caches hold against its budget
// and, with a budget, keeps the memory of pages given back for the caches
// to come. Caches collected without Free give their pages back from
// another goroutine, hence the lock; everything else runs on the goroutine
// that drives the engine.
type pagePool struct {
	size      int   // positions per page
	bytes     int64 // bytes per page
	total     int   // budget in pages; 0: none
	rowBytes  int   // bytes of one position of one region
	regions   int   // regions per cache: keys and values of every layer
	stdPos    int   // with a budget: the positions of the mappings kept for reuse (0: none kept)
	stdRegion int   // their region bytes

	mu     sync.Mutex
	inUse  int                    // pages of the live caches' lengths
	idle   int                    // pages written and not given back, past the live caches' lengths and in the stash
	live   map[*kvMemory]struct{} // with a budget: the mappings of live caches
	stash  []*kvMemory            // with a budget: mappings of freed caches, oldest first
	closed bool                   // the engine is closed: nothing more is kept
}

// maxStash bounds the mappings kept for reuse (address space, not memory:
// their pages count against the budget).
const maxStash = 64

// maxStdBytes bounds the address space of one mapping made for the whole
// context; past it caches are mapped for their own capacities and freed
// mappings are not kept.
const maxStdBytes = 1 << 40

func newPagePool(c model.Config, size int, total int) *pagePool {
	p := &pagePool{size: size, bytes: PageBytes(c, size), total: total, rowBytes: 4 * c.NumKeyValueHeads * c.HeadDim,
		regions: 2 * c.NumHiddenLayers, live: map[*kvMemory]struct{}{}}
	if total > 0 {
		region := roundUp(p.pagesFor(c.MaxPositionEmbeddings)*size*p.rowBytes, os.Getpagesize())
		if float64(region)*float64(p.regions) <= maxStdBytes {
			p.stdPos, p.stdRegion = c.MaxPositionEmbeddings, region
		}
	}
	return p
}

func (p *pagePool) pagesFor(n int) int { return (n + p.size - 1) / p.size }

func (p *pagePool) stats() engine.PageStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return engine.PageStats{PageSize: p.size, PageBytes: p.bytes, InUse: p.inUse, Idle: p.idle, Total: p.total}
}

// KVPages returns the state of the engine's page pool (engine.Paged).
func (e *Engine) KVPages() engine.PageStats { return e.pool.stats() }

var _ engine.Paged = (*Engine)(nil)

// kvMemory is the memory of one cache: p.regions regions (keys of layer 0,
// values of layer 0, keys of layer 1, ...) of regionBytes each. The
// first resident pages of every region have been written and not given
// back; the first pages of them are the cache's length. It is apart from
// the cache so that the cleanup of a cache that was never freed can reach
// it, and so that it outlives the cache in the stash.
type kvMemory struct {
	mem         []byte // nil once given back
	regionBytes int
	pages       int  // pages in use
	resident    int  // pages written and not given back, >= pages
	std         bool // made for the whole context: kept for reuse when freed
	pool        *pagePool
}

// newMemory returns the memory of a cache of capacity positions: a kept
// mapping when there is one, else a new one.
func (p *pagePool) newMemory(capacity int) (*kvMemory, error) {
	std := p.stdPos > 0 && capacity <= p.stdPos
	if std {
		p.mu.Lock()
		if n := len(p.stash); n > 0 {
			m := p.stash[n-1] // the newest: the most likely to be resident
			p.stash = p.stash[:n-1]
			p.live[m] = struct{}{}
			p.mu.Unlock()
			return m, nil
		}
		p.mu.Unlock()
	}
	region := p.stdRegion
	if !std {
		region = roundUp(p.pagesFor(capacity)*p.size*p.rowBytes, os.Getpagesize())
	}
	mem, err := mapKV(p.regions * region)
	if err != nil {
		return nil, fmt.Errorf("cpu/llm: reserving a cache of %d tokens (%s of address space): %w",
			capacity, memcheck.Format(float64(p.regions)*float64(region)), err)
	}
	m := &kvMemory{mem: mem, regionBytes: region, std: std, pool: p}
	if p.total > 0 {
		p.mu.Lock()
		p.live[m] = struct{}{}
		p.mu.Unlock()
	}
	return m, nil
}

// drop gives back the memory of pages from .. m.resident-1 of every region
// (whole pages of the operating system).
func (m *kvMemory) drop(from int) {
	osPage := os.Getpagesize()
	lo := roundUp(from*m.pool.size*m.pool.rowBytes, osPage)
	hi := min(roundUp(m.resident*m.pool.size*m.pool.rowBytes, osPage), m.regionBytes)
	if lo < hi {
		for r := 0; r < len(m.mem)/m.regionBytes; r++ {
			dropKV(m.mem[r*m.regionBytes+lo : r*m.regionBytes+hi])
		}
	}
	m.resident = from
}

// shrink keeps the first keep pages in use; the others are idle (with a
// budget) or given back.
func (m *kvMemory) shrink(keep int) {
	p := m.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if keep >= m.pages {
		return
	}
	p.inUse -= m.pages - keep
	p.idle += m.pages - keep
	m.pages = keep
	if p.total == 0 {
		p.idle -= m.resident - keep
		m.drop(keep)
	}
}

// release ends the cache of m: with a budget a mapping made for the whole
// context goes to the stash, its pages idle; any other is given back.
func (m *kvMemory) release() {
	p := m.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if m.mem == nil {
		return
	}
	delete(p.live, m)
	p.inUse -= m.pages
	p.idle += m.pages
	m.pages = 0
	if m.std && p.total > 0 && m.resident > 0 && !p.closed {
		p.stash = append(p.stash, m)
		if len(p.stash) > maxStash {
			p.unmap(p.stash[0])
			p.stash = p.stash[1:]
		}
		return
	}
	p.unmap(m)
}

// unmap gives all of m back (its pages are idle).
func (p *pagePool) unmap(m *kvMemory) {
	p.idle -= m.resident
	m.resident = 0
	unmapKV(m.mem)
	m.mem = nil
}

// evict gives back idle memory until n pages more fit in the budget beside
// the pages in use and idle, or no idle page is left: the stash's oldest
// mappings first, then the idle pages of live caches.
func (p *pagePool) evict(n int) {
	for p.inUse+p.idle+n > p.total && len(p.stash) > 0 {
		p.unmap(p.stash[0])
		p.stash = p.stash[1:]
	}
	for m := range p.live {
		if p.inUse+p.idle+n <= p.total {
			break
		}
		if t := m.resident - m.pages; t > 0 {
			p.idle -= t
			m.drop(m.pages)
		}
	}
}

// close gives the stash back.
func (p *pagePool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range p.stash {
		p.unmap(m)
	}
	p.stash, p.closed = nil, true
}

func roundUp(n, to int) int { return (n + to - 1) / to * to }

// cache is the KV cache of one sequence: per layer, keys and values of
// [capacity][kvHeads*headDim] float32 over kvMemory.
type cache struct {
	k, v     [][]float32
	n        int
	capacity int
	mem      *kvMemory // nil once freed
	cleanup  runtime.Cleanup
	e        *Engine
}

// NewCache returns an empty cache for a sequence of up to capacity tokens.
// It reserves address space for them; memory is taken as tokens are
// appended (see KVPages).
func (e *Engine) NewCache(capacity int) (engine.Cache, error) {
	c := e.model.Config
	if capacity < 1 {
		return nil, fmt.Errorf("cpu/llm: cache capacity %d: must be positive", capacity)
	}
	kvw := c.NumKeyValueHeads * c.HeadDim
	if bytes := float64(capacity) * float64(kvw) * 8 * float64(c.NumHiddenLayers); bytes > math.MaxInt/2 {
		return nil, fmt.Errorf("cpu/llm: a cache of %d tokens would take %.3g GiB", capacity, bytes/(1<<30))
	}
	m, err := e.pool.newMemory(capacity)
	if err != nil {
		return nil, err
	}
	kc := &cache{e: e, capacity: capacity, mem: m}
	floats := func(r int) []float32 {
		return unsafe.Slice((*float32)(unsafe.Pointer(&m.mem[r*m.regionBytes])), capacity*kvw)
	}
	for l := range c.NumHiddenLayers {
		kc.k = append(kc.k, floats(2*l))
		kc.v = append(kc.v, floats(2*l+1))
	}
	// A cache that is dropped without Free gives its memory back when it is
	// collected.
	kc.cleanup = runtime.AddCleanup(kc, (*kvMemory).release, m)
	return kc, nil
}

func (c *cache) Len() int { return c.n }

func (c *cache) Capacity() int { return c.capacity }

// Truncate keeps the first n positions and gives the pages past them back.
func (c *cache) Truncate(n int) error {
	if c.mem == nil {
		return errors.New("cpu/llm: truncate: the cache was freed")
	}
	if n < 0 || n > c.n {
		return fmt.Errorf("cpu/llm: truncate to %d positions: the cache holds %d", n, c.n)
	}
	c.n = n
	c.mem.shrink(c.e.pool.pagesFor(n))
	return nil
}

// Free gives the cache's memory and pages back.
func (c *cache) Free() error {
	if c.mem == nil {
		return errors.New("cpu/llm: cache was already freed")
	}
	c.cleanup.Stop()
	c.mem.release()
	c.k, c.v, c.n, c.mem = nil, nil, 0, nil
	return nil
}

// caches checks that every cache is this engine's, live and given once.
func (e *Engine) caches(cs []engine.Cache) ([]*cache, error) {
	out := make([]*cache, len(cs))
	seen := make(map[*cache]int, len(cs))
	for i, c := range cs {
		kc, ok := c.(*cache)
		if !ok || kc.e != e {
			return nil, fmt.Errorf("cpu/llm: cache %d was not made by this engine", i)
		}
		if kc.mem == nil {
			return nil, fmt.Errorf("cpu/llm: cache %d was freed", i)
		}
		if j, ok := seen[kc]; ok {
			return nil, fmt.Errorf("cpu/llm: caches %d and %d are the same cache", j, i)
		}
		seen[kc] = i
		out[i] = kc
	}
	return out, nil
}

// growBytesChecked: a Forward that takes more memory than this for new
// pages checks first that it is available (internal/memcheck).
const growBytesChecked = 256 << 20

// grow counts as in use the pages that caches need to hold news[i] more
// positions each: first those of their memory written already, then new
// ones, for which idle memory is given back where the budget needs it. On
// error no cache has changed.
func (e *Engine) grow(kcs []*cache, news []int) error {
	p := e.pool
	tos := make([]int, len(kcs))
	fresh, need := 0, 0
	for i, kc := range kcs {
		tos[i] = p.pagesFor(kc.n + news[i])
		fresh += max(0, tos[i]-max(kc.mem.pages, kc.mem.resident))
		need += max(0, tos[i]-kc.mem.pages)
	}
	if need == 0 {
		return nil
	}
	if bytes := float64(fresh) * float64(p.bytes); bytes >= growBytesChecked {
		if err := memcheck.Fits(fmt.Sprintf("%d new KV cache pages", fresh), bytes, ""); err != nil {
			return fmt.Errorf("cpu/llm: %w", err)
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	// Pages written already: idle to in use.
	was := make([]int, len(kcs))
	for i, kc := range kcs {
		m := kc.mem
		was[i] = m.pages
		if r := min(tos[i], m.resident) - m.pages; r > 0 {
			m.pages += r
			p.inUse += r
			p.idle -= r
		}
	}
	if p.total > 0 && p.inUse+p.idle+fresh > p.total {
		p.evict(fresh)
		if p.inUse+p.idle+fresh > p.total {
			for i, kc := range kcs { // back to idle
				m := kc.mem
				p.inUse -= m.pages - was[i]
				p.idle += m.pages - was[i]
				m.pages = was[i]
			}
			return fmt.Errorf("cpu/llm: %w: the new tokens need %d more pages of %d positions, %d of %d are free (KV budget %s)",
				engine.ErrOutOfPages, need, p.size, p.total-p.inUse, p.total, memcheck.Format(float64(p.total)*float64(p.bytes)))
		}
	}
	for i, kc := range kcs {
		m := kc.mem
		if tos[i] > m.pages {
			p.inUse += tos[i] - m.pages
			m.pages = tos[i]
			m.resident = max(m.resident, m.pages)
		}
	}
	return nil
}

// ungrow gives back the pages past each cache's length (after a failed
// Forward).
func (e *Engine) ungrow(kcs []*cache) {
	for _, kc := range kcs {
		kc.mem.shrink(e.pool.pagesFor(kc.n))
	}
}
