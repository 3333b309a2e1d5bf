package bench

import (
	"encoding/json"
	"fmt"
)

// ReadFFNResults decodes what bench ffn -json writes: a JSON array of at
// least one row of schema FFNSchema (fields other than FFNResult's are
// ignored).
func ReadFFNResults(data []byte) ([]FFNResult, error) {
	var rs []FFNResult
	if err := json.Unmarshal(data, &rs); err != nil {
		return nil, fmt.Errorf("not a bench ffn JSON array: %w", err)
	}
	if len(rs) == 0 {
		return nil, fmt.Errorf("no rows")
	}
	for i, r := range rs {
		if r.Schema != FFNSchema {
			return nil, fmt.Errorf("row %d: schema %q, want %q", i, r.Schema, FFNSchema)
		}
	}
	return rs, nil
}

// ResultSchema returns the schema of the first row of a JSON array of
// bench rows, so that a reader can tell which results a file holds.
func ResultSchema(data []byte) (string, error) {
	var rs []Row
	if err := json.Unmarshal(data, &rs); err != nil {
		return "", fmt.Errorf("not a JSON array of bench rows: %w", err)
	}
	if len(rs) == 0 {
		return "", fmt.Errorf("no rows")
	}
	return rs[0].Schema, nil
}
