package llm

import (
	"testing"

	"github.com/twell-ai/twell/gpu"
	"github.com/twell-ai/twell/internal/testutil"
)

// TestOptionsFromEnv checks the engine's switches: each sets its field,
// the MLP's switches reach Options.MLP, and an unknown value is an error
// naming the variable.
func TestOptionsFromEnv(t *testing.T) {
	type c = testutil.EnvCase[Options]
	on := Options{FuseNorms: true, AttnRope: true, GEMMTune: true, DecRope: true} // the defaults
	testutil.CheckEnv(t, Switches, OptionsFromEnv, []c{
		{Env: nil, Want: on},
		{Env: map[string]string{EnvAttention: "mma", EnvFuseNorms: "1"}, Want: Options{Attention: "mma", FuseNorms: true, AttnRope: true, GEMMTune: true, DecRope: true}},
		{Env: map[string]string{EnvAttention: "dec"}, Bad: EnvAttention},
		{Env: map[string]string{EnvFuseNorms: "0", EnvGraphs: "0", gpu.EnvTail: "sorted"},
			Want: Options{NoGraphs: true, AttnRope: true, GEMMTune: true, DecRope: true, MLP: gpu.Options{Tail: gpu.TailSorted}}},
		{Env: map[string]string{EnvAttnRope: "1"}, Want: on},
		{Env: map[string]string{EnvAttnRope: "0"}, Want: Options{FuseNorms: true, GEMMTune: true, DecRope: true}},
		{Env: map[string]string{EnvAttnRope: "yes"}, Bad: EnvAttnRope},
		{Env: map[string]string{EnvGEMMTune: "1"}, Want: on},
		{Env: map[string]string{EnvGEMMTune: "0"}, Want: Options{FuseNorms: true, AttnRope: true, DecRope: true}},
		{Env: map[string]string{EnvDecRope: "1"}, Want: on},
		{Env: map[string]string{EnvDecRope: "0"}, Want: Options{FuseNorms: true, AttnRope: true, GEMMTune: true}},
		{Env: map[string]string{EnvDecRope: "yes"}, Bad: EnvDecRope},
		{Env: map[string]string{EnvGEMMTune: "on"}, Bad: EnvGEMMTune},
		{Env: map[string]string{EnvAttention: "flash"}, Bad: EnvAttention},
		{Env: map[string]string{EnvFuseNorms: "on"}, Bad: EnvFuseNorms},
		{Env: map[string]string{gpu.EnvTail: "on"}, Bad: gpu.EnvTail},
		{Env: map[string]string{EnvGEMV: "0"}, Want: Options{FuseNorms: true, AttnRope: true, GEMMTune: true, DecRope: true, NoGEMV: true}},
		{Env: map[string]string{EnvGEMV: "8"}, Bad: EnvGEMV},
		{Env: map[string]string{EnvGEMV: "1"}, Want: on},
		{Env: map[string]string{EnvGEMV: "16"}, Bad: EnvGEMV},
	})
}
