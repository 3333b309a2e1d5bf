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
		{Env: map[string]string{EnvEarlyStart: "1", EnvTail: "auto"}, Want: Options{}},
		{Env: map[string]string{EnvEarlyStart: "0", EnvTail: "sorted", EnvD2TKernel: "mma"},
			Want: Options{Serial: true, Tail: TailSorted, Kernel: KernelMMA}},
		{Env: map[string]string{EnvD2TKernel: "wgmma"}, Want: Options{Kernel: KernelWGMMA}},
		{Env: map[string]string{EnvD2TKernel: "lt"}, Bad: EnvD2TKernel},
		{Env: map[string]string{EnvD2TKernel: "tma"}, Bad: EnvD2TKernel},
		{Env: map[string]string{EnvEarlyStart: "off"}, Bad: EnvEarlyStart},
		{Env: map[string]string{EnvTail: "split"}, Bad: EnvTail},
		{Env: map[string]string{EnvHotUnits: "1"}, Want: Options{}},
		{Env: map[string]string{EnvHotUnits: "0"}, Want: Options{NoHotUnits: true}},
		{Env: map[string]string{EnvHotUnits: "off"}, Bad: EnvHotUnits},
		{Env: map[string]string{EnvHotD2T: "1"}, Want: Options{}},
		{Env: map[string]string{EnvHotD2T: "0"}, Want: Options{SeparateHot: true}},
		{Env: map[string]string{EnvHotD2T: "no"}, Bad: EnvHotD2T},
		{Env: map[string]string{EnvDenseD2T: "1"}, Want: Options{}},
		{Env: map[string]string{EnvDenseD2T: "0"}, Want: Options{DenseOnCuBLAS: true}},
		{Env: map[string]string{EnvDenseD2T: "cublas"}, Bad: EnvDenseD2T},
		{Env: map[string]string{EnvGEMVFuse: "1"}, Want: Options{}},
		{Env: map[string]string{EnvGEMVFuse: "0"}, Want: Options{SplitGEMV: true}},
		{Env: map[string]string{EnvGEMVFuse: "yes"}, Bad: EnvGEMVFuse},
		{Env: map[string]string{EnvGEMVTimeline: "0"}, Want: Options{}},
		{Env: map[string]string{EnvGEMVTimeline: "1"}, Want: Options{GEMVTimeline: true}},
		{Env: map[string]string{EnvGEMVTimeline: "on"}, Bad: EnvGEMVTimeline},
	})
}
