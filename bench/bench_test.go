package bench

import (
	"encoding/json"
	"maps"
	"strings"
	"testing"
)

// TestSwitches checks that a result row records exactly the TWELL_
// variables of the environment, and none when there are none.
func TestSwitches(t *testing.T) {
	env := []string{"PATH=/bin", "TWELL_UNION=1", "TWELL_LLM_ATTENTION=dec", "TWELLX=2", "NOTTWELL_A=3", "TWELL_EMPTY="}
	want := map[string]string{"TWELL_UNION": "1", "TWELL_LLM_ATTENTION": "dec", "TWELL_EMPTY": ""}
	if got := switches(env); !maps.Equal(got, want) {
		t.Errorf("switches(%q) = %v, want %v", env, got, want)
	}
	if got := switches([]string{"HOME=/root"}); got != nil {
		t.Errorf("switches without TWELL_ variables = %v, want nil", got)
	}
	t.Setenv("TWELL_T2U_ROWS", "1")
	b, err := json.Marshal(newRow(FFNSchema, "cuda", "H200"))
	if err != nil || !strings.Contains(string(b), `"switches":{`) || !strings.Contains(string(b), `"TWELL_T2U_ROWS":"1"`) {
		t.Errorf("row JSON %s (%v) does not record TWELL_T2U_ROWS=1", b, err)
	}
}
