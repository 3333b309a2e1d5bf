//go:build linux

package llm

import "syscall"

// mapKV reserves n bytes of zeroed memory for KV caches: an anonymous
// private mapping that takes memory only where it is written, without
// transparent huge pages (they would take memory 2 MiB at a time).
func mapKV(n int) ([]byte, error) {
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON|syscall.MAP_NORESERVE)
	if err != nil {
		return nil, err
	}
	syscall.Madvise(b, syscall.MADV_NOHUGEPAGE) // an error only means the kernel has no huge pages
	return b, nil
}

// dropKV gives the memory of b (whole pages of the operating system) back;
// b reads as zeros afterwards.
func dropKV(b []byte) { syscall.Madvise(b, syscall.MADV_DONTNEED) }

// unmapKV gives b back whole.
func unmapKV(b []byte) { syscall.Munmap(b) }
