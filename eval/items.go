package eval

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
)

// ItemsSchema is the value of the "schema" field of every row that
// `twell eval -items` writes; it changes when a key changes meaning or
// goes away.
const ItemsSchema = "twell.eval-items/1"

// The kinds of row in an items file (the "kind" field).
const (
	KindRun    = "run"    // one row, first: the run's settings and row counts
	KindWindow = "window" // one row per rolling perplexity window
	KindItem   = "item"   // one row per task item
)

// RunRow is the first row of an items file: what an independent
// recomputation needs to know about the run, and how many rows of each
// kind follow (so that a reader can tell a complete file from a cut one).
// Rows of one kind all have the same keys.
type RunRow struct {
	Schema string `json:"schema"`
	Kind   string `json:"kind"`
	Model  string `json:"model"`
	Device string `json:"device"`
	// MLPPath is how the MLPs ran: "auto", "sparse" or "dense". The sparse
	// path holds the gate activations in bf16 (TwELL); on the CPU the
	// dense path is float32 throughout.
	MLPPath string `json:"mlp"`
	// Context, Stride and Batch are the evaluator's options.
	Context int `json:"context"`
	Stride  int `json:"stride"`
	Batch   int `json:"batch"`
	// HiddenAct is the MLP gate activation the model applied (the
	// config's hidden_act unless something overrode it); MLPGated is
	// false for an up/down-only MLP, act(x Wu^T) Wd^T.
	HiddenAct string `json:"hidden_act"`
	MLPGated  bool   `json:"mlp_gated"`
	VocabSize int    `json:"vocab_size"`
	// Windows and Items are the numbers of window and item rows.
	Windows int `json:"windows"`
	Items   int `json:"items"`
}

// WindowRow is one rolling perplexity window: the model read Tokens (the
// sequence's tokens at positions [Start, End)) from position 0 of a fresh
// cache, and the tokens at sequence positions [Score, End) were scored,
// each from the logits of the position before it.
type WindowRow struct {
	Schema string `json:"schema"`
	Kind   string `json:"kind"`
	// Source names the sequence (a text file, a data source's held-out
	// split), as in the report's perplexity rows; Seq is its index there
	// and Window the window's index within the sequence.
	Source string `json:"source"`
	Seq    int    `json:"seq"`
	Window int    `json:"window"`
	Start  int    `json:"start"`
	End    int    `json:"end"`
	Score  int    `json:"score"`
	Tokens []int  `json:"tokens"`
	// Scored is End - Score, the number of tokens scored; NLL is their
	// summed negative log-likelihood in nats and TokenLogProbs the
	// log-probability of each, in order.
	Scored        int       `json:"scored"`
	NLL           float64   `json:"nll"`
	TokenLogProbs []float64 `json:"token_logprobs"`
}

// ItemRow is one task item as it was scored: the model read Context and
// then, for each choice j, Continuations[j] less its last token; the
// choice's first token was scored from the context's last logits and
// each later one from the position before it.
type ItemRow struct {
	Schema string `json:"schema"`
	Kind   string `json:"kind"`
	// Task is the task file; Line the item's 1-based line in it.
	Task string `json:"task"`
	Line int    `json:"line"`
	Gold int    `json:"gold"`
	// LogLik is, per choice, the summed log-likelihood of its
	// continuation tokens in nats; Tokens the number of those tokens;
	// TokenLogProbs the log-probability of each; Chars the choice's
	// length in characters (acc_norm's divisor).
	LogLik        []float64   `json:"loglik"`
	Tokens        []int       `json:"tokens"`
	TokenLogProbs [][]float64 `json:"token_logprobs"`
	Chars         []int       `json:"chars"`
	// Pred and PredNorm are the choices picked for acc and acc_norm.
	Pred     int `json:"pred"`
	PredNorm int `json:"pred_norm"`
	// Context and Continuations are the token ids scored.
	Context       []int   `json:"context"`
	Continuations [][]int `json:"continuations"`
	// Truncated says whether the context was cut from the left to fit the
	// window, and TruncatedTokens by how many tokens.
	Truncated       bool `json:"truncated"`
	TruncatedTokens int  `json:"truncated_tokens"`
}

// WindowRows returns the rows of the windows of seqs, as
// PerplexityWindows returned them.
func WindowRows(seqs []Sequence, wins [][]WindowNLL) ([]WindowRow, error) {
	if len(wins) != len(seqs) {
		return nil, fmt.Errorf("eval: %d sequences but windows for %d", len(seqs), len(wins))
	}
	var rows []WindowRow
	for i, s := range seqs {
		for k, w := range wins[i] {
			if w.Start < 0 || w.Start >= w.Score || w.Score > w.End || w.End > len(s.Tokens) || len(w.LogProbs) != w.End-w.Score {
				return nil, fmt.Errorf("eval: %s: window %d (%+v, %d log-probabilities) does not fit the sequence of %d tokens", s.Name, k, w.Window, len(w.LogProbs), len(s.Tokens))
			}
			rows = append(rows, WindowRow{Schema: ItemsSchema, Kind: KindWindow, Source: s.Name, Seq: i, Window: k,
				Start: w.Start, End: w.End, Score: w.Score, Tokens: s.Tokens[w.Start:w.End],
				Scored: w.End - w.Score, NLL: w.Nats, TokenLogProbs: w.LogProbs})
		}
	}
	return rows, nil
}

// ItemRows returns the rows of one task's items and their scores, as
// Score returned them.
func ItemRows(task string, items []Encoded, scores []ItemScore) ([]ItemRow, error) {
	if len(items) != len(scores) {
		return nil, fmt.Errorf("eval: %s: %d items but %d scores", task, len(items), len(scores))
	}
	rows := make([]ItemRow, len(items))
	for i, it := range items {
		s := scores[i]
		if len(s.LogLik) != len(it.Conts) || len(s.TokenLogProbs) != len(it.Conts) || len(it.Chars) != len(it.Conts) {
			return nil, fmt.Errorf("eval: %s line %d: %d choices but %d log-likelihoods", task, it.Line, len(it.Conts), len(s.LogLik))
		}
		n := make([]int, len(it.Conts))
		for j, c := range it.Conts {
			if len(s.TokenLogProbs[j]) != len(c) {
				return nil, fmt.Errorf("eval: %s line %d: choice %d has %d tokens but %d log-probabilities", task, it.Line, j, len(c), len(s.TokenLogProbs[j]))
			}
			n[j] = len(c)
		}
		rows[i] = ItemRow{Schema: ItemsSchema, Kind: KindItem, Task: task, Line: it.Line, Gold: it.Gold,
			LogLik: s.LogLik, Tokens: n, TokenLogProbs: s.TokenLogProbs, Chars: it.Chars, Pred: s.Pred, PredNorm: s.PredNorm,
			Context: it.Context, Continuations: it.Conts, Truncated: it.Truncated > 0, TruncatedTokens: it.Truncated}
	}
	return rows, nil
}

// WriteItems writes run, then windows, then items to w as JSON lines.
// run's Schema, Kind and row counts are filled in here. A log-probability
// that is not a finite number (a model that gave NaN logits) is an error,
// as JSON cannot hold it.
func WriteItems(w io.Writer, run RunRow, windows []WindowRow, items []ItemRow) error {
	run.Schema, run.Kind, run.Windows, run.Items = ItemsSchema, KindRun, len(windows), len(items)
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	if err := enc.Encode(&run); err != nil {
		return err
	}
	for i := range windows {
		if err := enc.Encode(&windows[i]); err != nil {
			return fmt.Errorf("%s window %d: %w", windows[i].Source, windows[i].Window, err)
		}
	}
	for i := range items {
		if err := enc.Encode(&items[i]); err != nil {
			return fmt.Errorf("%s line %d: %w", items[i].Task, items[i].Line, err)
		}
	}
	return bw.Flush()
}
