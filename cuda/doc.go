// Package cuda drives NVIDIA GPUs from pure Go (CGO_ENABLED=0): the CUDA
// driver API, NVRTC kernel compilation with a disk cache, device memory with
// a caching allocator, streams, events, graphs, kernel launches (with
// clusters and more than 48 KiB of dynamic shared memory) and TMA tensor
// maps. The libraries are opened at run time through purego; no CUDA
// headers or toolkit are needed to build, and on a machine without a GPU
// every entry point returns an error for which NoGPU is true.
//
// A typical kernel launcher embeds its .cu source, compiles it once per
// process (the CUBIN is cached on disk) and launches it:
//
//	//go:embed fill.cu
//	var fillSrc []byte
//
//	dev, err := cuda.Open(0)
//	mod, err := dev.Compile("fill.cu", fillSrc)          // sm_90a on H100/H200
//	fill, err := mod.Function("fill_bf16")
//	buf, err := dev.Alloc(n * 2)
//	err = fill.Launch(cuda.Dim3{uint32((n + 255) / 256), 1, 1}, cuda.Dim3{256, 1, 1}, 0, nil, buf, uint16(0x3f80), int32(n))
//
// # Threads and contexts
//
// Each device is used through its primary context. Every method locks the
// calling goroutine to its OS thread and makes that context current for the
// duration of the driver call, so Devices, Buffers, Streams and Functions
// may be used from any goroutine. Device.Do gives other CUDA libraries
// (cuBLAS, NCCL) the same guarantee.
//
// # Errors
//
// Failed driver calls return an *Error naming the call and the CUDA error
// (CUDA_ERROR_OUT_OF_MEMORY, ...); it unwraps to a Result, so
// errors.Is(err, cuda.ErrorOutOfMemory) works. Misuse that twell catches
// before the driver (a double free, a copy out of bounds, a kernel argument
// of the wrong size) returns the same type with the status the driver would
// give. Compile errors are *NVRTCError values carrying NVRTC's log with file
// and line.
//
// # Environment
//
//	TWELL_CUDA_LIB_DIR      folders searched first for libcuda, libnvrtc, libcublas(Lt), libnvidia-ml, libcupti
//	TWELL_CUDA_INCLUDE_DIR  the folder with cuda_bf16.h, if not found by itself
//	TWELL_KERNEL_CACHE      "off", or the CUBIN cache folder (default: user cache dir/twell/kernels)
//	TWELL_CUBIN_DUMP        a folder where every compiled CUBIN is also written, for cuobjdump
//	TWELL_CUDA_NO_CACHE     1: no caching allocator (each Alloc is a cuMemAlloc), for memory checkers
package cuda
