package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twell-ai/twell/eval"
	"github.com/twell-ai/twell/internal/testutil"
)

// randomWords returns n words drawn from a small vocabulary, joined by
// spaces.
func randomWords(r *rand.Rand, n int) string {
	vocab := strings.Fields("the cat sat on a mat while rain fell over quiet hills and old ships sailed far away from home to find new land")
	w := make([]string, n)
	for i := range w {
		w[i] = vocab[r.IntN(len(vocab))]
	}
	return strings.Join(w, " ")
}

// writeRandomTasks writes n random items to path: contexts of 0 to 80
// words, the first of 70 to 80 (the tiny checkpoint's 64 positions cut
// the long ones), 1 to 4 choices of 1 to 4 words.
func writeRandomTasks(t *testing.T, r *rand.Rand, path string, n int) {
	t.Helper()
	var b strings.Builder
	for i := range n {
		k := 1 + r.IntN(4)
		words := r.IntN(81)
		if i == 0 {
			words = 70 + r.IntN(11)
		}
		choices := make([]string, k)
		for j := range choices {
			choices[j] = " " + randomWords(r, 1+r.IntN(4))
		}
		line, err := json.Marshal(map[string]any{"context": randomWords(r, words), "choices": choices, "gold": r.IntN(k)})
		if err != nil {
			t.Fatal(err)
		}
		b.Write(line)
		b.WriteByte('\n')
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestEvalItems: -items writes a run row, then a row per perplexity window
// and per task item, every row with the schema. The item rows of each task
// give the report's acc and acc_norm and its count of truncated contexts;
// each choice's log-likelihood is the sum of its token log-probabilities,
// and the scored ids fit the window; the window rows' NLLs add up to each
// source's nats and their token counts to its tokens.
func TestEvalItems(t *testing.T) {
	r, seed := testutil.Rand(t)
	dir := tinyCheckpoint(t)
	tmp := t.TempDir()
	text := filepath.Join(tmp, "a.txt")
	if err := os.WriteFile(text, []byte(randomWords(r, 20+r.IntN(200))), 0o644); err != nil {
		t.Fatal(err)
	}
	taskFiles := []string{filepath.Join(tmp, "t1.jsonl"), filepath.Join(tmp, "t2.jsonl")}
	lines := map[string]int{}
	for _, p := range taskFiles {
		n := 3 + r.IntN(10)
		writeRandomTasks(t, r, p, n)
		lines[p] = n
	}
	js, items := filepath.Join(tmp, "r.json"), filepath.Join(tmp, "items.jsonl")
	batch, stride, path := 1+r.IntN(4), 1+r.IntN(63), []string{"auto", "sparse", "dense"}[r.IntN(3)]
	args := []string{"eval", "-model", dir, "-device", "cpu", "-text", text, "-tasks", taskFiles[0], "-tasks", taskFiles[1],
		"-batch", fmt.Sprint(batch), "-stride", fmt.Sprint(stride), "-mlp", path, "-json", js, "-items", items}
	var out, errb bytes.Buffer
	if code := run(args, &out, &errb); code != 0 {
		t.Fatalf("seed %d: %v: exit %d: %s", seed, args, code, errb.String())
	}
	var rep eval.Report
	testutil.ReadJSON(t, js, &rep)

	f, err := os.Open(items)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<24)
	var runRow eval.RunRow
	var windows []eval.WindowRow
	var rows []eval.ItemRow
	for n := 1; sc.Scan(); n++ {
		var head struct{ Schema, Kind string }
		if err := json.Unmarshal(sc.Bytes(), &head); err != nil {
			t.Fatalf("seed %d: %s line %d: %v", seed, items, n, err)
		}
		if head.Schema != eval.ItemsSchema {
			t.Fatalf("seed %d: line %d: schema %q, want %q", seed, n, head.Schema, eval.ItemsSchema)
		}
		var err error
		switch {
		case n == 1 && head.Kind == eval.KindRun:
			err = json.Unmarshal(sc.Bytes(), &runRow)
		case n > 1 && head.Kind == eval.KindWindow && len(rows) == 0:
			var w eval.WindowRow
			err = json.Unmarshal(sc.Bytes(), &w)
			windows = append(windows, w)
		case n > 1 && head.Kind == eval.KindItem:
			var it eval.ItemRow
			err = json.Unmarshal(sc.Bytes(), &it)
			rows = append(rows, it)
		default:
			t.Fatalf("seed %d: line %d: kind %q out of place", seed, n, head.Kind)
		}
		if err != nil {
			t.Fatalf("seed %d: line %d: %v", seed, n, err)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if runRow.Context != rep.Context || runRow.Stride != stride || runRow.Batch != batch || runRow.HiddenAct != "relu" || !runRow.MLPGated ||
		runRow.MLPPath != path || rep.MLPPath != path ||
		runRow.Items != len(rows) || runRow.Windows != len(windows) || runRow.Device != "cpu" {
		t.Errorf("seed %d: run row %+v (%d window and %d item rows), report context %d", seed, runRow, len(windows), len(rows), rep.Context)
	}

	// Items: one row per line of each file, in order, agreeing with the report.
	byTask := map[string][]eval.ItemRow{}
	for _, it := range rows {
		byTask[it.Task] = append(byTask[it.Task], it)
	}
	if len(rep.Tasks) != len(taskFiles) {
		t.Fatalf("seed %d: %d task results", seed, len(rep.Tasks))
	}
	for _, res := range rep.Tasks {
		got := byTask[res.Name]
		if len(got) != lines[res.Name] || res.Items != len(got) {
			t.Fatalf("seed %d: %s: %d rows, %d items in the report, %d lines in the file", seed, res.Name, len(got), res.Items, lines[res.Name])
		}
		acc, accNorm, truncated := 0, 0, 0
		for k, it := range got {
			if it.Line != k+1 {
				t.Errorf("seed %d: %s: row %d has line %d", seed, res.Name, k, it.Line)
			}
			if len(it.LogLik) == 0 || len(it.Tokens) != len(it.LogLik) || len(it.Continuations) != len(it.LogLik) ||
				len(it.TokenLogProbs) != len(it.LogLik) || len(it.Chars) != len(it.LogLik) || it.Gold < 0 || it.Gold >= len(it.LogLik) ||
				len(it.Context) == 0 || it.Truncated != (it.TruncatedTokens > 0) {
				t.Fatalf("seed %d: %s line %d: malformed row %+v", seed, res.Name, it.Line, it)
			}
			pred, predNorm := 0, 0
			for j, ll := range it.LogLik {
				cont := it.Continuations[j]
				if it.Tokens[j] != len(cont) || len(it.TokenLogProbs[j]) != len(cont) || len(it.Context)+len(cont)-1 > rep.Context {
					t.Errorf("seed %d: %s line %d choice %d: %d tokens, %d ids, %d log-probabilities after %d of context (window %d)",
						seed, res.Name, it.Line, j, it.Tokens[j], len(cont), len(it.TokenLogProbs[j]), len(it.Context), rep.Context)
				}
				var sum float64
				for _, lp := range it.TokenLogProbs[j] {
					sum += lp
				}
				if math.Abs(sum-ll) > 1e-12*math.Max(1, math.Abs(ll)) || ll > 0 {
					t.Errorf("seed %d: %s line %d choice %d: log-likelihood %v, token log-probabilities sum to %v", seed, res.Name, it.Line, j, ll, sum)
				}
				if ll > it.LogLik[pred] {
					pred = j
				}
				if ll/float64(it.Chars[j]) > it.LogLik[predNorm]/float64(it.Chars[predNorm]) {
					predNorm = j
				}
			}
			if pred != it.Pred || predNorm != it.PredNorm {
				t.Errorf("seed %d: %s line %d: pred %d pred_norm %d, the log-likelihoods give %d and %d", seed, res.Name, it.Line, it.Pred, it.PredNorm, pred, predNorm)
			}
			if it.Pred == it.Gold {
				acc++
			}
			if it.PredNorm == it.Gold {
				accNorm++
			}
			if it.Truncated {
				truncated++
			}
		}
		n := float64(len(got))
		if math.Abs(float64(acc)/n-res.Acc) > 1e-12 || math.Abs(float64(accNorm)/n-res.AccNorm) > 1e-12 || truncated != res.Truncated || !got[0].Truncated {
			t.Errorf("seed %d: %s: rows give acc %v acc_norm %v and %d truncated (the first, of 70 or more words: %v); the report %v, %v and %d",
				seed, res.Name, float64(acc)/n, float64(accNorm)/n, truncated, got[0].Truncated, res.Acc, res.AccNorm, res.Truncated)
		}
	}

	// Windows: the report's perplexity rows, window by window.
	if len(rep.Perplexity) != 2 {
		t.Fatalf("seed %d: perplexity rows %+v", seed, rep.Perplexity)
	}
	p := rep.Perplexity[0]
	var nats float64
	var scored int64
	next := 1
	for k, w := range windows {
		if w.Source != p.Name || w.Seq != 0 || w.Window != k || len(w.Tokens) != w.End-w.Start || w.End-w.Start > rep.Context ||
			w.Score != next || w.Score <= w.Start || w.Scored != w.End-w.Score || len(w.TokenLogProbs) != w.Scored {
			t.Fatalf("seed %d: window row %d: %+v (the next token to score is %d)", seed, k, w, next)
		}
		if k > 0 && w.Start != windows[k-1].Start+stride {
			t.Errorf("seed %d: window %d starts at %d, the one before at %d, stride %d", seed, k, w.Start, windows[k-1].Start, stride)
		}
		next = w.End
		nats += w.NLL
		scored += int64(w.Scored)
	}
	if scored != p.Tokens || int64(len(windows)) != p.Windows || math.Abs(nats-p.Nats) > 1e-9*p.Nats {
		t.Errorf("seed %d: windows score %d tokens in %d windows, %v nats; the report %d tokens in %d windows, %v nats", seed, scored, len(windows), nats, p.Tokens, p.Windows, p.Nats)
	}

}
