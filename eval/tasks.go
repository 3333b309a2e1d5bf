package eval

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"unicode/utf8"
)

// Item is one multiple-choice question: a context and its candidate
// continuations, of which Gold is the right one.
type Item struct {
	// Line is the 1-based line of the JSONL file the item came from.
	Line    int
	Context string
	Choices []string
	Gold    int
}

// maxLine bounds one JSONL line.
const maxLine = 16 << 20

// ReadTasks reads multiple-choice items from JSONL: one JSON object per
// line (blank lines are skipped). Each object has
//
//   - "context" (or "query"): a string, the text the choices continue;
//     it may be empty;
//   - "choices" (or "endings"): a non-empty array of strings, the
//     continuations, each usually starting with the space that separates
//     it from the context;
//   - "gold" (or "label"): the index of the right choice, an integer (a
//     string holding an integer is accepted, as HellaSwag's "label" is).
//
// Other fields are ignored. Giving a field and its alias in one object is
// an error, as are a missing field, a value of the wrong type, a gold index
// outside the choices and text that is not valid UTF-8. Errors name the
// line and the field. name labels the errors (a file name).
func ReadTasks(name string, r io.Reader) ([]Item, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxLine)
	var items []Item
	for n := 1; sc.Scan(); n++ {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		it, err := parseItem(line)
		if err != nil {
			return nil, fmt.Errorf("%s line %d: %w", name, n, err)
		}
		it.Line = n
		items = append(items, it)
	}
	if err := sc.Err(); err != nil {
		if err == bufio.ErrTooLong {
			return nil, fmt.Errorf("%s line %d: longer than %d MiB", name, len(items)+1, maxLine>>20)
		}
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if len(items) == 0 {
		return nil, fmt.Errorf("%s: no items (want one JSON object per line)", name)
	}
	return items, nil
}

// parseItem reads one JSONL line.
func parseItem(line []byte) (Item, error) {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(line, &raw); err != nil {
		return Item{}, fmt.Errorf("not a JSON object: %v", err)
	}
	pick := func(name, alias string, required bool) (json.RawMessage, string, error) {
		v, ok := raw[name]
		a, aok := raw[alias]
		switch {
		case ok && aok:
			return nil, "", fmt.Errorf("both %q and its alias %q are given", name, alias)
		case aok:
			return a, alias, nil
		case !ok && required:
			return nil, "", fmt.Errorf("field %q (or %q) is missing", name, alias)
		}
		return v, name, nil
	}
	var it Item
	v, f, err := pick("context", "query", true)
	if err != nil {
		return it, err
	}
	if err := json.Unmarshal(v, &it.Context); err != nil {
		return it, fmt.Errorf("field %q: want a string", f)
	}
	if !utf8.ValidString(it.Context) {
		return it, fmt.Errorf("field %q: not valid UTF-8", f)
	}
	if v, f, err = pick("choices", "endings", true); err != nil {
		return it, err
	}
	if err := json.Unmarshal(v, &it.Choices); err != nil || it.Choices == nil {
		return it, fmt.Errorf("field %q: want an array of strings", f)
	}
	if len(it.Choices) == 0 {
		return it, fmt.Errorf("field %q: the list of choices is empty", f)
	}
	for i, c := range it.Choices {
		if c == "" {
			return it, fmt.Errorf("field %q: choice %d is empty", f, i)
		}
		if !utf8.ValidString(c) {
			return it, fmt.Errorf("field %q: choice %d is not valid UTF-8", f, i)
		}
	}
	if v, f, err = pick("gold", "label", true); err != nil {
		return it, err
	}
	if it.Gold, err = parseGold(v); err != nil {
		return it, fmt.Errorf("field %q: %v", f, err)
	}
	if it.Gold < 0 || it.Gold >= len(it.Choices) {
		return it, fmt.Errorf("field %q: gold index %d is outside the %d choices [0,%d)", f, it.Gold, len(it.Choices), len(it.Choices))
	}
	return it, nil
}

// parseGold reads an integer, or a string holding one.
func parseGold(v json.RawMessage) (int, error) {
	var s string
	if json.Unmarshal(v, &s) == nil {
		v = json.RawMessage(strings.TrimSpace(s))
	}
	var g int
	dec := json.NewDecoder(bytes.NewReader(v))
	if err := dec.Decode(&g); err != nil || dec.More() {
		return 0, fmt.Errorf("want an integer index, got %s", truncate(string(v), 40))
	}
	return g, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
