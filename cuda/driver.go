package cuda

import (
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/twell-ai/twell/cuda/internal/dl"
)

// driver holds the CUDA driver API entry points. Cold calls are purego
// RegisterFunc functions; hot calls (launches, async copies, event records,
// context switches) are raw addresses called through purego.SyscallN, which
// costs about a tenth of a reflect-built call.
type driver struct {
	lib *dl.Library

	cuInit                   func(flags uint32) int32
	cuDriverGetVersion       func(v *int32) int32
	cuDeviceGetCount         func(n *int32) int32
	cuDeviceGet              func(dev *int32, ordinal int32) int32
	cuDeviceGetName          func(name *byte, n int32, dev int32) int32
	cuDeviceGetAttribute     func(v *int32, attr int32, dev int32) int32
	cuDeviceTotalMem         func(b *uint64, dev int32) int32
	cuDeviceGetPCIBusId      func(id *byte, n int32, dev int32) int32
	cuDevicePrimaryCtxRetain func(ctx *uintptr, dev int32) int32
	cuCtxSynchronize         func() int32
	cuMemGetInfo             func(free, total *uint64) int32
	cuMemAlloc               func(p *uint64, size uint64) int32
	cuMemFree                func(p uint64) int32
	cuMemAllocHost           func(p *unsafe.Pointer, size uint64) int32
	cuMemFreeHost            func(p unsafe.Pointer) int32
	cuMemcpyHtoD             func(dst uint64, src unsafe.Pointer, n uint64) int32
	cuMemcpyDtoH             func(dst unsafe.Pointer, src uint64, n uint64) int32
	cuMemcpyDtoD             func(dst, src, n uint64) int32
	cuMemsetD8               func(dst uint64, v uint8, n uint64) int32
	cuMemsetD32              func(dst uint64, v uint32, n uint64) int32
	cuStreamCreate           func(s *uintptr, flags uint32) int32
	cuStreamCreatePriority   func(s *uintptr, flags uint32, priority int32) int32
	cuCtxStreamPriorities    func(least, greatest *int32) int32
	cuStreamDestroy          func(s uintptr) int32
	cuStreamSynchronize      func(s uintptr) int32
	cuStreamQuery            func(s uintptr) int32
	cuEventCreate            func(e *uintptr, flags uint32) int32
	cuEventDestroy           func(e uintptr) int32
	cuEventSynchronize       func(e uintptr) int32
	cuEventQuery             func(e uintptr) int32
	cuEventElapsedTime       func(ms *float32, start, end uintptr) int32
	cuModuleLoadData         func(m *uintptr, image unsafe.Pointer) int32
	cuModuleUnload           func(m uintptr) int32
	cuModuleGetFunction      func(f *uintptr, m uintptr, name string) int32
	cuModuleGetGlobal        func(p *uint64, size *uint64, m uintptr, name string) int32
	cuFuncGetAttribute       func(v *int32, attr int32, f uintptr) int32
	cuFuncSetAttribute       func(f uintptr, attr int32, v int32) int32
	cuFuncGetParamInfo       func(f uintptr, idx uint64, off, size *uint64) int32
	cuOccupancyMaxBlocks     func(n *int32, f uintptr, block int32, smem uint64) int32
	cuOccupancyMaxClusters   func(n *int32, f uintptr, cfg unsafe.Pointer) int32
	cuTensorMapEncodeTiled   func(tm unsafe.Pointer, dtype int32, rank uint32, addr uint64, dims, strides *uint64, box, estr *uint32, interleave, swizzle, l2, oob int32) int32
	cuGetErrorName           func(r int32, s **byte) int32
	cuGetErrorString         func(r int32, s **byte) int32
	cuStreamBeginCapture     func(s uintptr, mode int32) int32
	cuStreamEndCapture       func(s uintptr, g *uintptr) int32
	cuStreamIsCapturing      func(s uintptr, status *int32) int32
	cuGraphInstantiate       func(exec *uintptr, g uintptr, flags uint64) int32
	cuGraphExecDestroy       func(e uintptr) int32
	cuGraphDestroy           func(g uintptr) int32

	// Hot entry points, called with purego.SyscallN.
	pCtxSetCurrent   uintptr
	pLaunchKernel    uintptr
	pLaunchKernelEx  uintptr
	pMemcpyHtoDAsync uintptr
	pMemcpyDtoHAsync uintptr
	pMemcpyDtoDAsync uintptr
	pMemsetD8Async   uintptr
	pMemsetD32Async  uintptr
	pEventRecord     uintptr
	pStreamWaitEvent uintptr
	pGraphLaunch     uintptr
}

// symbols returns the binding table of d.
func (d *driver) symbols() []dl.Symbol {
	S, O := dl.Sym, dl.OptSym
	return []dl.Symbol{
		S(&d.cuInit, "cuInit"),
		S(&d.cuDriverGetVersion, "cuDriverGetVersion"),
		S(&d.cuDeviceGetCount, "cuDeviceGetCount"),
		S(&d.cuDeviceGet, "cuDeviceGet"),
		S(&d.cuDeviceGetName, "cuDeviceGetName"),
		S(&d.cuDeviceGetAttribute, "cuDeviceGetAttribute"),
		S(&d.cuDeviceTotalMem, "cuDeviceTotalMem_v2"),
		S(&d.cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId"),
		S(&d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
		S(&d.cuCtxSynchronize, "cuCtxSynchronize"),
		S(&d.cuMemGetInfo, "cuMemGetInfo_v2"),
		S(&d.cuMemAlloc, "cuMemAlloc_v2"),
		S(&d.cuMemFree, "cuMemFree_v2"),
		S(&d.cuMemAllocHost, "cuMemAllocHost_v2"),
		S(&d.cuMemFreeHost, "cuMemFreeHost"),
		S(&d.cuMemcpyHtoD, "cuMemcpyHtoD_v2"),
		S(&d.cuMemcpyDtoH, "cuMemcpyDtoH_v2"),
		S(&d.cuMemcpyDtoD, "cuMemcpyDtoD_v2"),
		S(&d.cuMemsetD8, "cuMemsetD8_v2"),
		S(&d.cuMemsetD32, "cuMemsetD32_v2"),
		S(&d.cuStreamCreate, "cuStreamCreate"),
		S(&d.cuStreamCreatePriority, "cuStreamCreateWithPriority"),
		S(&d.cuCtxStreamPriorities, "cuCtxGetStreamPriorityRange"),
		S(&d.cuStreamDestroy, "cuStreamDestroy_v2"),
		S(&d.cuStreamSynchronize, "cuStreamSynchronize"),
		S(&d.cuStreamQuery, "cuStreamQuery"),
		S(&d.cuEventCreate, "cuEventCreate"),
		S(&d.cuEventDestroy, "cuEventDestroy_v2"),
		S(&d.cuEventSynchronize, "cuEventSynchronize"),
		S(&d.cuEventQuery, "cuEventQuery"),
		S(&d.cuEventElapsedTime, "cuEventElapsedTime_v2", "cuEventElapsedTime"),
		S(&d.cuModuleLoadData, "cuModuleLoadData"),
		S(&d.cuModuleUnload, "cuModuleUnload"),
		S(&d.cuModuleGetFunction, "cuModuleGetFunction"),
		S(&d.cuModuleGetGlobal, "cuModuleGetGlobal_v2"),
		S(&d.cuFuncGetAttribute, "cuFuncGetAttribute"),
		S(&d.cuFuncSetAttribute, "cuFuncSetAttribute"),
		O(&d.cuFuncGetParamInfo, "cuFuncGetParamInfo"),
		S(&d.cuOccupancyMaxBlocks, "cuOccupancyMaxActiveBlocksPerMultiprocessor"),
		O(&d.cuOccupancyMaxClusters, "cuOccupancyMaxActiveClusters"),
		O(&d.cuTensorMapEncodeTiled, "cuTensorMapEncodeTiled"),
		S(&d.cuGetErrorName, "cuGetErrorName"),
		S(&d.cuGetErrorString, "cuGetErrorString"),
		S(&d.cuStreamBeginCapture, "cuStreamBeginCapture_v2"),
		S(&d.cuStreamEndCapture, "cuStreamEndCapture"),
		S(&d.cuStreamIsCapturing, "cuStreamIsCapturing"),
		S(&d.cuGraphInstantiate, "cuGraphInstantiateWithFlags"),
		S(&d.cuGraphExecDestroy, "cuGraphExecDestroy"),
		S(&d.cuGraphDestroy, "cuGraphDestroy"),

		S(&d.pCtxSetCurrent, "cuCtxSetCurrent"),
		S(&d.pLaunchKernel, "cuLaunchKernel"),
		O(&d.pLaunchKernelEx, "cuLaunchKernelEx"),
		S(&d.pMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"),
		S(&d.pMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2"),
		S(&d.pMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2"),
		S(&d.pMemsetD8Async, "cuMemsetD8Async"),
		S(&d.pMemsetD32Async, "cuMemsetD32Async"),
		S(&d.pEventRecord, "cuEventRecord"),
		S(&d.pStreamWaitEvent, "cuStreamWaitEvent"),
		S(&d.pGraphLaunch, "cuGraphLaunch"),
	}
}

var (
	drvOnce   sync.Once
	drv       *driver
	drvErr    error
	drvLoaded atomic.Pointer[driver] // set once the symbols are bound
)

// driverLibSpec is where libcuda.so.1 is looked for. The toolkit's
// lib64/stubs folder is never searched: its libcuda is a stub that fails.
var driverLibSpec = dl.Spec{
	Name:      "libcuda",
	Sonames:   []string{"libcuda.so.1", "libcuda.so"},
	ExtraDirs: []string{"/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/wsl/lib"},
}

// loadDriver opens libcuda, binds its symbols and calls cuInit(0), once.
func loadDriver() (*driver, error) {
	drvOnce.Do(func() {
		d := &driver{}
		lib, err := dl.Load(driverLibSpec, d.symbols())
		if err != nil {
			drvErr = fmt.Errorf("%w: %v", ErrNoDriver, err)
			return
		}
		d.lib = lib
		drv = d
		drvLoaded.Store(d) // error names now come from the driver
		if err := check(d.cuInit(0), "cuInit"); err != nil {
			drvErr = err
			return
		}
	})
	return drv, drvErr
}

// loadedDriver returns the driver library if it has been opened, else nil.
// It never opens it.
func loadedDriver() *driver { return drvLoaded.Load() }

// DriverVersion returns the CUDA version the driver supports, e.g. 13000
// for CUDA 13.0 (cuDriverGetVersion).
func DriverVersion() (int, error) {
	return driverInt("cuDriverGetVersion", func(d *driver) func(*int32) int32 { return d.cuDriverGetVersion })
}

// Count returns the number of CUDA devices. It returns an error wrapping
// ErrNoDriver when there is no driver library, and one that unwraps to
// ErrorNoDevice when the driver sees no GPU; NoGPU(err) is true for both.
func Count() (int, error) {
	return driverInt("cuDeviceGetCount", func(d *driver) func(*int32) int32 { return d.cuDeviceGetCount })
}

// driverInt loads the driver and returns the number that its function op,
// picked out of it by get, reports.
func driverInt(op string, get func(*driver) func(*int32) int32) (int, error) {
	d, err := loadDriver()
	if err != nil {
		return 0, err
	}
	var v int32
	if err := check(get(d)(&v), op); err != nil {
		return 0, err
	}
	return int(v), nil
}

// LibraryPath returns the path of the loaded driver library, or "" if it is
// not loaded.
func LibraryPath() string {
	if d := loadedDriver(); d != nil {
		return d.lib.Path
	}
	return ""
}

// goString copies the NUL-terminated C string at p.
func goString(p *byte) string { return dl.GoString(p) }

// cBytes trims a fixed C char buffer at its first NUL.
func cBytes(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}
