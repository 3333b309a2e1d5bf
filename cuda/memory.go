package cuda

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/ebitengine/purego"
)

// DevicePtr is a device address (CUdeviceptr).
type DevicePtr uint64

// Add returns p advanced by n bytes.
func (p DevicePtr) Add(n int) DevicePtr { return p + DevicePtr(n) }

// Buffer is a range of device memory. Buffers come from Device.Alloc (own
// their memory, and Free gives it back to the device's caching allocator)
// or from Buffer.Slice and Module.Global (views that cannot be freed).
// Copies and kernel arguments check a Buffer's bounds, device and liveness,
// so misuse returns an error rather than corrupting memory.
type Buffer struct {
	dev   *Device
	ptr   DevicePtr
	size  int
	root  *Buffer // the allocation this is a view of; itself for an allocation
	block int     // bytes reserved in the allocator (allocations only)
	freed atomic.Bool
	owned bool // an allocation (may be freed) rather than a view
}

// Ptr returns the buffer's device address.
func (b *Buffer) Ptr() DevicePtr { return b.ptr }

// Len returns the buffer's size in bytes.
func (b *Buffer) Len() int { return b.size }

// Device returns the device the buffer lives on.
func (b *Buffer) Device() *Device { return b.dev }

// String returns e.g. "buffer 0x7f0000000000 (4.0 MiB on GPU 0)".
func (b *Buffer) String() string {
	if b == nil {
		return "nil buffer"
	}
	return fmt.Sprintf("buffer %#x (%s on GPU %d)", uint64(b.ptr), formatBytes(int64(b.size)), b.dev.props.Ordinal)
}

// Slice returns a view of n bytes starting at byte off. The view shares the
// memory; it cannot be freed and becomes invalid when b is freed.
func (b *Buffer) Slice(off, n int) (*Buffer, error) {
	if err := b.valid("Slice"); err != nil {
		return nil, err
	}
	if off < 0 || n < 0 || off > b.size || n > b.size-off {
		return nil, misuse("Slice", ErrorInvalidValue, "range [%d, %d) is outside %v", off, off+n, b)
	}
	return &Buffer{dev: b.dev, ptr: b.ptr.Add(off), size: n, root: b.root}, nil
}

// valid reports misuse of a nil or freed buffer.
func (b *Buffer) valid(op string) error {
	if b == nil {
		return misuse(op, ErrorInvalidValue, "nil buffer")
	}
	if b.root != nil && b.root.freed.Load() {
		return misuse(op, ErrorInvalidValue, "%v was freed", b.root)
	}
	return nil
}

// Free gives the buffer's memory back to the device's caching allocator.
// Free a buffer only when no queued work still uses it, or when the next
// user of the memory is ordered after that work (same stream): the cache
// hands the block out again at once. Freeing twice, or freeing a view,
// returns an error with CUDA_ERROR_INVALID_VALUE, as cuMemFree would.
func (b *Buffer) Free() error {
	if b == nil {
		return misuse("Free", ErrorInvalidValue, "nil buffer")
	}
	if !b.owned {
		return misuse("Free", ErrorInvalidValue, "%v is a view (Slice or Global), not an allocation", b)
	}
	if b.freed.Swap(true) {
		return misuse("Free", ErrorInvalidValue, "%v was already freed", b)
	}
	return b.dev.alloc.free(b.ptr, b.block)
}

// Allocator size classes: small blocks are rounded to 512 bytes, large ones
// to 2 MiB (the driver's own allocation granularity), so that a freed block
// serves any later request of the same class.
const (
	smallLimit = 1 << 20
	smallRound = 512
	largeRound = 2 << 20
)

func roundBlock(n int) int {
	if n <= smallLimit {
		return (n + smallRound - 1) / smallRound * smallRound
	}
	return (n + largeRound - 1) / largeRound * largeRound
}

// allocator is a per-device caching allocator over cuMemAlloc: freed blocks
// are kept in per-size free lists and reused; on out-of-memory the cache is
// returned to the driver and the allocation retried once. Memory is always
// plain device memory, never managed memory.
type allocator struct {
	dev      *Device
	mu       sync.Mutex
	lists    map[int][]DevicePtr
	disabled bool
	stats    MemStats
}

// MemStats counts the caching allocator's activity on one device.
type MemStats struct {
	InUse      int64 // bytes in live allocations (rounded to blocks)
	Cached     int64 // bytes in freed blocks held for reuse
	Allocs     int64 // Alloc calls
	CacheHits  int64 // Alloc calls served from the cache
	DriverCall int64 // cuMemAlloc calls
}

// EnvNoCache names the environment variable that, set to 1, makes every
// Alloc and Free go straight to cuMemAlloc and cuMemFree (for memory
// checkers such as compute-sanitizer).
const EnvNoCache = "TWELL_CUDA_NO_CACHE"

func (a *allocator) init(dev *Device) {
	a.dev = dev
	a.lists = map[int][]DevicePtr{}
	a.disabled = os.Getenv(EnvNoCache) == "1"
}

// Alloc returns n bytes of device memory (cuMemAlloc through the caching
// allocator). The contents are not initialised. Asking for more than the
// device has returns an error that unwraps to ErrorOutOfMemory.
func (dev *Device) Alloc(n int) (*Buffer, error) {
	op := fmt.Sprintf("Alloc(%d bytes)", n)
	if n <= 0 {
		return nil, misuse(op, ErrorInvalidValue, "size must be positive")
	}
	block := roundBlock(n)
	if dev.alloc.disabled {
		block = n
	}
	p, err := dev.alloc.get(block)
	if err != nil {
		return nil, err
	}
	b := &Buffer{dev: dev, ptr: p, size: n, block: block, owned: true}
	b.root = b
	return b, nil
}

func (a *allocator) get(block int) (DevicePtr, error) {
	a.mu.Lock()
	a.stats.Allocs++
	if list := a.lists[block]; len(list) > 0 {
		p := list[len(list)-1]
		a.lists[block] = list[:len(list)-1]
		a.stats.CacheHits++
		a.stats.Cached -= int64(block)
		a.stats.InUse += int64(block)
		a.mu.Unlock()
		return p, nil
	}
	a.mu.Unlock()
	p, err := a.dev.memAlloc(block)
	if err != nil && errorsIsOOM(err) {
		if a.EmptyCache() == nil {
			p, err = a.dev.memAlloc(block)
		}
	}
	if err != nil {
		return 0, err
	}
	a.mu.Lock()
	a.stats.DriverCall++
	a.stats.InUse += int64(block)
	a.mu.Unlock()
	return p, nil
}

func errorsIsOOM(err error) bool {
	e, ok := err.(*Error)
	return ok && e.Code == ErrorOutOfMemory
}

func (a *allocator) free(p DevicePtr, block int) error {
	a.mu.Lock()
	a.stats.InUse -= int64(block)
	if !a.disabled {
		a.lists[block] = append(a.lists[block], p)
		a.stats.Cached += int64(block)
		a.mu.Unlock()
		return nil
	}
	a.mu.Unlock()
	return a.dev.MemFree(p)
}

// EmptyCache returns every cached block to the driver.
func (a *allocator) EmptyCache() error {
	a.mu.Lock()
	lists := a.lists
	a.lists = map[int][]DevicePtr{}
	a.mu.Unlock()
	var first error
	for block, list := range lists {
		for _, p := range list {
			if err := a.dev.MemFree(p); err != nil && first == nil {
				first = err
			}
			a.mu.Lock()
			a.stats.Cached -= int64(block)
			a.mu.Unlock()
		}
	}
	return first
}

// EmptyCache returns the caching allocator's free blocks to the driver.
func (dev *Device) EmptyCache() error { return dev.alloc.EmptyCache() }

// MemStats returns the caching allocator's counters.
func (dev *Device) MemStats() MemStats {
	dev.alloc.mu.Lock()
	defer dev.alloc.mu.Unlock()
	return dev.alloc.stats
}

// MemAlloc calls cuMemAlloc directly, bypassing the cache. Most code should
// use Alloc; this is for memory handed to other libraries.
func (dev *Device) MemAlloc(n int) (DevicePtr, error) {
	if n <= 0 {
		return 0, misuse(fmt.Sprintf("cuMemAlloc(%d bytes)", n), ErrorInvalidValue, "size must be positive")
	}
	return dev.memAlloc(n)
}

func (dev *Device) memAlloc(n int) (DevicePtr, error) {
	if err := dev.lock(); err != nil {
		return 0, err
	}
	defer dev.unlock()
	var p uint64
	if err := check(dev.drv.cuMemAlloc(&p, uint64(n)), fmt.Sprintf("cuMemAlloc(%s) on %v", formatBytes(int64(n)), dev)); err != nil {
		return 0, err
	}
	return DevicePtr(p), nil
}

// MemFree calls cuMemFree directly on memory from MemAlloc. Freeing an
// address twice returns the driver's error.
func (dev *Device) MemFree(p DevicePtr) error {
	return dev.call(fmt.Sprintf("cuMemFree(%#x)", uint64(p)), func() int32 { return dev.drv.cuMemFree(uint64(p)) })
}

// Bytes returns the memory of a slice of fixed-size values as bytes, for
// copies: dev.CopyHtoD(buf, cuda.Bytes(weights)).
func Bytes[T any](s []T) []byte {
	if len(s) == 0 {
		return nil
	}
	var z T
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), len(s)*int(unsafe.Sizeof(z)))
}

// copyCheck validates a copy of n bytes touching the given buffers.
func (dev *Device) copyCheck(op string, n int, bufs ...*Buffer) error {
	for _, b := range bufs {
		if err := b.valid(op); err != nil {
			return err
		}
		if b.dev != dev {
			return misuse(op, ErrorInvalidContext, "%v belongs to another device than %v", b, dev)
		}
		if n > b.size {
			return misuse(op, ErrorInvalidValue, "copy of %d bytes is out of bounds of %v (%d bytes)", n, b, b.size)
		}
	}
	return nil
}

// CopyHtoD copies src to the start of dst and waits for the copy.
func (dev *Device) CopyHtoD(dst *Buffer, src []byte) error {
	op := "CopyHtoD"
	if err := dev.copyCheck(op, len(src), dst); err != nil || len(src) == 0 {
		return err
	}
	return dev.call("cuMemcpyHtoD", func() int32 {
		r := dev.drv.cuMemcpyHtoD(uint64(dst.ptr), unsafe.Pointer(&src[0]), uint64(len(src)))
		runtime.KeepAlive(src)
		return r
	})
}

// CopyDtoH copies len(dst) bytes from the start of src into dst and waits.
// It is ordered after earlier work on the default stream and on streams
// from NewStream.
func (dev *Device) CopyDtoH(dst []byte, src *Buffer) error {
	op := "CopyDtoH"
	if err := dev.copyCheck(op, len(dst), src); err != nil || len(dst) == 0 {
		return err
	}
	return dev.call("cuMemcpyDtoH", func() int32 {
		r := dev.drv.cuMemcpyDtoH(unsafe.Pointer(&dst[0]), uint64(src.ptr), uint64(len(dst)))
		runtime.KeepAlive(dst)
		return r
	})
}

// CopyDtoD copies n bytes from the start of src to the start of dst.
func (dev *Device) CopyDtoD(dst, src *Buffer, n int) error {
	if err := dev.copyCheck("CopyDtoD", n, dst, src); err != nil || n == 0 {
		return err
	}
	return dev.call("cuMemcpyDtoD", func() int32 {
		return dev.drv.cuMemcpyDtoD(uint64(dst.ptr), uint64(src.ptr), uint64(n))
	})
}

// CopyHtoDAsync queues a copy of src to the start of dst on stream s (nil:
// the default stream). src must stay unchanged until the copy is done; from
// pageable Go memory the driver stages it before returning, from a
// HostBuffer the copy is truly asynchronous.
func (dev *Device) CopyHtoDAsync(dst *Buffer, src []byte, s *Stream) error {
	if err := dev.copyCheck("CopyHtoDAsync", len(src), dst); err != nil || len(src) == 0 {
		return err
	}
	return dev.hot3("cuMemcpyHtoDAsync", dev.drv.pMemcpyHtoDAsync, uintptr(dst.ptr), uintptr(unsafe.Pointer(&src[0])), uintptr(len(src)), s)
}

// CopyDtoHAsync queues a copy of len(dst) bytes from the start of src into
// dst on stream s. Into pageable Go memory the driver completes the copy
// before returning; into a HostBuffer, synchronise s before reading dst.
func (dev *Device) CopyDtoHAsync(dst []byte, src *Buffer, s *Stream) error {
	if err := dev.copyCheck("CopyDtoHAsync", len(dst), src); err != nil || len(dst) == 0 {
		return err
	}
	return dev.hot3("cuMemcpyDtoHAsync", dev.drv.pMemcpyDtoHAsync, uintptr(unsafe.Pointer(&dst[0])), uintptr(src.ptr), uintptr(len(dst)), s)
}

// CopyDtoDAsync queues a copy of n bytes from src to dst on stream s.
func (dev *Device) CopyDtoDAsync(dst, src *Buffer, n int, s *Stream) error {
	if err := dev.copyCheck("CopyDtoDAsync", n, dst, src); err != nil || n == 0 {
		return err
	}
	return dev.hot3("cuMemcpyDtoDAsync", dev.drv.pMemcpyDtoDAsync, uintptr(dst.ptr), uintptr(src.ptr), uintptr(n), s)
}

// Memset8 queues setting every byte of b to v on stream s (nil: default).
func (dev *Device) Memset8(b *Buffer, v byte, s *Stream) error {
	if err := dev.copyCheck("Memset8", 0, b); err != nil {
		return err
	}
	return dev.hot3("cuMemsetD8Async", dev.drv.pMemsetD8Async, uintptr(b.ptr), uintptr(v), uintptr(b.size), s)
}

// Memset32 queues setting every 32-bit word of b to v on stream s; b's
// length must be a multiple of 4.
func (dev *Device) Memset32(b *Buffer, v uint32, s *Stream) error {
	if err := dev.copyCheck("Memset32", 0, b); err != nil {
		return err
	}
	if b.size%4 != 0 {
		return misuse("Memset32", ErrorInvalidValue, "%v is not a whole number of 32-bit words", b)
	}
	return dev.hot3("cuMemsetD32Async", dev.drv.pMemsetD32Async, uintptr(b.ptr), uintptr(v), uintptr(b.size/4), s)
}

// hot3 calls a three-argument-plus-stream entry point through SyscallN.
//
//go:uintptrescapes
func (dev *Device) hot3(op string, fn uintptr, a, b, c uintptr, s *Stream) error {
	st, err := dev.streamHandle(op, s)
	if err != nil {
		return err
	}
	return dev.hot(op, fn, a, b, c, st)
}

// hot calls a hot entry point through SyscallN with the device's context
// current and checks its result.
func (dev *Device) hot(op string, fn uintptr, args ...uintptr) error {
	if err := dev.lock(); err != nil {
		return err
	}
	r, _, _ := purego.SyscallN(fn, args...)
	dev.unlock()
	return check(int32(r), op)
}

// HostBuffer is page-locked (pinned) host memory from cuMemAllocHost, for
// truly asynchronous copies. Its bytes are outside the Go heap.
type HostBuffer struct {
	dev   *Device
	p     unsafe.Pointer
	n     int
	freed atomic.Bool
}

// AllocHost returns n bytes of pinned host memory.
func (dev *Device) AllocHost(n int) (*HostBuffer, error) {
	op := fmt.Sprintf("cuMemAllocHost(%d bytes)", n)
	if n <= 0 {
		return nil, misuse(op, ErrorInvalidValue, "size must be positive")
	}
	if err := dev.lock(); err != nil {
		return nil, err
	}
	defer dev.unlock()
	var p unsafe.Pointer
	if err := check(dev.drv.cuMemAllocHost(&p, uint64(n)), op); err != nil {
		return nil, err
	}
	return &HostBuffer{dev: dev, p: p, n: n}, nil
}

// Bytes returns the pinned memory; it must not be used after Free.
func (h *HostBuffer) Bytes() []byte { return unsafe.Slice((*byte)(h.p), h.n) }

// Free releases the pinned memory. Freeing twice returns an error.
func (h *HostBuffer) Free() error {
	if h.freed.Swap(true) {
		return misuse("cuMemFreeHost", ErrorInvalidValue, "host buffer of %d bytes was already freed", h.n)
	}
	return h.dev.call("cuMemFreeHost", func() int32 { return h.dev.drv.cuMemFreeHost(h.p) })
}
