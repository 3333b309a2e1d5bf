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

// pagePool counts the pages the engine's caches hold against its budget.
// Caches freed by the garbage collector give their pages back from another
// goroutine, hence the lock.
type pagePool struct {
	size  int   // positions per page
	bytes int64 // bytes per page
	total int   // budget in pages; 0: none

	mu    sync.Mutex
	inUse int
}

// take counts n more pages in use, or fails when the budget has fewer free.
func (p *pagePool) take(n int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.total > 0 && p.inUse+n > p.total {
		return fmt.Errorf("cpu/llm: %w: the new tokens need %d more pages of %d positions, %d of %d are free (KV budget %s)",
			engine.ErrOutOfPages, n, p.size, p.total-p.inUse, p.total, memcheck.Format(float64(p.total)*float64(p.bytes)))
	}
	p.inUse += n
	return nil
}

// give counts n pages as free again.
func (p *pagePool) give(n int) {
	p.mu.Lock()
	p.inUse -= n
	p.mu.Unlock()
}

func (p *pagePool) stats() engine.PageStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return engine.PageStats{PageSize: p.size, PageBytes: p.bytes, InUse: p.inUse, Total: p.total}
}

// KVPages returns the state of the engine's page pool (engine.Paged).
func (e *Engine) KVPages() engine.PageStats { return e.pool.stats() }

var _ engine.Paged = (*Engine)(nil)

// kvMemory is the memory of one cache: 2 * layers regions (keys of layer 0,
// values of layer 0, keys of layer 1, ...) of regionBytes each, and the
// pages of it the pool counts. It is apart from the cache so that the
// cleanup of a cache that was never freed can reach it.
type kvMemory struct {
	mem         []byte // nil once freed
	regionBytes int
	rowBytes    int // bytes of one position of one region
	pages       int // pages held in the pool
	pool        *pagePool
}

// shrink keeps the first keep pages of every region and gives the memory
// and the pool's count of the others back.
func (m *kvMemory) shrink(keep int) {
	if keep >= m.pages {
		return
	}
	osPage := os.Getpagesize()
	from := roundUp(keep*m.pool.size*m.rowBytes, osPage)
	to := min(roundUp(m.pages*m.pool.size*m.rowBytes, osPage), m.regionBytes)
	if from < to {
		for r := 0; r < len(m.mem)/m.regionBytes; r++ {
			dropKV(m.mem[r*m.regionBytes+from : r*m.regionBytes+to])
		}
	}
	m.pool.give(m.pages - keep)
	m.pages = keep
}

// release gives all of the memory back.
func (m *kvMemory) release() {
	if m.mem == nil {
		return
	}
	m.pool.give(m.pages)
	m.pages = 0
	unmapKV(m.mem)
	m.mem = nil
}

func roundUp(n, to int) int { return (n + to - 1) / to * to }

// cache is the KV cache of one sequence: per layer, keys and values of
// [capacity][kvHeads*headDim] float32 over kvMemory.
type cache struct {
	k, v     [][]float32
	n        int
	capacity int
	mem      *kvMemory
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
	rowBytes := 4 * kvw
	pages := (capacity + e.pool.size - 1) / e.pool.size
	region := roundUp(pages*e.pool.size*rowBytes, os.Getpagesize())
	mem, err := mapKV(2 * c.NumHiddenLayers * region)
	if err != nil {
		return nil, fmt.Errorf("cpu/llm: reserving a cache of %d tokens (%s of address space): %w",
			capacity, memcheck.Format(float64(2*c.NumHiddenLayers*region)), err)
	}
	m := &kvMemory{mem: mem, regionBytes: region, rowBytes: rowBytes, pool: e.pool}
	kc := &cache{e: e, capacity: capacity, mem: m}
	floats := func(r int) []float32 {
		return unsafe.Slice((*float32)(unsafe.Pointer(&mem[r*region])), capacity*kvw)
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
	if c.mem.mem == nil {
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
	if c.mem.mem == nil {
		return errors.New("cpu/llm: cache was already freed")
	}
	c.cleanup.Stop()
	c.mem.release()
	c.k, c.v, c.n = nil, nil, 0
	return nil
}

func (p *pagePool) pagesFor(n int) int { return (n + p.size - 1) / p.size }

// caches checks that every cache is this engine's, live and given once.
func (e *Engine) caches(cs []engine.Cache) ([]*cache, error) {
	out := make([]*cache, len(cs))
	seen := make(map[*cache]int, len(cs))
	for i, c := range cs {
		kc, ok := c.(*cache)
		if !ok || kc.e != e {
			return nil, fmt.Errorf("cpu/llm: cache %d was not made by this engine", i)
		}
		if kc.mem.mem == nil {
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

// grow takes from the pool the pages that caches need to hold news[i] more
// positions each. On error no cache has changed.
func (e *Engine) grow(kcs []*cache, news []int) error {
	need := 0
	for i, kc := range kcs {
		need += max(0, e.pool.pagesFor(kc.n+news[i])-kc.mem.pages)
	}
	if need <= 0 {
		return nil
	}
	if bytes := float64(need) * float64(e.pool.bytes); bytes >= growBytesChecked {
		if err := memcheck.Fits(fmt.Sprintf("%d new KV cache pages", need), bytes, ""); err != nil {
			return fmt.Errorf("cpu/llm: %w", err)
		}
	}
	if err := e.pool.take(need); err != nil {
		return err
	}
	for i, kc := range kcs {
		kc.mem.pages = max(kc.mem.pages, e.pool.pagesFor(kc.n+news[i]))
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
