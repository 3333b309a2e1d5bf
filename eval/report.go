package eval

import (
	"fmt"
	"io"
	"strings"
)

// Schema is the value of a Report's "schema" field; it changes when a key
// changes meaning or goes away.
const Schema = "twell.eval/1"

// Report is the result of an evaluation, as `twell eval -json` writes it.
// Every row of a list has the same keys; a value that was not measured is
// null.
type Report struct {
	Schema string `json:"schema"`
	Model  string `json:"model"`
	Device string `json:"device"`
	// MLPPath is how the MLPs ran: "auto", "sparse" or "dense" (see
	// mlp.Path).
	MLPPath string `json:"mlp"`
	// Context, Stride and Batch are the evaluator's options.
	Context int `json:"context"`
	Stride  int `json:"stride"`
	Batch   int `json:"batch"`
	// Perplexity has one row per sequence (a data source's held-out split,
	// a text file) and, last, their pooled total named "all" (empty when
	// no perplexity was asked for).
	Perplexity []PPL `json:"perplexity"`
	// Tasks has one row per task file.
	Tasks []TaskResult `json:"tasks"`
	// Sparsity has one row per layer, over Tokens tokens run in all.
	Sparsity     []LayerSparsity `json:"sparsity"`
	MLPWidth     int             `json:"mlp_width"`
	Tokens       int64           `json:"tokens"`
	Seconds      float64         `json:"seconds"`
	TokensPerSec float64         `json:"tokens_per_second"`
}

// WriteTable writes r as readable tables.
func (r *Report) WriteTable(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "model %s on %s: MLP %s, context %d, stride %d, batch %d; %d tokens in %.1f s (%.0f tokens/s)\n",
		r.Model, r.Device, r.MLPPath, r.Context, r.Stride, r.Batch, r.Tokens, r.Seconds, r.TokensPerSec)
	if len(r.Perplexity) > 0 {
		fmt.Fprintf(&b, "\n%-28s %10s %12s %9s %11s %9s\n", "perplexity", "tokens", "bytes", "CE nats", "perplexity", "bits/byte")
		for _, p := range r.Perplexity {
			fmt.Fprintf(&b, "%-28s %10d %12d %9.4f %11.3f %9.4f\n", clip(p.Name, 28), p.Tokens, p.Bytes, p.CE, p.Perplexity, p.BitsPerByte)
		}
	}
	if len(r.Tasks) > 0 {
		fmt.Fprintf(&b, "\n%-28s %6s %16s %16s\n", "task", "items", "acc", "acc_norm")
		for _, t := range r.Tasks {
			fmt.Fprintf(&b, "%-28s %6d %7.4f ± %.4f %7.4f ± %.4f\n", clip(t.Name, 28), t.Items, t.Acc, t.AccStderr, t.AccNorm, t.AccNormStderr)
		}
	}
	if len(r.Sparsity) > 0 {
		fmt.Fprintf(&b, "\n%-6s %12s %10s   (MLP width %d)\n", "layer", "active/tok", "active %", r.MLPWidth)
		for _, s := range r.Sparsity {
			if s.MeanActive == nil {
				fmt.Fprintf(&b, "%-6d %12s %10s\n", s.Layer, "-", "-")
				continue
			}
			fmt.Fprintf(&b, "%-6d %12.1f %9.3f%%\n", s.Layer, *s.MeanActive, 100**s.Fraction)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n+3:]
}
