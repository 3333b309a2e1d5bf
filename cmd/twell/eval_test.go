package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
)

// TestEvalRunsOnCPU: perplexity of a text file (and of the sample's
// held-out split, built with twell data and the checkpoint's tokenizer),
// a stand-in task, the table on stdout and the JSON report with the same
// keys in every row.
func TestEvalRunsOnCPU(t *testing.T) {
	dir := tinyCheckpoint(t)
	tmp := t.TempDir()
	text := filepath.Join(tmp, "a.txt")
	os.WriteFile(text, []byte(strings.Repeat("Alice was beginning to get very tired of sitting by her sister on the bank. ", 6)), 0o644)
	ds := filepath.Join(tmp, "ds")
	var out, errb bytes.Buffer
	if code := run([]string{"data", "-tokenizer", filepath.Join(dir, "tokenizer.json"), "-out", ds, "-sample"}, &out, &errb); code != 0 {
		t.Fatalf("twell data: exit %d: %s", code, errb.String())
	}
	tasks := filepath.Join(tmp, "t.jsonl")
	os.WriteFile(tasks, []byte(strings.Join(strings.SplitN(readFile(t, "../../tasks/lastword.jsonl"), "\n", 6)[:5], "\n")), 0o644)
	js := filepath.Join(tmp, "r.json")
	out.Reset()
	errb.Reset()
	code := run([]string{"eval", "-model", dir, "-device", "cpu", "-text", text, "-data", ds, "-max-tokens", "300",
		"-tasks", tasks, "-batch", "3", "-json", js}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	for _, want := range []string{"perplexity", "bits/byte", "acc_norm", "t.jsonl", "active %", "all"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
	var rep map[string]any
	if err := json.Unmarshal([]byte(readFile(t, js)), &rep); err != nil {
		t.Fatal(err)
	}
	if rep["schema"] != "twell.eval/1" {
		t.Errorf("schema %v", rep["schema"])
	}
	for _, list := range []string{"perplexity", "tasks", "sparsity"} {
		rows, _ := rep[list].([]any)
		if len(rows) == 0 {
			t.Fatalf("%s: no rows in %v", list, rep[list])
		}
		keys := func(r any) []string {
			var ks []string
			for k := range r.(map[string]any) {
				ks = append(ks, k)
			}
			sort.Strings(ks)
			return ks
		}
		for _, r := range rows {
			if !reflect.DeepEqual(keys(r), keys(rows[0])) {
				t.Errorf("%s: row keys %v differ from %v", list, keys(r), keys(rows[0]))
			}
		}
	}
	ppl := rep["perplexity"].([]any)
	last := ppl[len(ppl)-1].(map[string]any)
	if last["name"] != "all" || last["tokens"].(float64) != 300 || last["bits_per_byte"].(float64) <= 0 {
		t.Errorf("total row %v: want 300 tokens (the -max-tokens cap) and bits per byte", last)
	}
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestEvalBadInput(t *testing.T) {
	dir := tinyCheckpoint(t)
	tmp := t.TempDir()
	write := func(name, s string) string {
		p := filepath.Join(tmp, name)
		os.WriteFile(p, []byte(s), 0o644)
		return p
	}
	good := `{"context": "a", "choices": [" b", " c"], "gold": 1}` + "\n"
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"eval", "-text", "x"}, 2, "-model is required"},
		{[]string{"eval", "-model", dir}, 2, "nothing to evaluate"},
		{[]string{"eval", "-model", dir, "-text", "x", "-batch", "0"}, 2, "-batch 0"},
		{[]string{"eval", "-model", dir, "-text", "x", "-device", "tpu"}, 2, "tpu"},
		{[]string{"eval", "-model", dir, "-text", "x", "-mlp", "fast"}, 2, "fast"},
		{[]string{"eval", "-model", dir, "-text", "x", "-items", filepath.Join(tmp, "no", "i.jsonl")}, 2, "does not exist"},
		{[]string{"eval", "-model", dir, "-text", write("t.txt", "hello there"), "-stride", "64"}, 2, "-stride 64"},
		{[]string{"eval", "-model", dir, "-text", filepath.Join(tmp, "missing.txt")}, 1, "missing.txt"},
		{[]string{"eval", "-model", dir, "-tasks", write("bad.jsonl", good+"{\"context\": \"a\", \"choices\": [\" b\"]}\n")}, 1, `bad.jsonl line 2: field "gold"`},
		{[]string{"eval", "-model", dir, "-tasks", write("gold.jsonl", `{"context": "a", "choices": [" b"], "gold": 3}`)}, 1, "gold index 3 is outside"},
		{[]string{"eval", "-model", dir, "-tasks", write("empty.jsonl", `{"context": "a", "choices": [], "gold": 0}`)}, 1, "the list of choices is empty"},
		{[]string{"eval", "-model", filepath.Join(tmp, "nomodel"), "-text", write("t2.txt", "hi")}, 1, "nomodel"},
		{[]string{"eval", "-model", dir, "-data", tmp}, 1, "not a dataset folder"},
	}
	for _, c := range cases {
		var out, errb bytes.Buffer
		code := run(c.args, &out, &errb)
		msg := errb.String()
		if code != c.code || !strings.Contains(msg, c.want) || strings.Count(msg, "\n") != 1 || strings.Contains(msg, "goroutine") {
			t.Errorf("%v: exit %d, stderr %q; want exit %d and one line mentioning %q", c.args[1:], code, msg, c.code, c.want)
		}
	}
}
