package tokenizer

import (
	"hash/maphash"
	"strings"
	"sync"
	"unicode/utf8"
)

// bpe is the BPE model of tokenizer.json: a vocabulary and ranked merges.
type bpe struct {
	vocab   map[string]int32
	tokens  []string // by id; "" where present is false
	present []bool
	merges  map[uint64]mergeRule

	unk          int32 // id of unk_token, or -1
	fuseUnk      bool
	byteFallback bool
	ignoreMerges bool
	prefix       string // continuing_subword_prefix
	suffix       string // end_of_word_suffix

	byteIDs [256]int32 // ids of the byte tokens "<0xNN>", -1 where missing

	// chunkSep, when set ("▁"), lets a word be cut before every "▁" that follows another
	// character and each part be tokenized alone: no token of the vocabulary has a "▁" after
	// another character, so no merge can cross such a cut and the result is the same. This
	// makes SentencePiece-style models (no pre-tokenizer: the word is the whole text) fast.
	chunkSep string

	// rawIDs holds the id of every byte's GPT-2 character; rawOK says all 256 exist, so
	// that words still in raw bytes (piece.raw) can start from rawIDs directly.
	rawIDs [256]int32
	rawOK  bool

	cache, rawCache wordCache
	work            sync.Pool // *bpeWork
}

// mergeRule is what a pair of adjacent tokens merges into, and the merge's priority (lower
// rank merges first).
type mergeRule struct{ rank, id int32 }

func pairKey(a, b int32) uint64 { return uint64(uint32(a))<<32 | uint64(uint32(b)) }

// finish fills the tables derived from vocab.
func (m *bpe) finish() {
	for b := 0; b < 256; b++ {
		m.byteIDs[b] = -1
		if id, ok := m.vocab[byteTokenName(byte(b))]; ok {
			m.byteIDs[b] = id
		}
	}
	m.rawOK = m.prefix == "" && m.suffix == ""
	for b := 0; b < 256; b++ {
		id, ok := m.vocab[byteToString[b]]
		if !ok {
			m.rawOK = false
			id = -1
		}
		m.rawIDs[b] = id
	}
	m.cache.init()
	m.rawCache.init()
	m.chunkSep = ""
	if _, ok := m.vocab[metaspace]; ok && m.prefix == "" && m.suffix == "" && !m.ignoreMerges {
		m.chunkSep = metaspace
		for tok := range m.vocab {
			if i := strings.Index(tok, metaspace); i >= 0 && strings.Contains(strings.TrimLeft(tok, metaspace), metaspace) {
				m.chunkSep = ""
				break
			}
		}
	}
}

// metaspace is SentencePiece's word-boundary mark.
const metaspace = "\u2581"

const hexDigits = "0123456789ABCDEF"

// byteTokenName returns the byte-fallback token of b, e.g. "<0x0A>".
func byteTokenName(b byte) string {
	return string([]byte{'<', '0', 'x', hexDigits[b>>4], hexDigits[b&15], '>'})
}

type symbol struct {
	id         int32 // -1 once merged into the symbol before it
	prev, next int32 // neighbours, -1 at the ends
}

type mergeCand struct{ rank, pos, id int32 }

type bpeWork struct {
	syms []symbol
	heap []mergeCand
}

func (m *bpe) getWork() *bpeWork {
	if w, ok := m.work.Get().(*bpeWork); ok {
		return w
	}
	return &bpeWork{}
}

func (m *bpe) putWork(w *bpeWork) {
	if cap(w.syms) > 1<<16 {
		return // don't keep buffers of huge words
	}
	m.work.Put(w)
}

// tokenize appends the ids of one pre-tokenized piece.
func (m *bpe) tokenize(dst []int, p piece) []int {
	if p.raw && m.rawOK {
		return m.tokenizeRaw(dst, p.text)
	}
	return m.tokenizeWord(dst, p.str())
}

// tokenizeWord tokenizes w, in parts when chunkSep allows it.
func (m *bpe) tokenizeWord(dst []int, w string) []int {
	sep := m.chunkSep
	if sep == "" || len(w) <= len(sep) {
		return m.tokenizeChunk(dst, w)
	}
	start := 0
	for i := 0; ; {
		j := strings.Index(w[i:], sep)
		if j < 0 {
			break
		}
		j += i
		if j > start && !strings.HasSuffix(w[:j], sep) {
			dst = m.tokenizeChunk(dst, w[start:j])
			start = j
		}
		i = j + len(sep)
	}
	return m.tokenizeChunk(dst, w[start:])
}

// tokenizeChunk tokenizes w character by character, as Hugging Face's BPE::merge_word does.
func (m *bpe) tokenizeChunk(dst []int, w string) []int {
	if w == "" {
		return dst
	}
	if m.ignoreMerges {
		if id, ok := m.vocab[w]; ok {
			return append(dst, int(id))
		}
	}
	if ids, ok := m.cache.get(w); ok {
		return appendIDs(dst, ids)
	}
	work := m.getWork()
	syms := work.syms[:0]
	add := func(id int32) {
		syms = append(syms, symbol{id: id, prev: int32(len(syms)) - 1, next: int32(len(syms)) + 1})
	}
	pendingUnk := false
	for i := 0; i < len(w); {
		_, n := utf8.DecodeRuneInString(w[i:])
		end := i + n
		s := w[i:end]
		if i > 0 && m.prefix != "" {
			s = m.prefix + s
		}
		if end == len(w) && m.suffix != "" {
			s += m.suffix
		}
		i = end
		if id, ok := m.vocab[s]; ok {
			if pendingUnk {
				add(m.unk)
				pendingUnk = false
			}
			add(id)
			continue
		}
		if m.byteFallback && m.hasByteTokens(s) {
			// Like Hugging Face, a pending unknown token is not flushed here.
			for k := 0; k < len(s); k++ {
				add(m.byteIDs[s[k]])
			}
			continue
		}
		if m.unk >= 0 {
			if pendingUnk && !m.fuseUnk {
				add(m.unk)
			}
			pendingUnk = true
		}
		// Without an unk token the character is dropped, as in Hugging Face.
	}
	if pendingUnk {
		add(m.unk)
	}
	dst, ids := m.mergeAndEmit(dst, work, syms, len(w) <= maxCachedWord)
	if ids != nil {
		m.cache.put(w, ids)
	}
	return dst
}

func (m *bpe) hasByteTokens(s string) bool {
	for k := 0; k < len(s); k++ {
		if m.byteIDs[s[k]] < 0 {
			return false
		}
	}
	return true
}

// tokenizeRaw tokenizes a word given as raw bytes whose GPT-2 characters all are tokens.
func (m *bpe) tokenizeRaw(dst []int, w string) []int {
	if w == "" {
		return dst
	}
	if ids, ok := m.rawCache.get(w); ok {
		return appendIDs(dst, ids)
	}
	if m.ignoreMerges {
		if id, ok := m.vocab[byteLevelEncode(w)]; ok {
			if len(w) <= maxCachedWord {
				m.rawCache.put(w, []int32{id})
			}
			return append(dst, int(id))
		}
	}
	work := m.getWork()
	syms := work.syms[:0]
	for k := 0; k < len(w); k++ {
		syms = append(syms, symbol{id: m.rawIDs[w[k]], prev: int32(k) - 1, next: int32(k) + 1})
	}
	dst, ids := m.mergeAndEmit(dst, work, syms, len(w) <= maxCachedWord)
	if ids != nil {
		m.rawCache.put(w, ids)
	}
	return dst
}

// mergeAndEmit applies the merges to syms, appends the resulting ids to dst and, if keep is
// set, also returns them in a new slice for the cache. It returns work to the pool.
func (m *bpe) mergeAndEmit(dst []int, work *bpeWork, syms []symbol, keep bool) ([]int, []int32) {
	if len(syms) > 0 {
		syms[len(syms)-1].next = -1
	}
	work.heap = m.mergeAll(syms, work.heap[:0])
	var ids []int32
	for i := 0; i < len(syms); i++ {
		if id := syms[i].id; id >= 0 {
			dst = append(dst, int(id))
			if keep {
				ids = append(ids, id)
			}
		}
	}
	work.syms = syms
	m.putWork(work)
	if keep && ids == nil {
		ids = []int32{}
	}
	return dst, ids
}

// mergeAll repeatedly merges the adjacent pair with the lowest rank (the leftmost among equal
// ranks) until no pair of the merge table is left, as Hugging Face's Word::merge_all does.
func (m *bpe) mergeAll(syms []symbol, h []mergeCand) []mergeCand {
	for i := 0; i+1 < len(syms); i++ {
		if r, ok := m.merges[pairKey(syms[i].id, syms[i+1].id)]; ok {
			h = heapPush(h, mergeCand{r.rank, int32(i), r.id})
		}
	}
	for len(h) > 0 {
		var top mergeCand
		top, h = heapPop(h)
		s := &syms[top.pos]
		if s.id < 0 || s.next < 0 {
			continue
		}
		nx := s.next
		r, ok := m.merges[pairKey(s.id, syms[nx].id)]
		if !ok || r.id != top.id {
			continue // stale candidate
		}
		s.id = top.id
		syms[nx].id = -1
		s.next = syms[nx].next
		if s.next >= 0 {
			syms[s.next].prev = top.pos
		}
		if s.prev >= 0 {
			if r, ok := m.merges[pairKey(syms[s.prev].id, s.id)]; ok {
				h = heapPush(h, mergeCand{r.rank, s.prev, r.id})
			}
		}
		if s.next >= 0 {
			if r, ok := m.merges[pairKey(s.id, syms[s.next].id)]; ok {
				h = heapPush(h, mergeCand{r.rank, top.pos, r.id})
			}
		}
	}
	return h
}

func candLess(a, b mergeCand) bool {
	return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos)
}

func heapPush(h []mergeCand, c mergeCand) []mergeCand {
	h = append(h, c)
	i := len(h) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !candLess(h[i], h[p]) {
			break
		}
		h[i], h[p] = h[p], h[i]
		i = p
	}
	return h
}

func heapPop(h []mergeCand) (mergeCand, []mergeCand) {
	top := h[0]
	last := len(h) - 1
	h[0] = h[last]
	h = h[:last]
	i := 0
	for {
		l := 2*i + 1
		if l >= len(h) {
			break
		}
		c := l
		if r := l + 1; r < len(h) && candLess(h[r], h[l]) {
			c = r
		}
		if !candLess(h[c], h[i]) {
			break
		}
		h[i], h[c] = h[c], h[i]
		i = c
	}
	return top, h
}

func appendIDs(dst []int, ids []int32) []int {
	for _, id := range ids {
		dst = append(dst, int(id))
	}
	return dst
}

// Word cache: results for short words, shared by all goroutines. Like Hugging Face's cache it
// stops taking new words when full.
const (
	maxCachedWord  = 128 // bytes
	cacheShards    = 64
	cacheShardSize = 4096 // words per shard
)

type wordCache struct {
	seed   maphash.Seed
	shards [cacheShards]cacheShard
}

type cacheShard struct {
	mu sync.RWMutex
	m  map[string][]int32
}

func (c *wordCache) init() {
	c.seed = maphash.MakeSeed()
	for i := range c.shards {
		c.shards[i].m = make(map[string][]int32)
	}
}

func (c *wordCache) shard(w string) *cacheShard {
	return &c.shards[maphash.String(c.seed, w)%cacheShards]
}

func (c *wordCache) get(w string) ([]int32, bool) {
	if len(w) > maxCachedWord {
		return nil, false
	}
	s := c.shard(w)
	s.mu.RLock()
	ids, ok := s.m[w]
	s.mu.RUnlock()
	return ids, ok
}

func (c *wordCache) put(w string, ids []int32) {
	s := c.shard(w)
	s.mu.Lock()
	if len(s.m) < cacheShardSize {
		s.m[strings.Clone(w)] = ids // w may point into a large text
	}
	s.mu.Unlock()
}
