package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/data"
	"github.com/twell-ai/twell/internal/testutil"
)

func TestCorpusParagraphs(t *testing.T) {
	s := func(i int) string { return fmt.Sprintf("Sentence number %d is here.", i) }
	var long []string
	for i := range 13 {
		long = append(long, s(i))
	}
	cases := []struct {
		name    string
		text    string
		entries bool
		want    []string
	}{
		{"blocks joined", "One line,\n    and its continuation.\n\nSecond  block.\n", false,
			[]string{"One line, and its continuation.", "Second block."}},
		{"headings dropped", "[BOOK I.  INSCRIPTIONS]\n\n}  A Title!\n\nWalt Whitman\n\n     3\nWhat do you hear?\n\nA verse,\nand more", false,
			[]string{"What do you hear?", "A verse, and more"}},
		{"running text cut", strings.Join(long, " "), false, []string{
			strings.Join(long[0:5], " "), strings.Join(long[5:10], " "), strings.Join(long[10:13], " "),
		}},
		{"one sentence a line", strings.Join(long[:11], "\n"), false, []string{
			strings.Join(long[0:5], " "), strings.Join(long[5:11], " "),
		}},
		{"short block kept", strings.Join(long[:10], "\n"), false, []string{strings.Join(long[:10], " ")}},
		{"entries", "dog, domestic dog: a member of the genus Canis; \"the dog barked\"\n\nrun:  move  fast\n", true,
			[]string{"dog, domestic dog: a member of the genus Canis; \"the dog barked\"", "run: move fast"}},
	}
	for _, c := range cases {
		if got := corpusParagraphs(c.text, c.entries); !slices.Equal(got, c.want) {
			t.Errorf("%s: got\n%q\nwant\n%q", c.name, got, c.want)
		}
	}
}

// tag returns letters that name document i of source s, so that every word
// of the test corpus says which document it comes from.
func tag(s, i int) string {
	return "q" + string(rune('a'+s)) + string(rune('a'+i/26)) + string(rune('a'+i%26))
}

func randSentence(r *rand.Rand, tg string) string {
	base := []string{"river", "stone", "bridge", "lantern", "harbor", "meadow", "engine", "letter", "winter", "garden"}
	var ws []string
	for range 5 + r.IntN(8) {
		ws = append(ws, base[r.IntN(len(base))]+tg)
	}
	ws[0] = strings.ToUpper(ws[0][:1]) + ws[0][1:]
	return strings.Join(ws, " ") + []string{".", "!", "?", "."}[r.IntN(4)]
}

// writeCorpus writes a corpus folder like scripts/fetch-corpus makes: a
// MANIFEST and three sources, prose in paragraphs, speeches on one line,
// and dictionary entries one a line.
func writeCorpus(t *testing.T, r *rand.Rand, dir string) {
	t.Helper()
	write := func(path, text string) {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(dir, "MANIFEST"), "# folder\tregistry\tpackage\nprose\tnpm\tx\nspeech\tnpm\ty\ndict\tdeb\tz\n")
	for i := range 10 + r.IntN(10) {
		var paras []string
		for range 3 + r.IntN(6) {
			var ss []string
			for range 1 + r.IntN(8) {
				ss = append(ss, randSentence(r, tag(0, i)))
			}
			paras = append(paras, strings.Join(ss, "\n"))
		}
		write(filepath.Join(dir, "prose", fmt.Sprintf("p%02d.txt", i)), "A Title\n\n"+strings.Join(paras, "\n\n")+"\n")
	}
	for i := range 10 + r.IntN(10) {
		var ss []string
		for range 20 + r.IntN(30) {
			ss = append(ss, randSentence(r, tag(1, i)))
		}
		write(filepath.Join(dir, "speech", fmt.Sprintf("s%02d.txt", i)), strings.Join(ss, " ")+"\n")
	}
	for i := range 5 + r.IntN(5) {
		var lines []string
		for range 20 {
			tg := tag(2, i)
			lines = append(lines, fmt.Sprintf("word%s, other%s: %s; \"%s\"", tg, tg, strings.TrimSuffix(randSentence(r, tg), "."), randSentence(r, tg)))
		}
		write(filepath.Join(dir, "dict", fmt.Sprintf("d%02d.txt", i)), strings.Join(lines, "\n")+"\n")
	}
}

func readItems(t *testing.T, path string) []item {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var items []item
	for _, l := range strings.Split(strings.TrimSuffix(string(b), "\n"), "\n") {
		var it item
		if err := json.Unmarshal([]byte(l), &it); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		items = append(items, it)
	}
	return items
}

// TestCorpusTasks makes the tasks from a random corpus and checks that they
// are well formed, made only of held-out text, and the same on a second run.
func TestCorpusTasks(t *testing.T) {
	r, seed := testutil.Rand(t)
	dir := t.TempDir()
	corpus := filepath.Join(dir, "corpus")
	writeCorpus(t, r, corpus)
	const valFrac = 0.2
	sources, err := data.SourcesFromPaths([]string{corpus})
	if err != nil {
		t.Fatal(err)
	}
	held, err := data.HeldOut(sources, valFrac)
	if err != nil {
		t.Fatal(err)
	}
	heldWords := map[string]bool{}
	for _, h := range held {
		for _, w := range strings.Fields(h.Text) {
			heldWords[strings.Trim(w, `.,;:!?"`)] = true
		}
	}
	n := 5 + r.IntN(30)
	var outs [2][]byte
	for run2 := range 2 {
		out := filepath.Join(dir, fmt.Sprintf("out%d", run2))
		if err := os.Mkdir(out, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := run(out, n, seed, corpus, valFrac, "dict"); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		for _, name := range []string{"corpus-lastword.jsonl", "corpus-nextsentence.jsonl"} {
			items := readItems(t, filepath.Join(out, name))
			if len(items) == 0 || len(items) > n {
				t.Fatalf("seed %d: %s has %d items, want 1 to %d", seed, name, len(items), n)
			}
			for _, it := range items {
				if len(it.Choices) != 4 || it.Gold < 0 || it.Gold >= 4 {
					t.Fatalf("seed %d: %s: bad item %+v", seed, name, it)
				}
				seen := map[string]bool{}
				for _, c := range it.Choices {
					if !strings.HasPrefix(c, " ") || seen[strings.ToLower(c)] {
						t.Fatalf("seed %d: %s: bad choices %q", seed, name, it.Choices)
					}
					seen[strings.ToLower(c)] = true
				}
				text := it.Context + " " + strings.Join(it.Choices, " ")
				if name == "corpus-nextsentence.jsonl" && strings.Contains(text, ":") {
					t.Fatalf("seed %d: a next-sentence item uses a dictionary entry: %+v", seed, it)
				}
				for _, w := range strings.Fields(text) {
					if w = strings.Trim(w, `.,;:!?"`); !heldWords[w] && !heldWords[strings.ToUpper(w[:1])+w[1:]] {
						t.Fatalf("seed %d: %s: word %q is not from the held-out documents: %+v", seed, name, w, it)
					}
				}
			}
		}
		var all bytes.Buffer
		for _, name := range []string{"corpus-lastword.jsonl", "corpus-nextsentence.jsonl"} {
			b, _ := os.ReadFile(filepath.Join(out, name))
			all.Write(b)
		}
		outs[run2] = all.Bytes()
	}
	if !bytes.Equal(outs[0], outs[1]) {
		t.Errorf("seed %d: two runs gave different files", seed)
	}
}

func TestRunErrors(t *testing.T) {
	out := t.TempDir()
	missing := filepath.Join(out, "no-corpus")
	empty := filepath.Join(out, "empty")
	os.Mkdir(empty, 0o755)
	short := filepath.Join(out, "short.txt")
	os.WriteFile(short, []byte("Too short.\n\nTo make items."), 0o644)
	for _, c := range []struct {
		name   string
		out    string
		n      int
		corpus string
		frac   float64
		want   string
	}{
		{"missing corpus", out, 10, missing, 0.01, missing},
		{"empty corpus", out, 10, empty, 0.01, "no .txt, .md or .jsonl files"},
		{"bad fraction", out, 10, short, 1, "validation fraction"},
		{"no held-out text", out, 10, short, 0, "no held-out documents"},
		{"no candidates", out, 10, short, 0.5, "no items"},
		{"bad n", out, 0, "", 0.01, "-n 0"},
		{"missing out", missing, 10, "", 0.01, missing},
	} {
		if err := run(c.out, c.n, 1, c.corpus, c.frac, "wordnet"); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: want an error with %q, got %v", c.name, c.want, err)
		}
	}
}
