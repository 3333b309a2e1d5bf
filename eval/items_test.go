package eval

import (
	"bytes"
	"encoding/json"
	"math"
	"strings"
	"testing"

	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/internal/testutil"
)

// TestPerplexityWindowsAgree: PerplexityWindows returns the windows of
// Windows in order, the log-probability of every scored token (each
// equal to that of a separate pass over the window in a fresh cache, to
// 1e-4 nats: float32 logits of differently shaped passes), window NLLs
// that are minus the sums of their log-probabilities, and per-sequence
// results equal to Perplexity's.
func TestPerplexityWindowsAgree(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig(true)
	e := newEngine(t, c, nil, r)
	for trial := range 3 {
		var seqs []Sequence
		for i := range 1 + r.IntN(3) {
			seqs = append(seqs, Sequence{Name: string(rune('a' + i)), Tokens: enginetest.Tokens(r, 2+r.IntN(40), c.VocabSize), Bytes: int64(r.IntN(100))})
		}
		ctx := 2 + r.IntN(c.MaxPositionEmbeddings-1)
		o := Options{Context: ctx, Stride: 1 + r.IntN(ctx-1), Batch: 1 + r.IntN(5)}
		ev, err := New(e, o)
		if err != nil {
			t.Fatal(err)
		}
		want, err := ev.Perplexity(seqs)
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		got, wins, err := ev.PerplexityWindows(seqs)
		ev.Close()
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if len(got) != len(seqs) || len(wins) != len(seqs) {
			t.Fatalf("seed %d trial %d: %d results and %d window lists for %d sequences", seed, trial, len(got), len(wins), len(seqs))
		}
		for i, s := range seqs {
			ws := Windows(len(s.Tokens), o.Context, o.Stride)
			if len(wins[i]) != len(ws) {
				t.Fatalf("seed %d trial %d seq %d: %d windows, want %d", seed, trial, i, len(wins[i]), len(ws))
			}
			var nats float64
			for k, w := range wins[i] {
				if w.Window != ws[k] || len(w.LogProbs) != w.End-w.Score {
					t.Fatalf("seed %d trial %d seq %d window %d: %+v with %d log-probabilities, want %+v", seed, trial, i, k, w.Window, len(w.LogProbs), ws[k])
				}
				cache := enginetest.Caches(t, e, 1, o.Context)
				l, _ := enginetest.Forward(t, e, cache, [][]int{s.Tokens[w.Start:w.End]}, true)
				var sum float64
				for p, lp := range w.LogProbs {
					pos := w.Score + p
					if direct := LogProb(l[pos-1-w.Start], s.Tokens[pos]); math.Abs(lp-direct) > 1e-4 {
						t.Errorf("seed %d trial %d seq %d window %d position %d: log-probability %.6f, separate pass %.6f", seed, trial, i, k, pos, lp, direct)
					}
					sum -= lp
				}
				if sum != w.Nats {
					t.Errorf("seed %d trial %d seq %d window %d: nats %v, minus the sum of the log-probabilities %v", seed, trial, i, k, w.Nats, sum)
				}
				nats += w.Nats
			}
			g := got[i]
			if g.Nats != nats || g.Tokens != want[i].Tokens || g.Windows != want[i].Windows || g.Bytes != want[i].Bytes ||
				math.Abs(g.Nats-want[i].Nats) > 1e-9*math.Abs(want[i].Nats) {
				t.Errorf("seed %d trial %d seq %d: PerplexityWindows %+v (windows sum to %v nats), Perplexity %+v", seed, trial, i, g, nats, want[i])
			}
		}
	}
}

// TestScoreTokenLogProbs: each choice's log-likelihood is the sum, in
// order, of its per-token log-probabilities, one per continuation token,
// each equal to that of a separate pass (to 1e-4 nats).
func TestScoreTokenLogProbs(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig(false)
	e := newEngine(t, c, nil, r)
	items := randomItems(r, 9, c.VocabSize, c.MaxPositionEmbeddings)
	ev, err := New(e, Options{Batch: 1 + r.IntN(9)})
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	_, scores, err := ev.Score("random", items)
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	for i, it := range items {
		for j, cont := range it.Conts {
			lps := scores[i].TokenLogProbs[j]
			if len(lps) != len(cont) {
				t.Fatalf("seed %d item %d choice %d: %d log-probabilities for %d tokens", seed, i, j, len(lps), len(cont))
			}
			var sum float64
			for _, lp := range lps {
				sum += lp
			}
			if sum != scores[i].LogLik[j] {
				t.Errorf("seed %d item %d choice %d: log-likelihood %v, sum of token log-probabilities %v", seed, i, j, scores[i].LogLik[j], sum)
			}
			cache := enginetest.Caches(t, e, 1, c.MaxPositionEmbeddings)
			in := append(append([]int(nil), it.Context...), cont[:len(cont)-1]...)
			l, _ := enginetest.Forward(t, e, cache, [][]int{in}, true)
			for k, tok := range cont {
				if direct := LogProb(l[len(it.Context)-1+k], tok); math.Abs(lps[k]-direct) > 1e-4 {
					t.Errorf("seed %d item %d choice %d token %d: log-probability %.6f, separate pass %.6f", seed, i, j, k, lps[k], direct)
				}
			}
		}
	}
}

// TestItemsRows: the rows of an evaluation carry what was scored (token
// ids, counts, truncation), one per item and window; WriteItems writes the
// run row first with the counts, then one JSON line per row, each with the
// schema; mismatched inputs and NaN log-probabilities are errors.
func TestItemsRows(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig(true)
	e := newEngine(t, c, nil, r)
	ev, err := New(e, Options{Batch: 1 + r.IntN(4), Stride: 1 + r.IntN(c.MaxPositionEmbeddings-1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	items := randomItems(r, 1+r.IntN(8), c.VocabSize, c.MaxPositionEmbeddings)
	items[0].Truncated = 1 + r.IntN(5)
	_, scores, err := ev.Score("task.jsonl", items)
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	seqs := []Sequence{{Name: "a", Tokens: enginetest.Tokens(r, 2+r.IntN(50), c.VocabSize)}, {Name: "b", Tokens: enginetest.Tokens(r, 2+r.IntN(50), c.VocabSize)}}
	ppl, wins, err := ev.PerplexityWindows(seqs)
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	irows, err := ItemRows("task.jsonl", items, scores)
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	wrows, err := WindowRows(seqs, wins)
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	if len(irows) != len(items) || len(wrows) != len(wins[0])+len(wins[1]) {
		t.Fatalf("seed %d: %d item rows for %d items, %d window rows for %d+%d windows", seed, len(irows), len(items), len(wrows), len(wins[0]), len(wins[1]))
	}
	for i, row := range irows {
		it := items[i]
		if row.Task != "task.jsonl" || row.Line != it.Line || row.Gold != it.Gold || row.Truncated != (it.Truncated > 0) || row.TruncatedTokens != it.Truncated ||
			row.Pred != scores[i].Pred || row.PredNorm != scores[i].PredNorm || len(row.Tokens) != len(it.Conts) || len(row.Context) != len(it.Context) {
			t.Errorf("seed %d item %d: row %+v for item %+v, score %+v", seed, i, row, it, scores[i])
		}
		for j, cont := range it.Conts {
			if row.Tokens[j] != len(cont) || row.LogLik[j] != scores[i].LogLik[j] || len(row.Continuations[j]) != len(cont) {
				t.Errorf("seed %d item %d choice %d: row %+v", seed, i, j, row)
			}
		}
	}
	nats := map[string]float64{}
	for _, w := range wrows {
		nats[w.Source] += w.NLL
		if len(w.Tokens) != w.End-w.Start || w.Scored != w.End-w.Score || len(w.TokenLogProbs) != w.Scored {
			t.Errorf("seed %d: window row %+v", seed, w)
		}
	}
	for i, s := range seqs {
		if math.Abs(nats[s.Name]-ppl[i].Nats) > 1e-12*math.Abs(ppl[i].Nats) {
			t.Errorf("seed %d: %s: windows sum to %v nats, the result has %v", seed, s.Name, nats[s.Name], ppl[i].Nats)
		}
	}

	var buf bytes.Buffer
	if err := WriteItems(&buf, RunRow{Model: "m", Context: 16}, wrows, irows); err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	lines := strings.Split(strings.TrimSuffix(buf.String(), "\n"), "\n")
	if len(lines) != 1+len(wrows)+len(irows) {
		t.Fatalf("seed %d: %d lines, want %d", seed, len(lines), 1+len(wrows)+len(irows))
	}
	for k, line := range lines {
		var row map[string]any
		if err := json.Unmarshal([]byte(line), &row); err != nil {
			t.Fatalf("seed %d line %d: %v", seed, k+1, err)
		}
		want := KindRun
		switch {
		case k > len(wrows):
			want = KindItem
		case k > 0:
			want = KindWindow
		}
		if row["schema"] != ItemsSchema || row["kind"] != want {
			t.Errorf("seed %d line %d: schema %v kind %v, want %s %s", seed, k+1, row["schema"], row["kind"], ItemsSchema, want)
		}
		if k == 0 && (row["items"] != float64(len(irows)) || row["windows"] != float64(len(wrows)) || row["context"] != 16.0) {
			t.Errorf("seed %d: run row %v", seed, row)
		}
	}

	if _, err := ItemRows("t", items, scores[1:]); err == nil {
		t.Error("fewer scores than items: no error")
	}
	bad := append([]ItemScore(nil), scores...)
	bad[0].TokenLogProbs = bad[0].TokenLogProbs[:0]
	if _, err := ItemRows("t", items, bad); err == nil {
		t.Error("a score without per-token log-probabilities: no error")
	}
	if _, err := WindowRows(seqs[:1], wins); err == nil {
		t.Error("more window lists than sequences: no error")
	}
	short := []Sequence{{Name: "a", Tokens: seqs[0].Tokens[:1]}, seqs[1]}
	if _, err := WindowRows(short, wins); err == nil {
		t.Error("windows past the end of their sequence: no error")
	}
	nan := append([]ItemRow(nil), irows...)
	nan[0].LogLik = []float64{math.NaN()}
	if err := WriteItems(&buf, RunRow{}, nil, nan); err == nil || !strings.Contains(err.Error(), "line") {
		t.Errorf("a NaN log-likelihood: error %v, want one naming the line", err)
	}
}
