// Package openblas loads OpenBLAS at run time (through purego, no cgo) so
// that twell's own CPU GEMM can be compared with cblas_sgemm in one process.
// It is a benchmarking aid: twell itself never depends on OpenBLAS.
package openblas

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/ebitengine/purego"
)

// CBLAS enum values.
const (
	rowMajor = 101
	noTrans  = 111
	trans    = 112
)

// Lib is a loaded OpenBLAS.
type Lib struct {
	Path   string
	sgemm  func(order, ta, tb, m, n, k int32, alpha float32, a *float32, lda int32, b *float32, ldb int32, beta float32, c *float32, ldc int32)
	config func() string
}

// Open loads libopenblas.so.0 from dir (and libgfortran.so.5 from dir or its
// parent, as Debian's packages lay them out). An empty dir lets the system
// loader search.
func Open(dir string) (*Lib, error) {
	if dir != "" {
		for _, d := range []string{dir, filepath.Dir(dir)} {
			p := filepath.Join(d, "libgfortran.so.5")
			if _, err := os.Stat(p); err == nil {
				if _, err := purego.Dlopen(p, purego.RTLD_NOW|purego.RTLD_GLOBAL); err != nil {
					return nil, fmt.Errorf("openblas: load %s: %w", p, err)
				}
				break
			}
		}
	}
	path := filepath.Join(dir, "libopenblas.so.0")
	if dir == "" {
		path = "libopenblas.so.0"
	}
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return nil, fmt.Errorf("openblas: load %s: %w", path, err)
	}
	l := &Lib{Path: path}
	for name, fn := range map[string]any{"cblas_sgemm": &l.sgemm, "openblas_get_config": &l.config} {
		sym, err := purego.Dlsym(h, name)
		if err != nil {
			return nil, fmt.Errorf("openblas: %s: %w", name, err)
		}
		purego.RegisterFunc(fn, sym)
	}
	return l, nil
}

// Config returns OpenBLAS's build description (version, target core).
func (l *Lib) Config() string { return l.config() }

// GemmNT computes c = a b^T with a m x k, b n x k and c m x n, all row-major:
// the same product as twell's cpu.Gemm.
func (l *Lib) GemmNT(c, a, b []float32, m, n, k int) error {
	if len(a) != m*k || len(b) != n*k || len(c) != m*n {
		return fmt.Errorf("openblas: sgemm buffers %d, %d, %d do not fit %d x %d x %d", len(a), len(b), len(c), m, n, k)
	}
	l.sgemm(rowMajor, noTrans, trans, int32(m), int32(n), int32(k), 1, &a[0], int32(k), &b[0], int32(k), 0, &c[0], int32(n))
	return nil
}
