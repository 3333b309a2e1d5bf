package safetensors

import (
	"bytes"
	"encoding/json"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// MaxHeaderSize bounds the JSON header, as the reference implementation does (100 MB), so a
// corrupt length prefix cannot make a reader allocate or scan gigabytes.
const MaxHeaderSize = 100_000_000

// metadataKey is the reserved header key holding free-form string metadata.
const metadataKey = "__metadata__"

// entry is one tensor of a parsed header; begin and end are relative to the data section.
type entry struct {
	name       string
	dtype      DType
	shape      []int
	begin, end int64
}

// rawEntry is a tensor's header record as JSON; pointers detect missing fields.
type rawEntry struct {
	DType       *string  `json:"dtype"`
	Shape       *[]int64 `json:"shape"`
	DataOffsets *[]int64 `json:"data_offsets"`
}

// parseHeader parses and checks the JSON header of file path whose data section holds
// dataLen bytes: every tensor must be well formed, and the tensors must tile the data
// section exactly (no overlap, no hole, nothing left over).
func parseHeader(path string, hdr []byte, dataLen int64) (map[string]string, []entry, error) {
	if !utf8.Valid(hdr) {
		return nil, nil, formatErr(path, "", "header is not valid UTF-8")
	}
	if len(hdr) == 0 || hdr[0] != '{' { // as the reference reader: no leading whitespace
		return nil, nil, formatErr(path, "", "header is not a JSON object (starts with %q)", clip(hdr, 20))
	}
	dec := json.NewDecoder(bytes.NewReader(hdr))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, nil, formatErr(path, "", "header is not a JSON object (starts with %q)", clip(hdr, 20))
	}
	var meta map[string]string
	var entries []entry
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, nil, &Error{Path: path, Msg: "header is not valid JSON", Kind: ErrFormat, Err: err}
		}
		name := tok.(string) // object keys are always strings
		if seen[name] {
			return nil, nil, formatErr(path, name, "listed twice in the header")
		}
		seen[name] = true
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, nil, &Error{Path: path, Tensor: name, Msg: "header is not valid JSON", Kind: ErrFormat, Err: err}
		}
		if name == metadataKey {
			if err := json.Unmarshal(raw, &meta); err != nil {
				return nil, nil, &Error{Path: path, Msg: "__metadata__ must map strings to strings", Kind: ErrFormat, Err: err}
			}
			continue
		}
		e, err := parseEntry(path, name, raw, dataLen)
		if err != nil {
			return nil, nil, err
		}
		entries = append(entries, e)
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return nil, nil, &Error{Path: path, Msg: "header is not valid JSON", Kind: ErrFormat, Err: err}
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, nil, formatErr(path, "", "header has data after its JSON object")
	}
	if err := checkTiling(path, entries, dataLen); err != nil {
		return nil, nil, err
	}
	return meta, entries, nil
}

func parseEntry(path, name string, raw json.RawMessage, dataLen int64) (entry, error) {
	var r rawEntry
	if err := json.Unmarshal(raw, &r); err != nil {
		return entry{}, &Error{Path: path, Tensor: name, Msg: "malformed header entry", Kind: ErrFormat, Err: err}
	}
	switch {
	case r.DType == nil:
		return entry{}, formatErr(path, name, "header entry has no dtype")
	case r.Shape == nil:
		return entry{}, formatErr(path, name, "header entry has no shape")
	case r.DataOffsets == nil:
		return entry{}, formatErr(path, name, "header entry has no data_offsets")
	}
	dtype := DType(*r.DType)
	if !dtype.Valid() {
		return entry{}, formatErr(path, name, "unknown dtype %q", *r.DType)
	}
	offs := *r.DataOffsets
	if len(offs) != 2 {
		return entry{}, formatErr(path, name, "data_offsets %v must hold 2 numbers", offs)
	}
	begin, end := offs[0], offs[1]
	if begin < 0 || end < begin || end > dataLen {
		return entry{}, formatErr(path, name, "data_offsets [%d %d] outside the %d-byte data section or reversed", begin, end, dataLen)
	}
	shape := make([]int, len(*r.Shape))
	n := int64(1)
	for i, d := range *r.Shape {
		if d < 0 {
			return entry{}, formatErr(path, name, "shape %v has a negative dimension", *r.Shape)
		}
		if d > 0 && n > math.MaxInt64/d {
			return entry{}, formatErr(path, name, "shape %v has too many elements", *r.Shape)
		}
		n *= d
		if d > math.MaxInt {
			return entry{}, formatErr(path, name, "shape %v does not fit in int", *r.Shape)
		}
		shape[i] = int(d)
	}
	size := int64(dtype.Size())
	if n > math.MaxInt64/size || n*size != end-begin {
		return entry{}, formatErr(path, name, "shape %v of %s needs %s bytes, data_offsets [%d %d] hold %d",
			*r.Shape, dtype, mulString(n, size), begin, end, end-begin)
	}
	return entry{name: name, dtype: dtype, shape: shape, begin: begin, end: end}, nil
}

// checkTiling verifies that the tensors cover [0, dataLen) exactly once. Zero-size tensors
// may sit anywhere that is not strictly inside another tensor.
func checkTiling(path string, entries []entry, dataLen int64) error {
	sorted := slices.Clone(entries)
	slices.SortFunc(sorted, func(a, b entry) int {
		if a.begin != b.begin {
			return cmpInt64(a.begin, b.begin)
		}
		if a.end != b.end {
			return cmpInt64(a.end, b.end)
		}
		return strings.Compare(a.name, b.name)
	})
	pos, prev := int64(0), ""
	for _, e := range sorted {
		switch {
		case e.begin < pos:
			return formatErr(path, e.name, "data_offsets [%d %d] overlap tensor %q, which ends at %d", e.begin, e.end, prev, pos)
		case e.begin > pos:
			return formatErr(path, "", "bytes [%d %d) of the data section belong to no tensor (before %q)", pos, e.begin, e.name)
		}
		if e.end > pos || prev == "" {
			prev = e.name
		}
		pos = e.end
	}
	if pos != dataLen {
		return formatErr(path, "", "data section is %d bytes but the tensors cover only %d (trailing bytes)", dataLen, pos)
	}
	return nil
}

func cmpInt64(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// mulString prints a*b without overflowing.
func mulString(a, b int64) string {
	if a > math.MaxInt64/b {
		return "more than 2^63"
	}
	return strconv.FormatInt(a*b, 10)
}

// clip returns at most n bytes of b as a string, for error messages.
func clip(b []byte, n int) string {
	if len(b) > n {
		b = b[:n]
	}
	return string(b)
}
