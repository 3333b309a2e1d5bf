package dl

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestOpenReportsWhatItTried puts a file that is not a shared library where
// TWELL_CUDA_LIB_DIR points and checks that Open fails with an error naming
// it, rather than panicking.
func TestOpenReportsWhatItTried(t *testing.T) {
	dir := t.TempDir()
	bogus := filepath.Join(dir, "libtwellbogus.so.1")
	if err := os.WriteFile(bogus, []byte("not an ELF file"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv(EnvLibDir, dir)
	_, err := Open(Spec{Name: "libtwellbogus", Sonames: []string{"libtwellbogus.so.1"}})
	var nf *NotFoundError
	if !errors.As(err, &nf) || !strings.Contains(err.Error(), bogus) || !strings.Contains(err.Error(), EnvLibDir) {
		t.Fatalf("got %v, want a NotFoundError naming %s and %s", err, bogus, EnvLibDir)
	}
}

func TestBindRejectsBadTargets(t *testing.T) {
	var notFunc int
	err := Bind("lib", func(string) (uintptr, error) { return 0x1000, nil }, []Symbol{Sym(&notFunc, "f")})
	if err == nil || !strings.Contains(err.Error(), "neither") {
		t.Fatalf("binding an *int: %v", err)
	}
	var f func(ch chan int) // purego cannot pass channels
	err = Bind("lib", func(string) (uintptr, error) { return 0x1000, nil }, []Symbol{Sym(&f, "f")})
	if err == nil || !strings.Contains(err.Error(), "purego cannot bind") {
		t.Fatalf("binding a func with a channel argument: %v", err)
	}
	var addr uintptr
	if err := Bind("lib", func(name string) (uintptr, error) { return 0x2000, nil }, []Symbol{Sym(&addr, "g")}); err != nil || addr != 0x2000 {
		t.Fatalf("raw address: %#x, %v", addr, err)
	}
}
