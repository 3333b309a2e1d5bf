package gpu

import (
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// TestOptionsFromEnv checks that each switch sets its option, that unset
// ones keep the defaults, and that an unknown value is an error naming the
// variable.
func TestOptionsFromEnv(t *testing.T) {
	type c = testutil.EnvCase[Options]
	testutil.CheckEnv(t, Switches, OptionsFromEnv, []c{
		{Env: nil, Want: Options{}},
		{Env: map[string]string{EnvUnion: "9"}, Want: Options{UnionFrom: 9}},
		{Env: map[string]string{EnvUnion: "65"}, Bad: EnvUnion},
		{Env: map[string]string{EnvUnion: "-1"}, Bad: EnvUnion},
		{Env: map[string]string{EnvUnion: "0", EnvEarlyStart: "1"}, Want: Options{}},
		{Env: map[string]string{EnvEarlyStart: "0", EnvTail: "sorted", EnvD2TKernel: "mma"},
			Want: Options{Serial: true, Tail: TailSorted, Kernel: KernelMMA}},
		{Env: map[string]string{EnvUnion: "yes"}, Bad: EnvUnion},
		{Env: map[string]string{EnvUnion: "1"}, Want: Options{UnionFrom: 1}},
		{Env: map[string]string{EnvEarlyStart: "off"}, Bad: EnvEarlyStart},
		{Env: map[string]string{EnvTail: "split"}, Bad: EnvTail},
	})
}
