package cuda

import (
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/ebitengine/purego"
)

// Module is a CUBIN (or PTX) loaded on a device (cuModuleLoadData).
type Module struct {
	dev      *Device
	h        uintptr
	name     string
	prog     *Program // how it was compiled, nil for LoadModule
	mu       sync.Mutex
	funcs    map[string]*Function
	unloaded atomic.Bool
}

// LoadModule loads a compiled image (CUBIN, fatbin, or NUL-terminated PTX)
// on the device; name is used in messages.
func (dev *Device) LoadModule(name string, image []byte) (*Module, error) {
	op := fmt.Sprintf("cuModuleLoadData(%s)", name)
	if len(image) == 0 {
		return nil, misuse(op, ErrorInvalidImage, "empty image")
	}
	if err := dev.lock(); err != nil {
		return nil, err
	}
	defer dev.unlock()
	var h uintptr
	r := dev.drv.cuModuleLoadData(&h, unsafe.Pointer(&image[0]))
	runtime.KeepAlive(image)
	if err := check(r, op); err != nil {
		return nil, err
	}
	return &Module{dev: dev, h: h, name: name, funcs: map[string]*Function{}}, nil
}

// Name returns the name the module was compiled or loaded under.
func (m *Module) Name() string { return m.name }

// Program returns how the module was compiled (nil for LoadModule).
func (m *Module) Program() *Program { return m.prog }

// Function returns the kernel called name: an extern "C" name, or a C++
// name expression registered with WithNameExpressions (e.g. "scale<256>").
func (m *Module) Function(name string) (*Function, error) {
	op := fmt.Sprintf("cuModuleGetFunction(%s, %q)", m.name, name)
	if m.unloaded.Load() {
		return nil, misuse(op, ErrorInvalidHandle, "module was unloaded")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if f, ok := m.funcs[name]; ok {
		return f, nil
	}
	sym := name
	if m.prog != nil {
		if lowered, ok := m.prog.LoweredNames[name]; ok {
			sym = lowered
		}
	}
	dev := m.dev
	if err := dev.lock(); err != nil {
		return nil, err
	}
	defer dev.unlock()
	var h uintptr
	if err := check(dev.drv.cuModuleGetFunction(&h, m.h, sym), op); err != nil {
		return nil, err
	}
	f := &Function{mod: m, h: h, name: name}
	f.readParams()
	m.funcs[name] = f
	return f, nil
}

// Global returns the module's __device__ or __constant__ variable called
// name as a Buffer view (it cannot be freed).
func (m *Module) Global(name string) (*Buffer, error) {
	op := fmt.Sprintf("cuModuleGetGlobal(%s, %q)", m.name, name)
	if m.unloaded.Load() {
		return nil, misuse(op, ErrorInvalidHandle, "module was unloaded")
	}
	if err := m.dev.lock(); err != nil {
		return nil, err
	}
	defer m.dev.unlock()
	var p, n uint64
	if err := check(m.dev.drv.cuModuleGetGlobal(&p, &n, m.h, name), op); err != nil {
		return nil, err
	}
	b := &Buffer{dev: m.dev, ptr: DevicePtr(p), size: int(n)}
	b.root = b
	return b, nil
}

// Unload unloads the module; its functions become unusable.
func (m *Module) Unload() error {
	if m.unloaded.Swap(true) {
		return misuse("cuModuleUnload("+m.name+")", ErrorInvalidHandle, "module was already unloaded")
	}
	m.dev.modMu.Lock()
	for k, v := range m.dev.modules {
		if v == m {
			delete(m.dev.modules, k)
		}
	}
	m.dev.modMu.Unlock()
	return m.dev.call("cuModuleUnload("+m.name+")", func() int32 { return m.dev.drv.cuModuleUnload(m.h) })
}

// Function is a kernel in a loaded module.
type Function struct {
	mod  *Module
	h    uintptr
	name string

	params []int // parameter sizes in bytes, nil if the driver cannot say

	dynShared   atomic.Int32 // current MAX_DYNAMIC_SHARED_SIZE_BYTES
	nonPortable atomic.Bool  // NON_PORTABLE_CLUSTER_SIZE_ALLOWED set
}

// Name returns the kernel's name.
func (f *Function) Name() string { return f.name }

// Params returns the kernel's parameter sizes in bytes, as the driver
// reports them (cuFuncGetParamInfo, CUDA 12.4+), or nil if it cannot.
func (f *Function) Params() []int { return f.params }

// readParams asks the driver for the parameter list; called with the
// device locked.
func (f *Function) readParams() {
	d := f.mod.dev.drv
	if d.cuFuncGetParamInfo == nil {
		return
	}
	sizes := []int{}
	for i := uint64(0); i < 1024; i++ {
		var off, size uint64
		if d.cuFuncGetParamInfo(f.h, i, &off, &size) != 0 {
			break
		}
		sizes = append(sizes, int(size))
	}
	f.params = sizes
}

// Function attribute numbers (CUfunction_attribute).
const (
	funcMaxThreadsPerBlock   = 0
	funcSharedSizeBytes      = 1
	funcConstSizeBytes       = 2
	funcLocalSizeBytes       = 3
	funcNumRegs              = 4
	funcPTXVersion           = 5
	funcBinaryVersion        = 6
	funcMaxDynamicShared     = 8
	funcNonPortableClusterOK = 14
)

// FuncAttributes are a compiled kernel's resource needs, for checking that a
// kernel does not spill (LocalBytes) and fits the occupancy you planned.
type FuncAttributes struct {
	MaxThreadsPerBlock int // the most threads a block of this kernel may have
	NumRegs            int // registers per thread
	StaticShared       int // bytes of statically declared shared memory
	LocalBytes         int // bytes of local memory per thread (spills, stack arrays)
	ConstBytes         int // bytes of __constant__ memory
	MaxDynamicShared   int // current dynamic shared memory limit
	PTXVersion         int // e.g. 90
	BinaryVersion      int // e.g. 90
}

// Attributes reads the kernel's attributes (cuFuncGetAttribute).
func (f *Function) Attributes() (FuncAttributes, error) {
	var a FuncAttributes
	dev := f.mod.dev
	if err := dev.lock(); err != nil {
		return a, err
	}
	defer dev.unlock()
	for _, x := range []struct {
		attr int32
		dst  *int
	}{
		{funcMaxThreadsPerBlock, &a.MaxThreadsPerBlock},
		{funcNumRegs, &a.NumRegs},
		{funcSharedSizeBytes, &a.StaticShared},
		{funcLocalSizeBytes, &a.LocalBytes},
		{funcConstSizeBytes, &a.ConstBytes},
		{funcMaxDynamicShared, &a.MaxDynamicShared},
		{funcPTXVersion, &a.PTXVersion},
		{funcBinaryVersion, &a.BinaryVersion},
	} {
		var v int32
		if err := check(dev.drv.cuFuncGetAttribute(&v, x.attr, f.h), fmt.Sprintf("cuFuncGetAttribute(%s, %d)", f.name, x.attr)); err != nil {
			return a, err
		}
		*x.dst = int(v)
	}
	return a, nil
}

// SetAttribute sets a raw CUfunction_attribute (cuFuncSetAttribute).
func (f *Function) SetAttribute(attr, value int) error {
	dev := f.mod.dev
	return dev.call(fmt.Sprintf("cuFuncSetAttribute(%s, %d, %d)", f.name, attr, value), func() int32 {
		return dev.drv.cuFuncSetAttribute(f.h, int32(attr), int32(value))
	})
}

// SetMaxDynamicShared raises (or lowers) the dynamic shared memory a launch
// of f may ask for; above 48 KiB a kernel must opt in this way. Launch calls
// it by itself when sharedBytes exceeds the current limit.
func (f *Function) SetMaxDynamicShared(bytes int) error {
	if err := f.SetAttribute(funcMaxDynamicShared, bytes); err != nil {
		return err
	}
	f.dynShared.Store(int32(bytes))
	return nil
}

// allowCluster lets the kernel run in clusters of shape c above 8 blocks
// (non-portable sizes), once.
func (f *Function) allowCluster(c Dim3) error {
	if n := c[0] * max(c[1], 1) * max(c[2], 1); c[0] > 0 && n > 8 && !f.nonPortable.Load() {
		if err := f.SetAttribute(funcNonPortableClusterOK, 1); err != nil {
			return err
		}
		f.nonPortable.Store(true)
	}
	return nil
}

// MaxActiveBlocksPerSM returns how many blocks of blockSize threads using
// dynShared bytes of dynamic shared memory fit on one multiprocessor.
func (f *Function) MaxActiveBlocksPerSM(blockSize, dynShared int) (int, error) {
	dev := f.mod.dev
	if err := dev.lock(); err != nil {
		return 0, err
	}
	defer dev.unlock()
	var n int32
	err := check(dev.drv.cuOccupancyMaxBlocks(&n, f.h, int32(blockSize), uint64(dynShared)),
		fmt.Sprintf("cuOccupancyMaxActiveBlocksPerMultiprocessor(%s)", f.name))
	return int(n), err
}

// MaxActiveClusters returns how many thread-block clusters of cfg (Grid,
// Block, SharedBytes and Cluster matter) can be resident on the device at
// once (cuOccupancyMaxActiveClusters): a persistent kernel should launch no
// more, or its surplus clusters wait for others to finish.
func (f *Function) MaxActiveClusters(cfg LaunchConfig) (int, error) {
	dev := f.mod.dev
	if dev.drv.cuOccupancyMaxClusters == nil {
		return 0, misuse("cuOccupancyMaxActiveClusters", ErrorNotSupported, "the driver has no cuOccupancyMaxActiveClusters (CUDA 12.0+)")
	}
	if cfg.Cluster == (Dim3{}) {
		return 0, misuse("cuOccupancyMaxActiveClusters", ErrorInvalidValue, "no cluster shape given")
	}
	if err := f.ensureShared(cfg.SharedBytes); err != nil {
		return 0, err
	}
	if err := f.allowCluster(cfg.Cluster); err != nil {
		return 0, err
	}
	var c cuLaunchConfig
	var attrs [3]cuLaunchAttribute
	c.fill(cfg, 0, &attrs)
	if err := dev.lock(); err != nil {
		return 0, err
	}
	defer dev.unlock()
	var n int32
	err := check(dev.drv.cuOccupancyMaxClusters(&n, f.h, unsafe.Pointer(&c)),
		fmt.Sprintf("cuOccupancyMaxActiveClusters(%s, cluster %v)", f.name, cfg.Cluster))
	runtime.KeepAlive(&attrs)
	return int(n), err
}

// Dim3 is a grid or block size: x, y, z. A zero component is an error at
// launch, as in CUDA.
type Dim3 [3]uint32

// String returns "x×y×z".
func (d Dim3) String() string { return fmt.Sprintf("%d×%d×%d", d[0], d[1], d[2]) }

// LaunchConfig describes a launch through cuLaunchKernelEx.
type LaunchConfig struct {
	Grid        Dim3    // blocks
	Block       Dim3    // threads per block
	SharedBytes int     // dynamic shared memory per block
	Stream      *Stream // nil: the default stream
	// Cluster is the thread-block cluster shape (Hopper and later); zero
	// means no cluster. Each Grid component must be a multiple of it.
	// Sizes above 8 blocks are allowed automatically (non-portable).
	Cluster Dim3
	// Cooperative launches all blocks at once so that grid-wide sync works.
	Cooperative bool
	// EarlyStart lets the kernel start while the kernel queued before it on
	// the stream still runs (programmatic dependent launch, Hopper and
	// later): its blocks may begin once every block of that kernel has run
	// griddepcontrol.launch_dependents, or exited. The kernel must run
	// griddepcontrol.wait in every thread before it reads what earlier
	// kernels wrote or writes what they read; before the wait it may only
	// read data that no kernel in flight writes (weights), so that their
	// loads overlap the kernel before.
	EarlyStart bool
}

// ensureShared raises the kernel's dynamic shared limit if a launch needs it.
func (f *Function) ensureShared(shared int) error {
	if shared <= 48<<10 || int32(shared) <= f.dynShared.Load() {
		return nil
	}
	return f.SetMaxDynamicShared(shared)
}

// Launch queues the kernel on stream s (nil: the default stream) with grid
// blocks of block threads and sharedBytes of dynamic shared memory (raising
// the kernel's limit above 48 KiB by itself). Arguments map to kernel
// parameters in order:
//
//	*Buffer, DevicePtr, uintptr, uint64, int64, float64  8 bytes
//	int32, uint32, float32                                4 bytes
//	int16, uint16 (e.g. a bfloat16), int8, uint8, bool    2 / 1 bytes
//	int                                                   the kernel parameter's size (4 or 8), else 4
//	TensorMap, *TensorMap                                 128 bytes, 64-aligned (__grid_constant__ CUtensorMap)
//	[]byte                                                a by-value struct, as is
//
// When the driver reports the kernel's parameters (CUDA 12.4+), a wrong
// count or size is an error naming the parameter, not a bad launch.
func (f *Function) Launch(grid, block Dim3, sharedBytes int, s *Stream, args ...any) error {
	return f.launch(LaunchConfig{Grid: grid, Block: block, SharedBytes: sharedBytes, Stream: s}, false, args)
}

// LaunchEx queues the kernel with cuLaunchKernelEx, which adds thread-block
// clusters (needed by TMA multicast kernels), cooperative launches and
// early starts.
// Arguments are as for Launch.
func (f *Function) LaunchEx(cfg LaunchConfig, args ...any) error {
	return f.launch(cfg, true, args)
}

func (f *Function) launch(cfg LaunchConfig, ex bool, args []any) error {
	dev := f.mod.dev
	if f.mod.unloaded.Load() {
		return misuse("launch "+f.name, ErrorInvalidHandle, "module %s was unloaded", f.mod.name)
	}
	if cfg.SharedBytes < 0 {
		return misuse("launch "+f.name, ErrorInvalidValue, "negative shared memory size %d", cfg.SharedBytes)
	}
	st, err := dev.streamHandle("cuLaunchKernel", cfg.Stream) // a constant op: no allocation per launch
	if err != nil {
		return fmt.Errorf("launch %s: %w", f.name, err)
	}
	if err := f.ensureShared(cfg.SharedBytes); err != nil {
		return err
	}
	if ex && cfg.Cluster == (Dim3{}) && !cfg.Cooperative && !cfg.EarlyStart {
		ex = false // nothing cuLaunchKernel lacks: it works on any driver
	}
	if ex {
		if dev.drv.pLaunchKernelEx == 0 {
			return misuse("cuLaunchKernelEx", ErrorNotSupported, "the driver has no cuLaunchKernelEx (CUDA 12.0+)")
		}
		if err := f.allowCluster(cfg.Cluster); err != nil {
			return err
		}
	}
	pb := paramPool.Get().(*paramBlock)
	defer paramPool.Put(pb)
	if err := pb.pack(f, args); err != nil {
		return err
	}
	params := uintptr(0)
	if len(args) > 0 {
		params = uintptr(unsafe.Pointer(&pb.ptrs[0]))
	}
	var r uintptr
	if err := dev.lock(); err != nil {
		return err
	}
	if !ex {
		r, _, _ = purego.SyscallN(dev.drv.pLaunchKernel, f.h,
			uintptr(cfg.Grid[0]), uintptr(cfg.Grid[1]), uintptr(cfg.Grid[2]),
			uintptr(cfg.Block[0]), uintptr(cfg.Block[1]), uintptr(cfg.Block[2]),
			uintptr(cfg.SharedBytes), st, params, 0)
	} else {
		c := &pb.cfg
		c.fill(cfg, st, &pb.attrs)
		r, _, _ = purego.SyscallN(dev.drv.pLaunchKernelEx, uintptr(unsafe.Pointer(c)), f.h, params, 0)
	}
	dev.unlock()
	runtime.KeepAlive(pb)
	if r != 0 {
		desc := fmt.Sprintf("cuLaunchKernel(%s, grid %v, block %v, shared %d)", f.name, cfg.Grid, cfg.Block, cfg.SharedBytes)
		if ex {
			desc = fmt.Sprintf("cuLaunchKernelEx(%s, grid %v, block %v, cluster %v, shared %d)", f.name, cfg.Grid, cfg.Block, cfg.Cluster, cfg.SharedBytes)
		}
		return check(int32(r), desc)
	}
	return nil
}

// Launch attribute ids (CUlaunchAttributeID).
const (
	launchAttrCooperative  = 2
	launchAttrClusterDim   = 4
	launchAttrProgrammatic = 6 // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
)

// cuLaunchConfig mirrors CUlaunchConfig (56 bytes on 64-bit).
type cuLaunchConfig struct {
	gridX, gridY, gridZ    uint32
	blockX, blockY, blockZ uint32
	shared                 uint32
	_                      uint32
	stream                 uintptr
	attrs                  uintptr
	numAttrs               uint32
	_                      uint32
}

// fill sets c to cfg on stream st, with its cluster shape, cooperative and
// early-start flags as attributes stored in attrs (which must outlive the
// driver call).
func (c *cuLaunchConfig) fill(cfg LaunchConfig, st uintptr, attrs *[3]cuLaunchAttribute) {
	*c = cuLaunchConfig{
		gridX: cfg.Grid[0], gridY: cfg.Grid[1], gridZ: cfg.Grid[2],
		blockX: cfg.Block[0], blockY: cfg.Block[1], blockZ: cfg.Block[2],
		shared: uint32(cfg.SharedBytes), stream: st,
	}
	n := 0
	if cfg.Cluster != (Dim3{}) {
		a := &attrs[n]
		*a = cuLaunchAttribute{id: launchAttrClusterDim}
		*(*Dim3)(unsafe.Pointer(&a.val[0])) = Dim3{cfg.Cluster[0], max(cfg.Cluster[1], 1), max(cfg.Cluster[2], 1)}
		n++
	}
	if cfg.Cooperative {
		a := &attrs[n]
		*a = cuLaunchAttribute{id: launchAttrCooperative}
		*(*int32)(unsafe.Pointer(&a.val[0])) = 1
		n++
	}
	if cfg.EarlyStart {
		a := &attrs[n]
		*a = cuLaunchAttribute{id: launchAttrProgrammatic}
		*(*int32)(unsafe.Pointer(&a.val[0])) = 1
		n++
	}
	if n > 0 {
		c.attrs = uintptr(unsafe.Pointer(&attrs[0]))
		c.numAttrs = uint32(n)
	}
}

// cuLaunchAttribute mirrors CUlaunchAttribute (72 bytes).
type cuLaunchAttribute struct {
	id  uint32
	_   uint32
	val [64]byte
}

const (
	maxParams     = 128
	paramArenaLen = 4096 + 128 // bytes of argument values (+ alignment slack)
)

// paramBlock holds one launch's argument values and the pointer array
// cuLaunchKernel reads them through. Blocks are pooled; they live on the Go
// heap, which does not move.
type paramBlock struct {
	words [paramArenaLen / 8]uint64
	ptrs  [maxParams]uintptr
	cfg   cuLaunchConfig
	attrs [3]cuLaunchAttribute
}

var paramPool = sync.Pool{New: func() any { return new(paramBlock) }}

// argError reports a bad kernel argument.
func argError(f *Function, format string, a ...any) error {
	return misuse("launch "+f.name, ErrorInvalidValue, format, a...)
}

// pack writes args into the block.
func (pb *paramBlock) pack(f *Function, args []any) error {
	if len(args) > maxParams {
		return argError(f, "%d arguments; at most %d are supported", len(args), maxParams)
	}
	if f.params != nil && len(f.params) != len(args) {
		return argError(f, "kernel %s takes %d parameters (sizes %v), got %d arguments", f.name, len(f.params), f.params, len(args))
	}
	base := uintptr(unsafe.Pointer(&pb.words[0]))
	off := uintptr(0)
	for i, a := range args {
		want := 0
		if f.params != nil {
			want = f.params[i]
		}
		var size, align uintptr
		var src unsafe.Pointer
		var tmp uint64
		switch v := a.(type) {
		case *Buffer:
			if err := v.valid("launch " + f.name); err != nil {
				return fmt.Errorf("argument %d: %w", i, err)
			}
			if v.dev != f.mod.dev {
				return argError(f, "argument %d: %v is on another device", i, v)
			}
			tmp, size = uint64(v.ptr), 8
		case DevicePtr:
			tmp, size = uint64(v), 8
		case uintptr:
			tmp, size = uint64(v), 8
		case uint64:
			tmp, size = v, 8
		case int64:
			tmp, size = uint64(v), 8
		case float64:
			tmp, size = math.Float64bits(v), 8
		case int32:
			tmp, size = uint64(uint32(v)), 4
		case uint32:
			tmp, size = uint64(v), 4
		case float32:
			tmp, size = uint64(math.Float32bits(v)), 4
		case int16:
			tmp, size = uint64(uint16(v)), 2
		case uint16:
			tmp, size = uint64(v), 2
		case int8:
			tmp, size = uint64(uint8(v)), 1
		case uint8:
			tmp, size = uint64(v), 1
		case bool:
			if v {
				tmp = 1
			}
			size = 1
		case int:
			if want == 8 {
				tmp, size = uint64(int64(v)), 8
			} else {
				if v < math.MinInt32 || v > math.MaxInt32 {
					return argError(f, "argument %d: int %d does not fit a 32-bit kernel parameter; pass int64", i, v)
				}
				tmp, size = uint64(uint32(int32(v))), 4
			}
		case TensorMap:
			src, size, align = unsafe.Pointer(&v.opaque[0]), 128, 64
		case *TensorMap:
			if v == nil {
				return argError(f, "argument %d: nil *TensorMap", i)
			}
			src, size, align = unsafe.Pointer(&v.opaque[0]), 128, 64
		case []byte:
			if len(v) == 0 {
				return argError(f, "argument %d: empty []byte", i)
			}
			src, size, align = unsafe.Pointer(&v[0]), uintptr(len(v)), 16
		case nil:
			return argError(f, "argument %d is nil", i)
		default:
			return argError(f, "argument %d has unsupported type %T", i, a)
		}
		if want != 0 && int(size) != want {
			return argError(f, "argument %d (%T) is %d bytes but kernel %s's parameter %d is %d bytes", i, a, size, f.name, i, want)
		}
		if align == 0 {
			align = 8
		}
		addr := (base + off + align - 1) &^ (align - 1)
		off = addr - base
		if off+size > paramArenaLen {
			return argError(f, "arguments take more than %d bytes", paramArenaLen-128)
		}
		dst := unsafe.Slice((*byte)(unsafe.Add(unsafe.Pointer(&pb.words[0]), off)), (size+7)&^7)
		clear(dst)
		if src != nil {
			copy(dst, unsafe.Slice((*byte)(src), size))
		} else {
			*(*uint64)(unsafe.Pointer(&dst[0])) = tmp // little-endian: low bytes first
		}
		pb.ptrs[i] = base + off
		off += (size + 7) &^ 7
	}
	return nil
}
