package tokenizer

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// variant is one entry of testdata/variants.json: a tokenizer.json from testdata, possibly
// edited, or one given inline. scripts/tokenizer-goldens.py applies the same edits.
type variant struct {
	Name      string                     `json:"name"`
	File      string                     `json:"file"`
	Inline    json.RawMessage            `json:"inline"`
	Set       map[string]json.RawMessage `json:"set"`
	ModelSet  map[string]json.RawMessage `json:"model_set"`
	AddTokens []json.RawMessage          `json:"add_tokens"`
}

func readVariants(t testing.TB) []variant {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "variants.json"))
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Configs []variant `json:"configs"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("variants.json: %v", err)
	}
	return v.Configs
}

func readGzip(t testing.TB, name string) []byte {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	b, err := io.ReadAll(zr)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return b
}

// variantJSON returns the tokenizer.json document of v.
func variantJSON(t testing.TB, v variant) []byte {
	t.Helper()
	if v.Inline != nil {
		return v.Inline
	}
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(readGzip(t, v.File), &doc); err != nil {
		t.Fatalf("%s: %v", v.File, err)
	}
	for k, x := range v.Set {
		doc[k] = x
	}
	if len(v.ModelSet) > 0 {
		var model map[string]json.RawMessage
		if err := json.Unmarshal(doc["model"], &model); err != nil {
			t.Fatal(err)
		}
		for k, x := range v.ModelSet {
			model[k] = x
		}
		doc["model"] = mustMarshal(t, model)
	}
	if len(v.AddTokens) > 0 {
		var added []json.RawMessage
		if err := json.Unmarshal(doc["added_tokens"], &added); err != nil {
			t.Fatal(err)
		}
		doc["added_tokens"] = mustMarshal(t, append(added, v.AddTokens...))
	}
	return mustMarshal(t, doc)
}

func mustMarshal(t testing.TB, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

var (
	tokMu    sync.Mutex
	tokCache = map[string]*Tokenizer{}
)

// testTokenizer returns the tokenizer of the variant called name, parsed once per test binary.
func testTokenizer(t testing.TB, name string) *Tokenizer {
	t.Helper()
	tokMu.Lock()
	defer tokMu.Unlock()
	if tk, ok := tokCache[name]; ok {
		return tk
	}
	for _, v := range readVariants(t) {
		if v.Name == name {
			tk, err := Parse(variantJSON(t, v))
			if err != nil {
				t.Fatalf("variant %s: %v", name, err)
			}
			tokCache[name] = tk
			return tk
		}
	}
	t.Fatalf("no variant %q in testdata/variants.json", name)
	return nil
}

func readTexts(t testing.TB) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "texts.json"))
	if err != nil {
		t.Fatal(err)
	}
	var texts []string
	if err := json.Unmarshal(b, &texts); err != nil {
		t.Fatalf("texts.json: %v", err)
	}
	return texts
}
