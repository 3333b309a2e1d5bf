// Package eval measures a language model through engine.Engine, so that
// the same code runs on the CPU and the GPU engines: held-out perplexity
// over rolling windows (Perplexity), multiple-choice and cloze tasks scored
// by log-likelihood in the style of EleutherAI's lm-evaluation-harness
// (ReadTasks, Choices), and the MLP activation sparsity of every token the
// evaluation ran (Sparsity).
//
// Log-probabilities are computed in float64 from each row of float32
// logits (a log-softmax per row); sums and means are float64.
//
// ItemRows, WindowRows and WriteItems write what was scored, token ids and
// per-token log-probabilities, as JSON lines (`twell eval -items`), which
// scripts/eval-crosscheck.py recomputes with PyTorch; docs/eval.md says how
// to run that cross-check on the GPU machine (it has not been run yet).
package eval

import (
	"errors"
	"fmt"
	"math"

	"github.com/twell-ai/twell/cpu"
	"github.com/twell-ai/twell/engine"
)

// Options are the settings of an Evaluator.
type Options struct {
	// Context is the window length in tokens: the most positions one
	// forward pass sees (0: the model's MaxPositionEmbeddings).
	Context int
	// Stride is how far apart rolling perplexity windows start, in
	// [1, Context-1] (0: Context/2).
	Stride int
	// Batch is the number of sequences (windows or task items) per
	// Forward call (0: 4).
	Batch int
	// Progress, when not nil, is called after each Forward batch with the
	// work done and the total, in the unit what names ("tokens", "items").
	Progress func(what string, done, total int64)
}

// Evaluator runs evaluations on one engine and keeps the MLP statistics of
// every pass it made. It is not safe for concurrent use.
type Evaluator struct {
	e      engine.Engine
	o      Options
	caches []engine.Cache
	sp     sparsity
}

// New returns an Evaluator over e with the defaults of o filled in, or an
// error naming the setting that is out of range. Close it when done.
func New(e engine.Engine, o Options) (*Evaluator, error) {
	c := e.Config()
	if o.Context == 0 {
		o.Context = c.MaxPositionEmbeddings
	}
	if o.Context < 2 || o.Context > c.MaxPositionEmbeddings {
		return nil, fmt.Errorf("eval: context %d: want 2 to the model's %d positions", o.Context, c.MaxPositionEmbeddings)
	}
	if o.Stride == 0 {
		o.Stride = max(o.Context/2, 1)
	}
	if o.Stride < 1 || o.Stride >= o.Context {
		return nil, fmt.Errorf("eval: stride %d: want 1 to %d (less than the context of %d, so that every window predicts its first new token from something)", o.Stride, o.Context-1, o.Context)
	}
	if o.Batch == 0 {
		o.Batch = 4
	}
	if o.Batch < 1 {
		return nil, fmt.Errorf("eval: batch %d: want >= 1", o.Batch)
	}
	return &Evaluator{e: e, o: o, sp: sparsity{layers: make([]layerSum, c.NumHiddenLayers)}}, nil
}

// Options returns the evaluator's options, defaults filled in.
func (ev *Evaluator) Options() Options { return ev.o }

// Close frees the KV caches the evaluator made (not the engine).
func (ev *Evaluator) Close() error {
	var errs []error
	for _, c := range ev.caches {
		errs = append(errs, c.Free())
	}
	ev.caches = nil
	return errors.Join(errs...)
}

// cachesFor returns n empty caches of the context's capacity, reusing the
// ones made before.
func (ev *Evaluator) cachesFor(n int) ([]engine.Cache, error) {
	for len(ev.caches) < n {
		c, err := ev.e.NewCache(ev.o.Context)
		if err != nil {
			return nil, fmt.Errorf("eval: %w", err)
		}
		ev.caches = append(ev.caches, c)
	}
	for _, c := range ev.caches[:n] {
		if err := c.Truncate(0); err != nil {
			return nil, fmt.Errorf("eval: %w", err)
		}
	}
	return ev.caches[:n], nil
}

// forward runs one Forward call and adds its MLP statistics.
func (ev *Evaluator) forward(caches []engine.Cache, tokens [][]int, all bool) ([][]float32, error) {
	logits, st, err := ev.e.Forward(caches, tokens, all)
	if err != nil {
		return nil, fmt.Errorf("eval: %w", err)
	}
	ev.sp.add(st)
	return logits, nil
}

// LogProb returns log softmax(logits)[target] in float64: the
// log-probability that a row of logits gives token target.
func LogProb(logits []float32, target int) float64 {
	m := math.Inf(-1)
	for _, l := range logits {
		m = max(m, float64(l))
	}
	var s float64
	for _, l := range logits {
		s += math.Exp(float64(l) - m)
	}
	return float64(logits[target]) - m - math.Log(s)
}

// logProbs returns LogProb(logits[rows[i]], targets[i]) for every i,
// spread over the CPUs: a row of a large vocabulary takes tens of
// microseconds, which would otherwise bound a GPU evaluation.
func logProbs(logits [][]float32, rows, targets []int) []float64 {
	out := make([]float64, len(rows))
	cpu.ParallelFor(len(rows), func(i int) { out[i] = LogProb(logits[rows[i]], targets[i]) })
	return out
}

// Window is one rolling perplexity window of a sequence: tokens [Start,
// End) are fed to the model and the tokens at positions [Score, End) are
// scored, each predicted from the logits of the position before it.
type Window struct {
	Start, End, Score int
}

// Windows returns the rolling windows over a sequence of n tokens, as
// Hugging Face's perplexity guide makes them: windows of up to context
// tokens starting stride apart; the first scores all its tokens but the
// first (which nothing predicts), each later one only the tokens past the
// previous window's end. Every token but the first is scored exactly once.
// It returns nil for n < 2.
func Windows(n, context, stride int) []Window {
	if n < 2 || context < 2 || stride < 1 || stride >= context {
		return nil
	}
	var ws []Window
	prevEnd := 1
	for start := 0; ; start += stride {
		end := min(start+context, n)
		if end > prevEnd {
			ws = append(ws, Window{Start: start, End: end, Score: prevEnd})
		}
		prevEnd = end
		if end == n {
			return ws
		}
	}
}

// Sequence is one run of tokens whose perplexity is measured.
type Sequence struct {
	// Name labels the result (a file, a data source).
	Name string
	// Tokens are the token ids; every one but the first is scored.
	Tokens []int
	// Bytes is the UTF-8 length of the text of the scored tokens (for
	// bits per byte; see the command for how it is counted).
	Bytes int64
}

// PPL is the perplexity of one sequence, or of several together.
type PPL struct {
	Name string `json:"name"`
	// Tokens is the number of tokens scored; Windows the number of
	// windows run.
	Tokens  int64 `json:"tokens"`
	Windows int64 `json:"windows"`
	// Bytes is the UTF-8 byte count of the scored text.
	Bytes int64 `json:"bytes"`
	// Nats is the summed cross-entropy; CE = Nats/Tokens, Perplexity =
	// exp(CE), BitsPerByte = Nats / ln 2 / Bytes (0 when Bytes is 0).
	Nats        float64 `json:"nats"`
	CE          float64 `json:"ce"`
	Perplexity  float64 `json:"perplexity"`
	BitsPerByte float64 `json:"bits_per_byte"`
}

// finish fills the derived fields from Tokens, Bytes and Nats.
func (p *PPL) finish() {
	if p.Tokens > 0 {
		p.CE = p.Nats / float64(p.Tokens)
		p.Perplexity = math.Exp(p.CE)
	}
	if p.Bytes > 0 {
		p.BitsPerByte = p.Nats / math.Ln2 / float64(p.Bytes)
	}
}

// Total returns the pooled perplexity of results, named name: tokens,
// bytes and nats summed.
func Total(name string, results []PPL) PPL {
	t := PPL{Name: name}
	for _, r := range results {
		t.Tokens += r.Tokens
		t.Windows += r.Windows
		t.Bytes += r.Bytes
		t.Nats += r.Nats
	}
	t.finish()
	return t
}

// Perplexity scores seqs over rolling windows (see Windows), Batch windows
// per Forward call with every logit, each window in a fresh cache, and
// returns one result per sequence. A sequence of fewer than 2 tokens is
// an error.
func (ev *Evaluator) Perplexity(seqs []Sequence) ([]PPL, error) {
	out, _, err := ev.perplexity(seqs, false)
	return out, err
}

// WindowNLL is what one rolling window contributed to the perplexity of
// its sequence.
type WindowNLL struct {
	Window
	// LogProbs is the log-probability of each scored token, those at
	// positions [Score, End) of the sequence, in order; each is predicted
	// from the window's tokens before it, the window's first token at
	// position 0 of a fresh cache.
	LogProbs []float64
	// Nats is minus the sum of LogProbs, added in order.
	Nats float64
}

// PerplexityWindows is Perplexity that also returns, per sequence, its
// windows in order with the log-probability of every token they scored.
// A sequence's Nats is the sum of its windows' Nats, added in order.
func (ev *Evaluator) PerplexityWindows(seqs []Sequence) ([]PPL, [][]WindowNLL, error) {
	return ev.perplexity(seqs, true)
}

// perplexity implements Perplexity and, with keep, PerplexityWindows.
func (ev *Evaluator) perplexity(seqs []Sequence, keep bool) ([]PPL, [][]WindowNLL, error) {
	type job struct {
		seq int
		w   Window
	}
	var jobs []job
	var total int64
	out := make([]PPL, len(seqs))
	var wins [][]WindowNLL
	if keep {
		wins = make([][]WindowNLL, len(seqs))
	}
	for i, s := range seqs {
		if len(s.Tokens) < 2 {
			return nil, nil, fmt.Errorf("eval: %s: %d tokens; perplexity needs at least 2", s.Name, len(s.Tokens))
		}
		out[i] = PPL{Name: s.Name, Bytes: s.Bytes}
		for _, w := range Windows(len(s.Tokens), ev.o.Context, ev.o.Stride) {
			jobs = append(jobs, job{i, w})
			total += int64(w.End - w.Score)
		}
	}
	var done int64
	for len(jobs) > 0 {
		b := jobs[:min(ev.o.Batch, len(jobs))]
		jobs = jobs[len(b):]
		caches, err := ev.cachesFor(len(b))
		if err != nil {
			return nil, nil, err
		}
		toks := make([][]int, len(b))
		for k, j := range b {
			toks[k] = seqs[j.seq].Tokens[j.w.Start:j.w.End]
		}
		logits, err := ev.forward(caches, toks, true)
		if err != nil {
			return nil, nil, err
		}
		var rows, targets []int
		row := 0
		for k, j := range b {
			s := seqs[j.seq].Tokens
			for t := j.w.Score; t < j.w.End; t++ {
				rows = append(rows, row+t-1-j.w.Start)
				targets = append(targets, s[t])
			}
			row += len(toks[k])
		}
		lps := logProbs(logits, rows, targets)
		for _, j := range b {
			wn := WindowNLL{Window: j.w}
			if keep {
				wn.LogProbs = make([]float64, 0, j.w.End-j.w.Score)
			}
			for range j.w.End - j.w.Score {
				lp := lps[0]
				lps = lps[1:]
				wn.Nats -= lp
				if keep {
					wn.LogProbs = append(wn.LogProbs, lp)
				}
			}
			out[j.seq].Nats += wn.Nats
			out[j.seq].Tokens += int64(j.w.End - j.w.Score)
			out[j.seq].Windows++
			if keep {
				wins[j.seq] = append(wins[j.seq], wn)
			}
			done += int64(j.w.End - j.w.Score)
		}
		if ev.o.Progress != nil {
			ev.o.Progress("tokens", done, total)
		}
	}
	for i := range out {
		out[i].finish()
	}
	return out, wins, nil
}
