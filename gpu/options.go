package gpu

import (
	"fmt"
	"os"
)

// Options are the kernel choices of an MLP that experiments change; the
// zero value picks by device and batch size. OptionsFromEnv reads them from
// the environment once, for the callers that build MLPs (the model engine,
// the benchmarks), which copy them into each MLP with Apply: no environment
// variable is read while MLPs run.
type Options struct {
	Kernel Kernel // D2T kernel: EnvD2TKernel
	Tail   Tail   // sparse tail: EnvTail
}

// EnvD2TKernel names the environment variable that, set to "mma" or
// "wgmma", sets Options.Kernel (unset or "auto": KernelAuto).
const EnvD2TKernel = "TWELL_D2T_KERNEL"

// EnvTail names the environment variable that, set to "warp" or "sorted",
// sets Options.Tail (unset or "auto": TailAuto).
const EnvTail = "TWELL_TAIL"

// OptionsFromEnv returns the Options that EnvD2TKernel and EnvTail set, or
// an error naming a value it does not know.
func OptionsFromEnv() (Options, error) {
	var o Options
	switch v := os.Getenv(EnvD2TKernel); v {
	case "", "auto":
	case "wgmma":
		o.Kernel = KernelWGMMA
	case "mma":
		o.Kernel = KernelMMA
	default:
		return o, fmt.Errorf("gpu: %s=%q: want auto, wgmma or mma", EnvD2TKernel, v)
	}
	switch v := os.Getenv(EnvTail); v {
	case "", "auto":
	case "warp":
		o.Tail = TailWarp
	case "sorted":
		o.Tail = TailSorted
	default:
		return o, fmt.Errorf("gpu: %s=%q: want auto, warp or sorted", EnvTail, v)
	}
	return o, nil
}

// Apply sets l's kernel choices to o.
func (l *MLP) Apply(o Options) { l.Kernel, l.Tail = o.Kernel, o.Tail }
