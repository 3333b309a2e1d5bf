package bench

import (
	"encoding/json"
	"fmt"
)

// ReadFFNResults decodes what bench ffn -json writes: a JSON array of at
// least one row of schema FFNSchema (fields other than FFNResult's are
// ignored).
func ReadFFNResults(data []byte) ([]FFNResult, error) {
	return readRows[FFNResult](data, FFNSchema, "bench ffn")
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
