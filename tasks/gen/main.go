// Command gen writes the stand-in multiple-choice tasks of this folder
// from the public-domain text sample that package data embeds
// (data.SampleFiles): lastword.jsonl, a LAMBADA-style last-word cloze, and
// nextsentence.jsonl, a next-sentence choice. The output depends only on
// the sample and the seed, so running it again gives the same files:
//
//	go run ./tasks/gen -out tasks
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/twell-ai/twell/data"
)

type item struct {
	Context string   `json:"context"`
	Choices []string `json:"choices"`
	Gold    int      `json:"gold"`
}

func main() {
	out := flag.String("out", "tasks", "folder to write lastword.jsonl and nextsentence.jsonl into")
	n := flag.Int("n", 300, "items per task")
	seed := flag.Uint64("seed", 1, "random seed")
	flag.Parse()
	files := data.SampleFiles()
	for _, t := range []struct {
		name  string
		items []item
	}{
		{"lastword.jsonl", lastWord(files, *n, rand.New(rand.NewPCG(*seed, 1)))},
		{"nextsentence.jsonl", nextSentence(files, *n, rand.New(rand.NewPCG(*seed, 2)))},
	} {
		var b strings.Builder
		for _, it := range t.items {
			j, err := json.Marshal(it)
			if err != nil {
				fail(err)
			}
			b.Write(j)
			b.WriteByte('\n')
		}
		if err := os.WriteFile(filepath.Join(*out, t.name), []byte(b.String()), 0o644); err != nil {
			fail(err)
		}
		fmt.Printf("%s: %d items\n", t.name, len(t.items))
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "gen:", err)
	os.Exit(1)
}

// paragraphs returns the paragraphs of a sample file (one per line).
func paragraphs(text string) []string {
	var ps []string
	for _, p := range strings.Split(text, "\n") {
		if p = strings.TrimSpace(p); p != "" {
			ps = append(ps, p)
		}
	}
	return ps
}

var wordRE = regexp.MustCompile(`^[A-Za-z]{3,}$`)

// lastWord makes items from paragraphs of at least 30 words that end in a
// plain word of 3+ letters followed by punctuation: the context is the
// paragraph up to that word, the choices the word and 3 distinct other
// words of the sample (3+ letters, drawn uniformly from its word list),
// each after a space, in random order.
func lastWord(files []data.SampleFile, n int, r *rand.Rand) []item {
	var vocab []string
	seen := map[string]bool{}
	type cand struct{ ctx, word string }
	var cands []cand
	for _, f := range files {
		for _, p := range paragraphs(f.Text) {
			ws := strings.Fields(p)
			for _, w := range ws {
				w = strings.Trim(w, `.,;:!?"'()-_*`)
				if wordRE.MatchString(w) && !seen[strings.ToLower(w)] {
					seen[strings.ToLower(w)] = true
					vocab = append(vocab, strings.ToLower(w))
				}
			}
			if len(ws) < 30 {
				continue
			}
			last := ws[len(ws)-1]
			w := strings.TrimRight(last, `.,;:!?"'`)
			if !wordRE.MatchString(w) || w == last {
				continue
			}
			ctx := strings.Join(ws[:len(ws)-1], " ")
			cands = append(cands, cand{ctx, w})
		}
	}
	r.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
	var items []item
	for _, c := range cands[:min(n, len(cands))] {
		choices := []string{c.word}
		used := map[string]bool{strings.ToLower(c.word): true}
		for len(choices) < 4 {
			w := vocab[r.IntN(len(vocab))]
			if !used[w] {
				used[w] = true
				choices = append(choices, w)
			}
		}
		items = append(items, shuffled(c.ctx, choices, r))
	}
	return items
}

var sentenceEnd = regexp.MustCompile(`[.!?]["']?\s+`)

// sentences splits a paragraph after ".", "!" or "?" (and a closing quote)
// followed by white space.
func sentences(p string) []string {
	var out []string
	start := 0
	for _, loc := range sentenceEnd.FindAllStringIndex(p, -1) {
		out = append(out, strings.TrimSpace(p[start:loc[1]]))
		start = loc[1]
	}
	if rest := strings.TrimSpace(p[start:]); rest != "" {
		out = append(out, rest)
	}
	return out
}

// nextSentence makes items from paragraphs of 3+ sentences of 20 to 200
// characters: the context is the paragraph's first k sentences (k drawn in
// [2, count-1]), the choices the sentence that follows and 3 sentences of
// other sample files, each after a space, in random order.
func nextSentence(files []data.SampleFile, n int, r *rand.Rand) []item {
	type sent struct {
		file int
		text string
	}
	var pool []sent
	type cand struct {
		file int
		ss   []string
	}
	var cands []cand
	for fi, f := range files {
		for _, p := range paragraphs(f.Text) {
			ss := sentences(p)
			ok := len(ss) >= 3
			for _, s := range ss {
				if len(s) < 20 || len(s) > 200 {
					ok = false
				} else {
					pool = append(pool, sent{fi, s})
				}
			}
			if ok {
				cands = append(cands, cand{fi, ss})
			}
		}
	}
	r.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
	var items []item
	for _, c := range cands[:min(n, len(cands))] {
		k := 2 + r.IntN(len(c.ss)-2)
		choices := []string{c.ss[k]}
		used := map[string]bool{c.ss[k]: true}
		for len(choices) < 4 {
			s := pool[r.IntN(len(pool))]
			if s.file != c.file && !used[s.text] {
				used[s.text] = true
				choices = append(choices, s.text)
			}
		}
		items = append(items, shuffled(strings.Join(c.ss[:k], " "), choices, r))
	}
	return items
}

// shuffled returns an item whose gold choice is choices[0], the choices
// in random order, each with a leading space.
func shuffled(ctx string, choices []string, r *rand.Rand) item {
	perm := r.Perm(len(choices))
	it := item{Context: ctx, Choices: make([]string, len(choices))}
	for i, p := range perm {
		it.Choices[p] = " " + choices[i]
		if i == 0 {
			it.Gold = p
		}
	}
	return it
}
