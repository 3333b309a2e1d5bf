// Package enginetest holds what tests over engines share: caches and
// forward passes that fail the test on error, random tokens, logit
// comparisons, the Hugging Face cross-check checkpoints (for cpu/llm and
// gpu/llm), and a tiny random model over the Llama-2 tokenizer (for the
// command and server tests).
package enginetest

import (
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/safetensors"
)

// SavedTwice saves w as a checkpoint of config c in dtype dt and returns
// it loaded whole (model.Load) and deferred (model.LoadDeferred, closed at
// the end of the test).
func SavedTwice(tb testing.TB, c model.Config, w *model.Weights, dt safetensors.DType) (full, lazy *model.Model) {
	tb.Helper()
	dir := tb.TempDir()
	if err := model.Save(dir, c, w, dt); err != nil {
		tb.Fatal(err)
	}
	full, err := model.Load(dir)
	if err != nil {
		tb.Fatal(err)
	}
	if lazy, err = model.LoadDeferred(dir); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { lazy.Close() })
	return full, lazy
}

// Caches returns n empty caches of e of capacity positions each, freed at
// the end of the test.
func Caches(tb testing.TB, e engine.Engine, n, capacity int) []engine.Cache {
	tb.Helper()
	cs := make([]engine.Cache, n)
	for i := range cs {
		c, err := e.NewCache(capacity)
		if err != nil {
			tb.Fatal(err)
		}
		cs[i] = c
		tb.Cleanup(func() { c.Free() })
	}
	return cs
}

// Forward runs e.Forward and fails the test on error.
func Forward(tb testing.TB, e engine.Engine, caches []engine.Cache, tokens [][]int, allLogits bool) ([][]float32, *engine.Stats) {
	tb.Helper()
	logits, st, err := e.Forward(caches, tokens, allLogits)
	if err != nil {
		tb.Fatal(err)
	}
	return logits, st
}

// Passes runs passes (each a batch of sequences) through e with all
// logits, in fresh caches of capacity positions, and returns the logits of
// every pass, one after the other.
func Passes(tb testing.TB, e engine.Engine, capacity int, passes ...[][]int) [][]float32 {
	tb.Helper()
	caches := Caches(tb, e, len(passes[0]), capacity)
	var out [][]float32
	for _, toks := range passes {
		l, _ := Forward(tb, e, caches, toks, true)
		out = append(out, l...)
	}
	return out
}

// Tokens returns n random token ids below vocab.
func Tokens(r *rand.Rand, n, vocab int) []int {
	ts := make([]int, n)
	for i := range ts {
		ts[i] = r.IntN(vocab)
	}
	return ts
}

// RandomBatch draws the sequences of one random step over caches (each of
// capacity positions): a sequence with room joins with probability 3/4,
// with one new token, or, a third of the time, with 1 to min(room,
// maxChunk) tokens. It returns the sequences' indices and their tokens.
func RandomBatch(r *rand.Rand, caches []engine.Cache, capacity, maxChunk, vocab int) (idx []int, toks [][]int) {
	for s, c := range caches {
		room := capacity - c.Len()
		if room == 0 || r.IntN(4) == 0 {
			continue
		}
		n := 1
		if r.IntN(3) == 0 {
			n = 1 + r.IntN(min(room, maxChunk))
		}
		idx = append(idx, s)
		toks = append(toks, Tokens(r, n, vocab))
	}
	return idx, toks
}

// Pick returns caches[i] for each i of idx.
func Pick(caches []engine.Cache, idx []int) []engine.Cache {
	out := make([]engine.Cache, len(idx))
	for i, s := range idx {
		out[i] = caches[s]
	}
	return out
}

// Argmax returns the index of the largest logit (the first of ties).
func Argmax(logits []float32) int {
	best := 0
	for v, l := range logits {
		if l > logits[best] {
			best = v
		}
	}
	return best
}

// MaxRelDiff returns max |got-want| / max |want| over one row of logits.
func MaxRelDiff[T float32 | float64](got []float32, want []T) float64 {
	var num, den float64
	for i, w := range want {
		num = math.Max(num, math.Abs(float64(got[i])-float64(w)))
		den = math.Max(den, math.Abs(float64(w)))
	}
	return num / den
}

// RelDiff returns max |a-b| / max |b| over all rows, or an error when the
// shapes differ or a holds a NaN or an infinity.
func RelDiff(a, b [][]float32) (float64, error) {
	if len(a) != len(b) {
		return 0, fmt.Errorf("%d rows vs %d", len(a), len(b))
	}
	var d, m float64
	for i := range a {
		if len(a[i]) != len(b[i]) {
			return 0, fmt.Errorf("row %d: %d values vs %d", i, len(a[i]), len(b[i]))
		}
		for j := range a[i] {
			x, y := float64(a[i][j]), float64(b[i][j])
			if math.IsNaN(x) || math.IsInf(x, 0) {
				return math.Inf(1), fmt.Errorf("row %d col %d: %v", i, j, x)
			}
			d = max(d, math.Abs(x-y))
			m = max(m, math.Abs(y))
		}
	}
	return d / max(m, 1e-30), nil
}

// SameBits fails the test at the first logit of got that is not, bit for
// bit, the one in want; what names the comparison in the message.
func SameBits(tb testing.TB, what string, got, want [][]float32) {
	tb.Helper()
	if len(got) != len(want) {
		tb.Fatalf("%s: %d rows, want %d", what, len(got), len(want))
	}
	for i := range want {
		for j := range want[i] {
			if math.Float32bits(got[i][j]) != math.Float32bits(want[i][j]) {
				tb.Fatalf("%s: row %d logit %d: %v, want %v", what, i, j, got[i][j], want[i][j])
			}
		}
	}
}

// HFCase is one checkpoint that Hugging Face transformers saved with
// scripts/hf-crosscheck-model.py, and what PyTorch computed on it.
type HFCase struct {
	Model *model.Model
	// IDs is the prompt; Logits are PyTorch's float32 logits of each of
	// its positions.
	IDs    []int       `json:"ids"`
	Logits [][]float32 `json:"logits"`
	// Greedy is PyTorch's greedy continuation, and GreedyMargin the gap
	// between its top two logits at each step.
	Greedy       []int     `json:"greedy"`
	GreedyMargin []float64 `json:"greedy_margin"`
}

// HFCrossCheck runs check in a subtest for each checkpoint under
// TWELL_HF_DIR (one directory each, with expected.json), and skips the test
// when TWELL_HF_DIR is not set.
func HFCrossCheck(t *testing.T, check func(t *testing.T, c *HFCase)) {
	t.Helper()
	root := testutil.Getenv(t, "TWELL_HF_DIR", "run scripts/hf-crosscheck-model.py to make the checkpoints")
	exps, _ := filepath.Glob(filepath.Join(root, "*", "expected.json"))
	if len(exps) == 0 {
		t.Fatalf("no */expected.json under %s", root)
	}
	for _, exp := range exps {
		dir := filepath.Dir(exp)
		t.Run(filepath.Base(dir), func(t *testing.T) {
			var c HFCase
			testutil.ReadJSON(t, exp, &c)
			m, err := model.Load(dir)
			if err != nil {
				t.Fatal(err)
			}
			c.Model = m
			check(t, &c)
		})
	}
}

// IDText is a detokenizer (generate.Decoder) that writes each id as
// "<id>": text whose stop strings and pieces a test can predict from ids.
type IDText struct{}

// Decode writes ids as "<id>" each.
func (IDText) Decode(ids []int, _ bool) (string, error) {
	var b strings.Builder
	for _, id := range ids {
		fmt.Fprintf(&b, "<%d>", id)
	}
	return b.String(), nil
}
