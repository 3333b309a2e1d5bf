package serve

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/generate"
	"github.com/twell-ai/twell/sample"
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
	arrived  time.Time // when it was queued

	// owned by the batcher
	seq        *generate.Sequence
	cache      engine.Cache
	feed       []int // what the cache must hold before the next sample: the prompt, then each sampled token
	started    bool  // admitted once (its prompt tokens are counted)
	logpUpTo   int   // prompt positions whose log-probabilities are known
	lastToken  time.Time
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
	if err == nil {
		s.metrics.e2e.observe(time.Since(j.arrived).Seconds())
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
	now := time.Now()
	for _, j := range jobs {
		j.arrived = now
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
// jobs while there is room (a slot under -max-concurrent and, on an engine
// with a page budget, pages for their prompts), drops cancelled ones, plans
// one step (a chunk of prompt for jobs still prefilling, under the prefill
// budget; one token for the others), preempts the newest jobs if the step
// needs more pages than are free, and runs the step as one Forward.
func (s *Server) loop() {
	defer close(s.stopped)
	var running []*job // in the order they were admitted
	for {
		s.mu.Lock()
		stop, cancelAll := s.stop, s.cancelAll
		if cancelAll {
			for _, j := range s.queue {
				s.finish(j, errShutdown)
			}
			s.queue = nil
		}
		// Drop cancelled waiting jobs; admit the others, first come first
		// served: a job that does not fit holds back the ones after it.
		free := s.freePages(running)
		var keep []*job
		blocked := false
		for _, j := range s.queue {
			switch {
			case j.ctx.Err() != nil:
				s.finish(j, j.ctx.Err())
				continue
			case blocked || len(running) >= s.o.MaxConcurrent:
				keep = append(keep, j)
				continue
			}
			need := 0
			if s.pages != nil {
				need = s.pageStats().PagesFor(len(j.input()))
			}
			if need > free && len(running) == 0 {
				// Nothing runs that could give pages back: the pool holds too
				// few for this job however long it waits.
				ps := s.pageStats()
				s.finish(j, &apiError{status: 503, typ: "server_error", msg: fmt.Sprintf(
					"the request needs %d KV pages of %d positions, and only %d of the server's %d are free with no request running",
					need, ps.PageSize, free, ps.Total)})
				continue
			}
			if need > free {
				blocked = true
				keep = append(keep, j)
				continue
			}
			if err := s.start(j); err != nil {
				s.finish(j, err)
				continue
			}
			free -= need
			running = append(running, j)
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
		items, allLogits := s.plan(running)
		var preempted []*job
		items, running, preempted = s.makeRoom(items, running)
		if len(preempted) > 0 {
			s.requeue(preempted)
		}
		s.metrics.running.Store(int64(len(running)))
		if len(items) == 0 {
			continue
		}
		if s.stepHook != nil {
			s.stepHook()
		}
		running = s.step(items, allLogits, running)
		s.metrics.running.Store(int64(len(running)))
	}
}

var errShutdown = &apiError{status: 503, typ: "server_error", msg: "the server shut down before the request finished"}

// input returns what the job's cache must hold before its next sample:
// the prompt and every token sampled so far.
func (j *job) input() []int {
	if j.feed == nil {
		return j.prompt
	}
	return j.feed
}

// start gives a job its sequence (the first time) and a cache. A job that
// was preempted keeps its sequence and feeds its input again.
func (s *Server) start(j *job) error {
	capacity := len(j.prompt)
	if !j.score {
		if j.seq == nil {
			seq, err := generate.NewSequence(s.tok, j.prompt, j.opts)
			if err != nil {
				return badRequest("prompt", "%v", err)
			}
			j.seq = seq
		}
		capacity = j.seq.CacheCapacity()
	}
	c, err := s.e.NewCache(capacity)
	if err != nil {
		return err
	}
	j.cache = c
	if j.feed == nil {
		j.feed = append([]int(nil), j.prompt...)
	}
	if !j.started {
		j.started = true
		s.metrics.prompt.Add(int64(len(j.prompt)))
	}
	return nil
}

// pageStats returns the engine's page pool (the server has one).
func (s *Server) pageStats() engine.PageStats { return s.pages.KVPages() }

// freePages returns the pages free for new jobs: the pool's free pages
// less those the running jobs will still take for input they already have
// (the rest of a prompt, or the input a preempted job feeds again). It is
// 0 without a page budget (new jobs need none then).
func (s *Server) freePages(running []*job) int {
	if s.pages == nil {
		return 0
	}
	ps := s.pageStats()
	free := ps.Free()
	for _, j := range running {
		free -= ps.PagesFor(len(j.input())) - ps.PagesFor(j.cache.Len())
	}
	return free
}

// item is one job's part of a step: the tokens it feeds, and whether the
// prompt log-probabilities of those tokens are wanted.
type item struct {
	j    *job
	toks []int
	logp bool
}

// plan returns the step's items: for each running job still feeding its
// prompt, the next chunk of it while the step's prefill budget lasts; for
// each other job one token (its last sampled token, or the next one of the
// input a preempted job feeds again). Chunks start at multiples of the
// budget (-prefill-tokens) from the start of the prompt, whatever else is
// in the batch, so that a prompt is cut the same way alone and in any
// batch; a chunk that does not fit in what is left of this step's budget
// waits for the next step. At most one job's chunk per step needs the
// prompt's log-probabilities (the step then computes the logits of every
// token it feeds). allLogits reports whether it does.
func (s *Server) plan(running []*job) (items []item, allLogits bool) {
	budget := s.o.PrefillTokens
	for _, j := range running {
		in, n := j.input(), j.cache.Len()
		if n >= len(j.prompt) {
			items = append(items, item{j: j, toks: in[n : n+1]})
			continue
		}
		end := min(len(j.prompt), (n/s.o.PrefillTokens+1)*s.o.PrefillTokens)
		logp := j.echoLogp && j.logpUpTo < min(end+1, len(j.prompt))
		if end-n > budget || logp && allLogits {
			continue
		}
		budget -= end - n
		allLogits = allLogits || logp
		items = append(items, item{j: j, toks: in[n:end], logp: logp})
	}
	return items, allLogits
}

// makeRoom checks that the step's items fit in the free pages; where they
// do not, it takes the newest running jobs out of the batch (their caches
// are freed; they wait again and, admitted, feed their input again) until
// they do. The oldest job always fits: a request is refused up front when
// its cache alone would not fit in the whole pool. It returns the items and
// running jobs left and the jobs preempted, newest first.
func (s *Server) makeRoom(items []item, running []*job) ([]item, []*job, []*job) {
	if s.pages == nil {
		return items, running, nil
	}
	ps := s.pageStats()
	needOf := func(it item) int {
		n := it.j.cache.Len()
		return ps.PagesFor(n+len(it.toks)) - ps.PagesFor(n)
	}
	need := 0
	for _, it := range items {
		need += needOf(it)
	}
	free := ps.Free()
	var preempted []*job
	for need > free && len(running) > 1 {
		j := running[len(running)-1]
		running = running[:len(running)-1]
		for i, it := range items {
			if it.j == j {
				need -= needOf(it)
				items = append(items[:i], items[i+1:]...)
				break
			}
		}
		free += ps.PagesFor(j.cache.Len())
		j.cache.Free()
		j.cache = nil
		preempted = append(preempted, j)
		s.metrics.preemptions.Add(1)
	}
	return items, running, preempted
}

// requeue puts preempted jobs (newest first) back at the front of the
// queue, oldest first.
func (s *Server) requeue(jobs []*job) {
	s.mu.Lock()
	defer s.mu.Unlock()
	q := make([]*job, 0, len(jobs)+len(s.queue))
	for i := len(jobs) - 1; i >= 0; i-- {
		q = append(q, jobs[i])
	}
	s.queue = append(q, s.queue...)
	s.metrics.queued.Store(int64(len(s.queue)))
}

// step runs one Forward over the items and hands each job that has fed
// all of its input the logits of its last token; it returns the running
// jobs still running, in order.
func (s *Server) step(items []item, allLogits bool, running []*job) []*job {
	caches := make([]engine.Cache, len(items))
	tokens := make([][]int, len(items))
	for i, it := range items {
		caches[i], tokens[i] = it.j.cache, it.toks
	}
	var logits [][]float32
	var picks []int
	var st *engine.Stats
	var err error
	if ds, ok := s.e.(engine.DeviceSampling); ok && !s.o.PicksOnHost {
		if draws := deviceDraws(items, allLogits); draws != nil {
			picks, st, err = ds.ForwardSample(caches, tokens, s.vocab, draws)
		}
	}
	if picks == nil && err == nil {
		logits, st, err = s.e.Forward(caches, tokens, allLogits)
	}
	if err != nil {
		for _, j := range running {
			s.finish(j, err)
		}
		return nil
	}
	s.metrics.addStats(st)
	now := time.Now()
	ended := map[*job]bool{}
	// The jobs that sample this step, each from its last row of logits (or
	// the engine's pick).
	var draws []draw
	row := 0
	for i, it := range items {
		j := it.j
		rows := 1
		if allLogits {
			rows = len(tokens[i])
		}
		d := draw{j: j, pick: -1}
		if logits != nil {
			d.last = logits[row+rows-1]
		} else {
			d.pick = picks[i]
		}
		if it.logp {
			s.promptLogprobs(j, logits[row:row+rows], j.cache.Len()-len(it.toks))
		}
		row += rows
		if j.cache.Len() < len(j.input()) {
			continue // more of its input to feed
		}
		if j.score {
			s.finish(j, nil)
			ended[j] = true
			continue
		}
		draws = append(draws, d)
	}
	sampled := s.sampleAll(draws)
	for i := range draws {
		d := &draws[i]
		if !sampled {
			// Each job's text goes to its stream before the next job
			// samples, so the handlers write while the batcher goes on.
			s.sampleOne(d)
		}
		j := d.j
		if d.err != nil {
			s.finish(j, d.err)
			ended[j] = true
			continue
		}
		stp := d.stp
		if stp.Token >= 0 {
			if len(j.seq.Tokens()) == 1 {
				s.metrics.ttft.observe(now.Sub(j.arrived).Seconds())
			} else {
				s.metrics.itl.observe(now.Sub(j.lastToken).Seconds())
			}
			j.lastToken = now
			j.genLogp = append(j.genLogp, d.lp...)
		}
		if j.out != nil && (stp.Text != "" || d.lp != nil) {
			select {
			case j.out <- piece{text: stp.Text, logprobs: d.lp}:
			default:
				s.finish(j, errTooSlow)
				ended[j] = true
				continue
			}
		}
		if stp.Done {
			s.finish(j, nil)
			ended[j] = true
			continue
		}
		j.feed = append(j.feed, stp.Token)
	}
	live := running[:0]
	for _, j := range running {
		if !ended[j] {
			live = append(live, j)
		}
	}
	return live
}

// draw is one job's sample of a step: its input (the last row of logits,
// or the engine's pick) and what its Sequence made of it.
type draw struct {
	j    *job
	last []float32 // nil when the engine picked
	pick int
	stp  generate.Step
	err  error
	lp   []tokenLogprob // the token's log-probability, when asked for
}

// sampleOne runs a draw's sampler (Sequence.Next or Accept) and, when
// its job asks for it, the sampled token's log-probability.
func (s *Server) sampleOne(d *draw) {
	j := d.j
	if d.last == nil {
		d.stp, d.err = j.seq.Accept(d.pick)
	} else {
		d.stp, d.err = j.seq.Next(d.last)
	}
	if d.err == nil && d.stp.Token >= 0 && j.topN >= 0 {
		d.lp = []tokenLogprob{logprobOf(d.last, d.stp.Token, j.topN, s.vocab)}
	}
}

// sampleAll runs the draws' samplers on the host's cores where two or more
// of them draw at a temperature or want log-probabilities, and reports
// whether it did. Each job's state is its own, and such a draw takes a
// softmax of a whole row (about 0.2 ms at a vocabulary of 32000 on one
// core), so one core for a batch of 64 would take longer than a GPU's
// decode step. Greedy picks (one pass over the row, or none when the
// engine picked) are left to the caller, one job at a time.
func (s *Server) sampleAll(draws []draw) bool {
	heavy := 0
	for _, d := range draws {
		dr, greedy := d.j.seq.DeviceDraw()
		greedy = greedy && dr.Temperature == 0
		if d.last != nil && (d.j.topN >= 0 || !greedy) {
			heavy++
		}
	}
	workers := min(len(draws), runtime.GOMAXPROCS(0))
	if workers <= 1 || heavy < 2 {
		return false
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < len(draws); i = int(next.Add(1)) - 1 {
				s.sampleOne(&draws[i])
			}
		})
	}
	wg.Wait()
	return true
}

// deviceDraws returns the draws of a step of items whose picks the engine
// can make on its device (engine.DeviceSampling), one per item, or nil when
// the step needs logits on the host: for log-probabilities, scoring, or a
// job with a repetition penalty (generate.Sequence.DeviceDraw). An item
// still feeding its prompt gets the draw its next token will have; its
// pick is not used.
func deviceDraws(items []item, allLogits bool) []sample.Draw {
	if allLogits {
		return nil
	}
	draws := make([]sample.Draw, len(items))
	for i, it := range items {
		j := it.j
		d, ok := j.seq.DeviceDraw()
		if it.logp || j.score || j.topN >= 0 || !ok {
			return nil
		}
		draws[i] = d
	}
	return draws
}

// promptLogprobs records the log-probabilities of the prompt tokens that
// rows (the logits of the prompt's positions from, from+1, ...) predict
// and that are not known yet.
func (s *Server) promptLogprobs(j *job, rows [][]float32, from int) {
	if j.promptLogp == nil {
		j.promptLogp = make([]tokenLogprob, len(j.prompt))
		j.promptLogp[0] = tokenLogprob{id: j.prompt[0], logprob: math.NaN()}
		j.logpUpTo = 1
	}
	for k := max(j.logpUpTo, from+1); k < len(j.prompt) && k <= from+len(rows); k++ {
		j.promptLogp[k] = logprobOf(rows[k-1-from], j.prompt[k], j.topN, s.vocab)
		j.logpUpTo = k + 1
	}
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
