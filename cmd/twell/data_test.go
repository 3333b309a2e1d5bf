package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/data"
	"github.com/twell-ai/twell/tokenizer"
)

func TestParseFlagsAndArgs(t *testing.T) {
	for _, c := range []struct {
		args    []string
		wantPos []string
		wantOut string
	}{
		{[]string{"a", "-out", "o", "b"}, []string{"a", "b"}, "o"},
		{[]string{"-out=o", "a"}, []string{"a"}, "o"},
		{[]string{"a", "--", "-out", "b"}, []string{"a", "-out", "b"}, ""},
		{nil, nil, ""},
	} {
		fs := newFlagSet("x", &bytes.Buffer{})
		out := fs.String("out", "", "")
		pos, err := parseFlagsAndArgs(fs, c.args)
		if err != nil || !slices.Equal(pos, c.wantPos) || *out != c.wantOut {
			t.Errorf("%q: pos %q out %q err %v; want %q %q", c.args, pos, *out, err, c.wantPos, c.wantOut)
		}
	}
	fs := newFlagSet("x", &bytes.Buffer{})
	if _, err := parseFlagsAndArgs(fs, []string{"a", "-nope"}); err == nil || !strings.Contains(err.Error(), "nope") {
		t.Errorf("unknown flag: %v", err)
	}
	var buf bytes.Buffer
	fs = newFlagSet("x", &buf)
	fs.Usage = func() { fs.Output().Write([]byte("usage")) }
	if _, err := parseFlagsAndArgs(fs, []string{"-h"}); err != flag.ErrHelp || buf.String() != "usage" {
		t.Errorf("-h: %v, printed %q", err, buf.String())
	}
}

func TestDataBadInputExits2(t *testing.T) {
	dir := t.TempDir()
	for _, args := range [][]string{
		{"data", "-out", dir, "x.txt"},
		{"data", "-tokenizer", "t.json", "x.txt"},
		{"data", "-tokenizer", "t.json", "-out", dir},
		{"data", "-tokenizer", "t.json", "-out", dir, "-val-frac", "1", "x"},
		{"data", "-tokenizer", "t.json", "-out", dir, "-shard-tokens", "0", "x"},
		{"data", "-bogus"},
		{"tokenizer", "train", "-vocab", "100", "-out", "x.json", "-sample"},
		{"tokenizer", "train", "-sample"},
		{"tokenizer", "train", "-out", "x.json"},
		{"tokenizer", "train", "-out", "x.json", "-min-frequency", "0", "-sample"},
	} {
		var out, errb bytes.Buffer
		if code := run(args, &out, &errb); code != 2 || strings.Count(errb.String(), "\n") != 1 {
			t.Errorf("%q: exit %d, stderr %q; want 2 and one line", args, code, errb.String())
		}
	}
}

func TestTokenizerTrainAndDataEndToEnd(t *testing.T) {
	dir := t.TempDir()
	tok := filepath.Join(dir, "tok.json")
	expect := filepath.Join(dir, "expect.json")
	var out, errb bytes.Buffer
	if code := run([]string{"tokenizer", "train", "-sample", "-vocab", "1024", "-out", tok, "-expect", expect}, &out, &errb); code != 0 {
		t.Fatalf("tokenizer train: exit %d: %s", code, errb.String())
	}
	if !strings.Contains(out.String(), "vocabulary 1024") {
		t.Errorf("tokenizer train printed %q", out.String())
	}
	// Refuses to overwrite without -force.
	errb.Reset()
	if code := run([]string{"tokenizer", "train", "-sample", "-vocab", "1024", "-out", tok}, &out, &errb); code != 1 || !strings.Contains(errb.String(), "exists") {
		t.Errorf("overwrite without -force: exit %d, %s", code, errb.String())
	}
	// The expect file holds ids that package tokenizer reproduces.
	var e tokenizerExpect
	b, _ := os.ReadFile(expect)
	if err := json.Unmarshal(b, &e); err != nil {
		t.Fatal(err)
	}
	tk, err := tokenizer.Load(tok)
	if err != nil {
		t.Fatal(err)
	}
	if len(e.Cases) < 100 || e.VocabSize != 1024 || e.Special["<|endoftext|>"] != 1023 {
		t.Fatalf("expect file: %d cases, vocab %d, special %v", len(e.Cases), e.VocabSize, e.Special)
	}
	for _, c := range e.Cases {
		ids, _ := tk.Encode(c.Text, true)
		if !slices.Equal(ids, c.IDs) && !(len(ids) == 0 && len(c.IDs) == 0) {
			t.Fatalf("expect case %q: ids differ", c.Text)
		}
	}

	// twell data on a folder, a JSONL file (inputs before and after flags, and -in) and the sample.
	corpus := filepath.Join(dir, "corpus")
	os.MkdirAll(filepath.Join(corpus, "a"), 0o755)
	os.WriteFile(filepath.Join(corpus, "a", "one.txt"), []byte("The cat sat.\r\n"), 0o644)
	os.WriteFile(filepath.Join(corpus, "two.md"), []byte("# Title\n\nA dog ran."), 0o644)
	os.WriteFile(filepath.Join(corpus, "three.txt"), []byte("The cat sat."), 0o644) // a duplicate
	jl := filepath.Join(dir, "web.jsonl")
	os.WriteFile(jl, []byte("{\"text\": \"first line\"}\n{\"text\": \"second line\"}\n"), 0o644)
	ds := filepath.Join(dir, "ds")
	out.Reset()
	errb.Reset()
	code := run([]string{"data", corpus, "-tokenizer", tok, "-out", ds, "-sample", "-shard-tokens", "20000", "-in", jl}, &out, &errb)
	if code != 0 {
		t.Fatalf("data: exit %d: %s", code, errb.String())
	}
	if errb.Len() != 0 {
		t.Errorf("data wrote to stderr (not a terminal): %q", errb.String())
	}
	for _, want := range []string{"corpus", "web", "sample", "train tokens"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, out.String())
		}
	}
	d, err := data.Open(ds)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	// -in inputs come first, then the arguments, then the sample.
	var names []string
	for _, s := range d.Index.Sources {
		names = append(names, s.Name)
	}
	if !slices.Equal(names, []string{"web", "corpus", "sample"}) {
		t.Errorf("sources %q", names)
	}
	if got := d.Index.Sources[1]; got.Duplicates != 1 || got.Documents != 3 || got.ValDocuments != 1 {
		t.Errorf("corpus source stats %+v", got)
	}
	if len(d.Index.Train) < 5 || d.VocabSize() != 1024 || d.EOS() != 1023 {
		t.Errorf("%d train shards, vocab %d, eos %d", len(d.Index.Train), d.VocabSize(), d.EOS())
	}
	l, err := d.NewLoader(data.LoaderConfig{Batch: 4, SeqLen: 64, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	batch, _ := l.Next(nil)
	text, err := tk.Decode(intsOf(batch[:65]), false)
	if err != nil || len(text) < 64 {
		t.Errorf("first window decodes to %q (%v)", text, err)
	}
	// A second build into the same folder needs -force.
	errb.Reset()
	if code := run([]string{"data", "-tokenizer", tok, "-out", ds, "-sample"}, &out, &errb); code != 1 || !strings.Contains(errb.String(), "not empty") {
		t.Errorf("rebuild without -force: exit %d: %s", code, errb.String())
	}
	if code := run([]string{"data", "-tokenizer", tok, "-out", ds, "-sample", "-force"}, &out, &errb); code != 0 {
		t.Errorf("rebuild with -force: exit %d: %s", code, errb.String())
	}
	// An empty corpus fails before anything is written.
	empty := filepath.Join(dir, "empty")
	os.MkdirAll(empty, 0o755)
	errb.Reset()
	if code := run([]string{"data", "-tokenizer", tok, "-out", filepath.Join(dir, "ds2"), empty}, &out, &errb); code != 1 ||
		!strings.Contains(errb.String(), "no .txt, .md or .jsonl files") {
		t.Errorf("empty corpus: exit %d: %s", code, errb.String())
	}
	if _, err := os.Stat(filepath.Join(dir, "ds2")); err == nil {
		t.Errorf("a failed build left its output folder")
	}
}

func intsOf(s []int32) []int {
	out := make([]int, len(s))
	for i, v := range s {
		out[i] = int(v)
	}
	return out
}
