package eval

import (
	"fmt"
	"math"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Encoded is an Item in token ids, ready to score: the model reads
// Context followed by each continuation, and the choice's log-likelihood is
// the sum of the log-probabilities of its continuation tokens.
type Encoded struct {
	Line    int
	Context []int
	Conts   [][]int
	// Chars is, per choice, the length of the choice in Unicode
	// characters (code points), the divisor of acc_norm.
	Chars []int
	Gold  int
	// Truncated is the number of context tokens dropped from the left so
	// that the context and the longest continuation fit the window.
	Truncated int
}

// Encode turns items into token ids the way lm-evaluation-harness (v0.4,
// decoder-only models) pairs a context with a continuation: whitespace at
// the end of the context is moved to the front of the continuation; the
// context is encoded alone, the context and continuation together, and the
// continuation's tokens are those of the whole past the context's token
// count (so a token that spans the boundary belongs to the continuation).
// An empty context is replaced by the single token prefix (the BOS or
// end-of-text id; an error when prefix < 0). encode returns ids without
// special tokens.
//
// When the context and the longest continuation (less its last token,
// which is never fed) pass window tokens, the context is cut from the left
// for every choice of the item (lm-eval cuts per choice; here the choices
// share one context so that its KV cache is shared). A continuation that
// encodes to no tokens, or that alone does not fit the window, is an error
// naming the line and the choice.
func Encode(items []Item, encode func(string) ([]int, error), prefix, window int) ([]Encoded, error) {
	out := make([]Encoded, len(items))
	for i, it := range items {
		e := Encoded{Line: it.Line, Gold: it.Gold}
		ctx := strings.TrimRightFunc(it.Context, unicode.IsSpace)
		moved := it.Context[len(ctx):]
		var ctxEnc []int
		if ctx != "" {
			var err error
			if ctxEnc, err = encode(ctx); err != nil {
				return nil, fmt.Errorf("line %d: context: %w", it.Line, err)
			}
		}
		longest := 0
		for j, ch := range it.Choices {
			var cont []int
			if len(ctxEnc) == 0 {
				if prefix < 0 {
					return nil, fmt.Errorf("line %d: the context is empty and the tokenizer has no BOS or end-of-text token to stand for it", it.Line)
				}
				c, err := encode(moved + ch)
				if err != nil {
					return nil, fmt.Errorf("line %d: choice %d: %w", it.Line, j, err)
				}
				cont = c
			} else {
				whole, err := encode(ctx + moved + ch)
				if err != nil {
					return nil, fmt.Errorf("line %d: choice %d: %w", it.Line, j, err)
				}
				if len(whole) > len(ctxEnc) {
					cont = whole[len(ctxEnc):]
				}
			}
			if len(cont) == 0 {
				return nil, fmt.Errorf("line %d: choice %d (%q) encodes to no tokens after the context", it.Line, j, truncate(ch, 40))
			}
			if len(cont) > window {
				return nil, fmt.Errorf("line %d: choice %d has %d tokens; with one token of context it does not fit the window of %d", it.Line, j, len(cont), window)
			}
			longest = max(longest, len(cont))
			e.Conts = append(e.Conts, cont)
			e.Chars = append(e.Chars, utf8.RuneCountInString(ch))
		}
		if len(ctxEnc) == 0 {
			ctxEnc = []int{prefix}
		}
		if keep := window - longest + 1; len(ctxEnc) > keep {
			e.Truncated = len(ctxEnc) - keep
			ctxEnc = ctxEnc[e.Truncated:]
		}
		e.Context = ctxEnc
		out[i] = e
	}
	return out, nil
}

// ItemScore is what the model made of one item.
type ItemScore struct {
	Line int `json:"line"`
	Gold int `json:"gold"`
	// LogLik is, per choice, the summed log-probability of its
	// continuation tokens given the context, in nats.
	LogLik []float64 `json:"loglik"`
	// TokenLogProbs is, per choice, the log-probability of each of its
	// continuation tokens in order; LogLik[j] is the sum of
	// TokenLogProbs[j], added in that order.
	TokenLogProbs [][]float64 `json:"token_logprobs"`
	// Pred is the argmax of LogLik, PredNorm the argmax of LogLik divided
	// by the choice's length in characters (the first of ties).
	Pred     int `json:"pred"`
	PredNorm int `json:"pred_norm"`
}

// TaskResult is the accuracy of a model on one task.
type TaskResult struct {
	Name  string `json:"name"`
	Items int    `json:"items"`
	// Acc is the fraction of items whose Pred is the gold choice, AccNorm
	// that of PredNorm; the standard errors are sqrt(p(1-p)/n).
	Acc           float64 `json:"acc"`
	AccStderr     float64 `json:"acc_stderr"`
	AccNorm       float64 `json:"acc_norm"`
	AccNormStderr float64 `json:"acc_norm_stderr"`
	// Tokens is the number of tokens run (contexts once, continuations
	// each); Truncated the number of items whose context was cut.
	Tokens    int64 `json:"tokens"`
	Truncated int   `json:"truncated"`
}

// Score scores every choice of items: the contexts of Batch items are run
// in one Forward call, each in its own cache; then, choice by choice, the
// continuations (less their last token) are run on top of the contexts,
// every logit returned, and each cache is truncated back to its context
// for the next choice. A choice's first token is scored from the context's
// last logits.
func (ev *Evaluator) Score(name string, items []Encoded) (TaskResult, []ItemScore, error) {
	res := TaskResult{Name: name, Items: len(items)}
	scores := make([]ItemScore, len(items))
	for i, it := range items {
		if len(it.Context) == 0 || len(it.Conts) == 0 || it.Gold < 0 || it.Gold >= len(it.Conts) || len(it.Chars) != len(it.Conts) {
			return res, nil, fmt.Errorf("eval: %s line %d: malformed encoded item", name, it.Line)
		}
		for j, c := range it.Conts {
			if len(c) == 0 || len(it.Context)+len(c)-1 > ev.o.Context {
				return res, nil, fmt.Errorf("eval: %s line %d: choice %d: %d continuation tokens after %d of context do not fit the window of %d", name, it.Line, j, len(c), len(it.Context), ev.o.Context)
			}
		}
		scores[i] = ItemScore{Line: it.Line, Gold: it.Gold, LogLik: make([]float64, len(it.Conts)), TokenLogProbs: make([][]float64, len(it.Conts))}
		for j, c := range it.Conts {
			scores[i].TokenLogProbs[j] = make([]float64, len(c))
		}
		if it.Truncated > 0 {
			res.Truncated++
		}
	}
	for lo := 0; lo < len(items); lo += ev.o.Batch {
		b := items[lo:min(lo+ev.o.Batch, len(items))]
		sc := scores[lo : lo+len(b)]
		caches, err := ev.cachesFor(len(b))
		if err != nil {
			return res, nil, err
		}
		toks := make([][]int, len(b))
		most := 0
		for k, it := range b {
			toks[k] = it.Context
			res.Tokens += int64(len(it.Context))
			most = max(most, len(it.Conts))
		}
		logits, err := ev.forward(caches, toks, false)
		if err != nil {
			return res, nil, fmt.Errorf("%s: %w", name, err)
		}
		for k, it := range b {
			for j, c := range it.Conts {
				lp := LogProb(logits[k], c[0])
				sc[k].TokenLogProbs[j][0] = lp
				sc[k].LogLik[j] = lp
			}
		}
		for j := range most {
			var cs = caches[:0:0]
			var ts [][]int
			var who []int
			for k, it := range b {
				if j < len(it.Conts) && len(it.Conts[j]) > 1 {
					cs = append(cs, caches[k])
					ts = append(ts, it.Conts[j][:len(it.Conts[j])-1])
					who = append(who, k)
					res.Tokens += int64(len(it.Conts[j]) - 1)
				}
			}
			if len(cs) == 0 {
				continue
			}
			logits, err := ev.forward(cs, ts, true)
			if err != nil {
				return res, nil, fmt.Errorf("%s: %w", name, err)
			}
			row := 0
			for _, k := range who {
				c := b[k].Conts[j]
				for t := 1; t < len(c); t++ {
					lp := LogProb(logits[row], c[t])
					sc[k].TokenLogProbs[j][t] = lp
					sc[k].LogLik[j] += lp
					row++
				}
				if err := caches[k].Truncate(len(b[k].Context)); err != nil {
					return res, nil, fmt.Errorf("eval: %w", err)
				}
			}
		}
		if ev.o.Progress != nil {
			ev.o.Progress("items", int64(lo+len(b)), int64(len(items)))
		}
	}
	var acc, accNorm int
	for i, it := range items {
		s := &scores[i]
		s.Pred, s.PredNorm = 0, 0
		for j, ll := range s.LogLik {
			if ll > s.LogLik[s.Pred] {
				s.Pred = j
			}
			if ll/float64(it.Chars[j]) > s.LogLik[s.PredNorm]/float64(it.Chars[s.PredNorm]) {
				s.PredNorm = j
			}
		}
		if s.Pred == it.Gold {
			acc++
		}
		if s.PredNorm == it.Gold {
			accNorm++
		}
	}
	res.Acc, res.AccStderr = proportion(acc, len(items))
	res.AccNorm, res.AccNormStderr = proportion(accNorm, len(items))
	return res, scores, nil
}

// proportion returns k/n and its standard error sqrt(p(1-p)/n).
func proportion(k, n int) (p, se float64) {
	if n == 0 {
		return 0, 0
	}
	p = float64(k) / float64(n)
	return p, math.Sqrt(p * (1 - p) / float64(n))
}
