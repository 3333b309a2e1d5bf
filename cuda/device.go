package cuda

import (
	"fmt"
	"runtime"
	"sync"

	"github.com/ebitengine/purego"
)

// Properties describes a CUDA device, read once when it is opened.
type Properties struct {
	Ordinal             int    // CUDA device ordinal
	Name                string // e.g. "NVIDIA H200"
	Major, Minor        int    // compute capability, e.g. 9 and 0
	Arch                string // the NVRTC target twell builds for, e.g. "sm_90a"
	SMs                 int    // streaming multiprocessors
	TotalMemory         int64  // bytes of device memory
	L2Bytes             int    // L2 cache size
	SharedPerBlock      int    // shared memory a block gets without opting in (48 KiB)
	SharedPerBlockOptin int    // shared memory a block may get after SetMaxDynamicShared
	SharedPerSM         int    // shared memory per multiprocessor
	RegistersPerBlock   int
	RegistersPerSM      int
	MaxThreadsPerBlock  int
	MaxThreadsPerSM     int
	WarpSize            int
	MaxBlockDim         [3]int
	MaxGridDim          [3]int
	ClockKHz            int    // peak SM clock (0 if the driver no longer reports it)
	MemoryClockKHz      int    // peak memory clock (0 if not reported)
	MemoryBusWidth      int    // bits
	PCIBusID            string // e.g. "0000:18:00.0", used to match NVML devices
	ClusterLaunch       bool   // thread-block clusters (Hopper and later)
	CooperativeLaunch   bool
}

// ComputeCapability returns the capability as "9.0".
func (p *Properties) ComputeCapability() string { return fmt.Sprintf("%d.%d", p.Major, p.Minor) }

// archFor returns the NVRTC target for a compute capability: the
// architecture-specific "a" variant where one exists (wgmma, setmaxnreg
// need sm_90a on Hopper), else plain sm_XY.
func archFor(major, minor int) string {
	switch {
	case major == 9 && minor == 0, major == 10 && minor == 0, major == 10 && minor == 3,
		major == 12 && minor == 0, major == 12 && minor == 1:
		return fmt.Sprintf("sm_%d%da", major, minor)
	}
	return fmt.Sprintf("sm_%d%d", major, minor)
}

// Device attribute numbers (CUdevice_attribute).
const (
	attrMaxThreadsPerBlock   = 1
	attrMaxBlockDimX         = 2
	attrMaxGridDimX          = 5
	attrSharedPerBlock       = 8
	attrWarpSize             = 10
	attrRegistersPerBlock    = 12
	attrClockRate            = 13
	attrMultiprocessorCount  = 16
	attrMemoryClockRate      = 36
	attrGlobalMemoryBusWidth = 37
	attrL2CacheSize          = 38
	attrMaxThreadsPerSM      = 39
	attrCCMajor              = 75
	attrCCMinor              = 76
	attrSharedPerSM          = 81
	attrRegistersPerSM       = 82
	attrCooperativeLaunch    = 95
	attrSharedPerBlockOptin  = 97
	attrClusterLaunch        = 120
)

// Device is one GPU with its primary context. It is safe for concurrent use:
// every method locks the calling goroutine to its OS thread and makes the
// device's primary context current on that thread for the duration of the
// driver call, so a Device may be used from any goroutine, and several
// devices from one goroutine. Do runs other CUDA libraries' calls (cuBLAS,
// NCCL) under the same guarantee.
//
// Open returns the same *Device for the same ordinal for the life of the
// process; the primary context is never released.
type Device struct {
	drv   *driver
	dev   int32   // CUdevice
	ctx   uintptr // CUcontext (primary)
	props Properties

	alloc allocator

	modMu   sync.Mutex
	modules map[string]*Module // by compile key
}

var (
	devMu   sync.Mutex
	devices = map[int]*Device{}
)

// Open returns device ordinal (0-based) with its primary context retained.
// Without a driver or a GPU it returns an error for which NoGPU is true.
func Open(ordinal int) (*Device, error) {
	d, err := loadDriver()
	if err != nil {
		return nil, err
	}
	devMu.Lock()
	defer devMu.Unlock()
	if dev, ok := devices[ordinal]; ok {
		return dev, nil
	}
	n, err := Count()
	if err != nil {
		return nil, err
	}
	if ordinal < 0 || ordinal >= n {
		return nil, misuse(fmt.Sprintf("Open(%d)", ordinal), ErrorInvalidDevice, "this machine has %d CUDA device(s)", n)
	}
	dev := &Device{drv: d, modules: map[string]*Module{}}
	if err := check(d.cuDeviceGet(&dev.dev, int32(ordinal)), fmt.Sprintf("cuDeviceGet(%d)", ordinal)); err != nil {
		return nil, err
	}
	if err := dev.readProperties(ordinal); err != nil {
		return nil, err
	}
	if err := check(d.cuDevicePrimaryCtxRetain(&dev.ctx, dev.dev), fmt.Sprintf("cuDevicePrimaryCtxRetain(%d)", ordinal)); err != nil {
		return nil, err
	}
	dev.alloc.init(dev)
	devices[ordinal] = dev
	return dev, nil
}

func (dev *Device) readProperties(ordinal int) error {
	d := dev.drv
	p := &dev.props
	p.Ordinal = ordinal
	var name [256]byte
	if err := check(d.cuDeviceGetName(&name[0], int32(len(name)), dev.dev), "cuDeviceGetName"); err != nil {
		return err
	}
	p.Name = cBytes(name[:])
	var total uint64
	if err := check(d.cuDeviceTotalMem(&total, dev.dev), "cuDeviceTotalMem"); err != nil {
		return err
	}
	p.TotalMemory = int64(total)
	var bus [64]byte
	if d.cuDeviceGetPCIBusId(&bus[0], int32(len(bus)), dev.dev) == 0 {
		p.PCIBusID = cBytes(bus[:])
	}
	get := func(attr int32, dst *int, required bool) error {
		var v int32
		if r := d.cuDeviceGetAttribute(&v, attr, dev.dev); r != 0 {
			if required {
				return check(r, fmt.Sprintf("cuDeviceGetAttribute(%d)", attr))
			}
			return nil
		}
		*dst = int(v)
		return nil
	}
	var cluster, coop int
	for _, a := range []struct {
		attr     int32
		dst      *int
		required bool
	}{
		{attrCCMajor, &p.Major, true},
		{attrCCMinor, &p.Minor, true},
		{attrMultiprocessorCount, &p.SMs, true},
		{attrL2CacheSize, &p.L2Bytes, true},
		{attrSharedPerBlock, &p.SharedPerBlock, true},
		{attrSharedPerBlockOptin, &p.SharedPerBlockOptin, false},
		{attrSharedPerSM, &p.SharedPerSM, false},
		{attrRegistersPerBlock, &p.RegistersPerBlock, false},
		{attrRegistersPerSM, &p.RegistersPerSM, false},
		{attrMaxThreadsPerBlock, &p.MaxThreadsPerBlock, true},
		{attrMaxThreadsPerSM, &p.MaxThreadsPerSM, false},
		{attrWarpSize, &p.WarpSize, false},
		{attrClockRate, &p.ClockKHz, false},
		{attrMemoryClockRate, &p.MemoryClockKHz, false},
		{attrGlobalMemoryBusWidth, &p.MemoryBusWidth, false},
		{attrClusterLaunch, &cluster, false},
		{attrCooperativeLaunch, &coop, false},
	} {
		if err := get(a.attr, a.dst, a.required); err != nil {
			return err
		}
	}
	for i := 0; i < 3; i++ {
		_ = get(attrMaxBlockDimX+int32(i), &p.MaxBlockDim[i], false)
		_ = get(attrMaxGridDimX+int32(i), &p.MaxGridDim[i], false)
	}
	p.ClusterLaunch = cluster != 0
	p.CooperativeLaunch = coop != 0
	p.Arch = archFor(p.Major, p.Minor)
	return nil
}

// Properties returns the device's properties.
func (dev *Device) Properties() Properties { return dev.props }

// Ordinal returns the device's CUDA ordinal.
func (dev *Device) Ordinal() int { return dev.props.Ordinal }

// String returns e.g. "GPU 0 (NVIDIA H200, sm_90a)".
func (dev *Device) String() string {
	return fmt.Sprintf("GPU %d (%s, %s)", dev.props.Ordinal, dev.props.Name, dev.props.Arch)
}

// lock pins the goroutine to its OS thread and makes the primary context
// current there. Every successful lock must be paired with unlock.
func (dev *Device) lock() error {
	runtime.LockOSThread()
	r, _, _ := purego.SyscallN(dev.drv.pCtxSetCurrent, dev.ctx)
	if int32(r) != 0 {
		runtime.UnlockOSThread()
		return check(int32(r), "cuCtxSetCurrent")
	}
	return nil
}

func (dev *Device) unlock() { runtime.UnlockOSThread() }

// Do runs f on a locked OS thread with the device's primary context current.
// Use it for calls into other CUDA libraries (cuBLAS, NCCL) that work on the
// current context. f should not call methods of another Device, which would
// leave that device's context current.
func (dev *Device) Do(f func() error) error {
	if err := dev.lock(); err != nil {
		return err
	}
	defer dev.unlock()
	return f()
}

// call makes one driver call, f, like Do and checks its result, naming op
// in the error.
func (dev *Device) call(op string, f func() int32) error {
	if err := dev.lock(); err != nil {
		return err
	}
	defer dev.unlock()
	return check(f(), op)
}

// Context returns the raw CUcontext handle (the device's primary context),
// for libraries that take one.
func (dev *Device) Context() uintptr { return dev.ctx }

// Synchronize waits until all work on the device has finished and returns
// the first asynchronous error, if any (cuCtxSynchronize).
func (dev *Device) Synchronize() error {
	return dev.call("cuCtxSynchronize", func() int32 { return dev.drv.cuCtxSynchronize() })
}

// Available returns the device memory an allocation can get, in bytes: what
// the driver has free (MemInfo) plus the blocks the caching allocator holds
// for reuse, which it gives back to the driver when an allocation would
// otherwise fail. Checks of whether something fits use this, not MemInfo's
// free: after a large buffer is freed, the driver alone does not count it.
func (dev *Device) Available() (int64, error) {
	free, _, err := dev.MemInfo()
	if err != nil {
		return 0, err
	}
	return free + dev.MemStats().Cached, nil
}

// MemInfo returns the device's free and total memory in bytes (cuMemGetInfo).
// Memory held by the caching allocator counts as used.
func (dev *Device) MemInfo() (free, total int64, err error) {
	if err := dev.lock(); err != nil {
		return 0, 0, err
	}
	defer dev.unlock()
	var f, t uint64
	if err := check(dev.drv.cuMemGetInfo(&f, &t), "cuMemGetInfo"); err != nil {
		return 0, 0, err
	}
	return int64(f), int64(t), nil
}
