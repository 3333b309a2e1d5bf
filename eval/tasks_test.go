package eval

import (
	"encoding/json"
	"math"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// TestAccuracyOnKnownTask scores a model that prefers one token (fav)
// far above every other, whatever the context: the layers add nothing to
// the residual stream (o_proj and down_proj are zero), every embedding has
// 1 in dimension 0, and the final norm and the LM head read only that
// dimension.
func TestAccuracyOnKnownTask(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig(false)
	w := modelWeights(c, r)
	h := c.HiddenSize
	const fav, other = 5, 9
	for _, l := range w.Layers {
		clear(l.O)
		clear(l.Down)
	}
	for v := range c.VocabSize {
		w.Embed[v*h] = 1
	}
	clear(w.Norm)
	w.Norm[0] = 1
	clear(w.LMHead)
	w.LMHead[fav*h] = 20
	e := newEngine(t, c, w, r)
	// Items 0..5 put the all-fav choice at gold; items 6..9 put it
	// elsewhere: acc = 0.6 exactly. Lengths in characters do not change
	// the argmax when one choice is near 0 and the others far below.
	var items []Encoded
	for i := range 10 {
		it := Encoded{Line: i + 1, Context: []int{1 + i, 2, 3}, Chars: []int{3, 40, 7}}
		it.Conts = [][]int{{other, fav}, {fav, fav, fav}, {other}}
		it.Gold = 1
		if i >= 6 {
			it.Gold = i % 3 / 2 * 2 // 0 or 2: never 1
		}
		items = append(items, it)
	}
	ev, err := New(e, Options{Batch: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	res, scores, err := ev.Score("prefer", items)
	if err != nil {
		t.Fatal(err)
	}
	if res.Acc != 0.6 || res.AccNorm != 0.6 || math.Abs(res.AccStderr-math.Sqrt(0.24/10)) > 1e-15 {
		t.Errorf("seed %d: %+v, want acc and acc_norm 0.6 ± %.4f", seed, res, math.Sqrt(0.24/10))
	}
	for _, s := range scores {
		if s.Pred != 1 || s.PredNorm != 1 || s.LogLik[1] < -1e-3 || s.LogLik[0] > -10 {
			t.Errorf("seed %d: %+v", seed, s)
		}
	}

	// With every logit 0 the model is uniform: a choice's log-likelihood
	// is -k ln V for k tokens. acc picks the fewest tokens; acc_norm the
	// fewest tokens per character.
	clear(w.Norm)
	e = newEngine(t, c, w, r)
	ev2, err := New(e, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer ev2.Close()
	it := Encoded{Line: 1, Context: []int{4}, Conts: [][]int{{1, 2, 3}, {4}, {5, 6}}, Chars: []int{30, 1, 4}, Gold: 1}
	res, scores, err = ev2.Score("uniform", []Encoded{it})
	if err != nil {
		t.Fatal(err)
	}
	lnV := math.Log(float64(c.VocabSize))
	for j, k := range []float64{3, 1, 2} {
		if math.Abs(scores[0].LogLik[j]+k*lnV) > 1e-5 {
			t.Errorf("uniform model, choice %d: log-likelihood %v, want %v", j, scores[0].LogLik[j], -k*lnV)
		}
	}
	if scores[0].Pred != 1 || scores[0].PredNorm != 0 || res.Acc != 1 || res.AccNorm != 0 {
		t.Errorf("uniform model: %+v %+v; want pred 1, pred_norm 0", res, scores[0])
	}
}

func TestReadTasksErrors(t *testing.T) {
	good := `{"context": "a", "choices": [" b", " c"], "gold": 1}`
	cases := []struct{ in, want string }{
		{good + "\n{not json\n", "line 2: not a JSON object"},
		{`{"choices": [" b"], "gold": 0}`, `line 1: field "context" (or "query") is missing`},
		{`{"context": 3, "choices": [" b"], "gold": 0}`, `field "context": want a string`},
		{`{"context": "a", "gold": 0}`, `field "choices" (or "endings") is missing`},
		{`{"context": "a", "choices": [], "gold": 0}`, `field "choices": the list of choices is empty`},
		{`{"context": "a", "choices": [" b", 4], "gold": 0}`, `field "choices": want an array of strings`},
		{`{"context": "a", "choices": [" b", ""], "gold": 0}`, `choice 1 is empty`},
		{`{"context": "a", "choices": [" b"]}`, `field "gold" (or "label") is missing`},
		{`{"context": "a", "choices": [" b", " c"], "gold": 2}`, `field "gold": gold index 2 is outside the 2 choices`},
		{`{"context": "a", "choices": [" b", " c"], "gold": -1}`, `gold index -1 is outside`},
		{`{"context": "a", "choices": [" b", " c"], "gold": 1.5}`, `field "gold": want an integer index`},
		{`{"context": "a", "query": "b", "choices": [" b"], "gold": 0}`, `both "context" and its alias "query"`},
		{"\n\n", "no items"},
		{`[1, 2]`, "line 1: not a JSON object"},
	}
	for _, k := range cases {
		_, err := ReadTasks("t.jsonl", strings.NewReader(k.in))
		if err == nil || !strings.Contains(err.Error(), k.want) || !strings.HasPrefix(err.Error(), "t.jsonl") || strings.Contains(err.Error(), "\n") {
			t.Errorf("%q: error %v, want one line starting with the file and mentioning %q", k.in, err, k.want)
		}
	}
	items, err := ReadTasks("t.jsonl", strings.NewReader(good+"\n\n"+`{"query": "q", "endings": [" x", " y", " z"], "label": "2", "extra": 1}`+"\n"))
	if err != nil {
		t.Fatal(err)
	}
	if len(items) != 2 || items[1].Line != 3 || items[1].Context != "q" || items[1].Gold != 2 || len(items[1].Choices) != 3 {
		t.Errorf("items %+v", items)
	}
}

// TestEncodeBoundary: trailing whitespace of the context moves to the
// continuation, and the continuation is the whole encoding past the
// context's tokens, as lm-eval does; an empty context becomes the prefix
// token.
func TestEncodeBoundary(t *testing.T) {
	// A toy encoder: one token per byte, except "ab" is one token (id 1000).
	enc := func(s string) ([]int, error) {
		var ids []int
		for i := 0; i < len(s); i++ {
			if strings.HasPrefix(s[i:], "ab") {
				ids = append(ids, 1000)
				i++
				continue
			}
			ids = append(ids, int(s[i]))
		}
		return ids, nil
	}
	items := []Item{
		{Line: 1, Context: "xa ", Choices: []string{"b", "bc"}},
		{Line: 2, Context: "", Choices: []string{" é"}},
	}
	got, err := Encode(items, enc, 7, 16)
	if err != nil {
		t.Fatal(err)
	}
	want := []Encoded{
		{Line: 1, Context: []int{'x', 'a'}, Conts: [][]int{{' ', 'b'}, {' ', 'b', 'c'}}, Chars: []int{1, 2}},
		{Line: 2, Context: []int{7}, Conts: [][]int{{' ', 0xc3, 0xa9}}, Chars: []int{2}},
	}
	gj, _ := json.Marshal(got)
	wj, _ := json.Marshal(want)
	if string(gj) != string(wj) {
		t.Errorf("got %s\nwant %s", gj, wj)
	}
	// Without the space, "a"+"b" merge across the boundary: as in lm-eval,
	// the continuation is what the whole encoding has past the context's
	// token count (here the merged token takes the context's last place,
	// so only "q" is scored), and a choice that leaves nothing is an error.
	got, err = Encode([]Item{{Line: 1, Context: "xa", Choices: []string{"bq"}}}, enc, 7, 16)
	if err != nil {
		t.Fatal(err)
	}
	if len(got[0].Context) != 2 || len(got[0].Conts[0]) != 1 || got[0].Conts[0][0] != 'q' {
		t.Errorf("merged boundary: %+v", got[0])
	}
	if _, err := Encode([]Item{{Line: 3, Context: "xa", Choices: []string{"b"}}}, enc, 7, 16); err == nil || !strings.Contains(err.Error(), "line 3: choice 0") {
		t.Errorf("a choice merged away: %v", err)
	}
	// A context too long for the window is cut from the left.
	got, err = Encode([]Item{{Line: 1, Context: "0123456789", Choices: []string{"xyz"}}}, enc, 7, 5)
	if err != nil {
		t.Fatal(err)
	}
	if string(rune(got[0].Context[0])) != "7" || len(got[0].Context) != 3 || got[0].Truncated != 7 {
		t.Errorf("truncated: %+v", got[0])
	}
	if _, err := Encode([]Item{{Line: 4, Context: "", Choices: []string{"b"}}}, enc, -1, 16); err == nil || !strings.Contains(err.Error(), "line 4") {
		t.Errorf("empty context without a prefix token: %v", err)
	}
	if _, err := Encode([]Item{{Line: 5, Context: "a", Choices: []string{"0123456789"}}}, enc, 7, 5); err == nil || !strings.Contains(err.Error(), "line 5: choice 0") {
		t.Errorf("too long a choice: %v", err)
	}
}

// FuzzReadTasks: the parser never panics, and what it accepts is valid
// (choices non-empty, gold in range) and reads back the same after being
// written out again.
func FuzzReadTasks(f *testing.F) {
	f.Add(`{"context": "a", "choices": [" b", " c"], "gold": 1}`)
	f.Add(`{"query": "q", "endings": [" x"], "label": "0"}` + "\n" + `{"context":"","choices":["y"],"gold":0}`)
	f.Add(`{"context": "a", "choices": [], "gold": 0}`)
	f.Add("\n\n{}")
	f.Fuzz(func(t *testing.T, in string) {
		items, err := ReadTasks("fuzz", strings.NewReader(in))
		if err != nil {
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("multi-line error %q", err)
			}
			return
		}
		var sb strings.Builder
		for _, it := range items {
			if len(it.Choices) == 0 || it.Gold < 0 || it.Gold >= len(it.Choices) {
				t.Fatalf("accepted a bad item %+v", it)
			}
			b, _ := json.Marshal(map[string]any{"context": it.Context, "choices": it.Choices, "gold": it.Gold})
			sb.Write(b)
			sb.WriteByte('\n')
		}
		again, err := ReadTasks("again", strings.NewReader(sb.String()))
		if err != nil || len(again) != len(items) {
			t.Fatalf("re-read: %v (%d items, want %d)", err, len(again), len(items))
		}
		for i := range items {
			a, b := items[i], again[i]
			if a.Context != b.Context || a.Gold != b.Gold || strings.Join(a.Choices, "\x00") != strings.Join(b.Choices, "\x00") {
				t.Fatalf("item %d: %+v read back as %+v", i, a, b)
			}
		}
	})
}
