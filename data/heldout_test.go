package data_test

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/data"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/tokenizer"
	"github.com/twell-ai/twell/tokenizer/bpetrain"
)

// randProse returns a random document of words, sentences, line breaks, paragraph breaks and
// some white space that normalization changes.
func randProse(r *rand.Rand) string {
	words := []string{"the", "river", "ran", "under", "a", "bridge", "Über", "café", "e\u0301te\u0301", "1961", "said", "\"yes\"", "stone", "and"}
	var sb strings.Builder
	for i := range 3 + r.IntN(80) {
		if i > 0 {
			switch r.IntN(14) {
			case 0:
				sb.WriteString(".\n\n")
			case 1:
				sb.WriteString("\r\n")
			case 2:
				sb.WriteString(". ")
			case 3:
				sb.WriteString("  \n")
			default:
				sb.WriteString(" ")
			}
		}
		sb.WriteString(words[r.IntN(len(words))])
	}
	return sb.String()
}

// randCorpus writes a random corpus into dir: a folder of text files, a JSONL file, documents
// in memory and a source with a single document, with empty documents and exact duplicates
// (also across sources). It returns the sources and every document written.
func randCorpus(t *testing.T, r *rand.Rand, dir string) ([]data.Source, []string) {
	t.Helper()
	var all []string
	doc := func() string {
		switch {
		case len(all) > 0 && r.IntN(6) == 0:
			return all[r.IntN(len(all))]
		case r.IntN(12) == 0:
			return "\n \t\r\n"
		}
		d := randProse(r)
		all = append(all, d)
		return d
	}
	write := func(path, text string) {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var sources []data.Source
	books := filepath.Join(dir, "books")
	for i := range 1 + r.IntN(12) {
		write(filepath.Join(books, fmt.Sprintf("part%d", r.IntN(3)), fmt.Sprintf("b%02d.txt", i)), doc())
	}
	sources = append(sources, data.Source{Name: "books", Paths: []string{books}})
	var jl bytes.Buffer
	for range 1 + r.IntN(25) {
		fmt.Fprintf(&jl, "{\"text\": %q}\n", doc())
	}
	write(filepath.Join(dir, "web.jsonl"), jl.String())
	sources = append(sources, data.Source{Name: "web", Paths: []string{filepath.Join(dir, "web.jsonl")}})
	mem := data.Source{Name: "mem"}
	for range 1 + r.IntN(8) {
		mem.Docs = append(mem.Docs, doc())
	}
	sources = append(sources, mem)
	one := randProse(r) + ".\n\n" + randProse(r) + ".\n\n" + randProse(r)
	write(filepath.Join(dir, "one.txt"), one)
	all = append(all, one)
	sources = append(sources, data.Source{Name: "one", Paths: []string{filepath.Join(dir, "one.txt")}})
	r.Shuffle(len(sources), func(i, j int) { sources[i], sources[j] = sources[j], sources[i] })
	return sources, all
}

// TestHeldOutMatchesBuild checks that HeldOut lists exactly what Build writes to the validation
// shards: per source, the held-out documents tokenized with Build's tokenizer give the
// validation token count of index.json and the very tokens of the shards.
func TestHeldOutMatchesBuild(t *testing.T) {
	r, seed := testutil.Rand(t)
	for trial := range 6 {
		dir := t.TempDir()
		sources, texts := randCorpus(t, r, dir)
		for i := range texts {
			texts[i] = data.Normalize(texts[i])
		}
		m, err := bpetrain.Train(texts, bpetrain.Config{VocabSize: 256 + 1 + r.IntN(200)})
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		js, err := m.JSON()
		if err != nil {
			t.Fatal(err)
		}
		tk, err := tokenizer.Parse(js)
		if err != nil {
			t.Fatal(err)
		}
		eos, _ := tk.EOS()
		enc := sampleEncoder{tk, eos}
		valFrac := []float64{0, data.DefaultValFrac, 0.2, 0.5, 0.9}[r.IntN(5)]
		out := filepath.Join(dir, "shards")
		idx, err := data.Build(out, data.BuildConfig{Sources: sources, Encoder: enc, ValFrac: valFrac, ShardTokens: 20 + r.IntN(300), Workers: 1 + r.IntN(3)})
		if err != nil {
			t.Fatalf("seed %d trial %d: Build: %v", seed, trial, err)
		}
		held, err := data.HeldOut(sources, valFrac)
		if err != nil {
			t.Fatalf("seed %d trial %d: HeldOut: %v", seed, trial, err)
		}
		ds, err := data.Open(out)
		if err != nil {
			t.Fatal(err)
		}
		next := 0
		for _, st := range idx.Sources {
			var want []int32
			docs := 0
			for ; next < len(held) && held[next].Source == st.Name; next++ {
				h := held[next]
				if h.Text != data.Normalize(h.Text) || h.Text == "" {
					t.Errorf("seed %d trial %d: held-out %s is not a normalized document: %q", seed, trial, h.Name, h.Text)
				}
				ids, err := enc.Encode(h.Text)
				if err != nil {
					t.Fatal(err)
				}
				for _, id := range ids {
					want = append(want, int32(id))
				}
				want = append(want, int32(eos))
				docs++
			}
			if int64(len(want)) != st.ValTokens || docs != st.ValDocuments {
				t.Fatalf("seed %d trial %d (val-frac %v): source %s: held-out documents make %d documents, %d tokens; index.json says %d, %d",
					seed, trial, valFrac, st.Name, docs, len(want), st.ValDocuments, st.ValTokens)
			}
			if len(want) == 0 {
				continue
			}
			it, err := ds.Val(st.Name, 1, len(want)-1)
			if err != nil {
				t.Fatal(err)
			}
			got, _, err := it.Next(nil)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, want) {
				t.Fatalf("seed %d trial %d: source %s: the held-out documents tokenize to other tokens than the validation shards", seed, trial, st.Name)
			}
		}
		if next != len(held) {
			t.Errorf("seed %d trial %d: held-out documents out of source order or of unknown sources: %+v", seed, trial, held[next])
		}
		ds.Close()
	}
}

func TestHeldOutSingleDocumentAndErrors(t *testing.T) {
	doc := "First paragraph.\n\nSecond paragraph.\n\nThird one, the last."
	held, err := data.HeldOut([]data.Source{{Name: "one", Docs: []string{doc}}}, 0.2)
	if err != nil {
		t.Fatal(err)
	}
	want := []data.HeldOutDoc{{Source: "one", Name: "one[0]", Text: "Third one, the last.", Part: true}}
	if !slices.Equal(held, want) {
		t.Errorf("HeldOut of one document = %+v, want %+v", held, want)
	}
	held, err = data.HeldOut([]data.Source{{Name: "s", Docs: []string{"a", "b", "a", " ", "c", "d"}}}, 0.5)
	want = []data.HeldOutDoc{{Source: "s", Name: "s[4]", Text: "c"}, {Source: "s", Name: "s[5]", Text: "d"}}
	if err != nil || !slices.Equal(held, want) {
		t.Errorf("HeldOut = %+v, %v; want %+v", held, err, want)
	}
	if held, err := data.HeldOut([]data.Source{{Name: "s", Docs: []string{"a", "b"}}}, 0); err != nil || len(held) != 0 {
		t.Errorf("val-frac 0: %+v, %v", held, err)
	}
	missing := filepath.Join(t.TempDir(), "missing")
	for _, c := range []struct {
		name    string
		sources []data.Source
		frac    float64
		want    string
	}{
		{"missing path", []data.Source{{Name: "m", Paths: []string{missing}}}, 0.1, missing},
		{"no sources", nil, 0.1, "empty corpus"},
		{"bad fraction", []data.Source{{Name: "s", Docs: []string{"a"}}}, 1, "validation fraction"},
		{"all empty", []data.Source{{Name: "s", Docs: []string{" ", ""}}}, 0.1, "empty corpus"},
	} {
		if _, err := data.HeldOut(c.sources, c.frac); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: want an error with %q, got %v", c.name, c.want, err)
		}
	}
}
