package serve

import (
	"context"
	"errors"
	"fmt"
	"math"

	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/generate"
)

// streamBuffer is how many pieces of text a streaming request's channel
// holds; a client that falls this far behind is cancelled so that it never
// stalls the batch.
const streamBuffer = 64

// errTooSlow ends a streaming request whose client does not keep up.
var errTooSlow = errors.New("the client did not read the stream fast enough; the request was cancelled")

// tokenLogprob is the log-probability of one token and, when asked, the
// most likely alternatives at its position.
type tokenLogprob struct {
	id      int
	logprob float64
	top     []idLogprob
}

type idLogprob struct {
	id      int
	logprob float64
}

// piece is what one step of a streaming request produced.
type piece struct {
	text     string
	logprobs []tokenLogprob
}

// job is one prompt's generation. Fields below "owned by the batcher" are
// written only by the batcher goroutine until done is closed; after that
// the handler reads them.
type job struct {
	ctx      context.Context
	prompt   []int
	opts     generate.Options
	score    bool // max_tokens 0: the prompt's log-probabilities only
	echoLogp bool // the prompt's log-probabilities are wanted
	topN     int  // alternatives per position; -1: no logprobs at all
	out      chan piece
	done     chan struct{}

	// owned by the batcher
	seq        *generate.Sequence
	cache      engine.Cache
	next       []int // tokens to feed at the next step
	promptLogp []tokenLogprob
	genLogp    []tokenLogprob
	tokens     []int
	text       string
	reason     generate.StopReason
	err        error
}

// usage counts the job's prompt and generated tokens.
func (j *job) usage() usage {
	return usage{PromptTokens: len(j.prompt), CompletionTokens: len(j.tokens), TotalTokens: len(j.prompt) + len(j.tokens)}
}

// finish records err (nil on success), frees the job's cache and wakes its
// handler.
func (s *Server) finish(j *job, err error) {
	if j.cache != nil {
		j.cache.Free()
		j.cache = nil
	}
	j.err = err
	if j.seq != nil {
		j.tokens, j.text, j.reason = j.seq.Tokens(), j.seq.Text(), j.seq.Reason()
		s.metrics.generated.Add(int64(len(j.tokens)))
	}
	close(j.done)
}

// enqueue adds jobs to the waiting queue, all or none: an error when the
// queue has no room for them or the server is shutting down.
func (s *Server) enqueue(jobs []*job) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		return &apiError{status: 503, typ: "server_error", msg: "the server is shutting down"}
	}
	if len(s.queue)+len(jobs) > s.o.MaxQueue {
		return &apiError{status: 429, typ: "rate_limit_error",
			msg: fmt.Sprintf("the server is busy: %d requests wait already (-max-queue %d); retry later", len(s.queue), s.o.MaxQueue)}
	}
	s.queue = append(s.queue, jobs...)
	s.metrics.queued.Store(int64(len(s.queue)))
	select {
	case s.wake <- struct{}{}:
	default:
	}
	return nil
}

// loop is the batcher: it owns the engine. Each iteration admits waiting
// jobs while there is room, drops cancelled ones, and runs one Forward over
// every running job: a new job's whole prompt, a running job's last token.
func (s *Server) loop() {
	defer close(s.stopped)
	var running []*job
	for {
		s.mu.Lock()
		stop, cancelAll := s.stop, s.cancelAll
		if cancelAll {
			for _, j := range s.queue {
				s.finish(j, errShutdown)
			}
			s.queue = nil
		}
		// Drop cancelled waiting jobs; admit the others while there is room.
		// At most one new job per step asks for all its prompt's logits, so
		// that no step computes the logits of several long prompts.
		var keep []*job
		allLogits := false
		for _, j := range s.queue {
			switch {
			case j.ctx.Err() != nil:
				s.finish(j, j.ctx.Err())
			case len(running) < s.o.MaxConcurrent && !(allLogits && j.echoLogp):
				allLogits = allLogits || j.echoLogp
				if err := s.start(j); err != nil {
					s.finish(j, err)
					continue
				}
				running = append(running, j)
			default:
				keep = append(keep, j)
			}
		}
		s.queue = keep
		waiting := len(keep)
		s.metrics.queued.Store(int64(waiting))
		s.mu.Unlock()

		live := running[:0]
		for _, j := range running {
			switch {
			case cancelAll:
				s.finish(j, errShutdown)
			case j.ctx.Err() != nil:
				s.finish(j, j.ctx.Err())
			default:
				live = append(live, j)
			}
		}
		running = live
		s.metrics.running.Store(int64(len(running)))
		if len(running) == 0 {
			if waiting > 0 {
				continue
			}
			if stop {
				return
			}
			<-s.wake
			continue
		}
		if s.stepHook != nil {
			s.stepHook()
		}
		running = s.step(running, allLogits)
		s.metrics.running.Store(int64(len(running)))
	}
}

var errShutdown = &apiError{status: 503, typ: "server_error", msg: "the server shut down before the request finished"}

// start gives a new job its sequence and cache.
func (s *Server) start(j *job) error {
	capacity := len(j.prompt)
	if !j.score {
		seq, err := generate.NewSequence(s.tok, j.prompt, j.opts)
		if err != nil {
			return badRequest("prompt", "%v", err)
		}
		j.seq = seq
		capacity = seq.CacheCapacity()
	}
	c, err := s.e.NewCache(capacity)
	if err != nil {
		return err
	}
	j.cache = c
	j.next = j.prompt
	s.metrics.prompt.Add(int64(len(j.prompt)))
	return nil
}

// step runs one Forward over the running jobs and hands each its logits;
// it returns the jobs still running.
func (s *Server) step(running []*job, allLogits bool) []*job {
	caches := make([]engine.Cache, len(running))
	tokens := make([][]int, len(running))
	for i, j := range running {
		caches[i], tokens[i] = j.cache, j.next
	}
	logits, st, err := s.e.Forward(caches, tokens, allLogits)
	if err != nil {
		for _, j := range running {
			s.finish(j, err)
		}
		return nil
	}
	s.metrics.addStats(st)
	live := running[:0]
	row := 0
	for i, j := range running {
		rows := 1
		if allLogits {
			rows = len(tokens[i])
		}
		last := logits[row+rows-1]
		if allLogits && j.echoLogp && len(j.promptLogp) == 0 {
			j.promptLogp = make([]tokenLogprob, len(j.prompt))
			j.promptLogp[0] = tokenLogprob{id: j.prompt[0], logprob: math.NaN()}
			for k := 1; k < len(j.prompt); k++ {
				j.promptLogp[k] = logprobOf(logits[row+k-1], j.prompt[k], j.topN, s.vocab)
			}
		}
		row += rows
		if j.score {
			s.finish(j, nil)
			continue
		}
		stp, err := j.seq.Next(last)
		if err != nil {
			s.finish(j, err)
			continue
		}
		var lp []tokenLogprob
		if j.topN >= 0 && stp.Token >= 0 {
			lp = []tokenLogprob{logprobOf(last, stp.Token, j.topN, s.vocab)}
			j.genLogp = append(j.genLogp, lp...)
		}
		if j.out != nil && (stp.Text != "" || lp != nil) {
			select {
			case j.out <- piece{text: stp.Text, logprobs: lp}:
			default:
				s.finish(j, errTooSlow)
				continue
			}
		}
		if stp.Done {
			s.finish(j, nil)
			continue
		}
		j.next = []int{stp.Token}
		live = append(live, j)
	}
	return live
}

// logprobOf returns the log-probability of token id under logits (a
// float64 log-softmax over the whole row) and the topN most likely ids
// below vocab.
func logprobOf(logits []float32, id, topN, vocab int) tokenLogprob {
	m := math.Inf(-1)
	for _, v := range logits {
		m = max(m, float64(v))
	}
	sum := 0.0
	for _, v := range logits {
		sum += math.Exp(float64(v) - m)
	}
	lse := m + math.Log(sum)
	tl := tokenLogprob{id: id, logprob: float64(logits[id]) - lse}
	// The topN largest logits below vocab, largest first (the lowest id
	// first among equals), by insertion: topN is small.
	n := min(vocab, len(logits))
	if topN <= 0 {
		n = 0
	}
	for k := range n {
		v := logits[k]
		if len(tl.top) == topN && v <= logits[tl.top[topN-1].id] {
			continue
		}
		at := len(tl.top)
		for at > 0 && v > logits[tl.top[at-1].id] {
			at--
		}
		if len(tl.top) < topN {
			tl.top = append(tl.top, idLogprob{})
		}
		copy(tl.top[at+1:], tl.top[at:len(tl.top)-1])
		tl.top[at] = idLogprob{k, float64(v) - lse}
	}
	return tl
}
