package bench

import (
	"encoding/json"
	"fmt"
)

// NameVariants appends to the path of each row whose switches differ from
// the first row's the switches that differ, in brackets ("twell
// [GEMV_FUSE=0]"), as bench model -variants names its rows in its table
// and figure.
func NameVariants(rs []ModelResult) {
	for i := range rs {
		if d := SwitchDiff(rs[i].Switches, rs[0].Switches); d != "" {
			rs[i].Path += " [" + d + "]"
		}
	}
}

// ReadModelResults decodes what bench model -json writes: a JSON array of
// at least one row of schema ModelSchema (CPU or GPU rows; fields other than
// ModelResult's are ignored), with a path on every row.
func ReadModelResults(data []byte) ([]ModelResult, error) {
	rs, err := readRows[ModelResult](data, ModelSchema, "bench model")
	if err != nil {
		return nil, err
	}
	for i, r := range rs {
		if r.Path == "" {
			return nil, fmt.Errorf("row %d: no path", i)
		}
	}
	return rs, nil
}

// readRows decodes a JSON array of at least one result row of schema
// (what names the command that writes it, for the errors).
func readRows[T interface{ rowSchema() string }](data []byte, schema, what string) ([]T, error) {
	var rs []T
	if err := json.Unmarshal(data, &rs); err != nil {
		return nil, fmt.Errorf("not a %s JSON array: %w", what, err)
	}
	if len(rs) == 0 {
		return nil, fmt.Errorf("no rows")
	}
	for i, r := range rs {
		if got := r.rowSchema(); got != schema {
			return nil, fmt.Errorf("row %d: schema %q, want %q", i, got, schema)
		}
	}
	return rs, nil
}
