package cudatest

import (
	"encoding/binary"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// elfImage builds a minimal 64-bit little-endian ELF image whose sections
// are a null section, the name table and the named sections with the
// given sizes (no contents).
func elfImage(names []string, sizes []uint64) []byte {
	le := binary.LittleEndian
	strtab := []byte{0}
	at := make([]uint32, len(names)+1)
	at[0] = uint32(len(strtab))
	strtab = append(strtab, ".shstrtab\x00"...)
	for i, n := range names {
		at[i+1] = uint32(len(strtab))
		strtab = append(strtab, n...)
		strtab = append(strtab, 0)
	}
	b := make([]byte, 64)
	copy(b, "\x7fELF\x02\x01\x01")
	strOff := uint64(len(b))
	b = append(b, strtab...)
	shOff := uint64(len(b))
	n := len(names) + 2
	le.PutUint64(b[0x28:], shOff)
	le.PutUint16(b[0x3a:], 64)
	le.PutUint16(b[0x3c:], uint16(n))
	le.PutUint16(b[0x3e:], 1)
	b = append(b, make([]byte, 64*n)...)
	sh := func(i int) []byte { return b[shOff+uint64(64*i):] }
	le.PutUint32(sh(1), at[0])
	le.PutUint64(sh(1)[0x18:], strOff)
	le.PutUint64(sh(1)[0x20:], uint64(len(strtab)))
	for i := range names {
		le.PutUint32(sh(i+2), at[i+1])
		le.PutUint64(sh(i + 2)[0x20:], sizes[i])
	}
	return b
}

// TestELFSections reads back the names and sizes of a built image, and
// rejects every truncation of it with an error instead of a panic.
func TestELFSections(t *testing.T) {
	r, seed := testutil.Rand(t)
	names := []string{".text.kernel_a", ".nv.info", ".text.kernel_b"}
	sizes := []uint64{uint64(r.IntN(1 << 20)), uint64(r.IntN(100)), uint64(r.IntN(1 << 20))}
	img := elfImage(names, sizes)
	secs, err := elfSections(img)
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	if len(secs) != len(names)+2 || secs[1].name != ".shstrtab" {
		t.Fatalf("seed %d: sections %v", seed, secs)
	}
	for i, n := range names {
		if secs[i+2] != (elfSection{n, sizes[i]}) {
			t.Errorf("seed %d: section %d is %v, want %s of %d bytes", seed, i+2, secs[i+2], n, sizes[i])
		}
	}
	for cut := 0; cut < len(img); cut++ {
		if _, err := elfSections(img[:cut]); err == nil {
			t.Errorf("seed %d: the image cut to %d of %d bytes read without an error", seed, cut, len(img))
		}
	}
}

// FuzzELFSections: no input panics.
func FuzzELFSections(f *testing.F) {
	f.Add(elfImage([]string{".text.k"}, []uint64{4096}))
	f.Add([]byte("\x7fELF\x02\x01"))
	f.Fuzz(func(t *testing.T, b []byte) {
		elfSections(b)
	})
}
