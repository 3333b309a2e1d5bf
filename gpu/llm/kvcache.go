package llm

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/model"
)

// The KV cache in pages.
//
// A cache is a page table: pages of PageSize positions, page i holding
// positions i*PageSize onwards, each page bf16 [layer][k|v][kv head][page
// size][head_dim] anywhere in device memory (kvpage.cuh). A Forward first
// makes every sequence of its batch hold the pages its new positions need,
// then uploads the batch's page tables with the rest of its metadata; the
// kernels read a page's address once per position they write and once per
// block of 64 keys they read. Truncate and Free give the pages past the
// positions kept back to the engine's pool.
//
// The page size is a multiple of 64, the block of keys of every attention
// kernel, so that a block never straddles two pages: the kernels start
// their blocks at multiples of 64 from position 0, also in a pass whose
// first new token is in the middle of a page, and the plain kernel walks
// its keys page by page.
//
// The pool takes device memory in slabs of several pages (slabBytes) as the
// caches need it and keeps the pages given back for the caches to come
// (PageStats.Idle); the memory goes back to the device at Close. With a
// budget (SetKVPages) the slabs never hold more pages than it, and a
// Forward whose new tokens need more pages than the budget has beside those
// in use fails with engine.ErrOutOfPages and changes no cache. Without one,
// pages are limited by device memory alone: a Forward for which no slab can
// be allocated fails the same way.

// PageMultiple is what a KV cache page size must be a multiple of: the
// block of keys of the attention kernels (ATT_BK in attn.cuh), so that no
// block straddles two pages.
const PageMultiple = 64

// DefaultPageSize is the KV cache page size in positions when none is set:
// one block of keys of the attention kernels.
const DefaultPageSize = PageMultiple

// maxPageBytes bounds a page, so that offsets inside one fit the kernels'
// 32-bit ints.
const maxPageBytes = 1<<31 - 1

// slabBytes is the device memory the pool asks for at a time, unless a
// Forward needs more pages at once.
const slabBytes = 64 << 20

// PageBytes returns the device memory of one KV cache page of pageSize
// positions of a model of config c: keys and values of every layer, bf16.
func PageBytes(c model.Config, pageSize int) int64 {
	return int64(pageSize) * int64(c.NumKeyValueHeads) * int64(c.HeadDim) * 2 * 2 * int64(c.NumHiddenLayers)
}

// kvPool is the engine's KV cache pages. KVPages reads its counts from any
// goroutine, and caches collected without Free give their pages back from
// another one, hence the lock; the rest runs on the goroutine that drives
// the engine.
type kvPool struct {
	dev *cuda.Device
	cfg model.Config

	mu     sync.Mutex
	size   int   // positions per page
	bytes  int64 // bytes per page
	total  int   // budget in pages; 0: none
	slabs  []*cuda.Buffer
	idle   []uint64 // addresses of the pages no cache holds
	inUse  int
	closed bool
}

// configure sets the page size (0: DefaultPageSize) and the budget in
// bytes (0: none), before the pool has any memory.
func (p *kvPool) configure(pageSize int, memory int64) error {
	if pageSize == 0 {
		pageSize = DefaultPageSize
	}
	if pageSize < 0 || pageSize%PageMultiple != 0 {
		return fmt.Errorf("llm: KV page size %d: want a positive multiple of %d positions (the attention kernels' block of keys)", pageSize, PageMultiple)
	}
	if memory < 0 {
		return fmt.Errorf("llm: KV budget %d bytes: must be >= 0", memory)
	}
	bytes := PageBytes(p.cfg, pageSize)
	if bytes > maxPageBytes {
		return fmt.Errorf("llm: a KV page of %d positions would take %s, past the 2 GiB the kernels address", pageSize, memcheck.Format(float64(bytes)))
	}
	total := 0
	if memory > 0 {
		if total = int(min(memory/bytes, math.MaxInt32)); total < 1 {
			return fmt.Errorf("llm: a KV budget of %s holds no page of %d positions (%s)",
				memcheck.Format(float64(memory)), pageSize, memcheck.Format(float64(bytes)))
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.slabs) > 0 {
		return errors.New("llm: the KV page size and budget can only be set before the engine takes its first page")
	}
	p.size, p.bytes, p.total = pageSize, bytes, total
	return nil
}

func (p *kvPool) pagesFor(n int) int { return (n + p.size - 1) / p.size }

func (p *kvPool) stats() engine.PageStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return engine.PageStats{PageSize: p.size, PageBytes: p.bytes, InUse: p.inUse, Idle: len(p.idle), Total: p.total}
}

// grow makes each cache kcs[i] hold the pages of its length plus
// len(tokens[i]) positions: idle pages first, then those of a new slab. On
// error no cache has changed.
func (p *kvPool) grow(kcs []*cache, tokens [][]int) error {
	need := 0
	for i, kc := range kcs {
		need += max(0, p.pagesFor(kc.n+len(tokens[i]))-len(kc.pt.pages))
	}
	if need == 0 {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.total > 0 && p.inUse+need > p.total {
		return fmt.Errorf("llm: %w: the new tokens need %d more pages of %d positions, %d of %d are free (KV budget %s)",
			engine.ErrOutOfPages, need, p.size, p.total-p.inUse, p.total, memcheck.Format(float64(p.total)*float64(p.bytes)))
	}
	if short := need - len(p.idle); short > 0 {
		if err := p.addSlab(short); err != nil {
			return err
		}
	}
	for i, kc := range kcs {
		for want := p.pagesFor(kc.n + len(tokens[i])); len(kc.pt.pages) < want; {
			last := len(p.idle) - 1
			kc.pt.pages = append(kc.pt.pages, p.idle[last])
			p.idle = p.idle[:last]
		}
	}
	p.inUse += need
	return nil
}

// addSlab allocates a slab of at least n pages (slabBytes of them, within
// the budget) and makes its pages idle. Where the device has no room for a
// whole slab it tries n pages alone.
func (p *kvPool) addSlab(n int) error {
	pages := max(n, int(slabBytes/p.bytes))
	if p.total > 0 {
		pages = min(pages, p.total-p.inUse-len(p.idle))
	}
	alloc := func(pages int) (*cuda.Buffer, error) {
		bytes := int64(pages) * p.bytes
		if bytes > math.MaxInt {
			return nil, fmt.Errorf("%d pages of %d bytes are too many for one allocation", pages, p.bytes)
		}
		return p.dev.Alloc(int(bytes))
	}
	buf, err := alloc(pages)
	if err != nil && pages > n {
		pages = n
		buf, err = alloc(pages)
	}
	if err != nil {
		return fmt.Errorf("llm: %w: %d more pages of %d positions (%s): %w",
			engine.ErrOutOfPages, n, p.size, memcheck.Format(float64(n)*float64(p.bytes)), err)
	}
	p.slabs = append(p.slabs, buf)
	base := uint64(buf.Ptr())
	for i := pages - 1; i >= 0; i-- { // the slab's first page is taken first
		p.idle = append(p.idle, base+uint64(i)*uint64(p.bytes))
	}
	return nil
}

// release makes the pages of t past its first keep idle.
func (p *kvPool) release(t *pageTable, keep int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if keep >= len(t.pages) {
		return
	}
	if !p.closed {
		p.idle = append(p.idle, t.pages[keep:]...)
	}
	p.inUse -= len(t.pages) - keep
	t.pages = t.pages[:keep]
}

// close gives the slabs back to the device (the stream is idle).
func (p *kvPool) close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for _, b := range p.slabs {
		errs = append(errs, b.Free())
	}
	p.slabs, p.idle, p.closed = nil, nil, true
	return errors.Join(errs...)
}

// KVPages returns the state of the engine's page pool (engine.Paged). It
// may be called from any goroutine, also while another runs Forward.
func (e *Engine) KVPages() engine.PageStats { return e.pool.stats() }

// SetKVPages sets the KV cache page size in positions (a multiple of 64; 0:
// DefaultPageSize) and the budget of the engine's caches in bytes, counted
// in whole pages (0: none, the default: pages are then limited by device
// memory): a Forward whose new tokens would take the caches past the budget
// fails with engine.ErrOutOfPages. NewEngine sets them from the environment
// (Options); they can be changed until the engine takes its first page.
func (e *Engine) SetKVPages(pageSize int, memory int64) error {
	return e.pool.configure(pageSize, memory)
}

// cache is the KV cache of one sequence on the GPU: its length and the
// pages that hold it.
type cache struct {
	n, cap  int
	pt      *pageTable // nil once freed
	cleanup runtime.Cleanup
	e       *Engine
}

// pageTable is the device addresses of a cache's pages, in the order of
// its positions: as many as its length needs. It is apart from the cache so
// that the cleanup of a cache dropped without Free can give them back.
type pageTable struct {
	pages []uint64
	pool  *kvPool
}

// drop gives all of t's pages back.
func (t *pageTable) drop() { t.pool.release(t, 0) }

// NewCache returns an empty cache for a sequence of up to capacity tokens.
// It takes no device memory: pages are taken as tokens are appended (see
// KVPages).
func (e *Engine) NewCache(capacity int) (engine.Cache, error) {
	if e.closed {
		return nil, errors.New("llm: engine was closed")
	}
	if capacity < 1 || capacity > math.MaxInt32 {
		return nil, fmt.Errorf("llm: cache capacity %d: must be in 1..%d", capacity, math.MaxInt32)
	}
	kc := &cache{cap: capacity, pt: &pageTable{pool: e.pool}, e: e}
	// A cache dropped without Free gives its pages back when it is
	// collected.
	kc.cleanup = runtime.AddCleanup(kc, (*pageTable).drop, kc.pt)
	return kc, nil
}

// CacheBytes returns the device memory of the pages that the cache c of e
// holds: its length rounded up to whole pages.
func (e *Engine) CacheBytes(c engine.Cache) int64 {
	kc, ok := c.(*cache)
	if !ok || kc.e != e || kc.pt == nil {
		return 0
	}
	return int64(len(kc.pt.pages)) * e.pool.bytes
}

func (c *cache) Len() int      { return c.n }
func (c *cache) Capacity() int { return c.cap }

// Truncate keeps the first n positions and gives the pages past them back.
func (c *cache) Truncate(n int) error {
	if c.pt == nil {
		return errors.New("llm: truncate: the cache was freed")
	}
	if n < 0 || n > c.n {
		return fmt.Errorf("llm: truncate to %d positions: the cache holds %d", n, c.n)
	}
	// A Decoder's steps may still use the pages given back.
	if err := c.e.settle(); err != nil {
		return err
	}
	c.n = n
	c.e.pool.release(c.pt, c.e.pool.pagesFor(n))
	return nil
}

// Free gives the cache's pages back to the engine's pool. Free it only when
// no forward pass that uses it is running (Forward returns after its work
// is done).
func (c *cache) Free() error {
	if c.pt == nil {
		return errors.New("llm: cache was already freed")
	}
	if err := c.e.settle(); err != nil {
		return err
	}
	c.cleanup.Stop()
	c.e.pool.release(c.pt, 0)
	c.pt, c.n = nil, 0
	return nil
}

// ungrow gives back the pages past each cache's length (after a failed
// Forward).
func (p *kvPool) ungrow(kcs []*cache) {
	for _, kc := range kcs {
		p.release(kc.pt, p.pagesFor(kc.n))
	}
}
