package data

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unicode"

	"golang.org/x/text/unicode/norm"

	"github.com/twell-ai/twell/internal/testutil"
)

// byteEncoder is a test tokenizer: one token per byte, EOS = 256.
type byteEncoder struct{ fail string }

func (e byteEncoder) Encode(s string) ([]int, error) {
	if e.fail != "" && strings.Contains(s, e.fail) {
		return nil, fmt.Errorf("cannot encode %q", e.fail)
	}
	t := make([]int, len(s))
	for i := 0; i < len(s); i++ {
		t[i] = int(s[i])
	}
	return t, nil
}
func (byteEncoder) VocabSize() int { return 257 }
func (byteEncoder) EOS() int       { return 256 }

// decodeBytes turns byteEncoder tokens back into documents.
func decodeBytes(toks []int32) []string {
	var docs []string
	var cur []byte
	for _, t := range toks {
		if t == 256 {
			docs = append(docs, string(cur))
			cur = nil
			continue
		}
		cur = append(cur, byte(t))
	}
	if cur != nil {
		docs = append(docs, string(cur)+"<no eos>")
	}
	return docs
}

func TestNormalize(t *testing.T) {
	cases := []struct{ in, want string }{
		{"", ""},
		{"  \n\t\n", ""},
		{"a\r\nb\rc\n", "a\nb\nc"},
		{"\uFEFFhello  \nworld\t \n\n\n", "hello\nworld"},
		{"\n\n  indented\n\nkept  ", "  indented\n\nkept"},
		{"e\u0301t\u00e9", "\u00e9t\u00e9"}, // NFC
		{"bad\xffbyte", "bad\uFFFDbyte"},
		{"nbsp\u00a0\u00a0\nx", "nbsp\nx"},
	}
	for _, c := range cases {
		if got := Normalize(c.in); got != c.want {
			t.Errorf("Normalize(%q) = %q, want %q", c.in, got, c.want)
		}
	}
	r, seed := testutil.Rand(t)
	alphabet := []string{"a", "B", " ", "  ", "\t", "\n", "\r\n", "\r", "e\u0301", "\u00e9", "\xff", "\uFEFF", "\u00a0", "."}
	for range 500 {
		var sb strings.Builder
		for range r.IntN(40) {
			sb.WriteString(alphabet[r.IntN(len(alphabet))])
		}
		in := sb.String()
		got := Normalize(in)
		if Normalize(got) != got {
			t.Fatalf("seed %d: Normalize not idempotent on %q: %q", seed, in, got)
		}
		if strings.ContainsRune(got, '\r') || !norm.NFC.IsNormalString(got) || strings.HasPrefix(got, "\n") {
			t.Fatalf("seed %d: Normalize(%q) = %q", seed, in, got)
		}
		for _, line := range strings.Split(got, "\n") {
			if strings.TrimRightFunc(line, unicode.IsSpace) != line {
				t.Fatalf("seed %d: Normalize(%q) = %q keeps trailing space", seed, in, got)
			}
		}
	}
}

// corpus writes a random corpus to dir and returns its sources and, per source, the documents
// Build should keep (normalized, deduplicated, in order).
type testCorpus struct {
	sources []Source
	kept    [][]string
}

func randDoc(r *rand.Rand) string {
	words := []string{"the", "cat", "sat", "on", "a", "mat", "Über", "naïve", "e\u0301clair", "42", "!", "\"quoted\""}
	var sb strings.Builder
	for i := range 5 + r.IntN(60) {
		if i > 0 {
			switch r.IntN(12) {
			case 0:
				sb.WriteString("\r\n")
			case 1:
				sb.WriteString("  \n\n")
			default:
				sb.WriteString(" ")
			}
		}
		sb.WriteString(words[r.IntN(len(words))])
	}
	return sb.String()
}

func makeCorpus(t *testing.T, r *rand.Rand, dir string) testCorpus {
	t.Helper()
	var c testCorpus
	seen := map[string]bool{}
	var all []string // earlier documents, for duplicates across sources
	pick := func() string {
		switch {
		case len(all) > 0 && r.IntN(8) == 0:
			return all[r.IntN(len(all))] // exact duplicate
		case r.IntN(15) == 0:
			return " \n\t\r\n" // empty after normalization
		}
		d := randDoc(r)
		all = append(all, d)
		return d
	}
	keep := func(si int, d string) {
		n := Normalize(d)
		if n != "" && !seen[n] {
			seen[n] = true
			c.kept[si] = append(c.kept[si], n)
		}
	}
	// Source 0: a folder tree of .txt and .md files, with files Build must skip.
	root := filepath.Join(dir, "books")
	c.sources = append(c.sources, Source{Name: "books", Paths: []string{root}})
	c.kept = append(c.kept, nil)
	nFiles := 3 + r.IntN(8)
	for i := range nFiles {
		sub := filepath.Join(root, fmt.Sprintf("part%d", i%3))
		os.MkdirAll(sub, 0o755)
		ext := ".txt"
		if i%4 == 3 {
			ext = ".md"
		}
		d := pick()
		os.WriteFile(filepath.Join(sub, fmt.Sprintf("f%02d%s", i, ext)), []byte(d), 0o644)
	}
	os.WriteFile(filepath.Join(root, "skip.json"), []byte(`{"text": "no"}`), 0o644)
	os.WriteFile(filepath.Join(root, ".hidden.txt"), []byte("hidden"), 0o644)
	os.MkdirAll(filepath.Join(root, ".git"), 0o755)
	os.WriteFile(filepath.Join(root, ".git", "x.txt"), []byte("git"), 0o644)
	// WalkDir order is lexical by path: part0/f00, part0/f03, ..., part1/...
	for p := range 3 {
		for i := p; i < nFiles; i += 3 {
			ext := ".txt"
			if i%4 == 3 {
				ext = ".md"
			}
			b, _ := os.ReadFile(filepath.Join(root, fmt.Sprintf("part%d", p), fmt.Sprintf("f%02d%s", i, ext)))
			keep(0, string(b))
		}
	}
	// Source 1: a JSONL file.
	var jl bytes.Buffer
	c.sources = append(c.sources, Source{Name: "web", Paths: []string{filepath.Join(dir, "web.jsonl")}})
	c.kept = append(c.kept, nil)
	for range 5 + r.IntN(30) {
		d := pick()
		fmt.Fprintf(&jl, "{\"id\": 1, \"text\": %q}\n", d)
		if r.IntN(5) == 0 {
			jl.WriteString("\n")
		}
		keep(1, d)
	}
	os.WriteFile(filepath.Join(dir, "web.jsonl"), jl.Bytes(), 0o644)
	// Source 2: documents in memory.
	c.sources = append(c.sources, Source{Name: "mem"})
	c.kept = append(c.kept, nil)
	for range 2 + r.IntN(10) {
		d := pick()
		c.sources[2].Docs = append(c.sources[2].Docs, d)
		keep(2, d)
	}
	return c
}

func TestBuildRoundTrip(t *testing.T) {
	r, seed := testutil.Rand(t)
	for trial := range 4 {
		dir := t.TempDir()
		c := makeCorpus(t, r, dir)
		valFrac := []float64{0, 0.01, 0.3, 0.5}[trial]
		shardTokens := 50 + r.IntN(500)
		var outs [][]byte
		for _, workers := range []int{1, 3} {
			out := filepath.Join(dir, fmt.Sprintf("out%d", workers))
			var last Progress
			idx, err := Build(out, BuildConfig{Sources: c.sources, Encoder: byteEncoder{}, ValFrac: valFrac,
				ShardTokens: shardTokens, Workers: workers, Tokenizer: "bytes", Progress: func(p Progress) { last = p }})
			if err != nil {
				t.Fatalf("seed %d trial %d: Build: %v", seed, trial, err)
			}
			if last.Phase != "tokenize" || last.Done != last.Total {
				t.Errorf("seed %d: last progress %+v, want tokenize done", seed, last)
			}
			var all bytes.Buffer
			for _, s := range append(idx.Train, idx.Val...) {
				b, err := os.ReadFile(filepath.Join(out, s.File))
				if err != nil {
					t.Fatal(err)
				}
				all.Write(b)
			}
			outs = append(outs, all.Bytes())

			d, err := Open(out)
			if err != nil {
				t.Fatalf("seed %d trial %d: Open: %v", seed, trial, err)
			}
			// The train stream is the kept documents minus each source's held-out tail, in order.
			var wantTrain []string
			for si, docs := range c.kept {
				nVal := 0
				if valFrac > 0 && len(docs) >= 2 {
					nVal = min(max(int(math.Ceil(valFrac*float64(len(docs)))), 1), len(docs)-1)
				}
				trainDocs, valDocs := docs[:len(docs)-nVal], docs[len(docs)-nVal:]
				if valFrac > 0 && len(docs) == 1 {
					tr, va, ok := splitDoc(docs[0], valFrac)
					if ok {
						trainDocs, valDocs = []string{tr}, []string{va}
					}
				}
				wantTrain = append(wantTrain, trainDocs...)
				st := idx.Sources[si]
				if st.TrainDocuments != len(trainDocs) || st.ValDocuments != len(valDocs) {
					t.Errorf("seed %d trial %d source %s: %d train %d val documents, want %d %d",
						seed, trial, st.Name, st.TrainDocuments, st.ValDocuments, len(trainDocs), len(valDocs))
				}
				if len(valDocs) == 0 {
					if d.ValTokens(st.Name) != 0 {
						t.Errorf("seed %d: source %s has val tokens", seed, st.Name)
					}
					continue
				}
				got := make([]int32, d.ValTokens(st.Name))
				it, err := d.Val(st.Name, 1, len(got)-1)
				if err != nil {
					t.Fatal(err)
				}
				got, _, err = it.Next(got)
				if err != nil {
					t.Fatal(err)
				}
				if g := decodeBytes(got); !equalStrings(g, valDocs) {
					t.Fatalf("seed %d trial %d source %s: val docs\n%q\nwant\n%q", seed, trial, st.Name, g, valDocs)
				}
			}
			got := make([]int32, d.TrainTokens())
			if err := d.TrainTokensAt(got, 0); err != nil {
				t.Fatal(err)
			}
			if g := decodeBytes(got); !equalStrings(g, wantTrain) {
				t.Fatalf("seed %d trial %d: train docs\n%q\nwant\n%q", seed, trial, g, wantTrain)
			}
			for i, s := range idx.Train {
				if i < len(idx.Train)-1 && s.Tokens != int64(shardTokens) {
					t.Errorf("seed %d: shard %s has %d tokens, want %d", seed, s.File, s.Tokens, shardTokens)
				}
			}
			d.Close()
		}
		if !bytes.Equal(outs[0], outs[1]) {
			t.Errorf("seed %d trial %d: 1 and 3 workers wrote different shards", seed, trial)
		}
	}
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestBuildSingleDocumentSource(t *testing.T) {
	doc := "First paragraph.\n\nSecond paragraph.\n\nThird one, the last."
	d, err := BuildMemory(BuildConfig{Sources: []Source{{Name: "one", Docs: []string{doc}}}, Encoder: byteEncoder{}, ValFrac: 0.2})
	if err != nil {
		t.Fatal(err)
	}
	train := make([]int32, d.TrainTokens())
	d.TrainTokensAt(train, 0)
	val := make([]int32, d.ValTokens("one"))
	it, _ := d.Val("one", 1, len(val)-1)
	val, _, _ = it.Next(val)
	if g, v := decodeBytes(train), decodeBytes(val); !equalStrings(g, []string{"First paragraph.\n\nSecond paragraph."}) ||
		!equalStrings(v, []string{"Third one, the last."}) {
		t.Errorf("split %q | %q", g, v)
	}
}

func TestBuildErrors(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		os.WriteFile(p, []byte(content), 0o644)
		return p
	}
	emptyDir := filepath.Join(dir, "nothing")
	os.MkdirAll(emptyDir, 0o755)
	write("nothing/notes.json", "{}")
	blank := write("blank/a.txt", " \n\n")
	write("blank/b.txt", "\r\n")
	good := write("good.txt", "Some text.")
	cases := []struct {
		name string
		cfg  BuildConfig
		want string
	}{
		{"no sources", BuildConfig{Encoder: byteEncoder{}}, "empty corpus"},
		{"empty folder", BuildConfig{Sources: []Source{{Name: "n", Paths: []string{emptyDir}}}, Encoder: byteEncoder{}}, "no .txt, .md or .jsonl files under " + emptyDir},
		{"missing path", BuildConfig{Sources: []Source{{Name: "m", Paths: []string{filepath.Join(dir, "missing")}}}, Encoder: byteEncoder{}}, "missing"},
		{"all blank", BuildConfig{Sources: []Source{{Name: "b", Paths: []string{filepath.Dir(blank)}}}, Encoder: byteEncoder{}}, "empty corpus: all 2 documents are empty"},
		{"no encoder", BuildConfig{Sources: []Source{{Name: "g", Paths: []string{good}}}}, "no encoder"},
		{"bad val frac", BuildConfig{Sources: []Source{{Name: "g", Paths: []string{good}}}, Encoder: byteEncoder{}, ValFrac: 1}, "validation fraction"},
		{"same names", BuildConfig{Sources: []Source{{Name: "g", Paths: []string{good}}, {Name: "g", Docs: []string{"x"}}}, Encoder: byteEncoder{}}, `two sources are named "g"`},
		{"bad jsonl", BuildConfig{Sources: []Source{{Name: "j", Paths: []string{write("bad1.jsonl", "{\"text\": \"ok\"}\n[1,2]\n")}}}, Encoder: byteEncoder{}}, "bad1.jsonl:2: not a JSON object"},
		{"jsonl no text", BuildConfig{Sources: []Source{{Name: "j", Paths: []string{write("bad2.jsonl", "{\"body\": \"x\"}")}}}, Encoder: byteEncoder{}}, `bad2.jsonl:1: no "text" field`},
		{"jsonl number", BuildConfig{Sources: []Source{{Name: "j", Paths: []string{write("bad3.jsonl", "\n{\"text\": 5}")}}}, Encoder: byteEncoder{}}, `bad3.jsonl:2: field "text" is not a string`},
		{"encoder fails", BuildConfig{Sources: []Source{{Name: "g", Paths: []string{good}}}, Encoder: byteEncoder{fail: "text"}}, "cannot encode"},
	}
	for _, c := range cases {
		out := filepath.Join(dir, "out-"+strings.ReplaceAll(c.name, " ", "-"))
		_, err := Build(out, c.cfg)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: want an error with %q, got %v", c.name, c.want, err)
		}
		if _, serr := os.Stat(out); !errors.Is(serr, os.ErrNotExist) {
			t.Errorf("%s: a failed build left %s", c.name, out)
		}
	}
	if ents, _ := filepath.Glob(filepath.Join(dir, ".out-*")); len(ents) > 0 {
		t.Errorf("temporary folders left: %v", ents)
	}

	// Output folders: an existing non-empty folder is refused unless it is a dataset and
	// Overwrite is set.
	cfg := BuildConfig{Sources: []Source{{Name: "g", Paths: []string{good}}}, Encoder: byteEncoder{}}
	busy := filepath.Join(dir, "busy")
	write("busy/mine.txt", "keep me")
	if _, err := Build(busy, cfg); err == nil || !strings.Contains(err.Error(), "not empty") {
		t.Errorf("non-empty out folder: %v", err)
	}
	cfg.Overwrite = true
	if _, err := Build(busy, cfg); err == nil || !strings.Contains(err.Error(), "not a dataset folder") {
		t.Errorf("overwrite of a non-dataset folder: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(busy, "mine.txt")); string(b) != "keep me" {
		t.Errorf("user file lost")
	}
	ds := filepath.Join(dir, "ds")
	cfg.Overwrite = false
	if _, err := Build(ds, cfg); err != nil {
		t.Fatal(err)
	}
	if _, err := Build(ds, cfg); err == nil {
		t.Errorf("rebuilt over a dataset without Overwrite")
	}
	cfg.Overwrite = true
	cfg.Sources[0].Docs = []string{"more"}
	idx, err := Build(ds, cfg)
	if err != nil {
		t.Fatalf("overwrite: %v", err)
	}
	d, err := Open(ds)
	if err != nil || d.TrainTokens() != idx.TrainTokens() || idx.TrainTokens() != int64(len("Some text.")+len("more")+2) {
		t.Errorf("overwritten dataset: %v, %d tokens", err, idx.TrainTokens())
	}
	if ents, _ := filepath.Glob(filepath.Join(dir, ".ds.*")); len(ents) > 0 {
		t.Errorf("temporary folders left: %v", ents)
	}
}

func TestOpenErrors(t *testing.T) {
	dir := t.TempDir()
	ds := filepath.Join(dir, "ds")
	docs := []string{"one two three", "four five", "six seven eight nine", "ten"}
	idx, err := Build(ds, BuildConfig{Sources: []Source{{Name: "s", Docs: docs}}, Encoder: byteEncoder{}, ValFrac: 0.25, ShardTokens: 10})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "not a dataset folder") {
		t.Errorf("folder without index: %v", err)
	}
	shard := filepath.Join(ds, idx.Train[1].File)
	orig, _ := os.ReadFile(shard)
	bad := bytes.Clone(orig)
	bad[len(bad)-1] ^= 1
	os.WriteFile(shard, bad, 0o644)
	if _, err := Open(ds); err == nil || !strings.Contains(err.Error(), shard) || !strings.Contains(err.Error(), "corrupt payload") {
		t.Errorf("corrupt shard: %v", err)
	}
	// A valid shard from elsewhere in place of the right one.
	other := filepath.Join(ds, idx.Train[0].File)
	ob, _ := os.ReadFile(other)
	os.WriteFile(shard, ob, 0o644)
	if _, err := Open(ds); err == nil || !strings.Contains(err.Error(), "the index says") {
		t.Errorf("swapped shard: %v", err)
	}
	os.WriteFile(shard, orig, 0o644)
	ipath := filepath.Join(ds, IndexFile)
	ib, _ := os.ReadFile(ipath)
	for _, c := range []struct{ from, to, want string }{
		{`"format": "twell-token-shards"`, `"format": "other"`, "format"},
		{`"file": "train-00000.twsh"`, `"file": "../x.twsh"`, "not a shard file name"},
		{`"version": 1`, `"version": 9`, "version 9"},
		{`"eos": 256`, `"eos": 257`, "eos 257"},
	} {
		os.WriteFile(ipath, bytes.Replace(ib, []byte(c.from), []byte(c.to), 1), 0o644)
		if _, err := Open(ds); err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), ipath) {
			t.Errorf("index edit %s: %v", c.to, err)
		}
	}
	os.WriteFile(ipath, ib[:len(ib)/2], 0o644)
	if _, err := Open(ds); err == nil || !strings.Contains(err.Error(), ipath) {
		t.Errorf("truncated index: %v", err)
	}
}

func TestSourcesFromPaths(t *testing.T) {
	dir := t.TempDir()
	for _, f := range []string{"corpus/gutenberg/a.txt", "corpus/sotu/b.txt", "x/notes.txt", "y/notes.txt", "data.jsonl"} {
		os.MkdirAll(filepath.Join(dir, filepath.Dir(f)), 0o755)
		os.WriteFile(filepath.Join(dir, f), []byte("t"), 0o644)
	}
	os.WriteFile(filepath.Join(dir, "corpus", "MANIFEST"), []byte("# comment\ngutenberg\tnpm\tx\nsotu\tnpm\ty\n"), 0o644)
	srcs, err := SourcesFromPaths([]string{
		filepath.Join(dir, "corpus"), filepath.Join(dir, "x", "notes.txt"), filepath.Join(dir, "y", "notes.txt"),
		"web=" + filepath.Join(dir, "data.jsonl"),
	})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range srcs {
		names = append(names, s.Name)
	}
	if want := []string{"gutenberg", "sotu", "notes", "notes-2", "web"}; !equalStrings(names, want) {
		t.Errorf("names %v, want %v", names, want)
	}
	if _, err := SourcesFromPaths([]string{filepath.Join(dir, "nope")}); err == nil || !strings.Contains(err.Error(), "nope") {
		t.Errorf("missing input: %v", err)
	}
	os.WriteFile(filepath.Join(dir, "corpus", "MANIFEST"), []byte("brown\tnpm\n"), 0o644)
	if _, err := SourcesFromPaths([]string{filepath.Join(dir, "corpus")}); err == nil || !strings.Contains(err.Error(), "MANIFEST line 1") {
		t.Errorf("MANIFEST naming a missing folder: %v", err)
	}
}

func TestSample(t *testing.T) {
	files := SampleFiles()
	if len(files) < 20 {
		t.Fatalf("%d sample files", len(files))
	}
	total := 0
	for i, f := range files {
		if i > 0 && f.Name <= files[i-1].Name {
			t.Errorf("sample files not sorted: %s after %s", f.Name, files[i-1].Name)
		}
		if Normalize(f.Text) == "" {
			t.Errorf("sample file %s is empty", f.Name)
		}
		total += len(f.Text)
	}
	if total < 300_000 || total > 600_000 {
		t.Errorf("sample has %d bytes, want 300-600 KB", total)
	}
	if s := Sample(); len(s) < total || !strings.Contains(s, "Alice") {
		t.Errorf("Sample() has %d bytes", len(s))
	}
	if src := SampleSource(); len(src.Docs) != len(files) || src.Name != "sample" {
		t.Errorf("SampleSource: %d docs", len(src.Docs))
	}
}
