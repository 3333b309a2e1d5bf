// Package serve is twell's HTTP server: an OpenAI-compatible subset
// (/v1/completions, /v1/chat/completions, /v1/models) plus /health and
// /metrics, over one engine driven by a continuous batcher.
//
// One goroutine, the batcher, owns the engine. Requests wait in a bounded
// queue, join the running batch as soon as there is room (a slot and, on an
// engine with a KV page budget, pages for their prompt), and leave it when
// they finish, fail or their client goes away; each step of the batcher is
// one engine.Forward over the running requests: a chunk of prompt for those
// still prefilling, within a per-step prefill token budget, and one token
// for the others. When the pages run out the newest requests are preempted
// and later feed their tokens again. Each request has its own KV cache and
// generate.Sequence, and its prompt is cut into chunks the same way whatever
// else runs, so at temperature 0 its output does not depend on its
// neighbours in the batch. See docs/serve.md.
package serve

import (
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/tokenizer"
)

// Options are the server's limits. Validate gives their ranges.
type Options struct {
	// ModelName is the id /v1/models lists and responses carry.
	ModelName string
	// MaxConcurrent is the most requests (prompts) running in the batch.
	MaxConcurrent int
	// MaxQueue is the most requests waiting for room in the batch; past it
	// a request is answered 429.
	MaxQueue int
	// MaxTokens caps a request's max_tokens (and is the chat default).
	MaxTokens int
	// MaxBody is the largest request body in bytes.
	MaxBody int64
	// Context is the most positions a request takes (prompt and generated
	// tokens); 0 means the model's max_position_embeddings.
	Context int
	// PrefillTokens is the most prompt tokens one step of the batcher
	// feeds, beside one token of each running request: longer prompts are
	// fed in chunks of this many tokens over several steps.
	PrefillTokens int
	// PicksOnHost copies every step's logits to the host and samples there,
	// also where the engine could make the step's picks on its device
	// (engine.DeviceSampling: a step whose requests want no
	// log-probabilities and sample, greedily or at a temperature with top-k
	// and top-p, without a repetition penalty).
	PicksOnHost bool
}

// DefaultOptions are the flags' defaults.
func DefaultOptions() Options {
	return Options{ModelName: "twell", MaxConcurrent: 8, MaxQueue: 64, MaxTokens: 1024, MaxBody: 4 << 20, PrefillTokens: 512}
}

// Validate reports the first option out of its range:
//
//	MaxConcurrent  1..4096
//	MaxQueue       0..1000000 (0: a request runs at once or is refused)
//	MaxTokens      1..1000000
//	MaxBody        1 KiB..1 GiB
//	Context        >= 0 (0: the model's)
//	PrefillTokens  1..1048576
func (o Options) Validate() error {
	switch {
	case o.MaxConcurrent < 1 || o.MaxConcurrent > 4096:
		return fmt.Errorf("-max-concurrent %d: must be in 1..4096", o.MaxConcurrent)
	case o.MaxQueue < 0 || o.MaxQueue > 1000000:
		return fmt.Errorf("-max-queue %d: must be in 0..1000000", o.MaxQueue)
	case o.MaxTokens < 1 || o.MaxTokens > 1000000:
		return fmt.Errorf("-max-tokens %d: must be in 1..1000000", o.MaxTokens)
	case o.MaxBody < 1<<10 || o.MaxBody > 1<<30:
		return fmt.Errorf("-max-body %d: must be in 1024..1073741824 bytes", o.MaxBody)
	case o.Context < 0:
		return fmt.Errorf("context %d: must be >= 0", o.Context)
	case o.PrefillTokens < 1 || o.PrefillTokens > 1<<20:
		return fmt.Errorf("-prefill-tokens %d: must be in 1..1048576", o.PrefillTokens)
	}
	return nil
}

// Server answers the API over one engine. Make it with New, serve
// Handler, and end it with Shutdown.
type Server struct {
	e     engine.Engine
	pages engine.Paged // e, when its caches take pages from a budget; else nil
	tok   *tokenizer.Tokenizer
	o     Options
	eos   []int
	vocab int // ids below it can be decoded

	mu        sync.Mutex
	queue     []*job
	closing   bool // no new requests
	stop      bool // the batcher returns once idle
	cancelAll bool // the batcher fails every job
	wake      chan struct{}
	stopped   chan struct{}

	metrics  *metrics
	ids      atomic.Uint64
	created  int64
	stepHook func() // tests: called before each Forward, on the batcher
}

// New starts a server's batcher over e, which it owns from now on (Shutdown
// closes it).
func New(e engine.Engine, tok *tokenizer.Tokenizer, o Options) (*Server, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	c := e.Config()
	if o.Context == 0 || o.Context > c.MaxPositionEmbeddings {
		o.Context = c.MaxPositionEmbeddings
	}
	if tok.VocabSize() > c.VocabSize {
		return nil, fmt.Errorf("serve: the tokenizer has %d tokens but the model's vocabulary is %d", tok.VocabSize(), c.VocabSize)
	}
	s := &Server{e: e, tok: tok, o: o, eos: append([]int(nil), c.EOSTokenIDs...), vocab: tok.VocabSize(),
		wake: make(chan struct{}, 1), stopped: make(chan struct{}), metrics: newMetrics(c.NumHiddenLayers),
		created: time.Now().Unix()}
	if id, ok := tok.EOS(); ok {
		s.eos = append(s.eos, id)
	}
	if p, ok := e.(engine.Paged); ok && p.KVPages().Total > 0 {
		s.pages = p
	}
	go s.loop()
	return s, nil
}

// Handler returns the HTTP handler of the API.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	route := func(pattern, endpoint string, h http.HandlerFunc) {
		mux.Handle(pattern, s.count(endpoint, h))
	}
	route("POST /v1/completions", "/v1/completions", s.completions)
	route("POST /v1/chat/completions", "/v1/chat/completions", s.chat)
	route("GET /v1/models", "/v1/models", s.models)
	route("GET /health", "/health", s.health)
	route("GET /metrics", "/metrics", s.serveMetrics)
	route("/", "other", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, &apiError{status: http.StatusNotFound, typ: "invalid_request_error",
			msg: fmt.Sprintf("no route %s %s (see docs/serve.md)", r.Method, r.URL.Path)})
	})
	return mux
}

// Shutdown refuses new requests and waits for the running and waiting ones
// to finish until done is closed (a timeout); then it cancels what is left
// and stops the batcher. It closes the engine.
func (s *Server) Shutdown(done <-chan struct{}) error {
	s.mu.Lock()
	s.closing, s.stop = true, true
	s.mu.Unlock()
	s.poke()
	select {
	case <-s.stopped:
	case <-done:
		s.mu.Lock()
		s.cancelAll = true
		s.mu.Unlock()
		s.poke()
		<-s.stopped
	}
	return s.e.Close()
}

func (s *Server) poke() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Load returns the number of running and waiting requests.
func (s *Server) Load() (running, queued int) {
	return int(s.metrics.running.Load()), int(s.metrics.queued.Load())
}

func (s *Server) newID(prefix string) string {
	return fmt.Sprintf("%s-%d%06d", prefix, s.created, s.ids.Add(1))
}

// wait blocks until every job is done or ctx ends; on a cancelled context
// the batcher drops the jobs (they share it) and frees their caches.
func wait(r *http.Request, jobs []*job) error {
	for _, j := range jobs {
		select {
		case <-j.done:
			if j.err != nil {
				return j.err
			}
		case <-r.Context().Done():
			return r.Context().Err()
		}
	}
	return nil
}

var errNoFlush = errors.New("serve: the response writer cannot stream")
