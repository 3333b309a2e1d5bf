package gpu

import (
	"fmt"
	"os"

	"github.com/twell-ai/twell/cuda"
)

// Options are the kernel choices of an MLP that experiments change; the
// zero value picks by device and batch size. OptionsFromEnv reads them from
// the environment once, for the callers that build MLPs (the model engine,
// the benchmarks), which copy them into each MLP with Apply: no environment
// variable is read while MLPs run.
type Options struct {
	Kernel Kernel // D2T kernel: EnvD2TKernel
	Tail   Tail   // sparse tail: EnvTail
	Serial bool   // no early start of the decode-step kernels: EnvEarlyStart = "0"
	// SplitGEMV runs the small-batch MLP of one token as two kernels
	// rather than gemv_mlp's one: EnvGEMVFuse = "0".
	SplitGEMV bool
	// GEMVTimeline runs the small-batch kernels of the GEMV_TIMELINE build,
	// which stamp where gemv_mlp's time goes (MLP.GEMVStamps):
	// EnvGEMVTimeline = "1". A measuring build, not for production.
	GEMVTimeline bool
	// NoHotUnits tells the callers that build MLPs not to calibrate them
	// (MLP.Calibrate), so that no units are computed densely: EnvHotUnits =
	// "0". Apply does not read it.
	NoHotUnits bool
	// SeparateHot computes the hot units' gate and up products with
	// cuBLASLt GEMMs and h with relu_mul, instead of in extra tiles of the
	// wgmma D2T: EnvHotD2T = "0".
	SeparateHot bool
	// DenseOnCuBLAS keeps the automatic path's dense arm on cuBLASLt's
	// GEMMs at every batch size (MLP.DenseOnCuBLAS): EnvDenseD2T = "0".
	DenseOnCuBLAS bool
}

// EnvD2TKernel names the environment variable that, set to "mma" or
// "wgmma", sets Options.Kernel (unset or "auto": KernelAuto).
const EnvD2TKernel = "TWELL_D2T_KERNEL"

// EnvTail names the environment variable that, set to "warp" or "sorted",
// sets Options.Tail (unset or "auto": TailAuto).
const EnvTail = "TWELL_TAIL"

// EnvEarlyStart names the environment variable that, set to "0", sets
// Options.Serial: decode-step and sorted-tail kernels then start only when
// the kernel before them has finished (to compare; see
// cuda.LaunchConfig.EarlyStart).
const EnvEarlyStart = "TWELL_EARLY_START"

// EnvGEMVFuse names the environment variable that, set to "0", sets
// Options.SplitGEMV (gemv_act and gemv_down as two kernels for one token).
const EnvGEMVFuse = "TWELL_GEMV_FUSE"

// EnvGEMVTimeline names the environment variable that, set to "1", sets
// Options.GEMVTimeline.
const EnvGEMVTimeline = "TWELL_GEMV_TIMELINE"

// EnvHotUnits names the environment variable that, set to "0", sets
// Options.NoHotUnits: no hot units calibrated and computed densely
// (hot.go).
const EnvHotUnits = "TWELL_HOT_UNITS"

// EnvHotD2T names the environment variable that, set to "0", sets
// Options.SeparateHot.
const EnvHotD2T = "TWELL_HOT_D2T"

// EnvDenseD2T names the environment variable that, set to "0", sets
// Options.DenseOnCuBLAS.
const EnvDenseD2T = "TWELL_DENSE_D2T"

// Switches are the names of the environment variables that set Options.
var Switches = []string{EnvD2TKernel, EnvTail, EnvEarlyStart, EnvHotUnits, EnvHotD2T, EnvDenseD2T, EnvGEMVFuse, EnvGEMVTimeline}

// OptionsFromEnv returns the Options that EnvD2TKernel, EnvTail,
// EnvEarlyStart, EnvHotUnits, EnvHotD2T, EnvDenseD2T, EnvGEMVFuse and
// EnvGEMVTimeline set, or an error naming a value it does not know.
func OptionsFromEnv() (Options, error) { return OptionsFrom(os.Getenv) }

// OptionsFrom is OptionsFromEnv with the variables' values looked up by
// getenv ("" for unset), for settings that override the environment (the
// benchmarks' variants).
func OptionsFrom(getenv func(string) string) (Options, error) {
	var o Options
	early, err := envBool(getenv, EnvEarlyStart, true)
	if err != nil {
		return o, err
	}
	o.Serial = !early
	hot, err := envBool(getenv, EnvHotUnits, true)
	if err != nil {
		return o, err
	}
	o.NoHotUnits = !hot
	hotD2T, err := envBool(getenv, EnvHotD2T, true)
	if err != nil {
		return o, err
	}
	o.SeparateHot = !hotD2T
	denseD2T, err := envBool(getenv, EnvDenseD2T, true)
	if err != nil {
		return o, err
	}
	o.DenseOnCuBLAS = !denseD2T
	fuse, err := envBool(getenv, EnvGEMVFuse, true)
	if err != nil {
		return o, err
	}
	o.SplitGEMV = !fuse
	if o.GEMVTimeline, err = envBool(getenv, EnvGEMVTimeline, false); err != nil {
		return o, err
	}
	o.Kernel, err = envChoice(getenv, EnvD2TKernel, "auto, wgmma or mma", map[string]Kernel{"wgmma": KernelWGMMA, "mma": KernelMMA})
	if err != nil {
		return o, err
	}
	o.Tail, err = envChoice(getenv, EnvTail, "auto, warp or sorted", map[string]Tail{"warp": TailWarp, "sorted": TailSorted})
	return o, err
}

// envBool returns the switch that variable name sets: "1" on, "0" off,
// unset the given default; any other value is an error.
func envBool(getenv func(string) string, name string, unset bool) (bool, error) {
	switch v := getenv(name); v {
	case "":
		return unset, nil
	case "1":
		return true, nil
	case "0":
		return false, nil
	default:
		return false, fmt.Errorf("gpu: %s=%q: want 0 or 1", name, v)
	}
}

// envChoice returns the choice that variable name picks: the zero value
// when it is unset or "auto", else an error naming the values it takes
// (want).
func envChoice[T any](getenv func(string) string, name, want string, choices map[string]T) (T, error) {
	v := getenv(name)
	c, ok := choices[v]
	if !ok && v != "" && v != "auto" {
		return c, fmt.Errorf("gpu: %s=%q: want %s", name, v, want)
	}
	return c, nil
}

// Apply sets l's kernel choices to o.
func (l *MLP) Apply(o Options) {
	l.Kernel, l.Tail, l.Serial, l.SplitGEMV, l.GEMVTimeline = o.Kernel, o.Tail, o.Serial, o.SplitGEMV, o.GEMVTimeline
	l.SeparateHot, l.DenseOnCuBLAS = o.SeparateHot, o.DenseOnCuBLAS
}

// EarlyStart reports whether kernels that wait with grid_wait (common.cuh)
// should be launched with early start on dev: compute capability 9.0 or
// later, and not serial.
func EarlyStart(dev *cuda.Device, serial bool) bool { return !serial && dev.Properties().Major >= 9 }

// earlyStart reports whether l launches its small-batch kernels with early
// start.
func (l *MLP) earlyStart() bool { return EarlyStart(l.dev, l.Serial) }
