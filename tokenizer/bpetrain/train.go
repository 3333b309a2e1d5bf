// Package bpetrain trains byte-level BPE tokenizers (the GPT-2 scheme) on text and writes them
// as Hugging Face tokenizer.json files, which package tokenizer and Hugging Face tokenizers
// load with the same ids.
//
// Training follows the usual recipe: the text is split into pre-tokens with the GPT-2
// pattern, identical pre-tokens are counted once, and then the most frequent adjacent pair of
// symbols is merged again and again until the vocabulary is full. Pair counts are kept up to
// date incrementally (only the words that contain the merged pair are touched) and the next
// pair is taken from a heap, so a merge costs time in proportion to the words it changes.
package bpetrain

import (
	"container/heap"
	"errors"
	"fmt"
	"runtime"
	"sort"
	"strings"
	"sync"
	"unicode/utf8"
)

// Defaults used when a Config field is zero.
const (
	DefaultVocabSize    = 8192
	DefaultMinFrequency = 2
	// EndOfText is the special token added when Config.SpecialTokens is nil.
	EndOfText = "<|endoftext|>"
)

// Config controls training.
type Config struct {
	// VocabSize is the size of the finished vocabulary: 256 byte tokens, the merged tokens
	// and the special tokens (DefaultVocabSize when 0). Training stops early when no pair
	// occurs MinFrequency times any more.
	VocabSize int
	// MinFrequency is the fewest occurrences a pair needs to be merged (DefaultMinFrequency
	// when 0).
	MinFrequency int
	// SpecialTokens are added after the learned tokens, with the last ids, in this order
	// ([EndOfText] when nil; an empty non-nil slice adds none).
	SpecialTokens []string
	// Workers is the number of goroutines that count words (all cores when 0).
	Workers int
}

func (c Config) withDefaults() (Config, error) {
	if c.VocabSize == 0 {
		c.VocabSize = DefaultVocabSize
	}
	if c.MinFrequency == 0 {
		c.MinFrequency = DefaultMinFrequency
	}
	if c.SpecialTokens == nil {
		c.SpecialTokens = []string{EndOfText}
	}
	if c.Workers <= 0 {
		c.Workers = runtime.GOMAXPROCS(0)
	}
	if c.MinFrequency < 1 {
		return c, fmt.Errorf("bpetrain: min frequency %d, want >= 1", c.MinFrequency)
	}
	seen := map[string]bool{}
	for i, s := range c.SpecialTokens {
		if s == "" {
			return c, fmt.Errorf("bpetrain: special token %d is empty", i)
		}
		if !utf8.ValidString(s) {
			return c, fmt.Errorf("bpetrain: special token %d (%q) is not valid UTF-8, which tokenizer.json cannot hold", i, s)
		}
		if seen[s] {
			return c, fmt.Errorf("bpetrain: special token %q is listed twice", s)
		}
		seen[s] = true
	}
	if min := 256 + len(c.SpecialTokens); c.VocabSize < min {
		return c, fmt.Errorf("bpetrain: vocabulary size %d is below %d (256 byte tokens + %d special tokens)",
			c.VocabSize, min, len(c.SpecialTokens))
	}
	if c.VocabSize > 1<<24 {
		return c, fmt.Errorf("bpetrain: vocabulary size %d is too large (at most %d)", c.VocabSize, 1<<24)
	}
	return c, nil
}

// Trainer collects word counts from text and then learns merges. Add may be called from
// several goroutines at once.
type Trainer struct {
	cfg    Config
	mu     sync.Mutex
	counts map[string]int64
	bytes  int64
}

// NewTrainer returns a Trainer for cfg, after checking it.
func NewTrainer(cfg Config) (*Trainer, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	return &Trainer{cfg: cfg, counts: map[string]int64{}}, nil
}

// Add counts the pre-tokens of text. Special tokens written in the text are cut out first, the
// way a tokenizer matches them before pre-tokenizing, so they never take part in merges.
func (t *Trainer) Add(text string) {
	local := map[string]int64{}
	t.count(local, text)
	t.mu.Lock()
	t.bytes += int64(len(text))
	for w, n := range local {
		t.counts[w] += n
	}
	t.mu.Unlock()
}

// AddAll counts the pre-tokens of all texts, spread over Config.Workers goroutines.
func (t *Trainer) AddAll(texts []string) {
	ch := make(chan string)
	go func() {
		for _, s := range texts {
			ch <- s
		}
		close(ch)
	}()
	t.AddStream(ch)
}

// AddStream counts the pre-tokens of every text received from texts, on Config.Workers
// goroutines, and returns when texts is closed and all are counted.
func (t *Trainer) AddStream(texts <-chan string) {
	var wg sync.WaitGroup
	for range t.cfg.Workers {
		wg.Go(func() {
			local := map[string]int64{}
			var n int64
			for s := range texts {
				n += int64(len(s))
				t.count(local, s)
			}
			t.mu.Lock()
			t.bytes += n
			for w, c := range local {
				t.counts[w] += c
			}
			t.mu.Unlock()
		})
	}
	wg.Wait()
}

// count adds the pre-tokens of text, without its special tokens, to counts. Special tokens
// are found as a tokenizer finds them (Hugging Face's LeftmostLongest): the leftmost, and
// among those starting there the longest.
func (t *Trainer) count(counts map[string]int64, text string) {
	for len(text) > 0 {
		cut, skip := len(text), 0
		for _, sp := range t.cfg.SpecialTokens {
			i := strings.Index(text[:min(len(text), cut+len(sp))], sp)
			if i >= 0 && (i < cut || i == cut && len(sp) > skip) {
				cut, skip = i, len(sp)
			}
		}
		SplitWords(text[:cut], func(w string) { counts[w]++ })
		text = text[cut+skip:]
	}
}

// Words returns the number of distinct pre-tokens and the number of text bytes counted so far.
func (t *Trainer) Words() (distinct int, textBytes int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.counts), t.bytes
}

// Model is a trained byte-level BPE tokenizer.
type Model struct {
	// Tokens lists the vocabulary by id, in byte-level form (see ByteLevel): ids 0..255 are
	// the single bytes in GPT-2's order, then the merged tokens in the order they were
	// learned, then the special tokens, which are kept as written.
	Tokens []string
	// Merges lists the merge rules by rank, as pairs of byte-level token strings.
	Merges [][2]string
	// Special is the number of special tokens at the end of Tokens.
	Special int
}

// SpecialTokens returns the special tokens, which have the last ids.
func (m *Model) SpecialTokens() []string { return m.Tokens[len(m.Tokens)-m.Special:] }

// word is one distinct pre-token during training.
type word struct {
	syms  []int32
	count int64
}

// pairKey packs two symbol ids into a map key.
func pairKey(a, b int32) uint64 { return uint64(uint32(a))<<32 | uint64(uint32(b)) }

func pairOf(k uint64) (int32, int32) { return int32(k >> 32), int32(uint32(k)) }

// candidate is a heap entry: a pair with its count at the time it was pushed. Entries go
// stale when counts change; pop checks them against the live count.
type candidate struct {
	pair  uint64
	count int64
}

type pairHeap []candidate

func (h pairHeap) Len() int { return len(h) }
func (h pairHeap) Less(i, j int) bool {
	if h[i].count != h[j].count {
		return h[i].count > h[j].count
	}
	return h[i].pair < h[j].pair // ties: the pair with the smaller ids first
}
func (h pairHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *pairHeap) Push(x any)   { *h = append(*h, x.(candidate)) }
func (h *pairHeap) Pop() any {
	old := *h
	c := old[len(old)-1]
	*h = old[:len(old)-1]
	return c
}

// Train learns the merges from the counted words. Progress, when not nil, is called now and
// then with the vocabulary size reached and the target.
func (t *Trainer) Train(progress func(vocab, target int)) (*Model, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.counts) == 0 {
		return nil, errors.New("bpetrain: no text to train on")
	}
	cfg := t.cfg
	target := cfg.VocabSize - len(cfg.SpecialTokens)

	// The initial vocabulary: one token per byte.
	tokens := make([]string, 0, cfg.VocabSize)
	var byteID [256]int32
	for i, b := range byteOrder {
		byteID[b] = int32(i)
		tokens = append(tokens, byteChars[b])
	}
	ids := make(map[string]int32, cfg.VocabSize)
	for i, s := range tokens {
		ids[s] = int32(i)
	}

	// Distinct words in a fixed order (so training is deterministic), as symbol sequences.
	keys := make([]string, 0, len(t.counts))
	for w := range t.counts {
		keys = append(keys, w)
	}
	sort.Strings(keys)
	words := make([]word, len(keys))
	pairs := map[uint64]int64{}
	where := map[uint64][]int32{}
	for wi, k := range keys {
		syms := make([]int32, len(k))
		for i := 0; i < len(k); i++ {
			syms[i] = byteID[k[i]]
		}
		words[wi] = word{syms: syms, count: t.counts[k]}
		for i := 0; i+1 < len(syms); i++ {
			p := pairKey(syms[i], syms[i+1])
			if !lastIs(where[p], int32(wi)) {
				where[p] = append(where[p], int32(wi))
			}
			pairs[p] += words[wi].count
		}
	}
	h := make(pairHeap, 0, len(pairs))
	for p, c := range pairs {
		h = append(h, candidate{p, c})
	}
	heap.Init(&h)

	var merges [][2]string
	merged := map[uint64]bool{}
	stamp := make([]int32, len(words)) // the merge step that last visited each word, +1
	var changed []uint64
	step := int32(0)
	for len(tokens) < target && h.Len() > 0 {
		top := heap.Pop(&h).(candidate)
		live := pairs[top.pair]
		if top.count != live {
			// A stale entry. If the count fell, requeue the pair with its live count; if it
			// rose, a newer entry with the live count is already queued.
			if top.count > live && live > 0 {
				heap.Push(&h, candidate{top.pair, live})
			}
			continue
		}
		if live < int64(cfg.MinFrequency) {
			break
		}
		step++
		a, b := pairOf(top.pair)
		s := tokens[a] + tokens[b]
		id, ok := ids[s]
		if !ok {
			id = int32(len(tokens))
			tokens = append(tokens, s)
			ids[s] = id
		}
		if !merged[top.pair] {
			merged[top.pair] = true
			merges = append(merges, [2]string{tokens[a], tokens[b]})
		}

		changed = changed[:0]
		for _, wi := range where[top.pair] {
			if stamp[wi] == step {
				continue
			}
			stamp[wi] = step
			w := &words[wi]
			if !contains(w.syms, a, b) {
				continue
			}
			for i := 0; i+1 < len(w.syms); i++ {
				p := pairKey(w.syms[i], w.syms[i+1])
				if pairs[p] -= w.count; pairs[p] == 0 {
					delete(pairs, p)
				}
			}
			w.syms = mergeSyms(w.syms, a, b, id)
			for i := 0; i+1 < len(w.syms); i++ {
				x, y := w.syms[i], w.syms[i+1]
				p := pairKey(x, y)
				pairs[p] += w.count
				if x == id || y == id {
					if !lastIs(where[p], int32(wi)) {
						where[p] = append(where[p], int32(wi))
					}
					changed = append(changed, p)
				}
			}
		}
		delete(where, top.pair)
		sort.Slice(changed, func(i, j int) bool { return changed[i] < changed[j] })
		for i, p := range changed {
			if i > 0 && p == changed[i-1] {
				continue
			}
			if c := pairs[p]; c > 0 {
				heap.Push(&h, candidate{p, c})
			}
		}
		if progress != nil && len(tokens)%256 == 0 {
			progress(len(tokens)+len(cfg.SpecialTokens), cfg.VocabSize)
		}
	}
	for _, sp := range cfg.SpecialTokens {
		if _, dup := ids[sp]; dup {
			return nil, fmt.Errorf("bpetrain: special token %q is also a learned token", sp)
		}
		tokens = append(tokens, sp)
	}
	if progress != nil {
		progress(len(tokens), cfg.VocabSize)
	}
	return &Model{Tokens: tokens, Merges: merges, Special: len(cfg.SpecialTokens)}, nil
}

// lastIs reports whether the last element of s is v.
func lastIs(s []int32, v int32) bool { return len(s) > 0 && s[len(s)-1] == v }

// contains reports whether a is directly followed by b somewhere in syms.
func contains(syms []int32, a, b int32) bool {
	for i := 0; i+1 < len(syms); i++ {
		if syms[i] == a && syms[i+1] == b {
			return true
		}
	}
	return false
}

// mergeSyms replaces each non-overlapping occurrence of a b, left to right, by id, in place.
func mergeSyms(syms []int32, a, b, id int32) []int32 {
	out := syms[:0]
	for i := 0; i < len(syms); i++ {
		if i+1 < len(syms) && syms[i] == a && syms[i+1] == b {
			out = append(out, id)
			i++
			continue
		}
		out = append(out, syms[i])
	}
	return out
}

// Train is a shortcut: it counts texts and trains a model with cfg.
func Train(texts []string, cfg Config) (*Model, error) {
	t, err := NewTrainer(cfg)
	if err != nil {
		return nil, err
	}
	t.AddAll(texts)
	return t.Train(nil)
}

// validate checks the model's internal consistency: every merge joins two tokens into a
// token of the vocabulary, and no token is listed twice.
func (m *Model) validate() error {
	if len(m.Tokens) < 256+m.Special || m.Special < 0 {
		return fmt.Errorf("bpetrain: model has %d tokens and %d special tokens", len(m.Tokens), m.Special)
	}
	ids := make(map[string]int, len(m.Tokens))
	for i, s := range m.Tokens {
		if !utf8.ValidString(s) {
			return fmt.Errorf("bpetrain: token %d (%q) is not valid UTF-8, which tokenizer.json cannot hold", i, s)
		}
		if j, dup := ids[s]; dup {
			return fmt.Errorf("bpetrain: token %q has ids %d and %d", s, j, i)
		}
		ids[s] = i
	}
	for r, mg := range m.Merges {
		for _, part := range mg {
			if _, ok := ids[part]; !ok || strings.Contains(part, " ") {
				return fmt.Errorf("bpetrain: merge %d (%q %q): %q is not a byte-level token", r, mg[0], mg[1], part)
			}
		}
		if _, ok := ids[mg[0]+mg[1]]; !ok {
			return fmt.Errorf("bpetrain: merge %d (%q %q) makes a token missing from the vocabulary", r, mg[0], mg[1])
		}
	}
	return nil
}
