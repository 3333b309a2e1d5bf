package cpu

import (
	"fmt"
	"math"
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
	data []float32 // the panels in float32; nil once Compact has dropped them
	bf16 []uint16  // the same panels in bfloat16; nil unless built
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
// Compact panels are bf16 already: for them it does nothing.
func (p *PackedB) UseBF16ForSmallM() {
	if p.bf16 == nil && p.data != nil {
		p.bf16 = make([]uint16, len(p.data))
		parallelFor((len(p.data)+65535)/65536, func(i int) {
			lo, hi := i*65536, min(len(p.data), (i+1)*65536)
			for j, v := range p.data[lo:hi] {
				p.bf16[lo+j] = bf16.FromFloat32(v)
			}
		})
	}
}

// Compact keeps the panels in bfloat16 alone, halving their memory, when
// every value of the matrix is a bfloat16 value (as the weights of a
// bfloat16 checkpoint are): products then read the bf16 panels at every
// size and give the same bits as from the float32 ones, since the kernels
// widen each value exactly and do the same arithmetic. It reports whether
// the panels are compact; a matrix with other values keeps its float32
// panels.
func (p *PackedB) Compact() bool {
	if p.data == nil {
		return true
	}
	b := exactBF16(p.data)
	if b == nil {
		return false
	}
	p.data, p.bf16 = nil, b
	return true
}

// exactBF16 returns src in bfloat16 when every value of it is a bfloat16
// value, and nil otherwise.
func exactBF16(src []float32) []uint16 {
	if !allExact(src) {
		return nil
	}
	const chunk = 1 << 16
	chunks := (len(src) + chunk - 1) / chunk
	dst := make([]uint16, len(src))
	parallelFor(chunks, func(i int) {
		lo, hi := i*chunk, min(len(src), (i+1)*chunk)
		bf16.Truncate(dst[lo:hi], src[lo:hi])
	})
	return dst
}

// allExact reports whether every value of src is a bfloat16 value.
func allExact(src []float32) bool {
	const chunk = 1 << 16
	var inexact atomic.Bool
	parallelFor((len(src)+chunk-1)/chunk, func(i int) {
		if !inexact.Load() && !bf16.Exact(src[i*chunk:min(len(src), (i+1)*chunk)]) {
			inexact.Store(true)
		}
	})
	return !inexact.Load()
}

// PackBCompact is PackB then Compact, without the float32 panels in
// between when every value of w is a bfloat16 value: it packs straight into
// bf16 panels (a model's LM head would otherwise take twice its compact
// size for a moment).
func PackBCompact(w []float32, n, k int) (*PackedB, error) {
	if n < 1 || k < 1 || len(w) != n*k || !allExact(w) {
		return PackB(w, n, k) // Compact would keep the float32 panels
	}
	p := &PackedB{N: n, K: k, bf16: make([]uint16, (n+nr-1)/nr*nr*k)}
	parallelFor(len(p.bf16)/(k*nr), func(pi int) {
		j0 := pi * nr
		cols := min(nr, n-j0)
		dst := p.bf16[pi*k*nr : (pi+1)*k*nr]
		if cols < nr {
			clear(dst)
		}
		for j := 0; j < cols; j++ {
			for q, v := range w[(j0+j)*k : (j0+j+1)*k] {
				dst[q*nr+j] = uint16(math.Float32bits(v) >> 16)
			}
		}
	})
	return p, nil
}

// PackB packs w, an n x k row-major matrix (the nn.Linear weight layout, so
// that C = A w^T), for Gemm.
func PackB(w []float32, n, k int) (*PackedB, error) { return (*Packer)(nil).PackB(w, n, k) }

// PackBT packs w, a k x n row-major matrix, for Gemm computing c = a w
// (the B of C = A B^T is then w^T).
func PackBT(w []float32, k, n int) (*PackedB, error) { return (*Packer)(nil).PackBT(w, k, n) }

// Packer packs matrices into one buffer that it keeps: a PackedB it returns
// is valid until its next call. Code that packs a changing matrix on every
// step (training) saves the allocation, whose page faults cost more than
// the packing. A nil Packer allocates afresh on every call.
type Packer struct{ buf []float32 }

// PackB is the package's PackB into the Packer's buffer.
func (pk *Packer) PackB(w []float32, n, k int) (*PackedB, error) {
	if n < 1 || k < 1 || len(w) != n*k {
		return nil, fmt.Errorf("cpu: PackB: %d values for a %d x %d matrix", len(w), n, k)
	}
	p := pk.alloc(n, k)
	parallelFor(len(p.data)/(k*nr), func(pi int) {
		j0 := pi * nr
		cols := min(nr, n-j0)
		dst := p.data[pi*k*nr : (pi+1)*k*nr]
		if cols < nr {
			clear(dst)
		}
		for j := 0; j < cols; j++ {
			for q, v := range w[(j0+j)*k : (j0+j+1)*k] {
				dst[q*nr+j] = v
			}
		}
	})
	return p, nil
}

// PackBT is the package's PackBT into the Packer's buffer. Workers take
// blocks of packBTRows rows of w, read them whole and write their part of
// every panel: reading one panel's columns down all k rows would stride
// through w.
func (pk *Packer) PackBT(w []float32, k, n int) (*PackedB, error) {
	if n < 1 || k < 1 || len(w) != n*k {
		return nil, fmt.Errorf("cpu: PackBT: %d values for a %d x %d matrix", len(w), k, n)
	}
	p := pk.alloc(n, k)
	panels := len(p.data) / (k * nr)
	parallelFor((k+packBTRows-1)/packBTRows, func(bi int) {
		q0, q1 := bi*packBTRows, min(k, (bi+1)*packBTRows)
		for pi := 0; pi < panels; pi++ {
			j0 := pi * nr
			cols := min(nr, n-j0)
			dst := p.data[pi*k*nr:]
			for q := q0; q < q1; q++ {
				copy(dst[q*nr:q*nr+cols], w[q*n+j0:q*n+j0+cols])
				clear(dst[q*nr+cols : (q+1)*nr])
			}
		}
	})
	return p, nil
}

// packBTRows is the rows of w per PackBT work item: 64 rows of a few
// thousand columns stay in L2 while their panels are written.
const packBTRows = 64

// alloc returns a PackedB of n x k over the Packer's buffer (a fresh one for
// a nil Packer). Its values are not cleared.
func (pk *Packer) alloc(n, k int) *PackedB {
	size := (n + nr - 1) / nr * nr * k
	if pk == nil {
		return &PackedB{N: n, K: k, data: make([]float32, size)}
	}
	if cap(pk.buf) < size {
		pk.buf = make([]float32, size)
	}
	return &PackedB{N: n, K: k, data: pk.buf[:size]}
}

// Bytes returns the memory the packed matrix takes.
func (p *PackedB) Bytes() int { return 4*len(p.data) + 2*len(p.bf16) }

// epilogue consumes one finished block of C: rows [i0, i0+rows) and columns
// [j0, j0+cols) of C, held in tile with row stride tileN. Blocks arrive
// concurrently from several goroutines.
type epilogue func(i0, rows, j0, cols int, tile []float32)

// Workers returns the number of goroutines the kernels use.
func Workers() int { return runtime.GOMAXPROCS(0) }

// gemmBlocks computes C = A B^T for A (m x K, row-major) block by block and
// hands each finished block to epi. No full C is ever held.
func gemmBlocks(a []float32, m int, b *PackedB, epi epilogue) {
	if m <= smallM {
		gemvBlocks(a, m, b, epi)
		return
	}
	k := b.K
	gemmPacked(m, b, func(dst []float32, i0, rows int) { packA(dst, a, i0, rows, k) }, epi)
}

// gemmPacked is gemmBlocks over an A that pack writes, mc rows at a time,
// in packA's layout.
func gemmPacked(m int, b *PackedB, pack func(dst []float32, i0, rows int), epi epilogue) {
	k := b.K
	mBlocks := (m + mc - 1) / mc
	nBlocks := (b.N + tileN - 1) / tileN
	useBF16 := b.bf16 != nil && (b.data == nil || m <= bf16MaxM)
	var mu sync.Mutex
	var held []*[]float32 // the workers' scratch, back to the pool at the end
	defer func() {
		for _, sp := range held {
			gemmScratch.Put(sp)
		}
	}()
	parallelWorkers(mBlocks*nBlocks, func() func(int) {
		sp := fromPool(&gemmScratch, mc*k+mc*tileN)
		mu.Lock()
		held = append(held, sp)
		mu.Unlock()
		apack, tile := (*sp)[:mc*k], (*sp)[mc*k:]
		lastM := -1
		return func(it int) {
			// Items run block-row by block-row, so a worker often keeps
			// its packed A block for the next item.
			ib, jb := it/nBlocks, it%nBlocks
			i0, j0 := ib*mc, jb*tileN
			rows, cols := min(mc, m-i0), min(tileN, b.N-j0)
			if ib != lastM {
				pack(apack, i0, rows)
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

// gemmScratch recycles the GEMM workers' packed A blocks and C tiles (about
// 0.9 MB a worker at K = 2048) between calls: a decode step makes a few
// GEMMs a layer, and fresh buffers cost page faults and collections.
var gemmScratch sync.Pool

// fromPool returns a buffer of n floats from pool (one of *[]float32), or a
// new one when the pool gives none large enough. Its values are not
// cleared.
func fromPool(pool *sync.Pool, n int) *[]float32 {
	if p, ok := pool.Get().(*[]float32); ok && cap(*p) >= n {
		*p = (*p)[:n]
		return p
	}
	s := make([]float32, n)
	return &s
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

// packAT is packA for an A given transposed: at is k x m row-major, and
// rows [i0, i0+rows) of A are its columns.
func packAT(dst, at []float32, m, i0, rows, k int) {
	groups := (rows + mr - 1) / mr
	for q := 0; q < k; q++ {
		src := at[q*m+i0 : q*m+i0+rows]
		for g := 0; g < groups; g++ {
			dq := dst[g*k*mr+q*mr : g*k*mr+(q+1)*mr]
			n := copy(dq, src[g*mr:min(rows, (g+1)*mr)])
			clear(dq[n:])
		}
	}
}

// GemmTA computes c = at^T b^T, or adds it to c when acc is set: at is
// K x m row-major (A transposed), b packed N x K, c m x N row-major. It is
// the weight-gradient product dW += dY^T X without transposing dY.
func GemmTA(c, at []float32, m int, b *PackedB, acc bool) error {
	if m < 1 || len(at) != m*b.K {
		return fmt.Errorf("cpu: GemmTA: A^T has %d values, want %d x %d", len(at), b.K, m)
	}
	if len(c) != m*b.N {
		return fmt.Errorf("cpu: GemmTA: C has %d values, want %d x %d", len(c), m, b.N)
	}
	n, k := b.N, b.K
	gemmPacked(m, b, func(dst []float32, i0, rows int) { packAT(dst, at, m, i0, rows, k) },
		func(i0, rows, j0, cols int, tile []float32) {
			for i := 0; i < rows; i++ {
				dst, src := c[(i0+i)*n+j0:(i0+i)*n+j0+cols], tile[i*tileN:i*tileN+cols]
				if !acc {
					copy(dst, src)
					continue
				}
				for j, v := range src {
					dst[j] += v
				}
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
