// Package engine is the seam between the jobs (generation, serving,
// evaluation, benchmarks) and the backends that run a model: the CPU engine
// (package cpu/llm, float32) and the GPU engine (package gpu/llm, bf16 on
// NVIDIA Hopper). A job is written once against Engine; a backend
// implements it.
//
// The unit of work is a batch of sequences, each with its own KV cache:
// Forward appends each sequence's new tokens to its cache and returns
// logits. The batch may differ from call to call, which is all continuous
// batching needs: a server keeps one Cache per live request and passes the
// caches of whichever requests are running (a prefill of new prompts beside
// one decode token of the others) to each call. An engine whose caches take
// memory in pages as they fill also implements Paged, so that the server
// can admit requests by the pages free.
package engine

import (
	"errors"

	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/sample"
)

// Engine runs forward passes of one model on one backend. An Engine is not
// safe for concurrent use: one goroutine drives it (a server's batcher).
type Engine interface {
	// Config returns the configuration of the model the engine runs.
	Config() model.Config
	// NewCache returns an empty KV cache for one sequence of up to
	// capacity positions. Caches belong to the engine that made them.
	NewCache(capacity int) (Cache, error)
	// Forward appends tokens[i] to the sequence whose cache is caches[i]
	// and returns, for each sequence, the logits of its last new token, or
	// of every new token when allLogits is set (rows of VocabSize values,
	// sequence after sequence). A sequence that would pass its cache's
	// capacity, an empty token list or an id outside the vocabulary is an
	// error and changes no cache. The returned logits may be reused by the
	// next call (see the backend); copy what must outlive it.
	Forward(caches []Cache, tokens [][]int, allLogits bool) ([][]float32, *Stats, error)
	// SetMLPPath chooses how the MLPs run from the next call on.
	SetMLPPath(p mlp.Path) error
	// Close frees what the engine holds. Caches it made must not be used
	// after it.
	Close() error
}

// Cache is the KV cache of one sequence.
type Cache interface {
	// Len returns the number of positions the cache holds.
	Len() int
	// Capacity returns the most positions the cache can hold.
	Capacity() int
	// Truncate keeps the first n positions and forgets the rest (n <=
	// Len): to start a new sequence in the same memory (n = 0) or to reuse
	// a shared prefix.
	Truncate(n int) error
	// Free gives the cache's memory back; the cache must not be used
	// after it.
	Free() error
}

// Paged is implemented by an engine whose caches take memory in fixed-size
// pages from one pool as tokens are appended, and give them back on
// Truncate and Free, so that the memory of its caches follows the tokens
// they hold rather than their capacities. A server asks it how many pages
// are free to admit requests by what their prompts need instead of their
// worst cases. The CPU engine (package cpu/llm) and the GPU engine (package
// gpu/llm) implement it; an engine that does not is treated as one whose
// every cache takes its capacity up front.
type Paged interface {
	Engine
	// KVPages returns the state of the engine's page pool. Unlike the
	// other methods it may be called from any goroutine, also while
	// another one runs Forward.
	KVPages() PageStats
}

// PageStats is the state of a Paged engine's KV page pool.
type PageStats struct {
	// PageSize is the number of positions one page holds.
	PageSize int
	// PageBytes is the memory of one page: keys and values of every layer
	// for PageSize positions.
	PageBytes int64
	// InUse is the number of pages the engine's live caches hold: per
	// cache, Len rounded up to whole pages.
	InUse int
	// Idle is the number of pages of memory the engine keeps for reuse
	// (given back by Truncate and Free, not yet returned to the system).
	// They are free: a Forward gives them back when it needs the room.
	Idle int
	// Total is the pool's budget in pages, or 0 when it has none (pages
	// are then limited by memory alone).
	Total int
}

// Free returns the pages left under the budget (0 when there is none).
func (p PageStats) Free() int { return max(0, p.Total-p.InUse) }

// PagesFor returns the pages a cache of n positions holds.
func (p PageStats) PagesFor(n int) int {
	if p.PageSize < 1 || n <= 0 {
		return 0
	}
	return (n + p.PageSize - 1) / p.PageSize
}

// ErrOutOfPages is wrapped by the error a Paged engine's Forward returns
// when its pool has too few free pages for the new tokens; the call then
// changes no cache, and freeing or truncating caches makes room.
var ErrOutOfPages = errors.New("out of KV cache pages")

// Stats reports what one Forward call did in its MLPs.
type Stats struct {
	// Tokens is the number of tokens the call processed.
	Tokens int
	// MeanActive is, per layer, the mean number of active MLP units per
	// token, or -1 where the call did not measure it (a GPU dense layer,
	// an MLP without exact zeros such as SiLU, or a GPU step that did not
	// copy its counts back).
	MeanActive []float64
	// Paths is, per layer, the path the MLP ran: mlp.Sparse when every
	// MLP call of the pass ran the TwELL path, mlp.Dense otherwise.
	Paths []mlp.Path
	// StepMS is, when the backend was asked to profile, the time of each
	// kind of step in milliseconds ("norm", "qkv", "attention", "mlp"...);
	// nil otherwise.
	StepMS map[string]float64
}

// NewStats returns Stats for a call of tokens tokens through layers layers,
// with nothing measured yet.
func NewStats(tokens, layers int) *Stats {
	s := &Stats{Tokens: tokens, MeanActive: make([]float64, layers), Paths: make([]mlp.Path, layers)}
	for i := range s.MeanActive {
		s.MeanActive[i] = -1
		s.Paths[i] = mlp.Dense
	}
	return s
}

// DeviceSampling is implemented by an engine that picks the next tokens of
// decode steps where it runs, greedily or drawn at a temperature with top-k
// and top-p (sample.Draw), so that only the picks come back to the host,
// not rows of logits, and that can queue a step before the host has the
// picks of the one before, so that the device does not wait for the host
// between steps (the GPU engine, package gpu/llm).
type DeviceSampling interface {
	Engine
	// NewDecoder returns a Decoder for the sequences whose caches are
	// given, picking among the first vocab logits of each step (the whole
	// vocabulary when vocab is 0): sequence i's n-th step (from 0) draws
	// as draws[i] with Index draws[i].Index + n, or greedily when draws is
	// nil.
	NewDecoder(caches []Cache, vocab int, draws []sample.Draw) (Decoder, error)
	// ForwardSample runs a pass as Forward does (without allLogits) but
	// returns, for each sequence, the token draws[i] picks after its last
	// new token among the first vocab logits (all when vocab is 0), so
	// that only the picks leave the device. A sequence with no logit above
	// -Inf gets -1.
	ForwardSample(caches []Cache, tokens [][]int, vocab int, draws []sample.Draw) ([]int, *Stats, error)
}

// Decoder runs decode steps of a fixed batch of sequences: each step
// appends one token to every sequence and picks the next one on the
// device, as its sample.Draw says (DeviceSampling.NewDecoder).
type Decoder interface {
	// Queue queues a step that appends tokens[i] to sequence i, or, with
	// tokens nil, the token the previous queued step picked for it. It does
	// not wait for the step; at most two steps may be queued whose picks
	// Next has not returned.
	Queue(tokens []int) error
	// Next waits for the oldest queued step whose picks it has not
	// returned and returns each sequence's pick. A sequence with no logit
	// above -Inf is an error wrapping sample.ErrNoCandidate.
	Next() ([]int, error)
	// Close waits for the queued steps and frees what the decoder holds;
	// the caches keep the tokens of every queued step.
	Close() error
}
