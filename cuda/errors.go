package cuda

import (
	"errors"
	"fmt"
	"strings"
)

// Result is a CUDA driver API status code (CUresult). A non-zero Result is
// an error whose text is the CUDA error name, e.g. CUDA_ERROR_OUT_OF_MEMORY,
// so errors.Is(err, cuda.ErrorOutOfMemory) works on every error this
// package returns.
type Result int32

// CUDA driver status codes that callers may want to test for with errors.Is.
const (
	Success                   Result = 0
	ErrorInvalidValue         Result = 1
	ErrorOutOfMemory          Result = 2
	ErrorNotInitialized       Result = 3
	ErrorDeinitialized        Result = 4
	ErrorStubLibrary          Result = 34
	ErrorNoDevice             Result = 100
	ErrorInvalidDevice        Result = 101
	ErrorInvalidImage         Result = 200
	ErrorInvalidContext       Result = 201
	ErrorNoBinaryForGPU       Result = 209
	ErrorInvalidPTX           Result = 218
	ErrorUnsupportedPTX       Result = 222
	ErrorInvalidHandle        Result = 400
	ErrorNotFound             Result = 500
	ErrorNotReady             Result = 600
	ErrorIllegalAddress       Result = 700
	ErrorLaunchOutOfResources Result = 701
	ErrorLaunchFailed         Result = 719
	// ErrorCooperativeLaunchTooLarge: a cooperative launch of more blocks
	// than can be resident at once (also where MPS gives the process fewer
	// SMs than the device has).
	ErrorCooperativeLaunchTooLarge Result = 720
	ErrorNotPermitted              Result = 800
	ErrorNotSupported              Result = 801
	ErrorInvalidClusterSize        Result = 912
	ErrorUnknown                   Result = 999
)

var resultNames = map[Result]string{
	Success:                        "CUDA_SUCCESS",
	ErrorInvalidValue:              "CUDA_ERROR_INVALID_VALUE",
	ErrorOutOfMemory:               "CUDA_ERROR_OUT_OF_MEMORY",
	ErrorNotInitialized:            "CUDA_ERROR_NOT_INITIALIZED",
	ErrorDeinitialized:             "CUDA_ERROR_DEINITIALIZED",
	ErrorStubLibrary:               "CUDA_ERROR_STUB_LIBRARY",
	ErrorNoDevice:                  "CUDA_ERROR_NO_DEVICE",
	ErrorInvalidDevice:             "CUDA_ERROR_INVALID_DEVICE",
	ErrorInvalidImage:              "CUDA_ERROR_INVALID_IMAGE",
	ErrorInvalidContext:            "CUDA_ERROR_INVALID_CONTEXT",
	ErrorNoBinaryForGPU:            "CUDA_ERROR_NO_BINARY_FOR_GPU",
	ErrorInvalidPTX:                "CUDA_ERROR_INVALID_PTX",
	ErrorUnsupportedPTX:            "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
	ErrorInvalidHandle:             "CUDA_ERROR_INVALID_HANDLE",
	ErrorNotFound:                  "CUDA_ERROR_NOT_FOUND",
	ErrorNotReady:                  "CUDA_ERROR_NOT_READY",
	ErrorIllegalAddress:            "CUDA_ERROR_ILLEGAL_ADDRESS",
	ErrorLaunchOutOfResources:      "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
	ErrorLaunchFailed:              "CUDA_ERROR_LAUNCH_FAILED",
	ErrorCooperativeLaunchTooLarge: "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
	ErrorNotPermitted:              "CUDA_ERROR_NOT_PERMITTED",
	ErrorNotSupported:              "CUDA_ERROR_NOT_SUPPORTED",
	ErrorInvalidClusterSize:        "CUDA_ERROR_INVALID_CLUSTER_SIZE",
	ErrorUnknown:                   "CUDA_ERROR_UNKNOWN",
}

// Name returns the CUDA error name of r, e.g. "CUDA_ERROR_INVALID_VALUE",
// asking the driver (cuGetErrorName) when it is loaded.
func (r Result) Name() string {
	if d := loadedDriver(); d != nil && d.cuGetErrorName != nil {
		var p *byte
		if d.cuGetErrorName(int32(r), &p) == 0 && p != nil {
			return goString(p)
		}
	}
	if n, ok := resultNames[r]; ok {
		return n
	}
	return fmt.Sprintf("CUDA_ERROR_%d", int32(r))
}

// Error returns the CUDA error name of r.
func (r Result) Error() string { return r.Name() }

// description returns cuGetErrorString's text for r, or "".
func (r Result) description() string {
	if d := loadedDriver(); d != nil && d.cuGetErrorString != nil {
		var p *byte
		if d.cuGetErrorString(int32(r), &p) == 0 && p != nil {
			return goString(p)
		}
	}
	return ""
}

// Error is a failed CUDA call: which operation, on what, and the CUDA status.
// It unwraps to its Result, so errors.Is(err, cuda.ErrorOutOfMemory) works.
type Error struct {
	Op     string // the driver call and its key arguments, e.g. "cuMemAlloc(2 TiB)"
	Code   Result // the CUDA status
	Detail string // the driver's description, or twell's explanation of a misuse it caught
}

// Error formats e as "cuda: OP: CUDA_ERROR_NAME (detail)".
func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("cuda: ")
	b.WriteString(e.Op)
	b.WriteString(": ")
	b.WriteString(e.Code.Name())
	if e.Detail != "" {
		b.WriteString(" (")
		b.WriteString(e.Detail)
		b.WriteString(")")
	}
	return b.String()
}

// Unwrap returns e.Code.
func (e *Error) Unwrap() error { return e.Code }

// check turns a driver status into nil or an *Error for op.
func check(r int32, op string) error {
	if r == 0 {
		return nil
	}
	res := Result(r)
	return &Error{Op: op, Code: res, Detail: res.description()}
}

// misuse reports a mistake that twell catches before the driver would see
// it (or where the driver could not see it, as with the caching allocator),
// with the CUDA status the driver gives for such a call.
func misuse(op string, code Result, format string, a ...any) error {
	return &Error{Op: op, Code: code, Detail: fmt.Sprintf(format, a...)}
}

// ErrNoDriver is returned (wrapped) when the CUDA driver library,
// libcuda.so.1, cannot be loaded: there is no NVIDIA driver on this machine.
var ErrNoDriver = errors.New("cuda: no CUDA driver found")

// ErrNoNVRTC is returned (wrapped) when libnvrtc cannot be loaded, so .cu
// sources cannot be compiled.
var ErrNoNVRTC = errors.New("cuda: NVRTC library not found")

// NoGPU reports whether err means that this machine has no usable GPU: no
// driver library, or a driver that sees no device. Callers fall back to the
// CPU backend on such errors.
func NoGPU(err error) bool {
	return errors.Is(err, ErrNoDriver) || errors.Is(err, ErrorNoDevice) ||
		errors.Is(err, ErrorStubLibrary)
}

// formatBytes writes n bytes in binary units for messages.
func formatBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 4; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTP"[exp])
}
