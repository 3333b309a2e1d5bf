package llm

import (
	"fmt"
	"os"

	"github.com/twell-ai/twell/gpu"
)

// Options are the engine settings that experiments change, read from the
// environment once per engine by OptionsFromEnv (NewEngine copies them into
// the Engine's fields and its MLPs; nothing reads the environment while the
// engine runs).
type Options struct {
	Attention string      // Engine.Attention: EnvAttention
	NoGraphs  bool        // Engine.NoGraphs: EnvGraphs = "0"
	NoGEMV    bool        // Engine.NoGEMV: EnvGEMV = "0"
	MLP       gpu.Options // each TwELL layer's kernels: gpu.EnvD2TKernel, gpu.EnvTail
}

// EnvAttention names the environment variable that sets a new Engine's
// Attention field ("auto", "wgmma3", "mma" or "ref"), to compare the
// kernels.
const EnvAttention = "TWELL_LLM_ATTENTION"

// EnvGraphs names the environment variable that, set to "0", makes a new
// Engine run decode steps kernel by kernel instead of replaying CUDA graphs
// (Engine.NoGraphs).
const EnvGraphs = "TWELL_GRAPHS"

// EnvGEMV names the environment variable that, set to "0", makes a new
// Engine run every projection through cuBLASLt (NoGEMV).
const EnvGEMV = "TWELL_GEMV"

// OptionsFromEnv returns the Options the environment sets, or an error
// naming a value it does not know.
func OptionsFromEnv() (Options, error) {
	o := Options{Attention: os.Getenv(EnvAttention), NoGraphs: os.Getenv(EnvGraphs) == "0", NoGEMV: os.Getenv(EnvGEMV) == "0"}
	switch o.Attention {
	case "", "auto", "wgmma3", "mma", "ref":
	default:
		return o, fmt.Errorf("llm: %s=%q: want auto, wgmma3, mma or ref", EnvAttention, o.Attention)
	}
	var err error
	o.MLP, err = gpu.OptionsFromEnv()
	return o, err
}
