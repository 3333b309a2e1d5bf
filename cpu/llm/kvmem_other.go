//go:build !linux

package llm

// mapKV allocates n bytes of memory for KV caches, whole (there is no
// mapping that takes memory only where it is written here).
func mapKV(n int) ([]byte, error) {
	return make([]byte, n), nil
}

// dropKV does nothing: the memory goes back when the cache is freed and
// collected.
func dropKV(b []byte) {}

// unmapKV does nothing: the garbage collector takes the memory back.
func unmapKV(b []byte) {}
