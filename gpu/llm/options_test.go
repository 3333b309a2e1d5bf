package llm

import (
	"strings"
	"testing"

	"github.com/twell-ai/twell/gpu"
)

// TestOptionsFromEnv checks the engine's switches: each sets its field,
// the MLP's switches reach Options.MLP, and an unknown value is an error
// naming the variable.
func TestOptionsFromEnv(t *testing.T) {
	vars := []string{EnvAttention, EnvFuseNorms, EnvGraphs, EnvGEMV, EnvKVPageSize, EnvKVMemory,
		gpu.EnvUnion, gpu.EnvD2TKernel, gpu.EnvTail, gpu.EnvEarlyStart, gpu.EnvT2URows}
	for _, c := range []struct {
		env  map[string]string
		want Options
		bad  string
	}{
		{env: nil, want: Options{}},
		{env: map[string]string{EnvAttention: "dec", EnvFuseNorms: "1"}, want: Options{Attention: "dec", FuseNorms: true}},
		{env: map[string]string{EnvFuseNorms: "0", EnvGraphs: "0", gpu.EnvUnion: "1"},
			want: Options{NoGraphs: true, MLP: gpu.Options{UnionFrom: 1}}},
		{env: map[string]string{EnvAttention: "flash"}, bad: EnvAttention},
		{env: map[string]string{EnvFuseNorms: "on"}, bad: EnvFuseNorms},
		{env: map[string]string{gpu.EnvUnion: "on"}, bad: gpu.EnvUnion},
	} {
		for _, name := range vars {
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
