// Command gen writes the stand-in multiple-choice tasks of this folder:
// lastword.jsonl, a LAMBADA-style last-word cloze, and nextsentence.jsonl,
// a next-sentence choice, made from the public-domain text sample that
// package data embeds (data.SampleFiles):
//
//	go run ./tasks/gen -out tasks
//
// With -corpus it makes the same two tasks from the held-out documents of a
// corpus folder instead (the documents that `twell data` keeps out of the
// training shards, listed by data.HeldOut with the same -val-frac), and
// writes them as corpus-lastword.jsonl and corpus-nextsentence.jsonl:
//
//	go run ./tasks/gen -corpus corpus -out tasks
//
// The output depends only on the text and the seed, so running it again
// gives the same files.
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

// doc is one document that items are made from: its paragraphs, in order.
// Next-sentence distractors come from documents other than the item's.
type doc struct {
	name  string
	paras []string
	// entries: the paragraphs are dictionary entries, not running text, so
	// they give last-word items and words but no sentences.
	entries bool
}

func main() {
	out := flag.String("out", "tasks", "folder to write the task files into")
	n := flag.Int("n", 300, "items per task (fewer when there are fewer candidates)")
	seed := flag.Uint64("seed", 1, "random seed")
	corpus := flag.String("corpus", "", "make the tasks from the held-out documents of this corpus folder (as `twell data` splits it) instead of the bundled sample")
	valFrac := flag.Float64("val-frac", data.DefaultValFrac, "with -corpus: the validation fraction that `twell data` was given")
	entries := flag.String("entries", "wordnet", "with -corpus: comma-separated sources whose every line is an entry of its own (one paragraph per line)")
	flag.Usage = func() {
		fmt.Fprintln(flag.CommandLine.Output(), "Usage: go run ./tasks/gen [-corpus DIR [-val-frac F]] [-out DIR] [-n N] [-seed S]")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() > 0 {
		fail(fmt.Errorf("unexpected arguments %q (flags only)", flag.Args()))
	}
	if err := run(*out, *n, *seed, *corpus, *valFrac, *entries); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "gen:", err)
	os.Exit(1)
}

func run(out string, n int, seed uint64, corpus string, valFrac float64, entries string) error {
	if n < 1 {
		return fmt.Errorf("-n %d: want at least 1 item", n)
	}
	if st, err := os.Stat(out); err != nil {
		return fmt.Errorf("-out: %w", err)
	} else if !st.IsDir() {
		return fmt.Errorf("-out %s: not a folder", out)
	}
	prefix := ""
	var docs []doc
	if corpus == "" {
		docs = sampleDocs()
	} else {
		var err error
		if docs, err = corpusDocs(corpus, valFrac, entries); err != nil {
			return err
		}
		prefix = "corpus-"
	}
	lw, lwCands := lastWord(docs, n, rand.New(rand.NewPCG(seed, 1)))
	ns, nsCands := nextSentence(docs, n, rand.New(rand.NewPCG(seed, 2)))
	tasks := []struct {
		name  string
		items []item
		cands int
	}{
		{prefix + "lastword.jsonl", lw, lwCands},
		{prefix + "nextsentence.jsonl", ns, nsCands},
	}
	for _, t := range tasks {
		switch {
		case t.cands == 0:
			return fmt.Errorf("%s: no items: no paragraph of the text fits the task", t.name)
		case len(t.items) == 0:
			return fmt.Errorf("%s: no items: %d candidates, but too few other words or sentences for distractors", t.name, t.cands)
		}
	}
	for _, t := range tasks {
		var b strings.Builder
		for _, it := range t.items {
			j, err := json.Marshal(it)
			if err != nil {
				return err
			}
			b.Write(j)
			b.WriteByte('\n')
		}
		if err := os.WriteFile(filepath.Join(out, t.name), []byte(b.String()), 0o644); err != nil {
			return err
		}
		fmt.Printf("%s: %d items (of %d candidates)\n", t.name, len(t.items), t.cands)
	}
	return nil
}

// sampleDocs returns the sample files, each line that is not blank a
// paragraph.
func sampleDocs() []doc {
	var docs []doc
	for _, f := range data.SampleFiles() {
		var ps []string
		for _, p := range strings.Split(f.Text, "\n") {
			if p = strings.TrimSpace(p); p != "" {
				ps = append(ps, p)
			}
		}
		docs = append(docs, doc{name: f.Name, paras: ps})
	}
	return docs
}

// corpusDocs returns the held-out documents of a corpus folder or file,
// with its sources named as `twell data` names them, split into paragraphs
// by corpusParagraphs.
func corpusDocs(dir string, valFrac float64, entries string) ([]doc, error) {
	if _, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("-corpus: %w", err)
	}
	sources, err := data.SourcesFromPaths([]string{dir})
	if err != nil {
		return nil, fmt.Errorf("-corpus %s: %w", dir, err)
	}
	held, err := data.HeldOut(sources, valFrac)
	if err != nil {
		return nil, fmt.Errorf("-corpus %s: %w", dir, err)
	}
	if len(held) == 0 {
		return nil, fmt.Errorf("-corpus %s: no held-out documents (-val-frac %v)", dir, valFrac)
	}
	isEntries := map[string]bool{}
	for _, s := range strings.Split(entries, ",") {
		if s = strings.TrimSpace(s); s != "" {
			isEntries[s] = true
		}
	}
	var docs []doc
	for _, h := range held {
		e := isEntries[h.Source]
		docs = append(docs, doc{name: h.Name, paras: corpusParagraphs(h.Text, e), entries: e})
	}
	return docs, nil
}

// A block of more than maxParaSentences sentences is taken to be running
// text without paragraph marks and cut into pieces of pieceSentences.
const (
	maxParaSentences = 10
	pieceSentences   = 5
)

var (
	endsSentence = regexp.MustCompile(`[.!?]["'”’)\]]*$`)
	// markLine matches a section number alone on its line, and a poem title
	// (marked with "}" in the Gutenberg texts of the NLTK selection).
	markLine = regexp.MustCompile(`^\s*([0-9]+\.?|\}.*)\s*$`)
)

// corpusParagraphs splits a corpus document into paragraphs, each with its
// white space runs made single spaces. With entries, every line that is
// not blank is a paragraph (a dictionary entry). Otherwise paragraphs are
// the blocks between blank lines, their lines joined (verse stanzas, prose
// paragraphs); section numbers and titles marked with "}" count as blank
// lines; a block of one line that does not end a sentence (a title or
// heading) is dropped; and a block of more than maxParaSentences
// sentences, which is running text without paragraph marks (a speech on
// one line, a text with one sentence a line), is cut into pieces of
// pieceSentences consecutive sentences, a remainder of one or two
// sentences joining the piece before.
func corpusParagraphs(text string, entries bool) []string {
	var out []string
	if entries {
		for _, l := range strings.Split(text, "\n") {
			if p := strings.Join(strings.Fields(l), " "); p != "" {
				out = append(out, p)
			}
		}
		return out
	}
	var block []string
	flush := func() {
		lines := block
		block = nil
		p := strings.Join(strings.Fields(strings.Join(lines, " ")), " ")
		if p == "" || len(lines) == 1 && !endsSentence.MatchString(p) {
			return
		}
		ss := sentences(p)
		if len(ss) <= maxParaSentences {
			out = append(out, p)
			return
		}
		for i := 0; i < len(ss); {
			j := i + pieceSentences
			if len(ss)-j < 3 {
				j = len(ss)
			}
			out = append(out, strings.Join(ss[i:j], " "))
			i = j
		}
	}
	for _, l := range strings.Split(text, "\n") {
		if strings.TrimSpace(l) == "" || markLine.MatchString(l) {
			flush()
			continue
		}
		block = append(block, l)
	}
	flush()
	return out
}

var wordRE = regexp.MustCompile(`^[A-Za-z]{3,}$`)

// lastWord makes items from paragraphs of at least 30 words that end in a
// plain word of 3+ letters followed by punctuation: the context is the
// paragraph up to that word, the choices the word and 3 distinct other
// words of the text (3+ letters, drawn uniformly from its word list),
// each after a space, in random order. It also returns the number of
// candidates.
func lastWord(docs []doc, n int, r *rand.Rand) ([]item, int) {
	var vocab []string
	seen := map[string]bool{}
	type cand struct{ ctx, word string }
	var cands []cand
	for _, d := range docs {
		for _, p := range d.paras {
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
	if len(vocab) < 4 { // the gold word and 3 others
		return nil, len(cands)
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
	return items, len(cands)
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
// other documents, each after a space, in random order. A candidate with
// fewer than 3 such sentences to choose from is skipped. Documents of
// dictionary entries give neither candidates nor sentences. It also returns
// the number of candidates.
func nextSentence(docs []doc, n int, r *rand.Rand) ([]item, int) {
	type sent struct {
		doc  int
		text string
	}
	var pool []sent
	type cand struct {
		doc int
		ss  []string
	}
	var cands []cand
	for di, d := range docs {
		if d.entries {
			continue
		}
		for _, p := range d.paras {
			ss := sentences(p)
			ok := len(ss) >= 3
			for _, s := range ss {
				if len(s) < 20 || len(s) > 200 {
					ok = false
				} else {
					pool = append(pool, sent{di, s})
				}
			}
			if ok {
				cands = append(cands, cand{di, ss})
			}
		}
	}
	// others(d, gold) counts the distinct pool sentences of documents other
	// than d, not counting gold: the distractors there are to draw from.
	docsOf := map[string]map[int]bool{}
	for _, s := range pool {
		if docsOf[s.text] == nil {
			docsOf[s.text] = map[int]bool{}
		}
		docsOf[s.text][s.doc] = true
	}
	onlyIn := make([]int, len(docs))
	for _, ds := range docsOf {
		if len(ds) == 1 {
			for d := range ds {
				onlyIn[d]++
			}
		}
	}
	others := func(d int, gold string) int {
		k := len(docsOf) - onlyIn[d]
		if len(docsOf[gold]) > 1 { // gold is also a sentence of another document
			k--
		}
		return k
	}
	r.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
	var items []item
	for _, c := range cands {
		if len(items) == n {
			break
		}
		k := 2 + r.IntN(len(c.ss)-2)
		if others(c.doc, c.ss[k]) < 3 {
			continue
		}
		choices := []string{c.ss[k]}
		used := map[string]bool{c.ss[k]: true}
		for len(choices) < 4 {
			s := pool[r.IntN(len(pool))]
			if s.doc != c.doc && !used[s.text] {
				used[s.text] = true
				choices = append(choices, s.text)
			}
		}
		items = append(items, shuffled(strings.Join(c.ss[:k], " "), choices, r))
	}
	return items, len(cands)
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
