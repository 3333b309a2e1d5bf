package cpu

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/twell-ai/twell/bf16"
)

// Cache blocking: an item of work is an mc x tileN block of C computed over
// the whole K, in chunks of kc. The B micro-panel (kc x nr) stays in L1, the
// packed A chunk (mc x kc) and the C block in L2.
const (
	mc    = 96 // rows per item, a multiple of mr
	kc    = 256
	tileN = 256 // columns per item, a multiple of nr; also the TwELL tile width
)

// PackedB is a weight matrix B (N x K, as in C = A B^T) packed into panels of
// nr columns, each stored [K][nr], zero-padded to a multiple of nr columns.
// Pack weights once and reuse them across calls.
type PackedB struct {
	N, K int
	data []float32
	bf16 []uint16 // the same panels in bfloat16, for small m; nil unless built
}

// smallM is the largest row count that takes the matrix-vector path: one
// pass over B per row, no packing of A, no padding to mr rows.
const smallM = 4

// bf16MaxM is the largest row count that reads bf16 panels once
// UseBF16ForSmallM has made them. Up to here a product is bound by reading
// B from memory (decode steps of up to 16 sequences); beyond it, by the
// FMAs, and the float32 panels lose nothing.
const bf16MaxM = 16

// UseBF16ForSmallM makes products with at most 16 rows (decode steps) read
// a bfloat16 copy of the panels: such products are bound by reading B, and
// bf16 halves the bytes. Results then carry bf16 rounding of B (relative
// error about 2^-9 per weight). It costs half the packed size in memory.
func (p *PackedB) UseBF16ForSmallM() {
	if p.bf16 == nil {
		p.bf16 = make([]uint16, len(p.data))
		parallelFor((len(p.data)+65535)/65536, func(i int) {
			lo, hi := i*65536, min(len(p.data), (i+1)*65536)
			for j, v := range p.data[lo:hi] {
				p.bf16[lo+j] = bf16.FromFloat32(v)
			}
		})
	}
}

// PackB packs w, an n x k row-major matrix (the nn.Linear weight layout, so
// that C = A w^T), for Gemm.
func PackB(w []float32, n, k int) (*PackedB, error) {
	if n < 1 || k < 1 || len(w) != n*k {
		return nil, fmt.Errorf("cpu: PackB: %d values for a %d x %d matrix", len(w), n, k)
	}
	return packPanels(n, k, func(dst []float32, j0, cols int) {
		for j := 0; j < cols; j++ {
			for q, v := range w[(j0+j)*k : (j0+j+1)*k] {
				dst[q*nr+j] = v
			}
		}
	}), nil
}

// PackBT packs w, a k x n row-major matrix, for Gemm computing c = a w
// (the B of C = A B^T is then w^T).
func PackBT(w []float32, k, n int) (*PackedB, error) {
	if n < 1 || k < 1 || len(w) != n*k {
		return nil, fmt.Errorf("cpu: PackBT: %d values for a %d x %d matrix", len(w), k, n)
	}
	return packPanels(n, k, func(dst []float32, j0, cols int) {
		for q := 0; q < k; q++ {
			copy(dst[q*nr:q*nr+cols], w[q*n+j0:q*n+j0+cols])
		}
	}), nil
}

// packPanels packs a B of n rows and k columns in panels of nr rows, in
// parallel: fill writes rows [j0, j0+cols) of B into the k x nr panel dst,
// row j0+j of B in column j.
func packPanels(n, k int, fill func(dst []float32, j0, cols int)) *PackedB {
	panels := (n + nr - 1) / nr
	p := &PackedB{N: n, K: k, data: make([]float32, panels*k*nr)}
	parallelFor(panels, func(pi int) {
		j0 := pi * nr
		fill(p.data[pi*k*nr:(pi+1)*k*nr], j0, min(nr, n-j0))
	})
	return p
}

// Bytes returns the memory the packed matrix takes.
func (p *PackedB) Bytes() int { return 4 * len(p.data) }

// epilogue consumes one finished block of C: rows [i0, i0+rows) and columns
// [j0, j0+cols) of C, held in tile with row stride tileN. Blocks arrive
// concurrently from several goroutines.
type epilogue func(i0, rows, j0, cols int, tile []float32)

// Workers returns the number of goroutines the kernels use.
func Workers() int { return runtime.GOMAXPROCS(0) }

// gemmBlocks computes C = A B^T for A (m x K, row-major) block by block and
// hands each finished block to epi. No full C is ever held.
func gemmBlocks(a []float32, m int, b *PackedB, epi epilogue) {
	k := b.K
	if m <= smallM {
		gemvBlocks(a, m, b, epi)
		return
	}
	mBlocks := (m + mc - 1) / mc
	nBlocks := (b.N + tileN - 1) / tileN
	useBF16 := b.bf16 != nil && m <= bf16MaxM
	parallelWorkers(mBlocks*nBlocks, func() func(int) {
		apack := make([]float32, mc*k)
		tile := make([]float32, mc*tileN)
		lastM := -1
		return func(it int) {
			// Items run block-row by block-row, so a worker often keeps
			// its packed A block for the next item.
			ib, jb := it/nBlocks, it%nBlocks
			i0, j0 := ib*mc, jb*tileN
			rows, cols := min(mc, m-i0), min(tileN, b.N-j0)
			if ib != lastM {
				packA(apack, a, i0, rows, k)
				lastM = ib
			}
			groups := (rows + mr - 1) / mr
			panels := (cols + nr - 1) / nr
			for p0 := 0; p0 < k; p0 += kc {
				kk := min(kc, k-p0)
				for jp := 0; jp < panels; jp++ {
					pi := j0/nr + jp
					off := pi*k*nr + p0*nr
					for g := 0; g < groups; g++ {
						ap := apack[g*k*mr+p0*mr:]
						if useBF16 {
							microBF16(kk, ap, b.bf16[off:], tile[g*mr*tileN+jp*nr:], tileN, p0 > 0)
						} else {
							microkernel(kk, ap, b.data[off:], tile[g*mr*tileN+jp*nr:], tileN, p0 > 0)
						}
					}
				}
			}
			epi(i0, rows, j0, cols, tile)
		}
	})
}

// packA packs rows [i0, i0+rows) of a (row length k) into groups of mr rows,
// each stored [k][mr], zero-padding the last group.
func packA(dst, a []float32, i0, rows, k int) {
	groups := (rows + mr - 1) / mr
	for g := 0; g < groups; g++ {
		d := dst[g*k*mr : (g+1)*k*mr]
		for i := 0; i < mr; i++ {
			r := g*mr + i
			if r >= rows {
				for q := 0; q < k; q++ {
					d[q*mr+i] = 0
				}
				continue
			}
			src := a[(i0+r)*k : (i0+r+1)*k]
			for q, v := range src {
				d[q*mr+i] = v
			}
		}
	}
}

// Gemm computes c = a b^T: a is m x K row-major, b packed N x K, c m x N
// row-major.
func Gemm(c, a []float32, m int, b *PackedB) error {
	if err := checkGemm(c, a, m, b); err != nil {
		return err
	}
	n := b.N
	gemmBlocks(a, m, b, func(i0, rows, j0, cols int, tile []float32) {
		for i := 0; i < rows; i++ {
			copy(c[(i0+i)*n+j0:(i0+i)*n+j0+cols], tile[i*tileN:i*tileN+cols])
		}
	})
	return nil
}

func checkGemm(c, a []float32, m int, b *PackedB) error {
	if m < 0 || len(a) != m*b.K {
		return fmt.Errorf("cpu: gemm: A has %d values, want %d x %d", len(a), m, b.K)
	}
	if len(c) != m*b.N {
		return fmt.Errorf("cpu: gemm: C has %d values, want %d x %d", len(c), m, b.N)
	}
	return nil
}

// parallelFor runs f(0..n-1) on all workers.
func parallelFor(n int, f func(i int)) {
	parallelWorkers(n, func() func(int) { return f })
}

// parallelWorkers runs items 0..n-1 on all workers, each taking the next
// item as it becomes free. A worker gets the function that runs its items
// (with its own scratch space) from newWorker, once.
func parallelWorkers(n int, newWorker func() func(i int)) {
	workers := min(Workers(), n)
	if workers <= 1 {
		if n > 0 {
			f := newWorker()
			for i := 0; i < n; i++ {
				f(i)
			}
		}
		return
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f := newWorker()
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				f(i)
			}
		}()
	}
	wg.Wait()
}

// ParallelFor runs f(i) for i in [0, n) on all cores and returns when every
// call has finished.
func ParallelFor(n int, f func(i int)) { parallelFor(n, f) }

// gemvBlocks is gemmBlocks for m <= smallM: each worker takes whole column
// blocks and streams their panels once per row.
func gemvBlocks(a []float32, m int, b *PackedB, epi epilogue) {
	k := b.K
	nBlocks := (b.N + tileN - 1) / tileN
	var tiles sync.Pool
	parallelFor(nBlocks, func(jb int) {
		tp, _ := tiles.Get().(*[]float32)
		if tp == nil {
			t := make([]float32, smallM*tileN)
			tp = &t
		}
		tile := *tp
		j0 := jb * tileN
		cols := min(tileN, b.N-j0)
		for jp := 0; jp < (cols+nr-1)/nr; jp++ {
			pi := j0/nr + jp
			for i := 0; i < m; i++ {
				out := tile[i*tileN+jp*nr:]
				if b.bf16 != nil {
					gemvBF16Kernel(k, a[i*k:(i+1)*k], b.bf16[pi*k*nr:(pi+1)*k*nr], out)
				} else {
					gemvKernel(k, a[i*k:(i+1)*k], b.data[pi*k*nr:(pi+1)*k*nr], out)
				}
			}
		}
		epi(0, m, j0, cols, tile)
		tiles.Put(tp)
	})
}
