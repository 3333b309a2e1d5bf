package bench

import (
	"encoding/json"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/gpu"
	"github.com/twell-ai/twell/gpu/llm"
)

// TestSwitches checks that a result row records exactly the TWELL_
// variables of the environment, and none when there are none.
func TestSwitches(t *testing.T) {
	env := []string{"PATH=/bin", "TWELL_TAIL=sorted", "TWELL_LLM_ATTENTION=mma", "TWELLX=2", "NOTTWELL_A=3", "TWELL_EMPTY="}
	want := map[string]string{"TWELL_TAIL": "sorted", "TWELL_LLM_ATTENTION": "mma", "TWELL_EMPTY": ""}
	if got := switches(env); !maps.Equal(got, want) {
		t.Errorf("switches(%q) = %v, want %v", env, got, want)
	}
	if got := switches([]string{"HOME=/root"}); got != nil {
		t.Errorf("switches without TWELL_ variables = %v, want nil", got)
	}
	t.Setenv("TWELL_EARLY_START", "0")
	b, err := json.Marshal(newRow(FFNSchema, "cuda", "H200"))
	if err != nil || !strings.Contains(string(b), `"switches":{`) || !strings.Contains(string(b), `"TWELL_EARLY_START":"0"`) {
		t.Errorf("row JSON %s (%v) does not record TWELL_EARLY_START=0", b, err)
	}
}

// TestParseVariants reads the -variants form: names with or without the
// TWELL_ prefix, spaces or commas between settings, an empty variant for
// the environment's settings; unknown names, bad values, missing "=" and
// repeated names are errors naming the variant.
func TestParseVariants(t *testing.T) {
	for _, name := range gpu.Switches {
		t.Setenv(name, "")
	}
	got, err := ParseVariants("TAIL=warp;TWELL_TAIL=sorted D2T_KERNEL=mma, EARLY_START=0; ")
	want := []map[string]string{{"TWELL_TAIL": "warp"}, {"TWELL_TAIL": "sorted", "TWELL_D2T_KERNEL": "mma", "TWELL_EARLY_START": "0"}, {}}
	if err != nil || len(got) != len(want) {
		t.Fatalf("ParseVariants: %v, %v; want %v", got, err, want)
	}
	for i := range want {
		if !maps.Equal(got[i], want[i]) {
			t.Errorf("variant %d: %v, want %v", i, got[i], want[i])
		}
	}
	for _, c := range []struct{ in, want string }{
		{"BOGUS=1", "not one of the MLP's switches"},
		{"TAIL=fast", "TWELL_TAIL"},
		{"TAIL", "is not NAME=VALUE"},
		{"TAIL=warp TAIL=sorted", "sets TWELL_TAIL twice"},
		{"EARLY_START=maybe", "TWELL_EARLY_START"},
	} {
		if _, err := ParseVariants(c.in); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ParseVariants(%q): %v, want an error containing %q", c.in, err, c.want)
		}
	}
}

// FuzzParseVariants: any input parses or is refused, without panicking,
// and what parses names only the MLP's switches.
func FuzzParseVariants(f *testing.F) {
	f.Add("TAIL=warp;TAIL=sorted")
	f.Add(";EARLY_START=0,TAIL=warp")
	f.Add("=;;=,")
	f.Fuzz(func(t *testing.T, s string) {
		vs, err := ParseVariants(s)
		if err != nil {
			return
		}
		for _, v := range vs {
			for k := range v {
				if !slices.Contains(gpu.Switches, k) {
					t.Fatalf("ParseVariants(%q) accepted %s", s, k)
				}
			}
		}
	})
}

// TestParseModelVariants takes the GPU engine's switches and its MLPs',
// and refuses unknown names and values.
func TestParseModelVariants(t *testing.T) {
	for _, name := range llm.Switches {
		t.Setenv(name, "")
	}
	got, err := ParseModelVariants("LLM_ATTENTION=mma TAIL=sorted;LLM_FUSE_NORMS=1")
	if err != nil || len(got) != 2 || got[0]["TWELL_LLM_ATTENTION"] != "mma" || got[0]["TWELL_TAIL"] != "sorted" || got[1]["TWELL_LLM_FUSE_NORMS"] != "1" {
		t.Fatalf("ParseModelVariants: %v, %v", got, err)
	}
	for _, c := range []struct{ in, want string }{
		{"LLM_ATTENTION=flash", "TWELL_LLM_ATTENTION"},
		{"LLM_FUSE_NORMS=yes", "TWELL_LLM_FUSE_NORMS"},
		{"BOGUS=1", "not one of the GPU engine's switches"},
	} {
		if _, err := ParseModelVariants(c.in); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ParseModelVariants(%q): %v, want an error containing %q", c.in, err, c.want)
		}
	}
}

// TestFFNPowerSummary: the power line of a bench ffn row names each path's
// window and leaves out what could not be read.
func TestFFNPowerSummary(t *testing.T) {
	full, half := 1.0, 0.5
	for _, c := range []struct {
		r    FFNResult
		want string
	}{
		{FFNResult{}, ""},
		{FFNResult{DenseWatts: 672.4, TwELLWatts: 701, AutoWatts: 699, PowerLimitWatts: 700,
			DenseSMClockMHz: 1500, TwELLSMClockMHz: 1710, AutoSMClockMHz: 1695, MaxSMClockMHz: 1980,
			DensePowerCapped: &full, TwELLPowerCapped: &full, AutoPowerCapped: &half},
			"power dense / TwELL / auto: 672 / 701 / 699 W (limit 700 W), SM clock 1500 / 1710 / 1695 of 1980 MHz, power cap in 100 / 100 / 50% of samples"},
		{FFNResult{DenseWatts: 300, TwELLWatts: 280, AutoWatts: 281, DenseSMClockMHz: 1980, TwELLSMClockMHz: 1980, AutoSMClockMHz: 1980, TwELLPowerCapped: &half},
			"power dense / TwELL / auto: 300 / 280 / 281 W, SM clock 1980 / 1980 / 1980 MHz, power cap in - / 50 / -% of samples"},
		{FFNResult{DenseWatts: 690, TwELLWatts: 700, AutoWatts: 699, DenseSMClockMHz: 1500, TwELLSMClockMHz: 1700, AutoSMClockMHz: 1695,
			D2TWatts: 698.6, D2TSMClockMHz: 1620, D2TPowerCapped: &full},
			"power dense / TwELL / auto: 690 / 700 / 699 W, SM clock 1500 / 1700 / 1695 MHz; D2T alone 699 W at 1620 MHz, power cap in 100% of samples"},
	} {
		if got := c.r.powerSummary(); got != c.want {
			t.Errorf("powerSummary() = %q, want %q", got, c.want)
		}
	}
}
