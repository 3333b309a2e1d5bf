package gpu

import (
	"strings"
	"testing"
)

// TestOptionsFromEnv checks that each switch sets its option, that unset
// ones keep the defaults, and that an unknown value is an error naming the
// variable.
func TestOptionsFromEnv(t *testing.T) {
	for _, c := range []struct {
		env  map[string]string
		want Options
		bad  string // the variable an error names
	}{
		{env: nil, want: Options{}},
		{env: map[string]string{EnvUnion: "9"}, want: Options{UnionFrom: 9}},
		{env: map[string]string{EnvUnion: "65"}, bad: EnvUnion},
		{env: map[string]string{EnvUnion: "-1"}, bad: EnvUnion},
		{env: map[string]string{EnvUnion: "0", EnvEarlyStart: "1"}, want: Options{}},
		{env: map[string]string{EnvEarlyStart: "0", EnvTail: "sorted", EnvD2TKernel: "mma"},
			want: Options{Serial: true, Tail: TailSorted, Kernel: KernelMMA}},
		{env: map[string]string{EnvUnion: "yes"}, bad: EnvUnion},
		{env: map[string]string{EnvUnion: "1"}, want: Options{UnionFrom: 1}},
		{env: map[string]string{EnvEarlyStart: "off"}, bad: EnvEarlyStart},
		{env: map[string]string{EnvTail: "split"}, bad: EnvTail},
		{env: map[string]string{EnvT2URows: "1"}, want: Options{T2URows: 1}},
		{env: map[string]string{EnvT2URows: "4"}, bad: EnvT2URows},
	} {
		for _, name := range []string{EnvUnion, EnvEarlyStart, EnvTail, EnvD2TKernel, EnvT2URows} {
			t.Setenv(name, c.env[name])
		}
		o, err := OptionsFromEnv()
		switch {
		case c.bad != "" && (err == nil || !strings.Contains(err.Error(), c.bad)):
			t.Errorf("env %v: error %v, want one naming %s", c.env, err, c.bad)
		case c.bad == "" && (err != nil || o != c.want):
			t.Errorf("env %v: %+v, %v; want %+v", c.env, o, err, c.want)
		}
	}
}
