package llm

import (
	"testing"
	"unsafe"
)

// BenchmarkKVMemory compares what writing 1 MiB of new KV cache costs:
// memory mapped for a cache and written for the first time (a page fault
// per page, as every cache's new pages are), the same after it was given
// back with dropKV (as after Truncate), and Go heap memory the process
// already holds (what caches allocated whole reused).
func BenchmarkKVMemory(b *testing.B) {
	const n = 1 << 20
	write := func(p []float32) {
		for i := 0; i < len(p); i += 256 {
			p[i] = 1
		}
	}
	b.Run("mapped", func(b *testing.B) {
		for b.Loop() {
			m, err := mapKV(n)
			if err != nil {
				b.Fatal(err)
			}
			write(unsafe.Slice((*float32)(unsafe.Pointer(&m[0])), n/4))
			unmapKV(m)
		}
	})
	b.Run("dropped", func(b *testing.B) {
		m, err := mapKV(n)
		if err != nil {
			b.Fatal(err)
		}
		defer unmapKV(m)
		f := unsafe.Slice((*float32)(unsafe.Pointer(&m[0])), n/4)
		for b.Loop() {
			write(f)
			dropKV(m)
		}
	})
	b.Run("heap", func(b *testing.B) {
		f := make([]float32, n/4)
		for b.Loop() {
			write(f)
		}
	})
}
