// Package cublas multiplies matrices on the GPU with cuBLASLt (bf16 inputs,
// fp32 accumulation, the heuristic's algorithm choice, or with
// Handle.TuneFlops the fastest of its candidates timed, cached per shape), falling
// back to plain cuBLAS (cublasGemmStridedBatchedEx) when cuBLASLt is missing
// or has no algorithm for a problem. The libraries are opened at run time
// through purego, like package cuda.
//
// Matrices are row-major, as everywhere in twell: a Gemm computes
//
//	C = Alpha·op(A)·op(B) + Beta·C
//
// with op(A) M×K, op(B) K×N and C M×N, batched with strides.
package cublas

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/internal/dl"
	"github.com/twell-ai/twell/internal/enum"
)

// DataType is a matrix element type.
type DataType int

// Element types. The zero value is BF16.
const (
	BF16 DataType = iota
	F16
	F32
)

// String returns "bf16", "f16" or "f32".
func (t DataType) String() string { return enum.String(t, "DataType", "bf16", "f16", "f32") }

// cudaType returns the cudaDataType value, and the element size.
func (t DataType) cudaType() (int32, int, bool) {
	switch t {
	case BF16:
		return 14, 2, true // CUDA_R_16BF
	case F16:
		return 2, 2, true // CUDA_R_16F
	case F32:
		return 0, 4, true // CUDA_R_32F
	}
	return 0, 0, false
}

// Backend picks the library that runs a Gemm.
type Backend int

// Backends. Auto uses cuBLASLt and falls back to cuBLAS.
const (
	Auto   Backend = iota
	Lt             // cuBLASLt only
	Legacy         // plain cuBLAS only (cublasGemmStridedBatchedEx)
)

// String returns "auto", "cublasLt" or "cublas".
func (b Backend) String() string {
	return enum.String(b, "Backend", "auto", "cublasLt", "cublas")
}

// Gemm describes C = Alpha·op(A)·op(B) + Beta·C on row-major matrices, with
// fp32 accumulation.
type Gemm struct {
	M, N, K int
	// TransA: A is stored K×M and op(A) = Aᵀ; otherwise A is stored M×K.
	// TransB: B is stored N×K and op(B) = Bᵀ; otherwise B is stored K×N.
	TransA, TransB bool
	// LDA, LDB, LDC are row strides in elements; 0 means packed rows.
	LDA, LDB, LDC int
	// Batch is the number of products (0 or 1: one); StrideA, StrideB and
	// StrideC are the elements between consecutive matrices (0: packed).
	Batch                     int
	StrideA, StrideB, StrideC int64
	// Alpha and Beta scale the product and C. Both zero means Alpha = 1,
	// Beta = 0: the plain product.
	Alpha, Beta float32
	// AType and BType are the input types, CType the output's (zero: BF16).
	AType, BType, CType DataType
	// Backend picks the library (zero: Auto).
	Backend Backend
}

// Flops returns the floating-point operations of the product, 2·M·N·K·batch.
func (g Gemm) Flops() float64 {
	return 2 * float64(g.M) * float64(g.N) * float64(g.K) * float64(max(g.Batch, 1))
}

// normalized fills in defaults and checks the description.
func (g Gemm) normalized() (Gemm, error) {
	if g.M <= 0 || g.N <= 0 || g.K <= 0 {
		return g, fmt.Errorf("cublas: matrix sizes M=%d N=%d K=%d must be positive", g.M, g.N, g.K)
	}
	if g.Batch <= 0 {
		g.Batch = 1
	}
	if g.Alpha == 0 && g.Beta == 0 {
		g.Alpha = 1
	}
	ar, ac := g.M, g.K
	if g.TransA {
		ar, ac = g.K, g.M
	}
	br, bc := g.K, g.N
	if g.TransB {
		br, bc = g.N, g.K
	}
	if g.LDA == 0 {
		g.LDA = ac
	}
	if g.LDB == 0 {
		g.LDB = bc
	}
	if g.LDC == 0 {
		g.LDC = g.N
	}
	switch {
	case g.LDA < ac:
		return g, fmt.Errorf("cublas: LDA %d is less than A's %d columns", g.LDA, ac)
	case g.LDB < bc:
		return g, fmt.Errorf("cublas: LDB %d is less than B's %d columns", g.LDB, bc)
	case g.LDC < g.N:
		return g, fmt.Errorf("cublas: LDC %d is less than C's %d columns", g.LDC, g.N)
	}
	if g.StrideA == 0 {
		g.StrideA = int64(ar) * int64(g.LDA)
	}
	if g.StrideB == 0 {
		g.StrideB = int64(br) * int64(g.LDB)
	}
	if g.StrideC == 0 {
		g.StrideC = int64(g.M) * int64(g.LDC)
	}
	for _, t := range []DataType{g.AType, g.BType, g.CType} {
		if _, _, ok := t.cudaType(); !ok {
			return g, fmt.Errorf("cublas: unknown data type %v", t)
		}
	}
	return g, nil
}

// need returns the bytes a matrix of rows×cols with row stride ld occupies
// over batch entries stride elements apart.
func need(rows, cols, ld int, batch int, stride int64, esize int) int64 {
	last := int64(rows-1)*int64(ld) + int64(cols)
	return (int64(batch-1)*stride + last) * int64(esize)
}

// checkBuffers checks that each buffer holds its matrix.
func (g Gemm) checkBuffers(a, b, c *cuda.Buffer) error {
	_, ea, _ := g.AType.cudaType()
	_, eb, _ := g.BType.cudaType()
	_, ec, _ := g.CType.cudaType()
	ar, ac := g.M, g.K
	if g.TransA {
		ar, ac = g.K, g.M
	}
	br, bc := g.K, g.N
	if g.TransB {
		br, bc = g.N, g.K
	}
	for _, m := range []struct {
		name string
		buf  *cuda.Buffer
		n    int64
	}{
		{"A", a, need(ar, ac, g.LDA, g.Batch, g.StrideA, ea)},
		{"B", b, need(br, bc, g.LDB, g.Batch, g.StrideB, eb)},
		{"C", c, need(g.M, g.N, g.LDC, g.Batch, g.StrideC, ec)},
	} {
		if m.buf == nil {
			return fmt.Errorf("cublas: matrix %s is nil", m.name)
		}
		if int64(m.buf.Len()) < m.n {
			return &cuda.Error{Op: "cublas Matmul", Code: cuda.ErrorInvalidValue,
				Detail: fmt.Sprintf("matrix %s needs %d bytes, %v has %d", m.name, m.n, m.buf, m.buf.Len())}
		}
	}
	return nil
}

// colMajor maps the row-major problem to cuBLAS's column-major one:
// Cᵀ = op(B)ᵀ·op(A)ᵀ, so B comes first.
type colMajor struct {
	m, n, k            int
	transA, transB     int32 // cublasOperation_t of the first (B) and second (A) operand
	aRows, aCols, lda  int   // first operand (the B buffer)
	bRows, bCols, ldb  int   // second operand (the A buffer)
	cRows, cCols, ldc  int
	strideA, strideB   int64
	strideC            int64
	aType, bType, cTyp int32
}

func (g Gemm) colMajor() colMajor {
	op := func(t bool) int32 {
		if t {
			return 1 // CUBLAS_OP_T
		}
		return 0 // CUBLAS_OP_N
	}
	c := colMajor{m: g.N, n: g.M, k: g.K, transA: op(g.TransB), transB: op(g.TransA),
		lda: g.LDB, ldb: g.LDA, ldc: g.LDC, cRows: g.N, cCols: g.M,
		strideA: g.StrideB, strideB: g.StrideA, strideC: g.StrideC}
	if g.TransB {
		c.aRows, c.aCols = g.K, g.N
	} else {
		c.aRows, c.aCols = g.N, g.K
	}
	if g.TransA {
		c.bRows, c.bCols = g.M, g.K
	} else {
		c.bRows, c.bCols = g.K, g.M
	}
	c.aType, _, _ = g.BType.cudaType()
	c.bType, _, _ = g.AType.cudaType()
	c.cTyp, _, _ = g.CType.cudaType()
	return c
}

// Error is a failed cuBLAS or cuBLASLt call.
type Error struct {
	Op     string // the call and problem, e.g. "cublasLtMatmul(8192×8192×8192 bf16)"
	Status int32  // cublasStatus_t
	Name   string // e.g. "CUBLAS_STATUS_NOT_SUPPORTED"
}

// Error returns "cublas: OP: CUBLAS_STATUS_NAME".
func (e *Error) Error() string { return fmt.Sprintf("cublas: %s: %s", e.Op, e.Name) }

var statusNames = map[int32]string{
	0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
	7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
	13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR", 15: "CUBLAS_STATUS_NOT_SUPPORTED",
	16: "CUBLAS_STATUS_LICENSE_ERROR",
}

func status(r int32, op string) error {
	if r == 0 {
		return nil
	}
	name, ok := statusNames[r]
	if !ok {
		name = fmt.Sprintf("CUBLAS_STATUS_%d", r)
	}
	return &Error{Op: op, Status: r, Name: name}
}

// ErrNoCUBLAS is returned (wrapped) when neither libcublasLt nor libcublas
// can be loaded.
var ErrNoCUBLAS = errors.New("cublas: no cuBLAS library found")

type ltLib struct {
	lib           *dl.Library
	create        func(h *uintptr) int32
	destroy       func(h uintptr) int32
	version       func() uint64
	descCreate    func(d *uintptr, compute int32, scale int32) int32
	descDestroy   func(d uintptr) int32
	descSet       func(d uintptr, attr int32, buf unsafe.Pointer, size uint64) int32
	layoutCreate  func(l *uintptr, typ int32, rows, cols uint64, ld int64) int32
	layoutDestroy func(l uintptr) int32
	layoutSet     func(l uintptr, attr int32, buf unsafe.Pointer, size uint64) int32
	prefCreate    func(p *uintptr) int32
	prefDestroy   func(p uintptr) int32
	prefSet       func(p uintptr, attr int32, buf unsafe.Pointer, size uint64) int32
	heuristic     func(h, desc, a, b, c, d, pref uintptr, n int32, results unsafe.Pointer, count *int32) int32
	pMatmul       uintptr
}

func (l *ltLib) symbols() []dl.Symbol {
	S := dl.Sym
	return []dl.Symbol{
		S(&l.create, "cublasLtCreate"),
		S(&l.destroy, "cublasLtDestroy"),
		S(&l.version, "cublasLtGetVersion"),
		S(&l.descCreate, "cublasLtMatmulDescCreate"),
		S(&l.descDestroy, "cublasLtMatmulDescDestroy"),
		S(&l.descSet, "cublasLtMatmulDescSetAttribute"),
		S(&l.layoutCreate, "cublasLtMatrixLayoutCreate"),
		S(&l.layoutDestroy, "cublasLtMatrixLayoutDestroy"),
		S(&l.layoutSet, "cublasLtMatrixLayoutSetAttribute"),
		S(&l.prefCreate, "cublasLtMatmulPreferenceCreate"),
		S(&l.prefDestroy, "cublasLtMatmulPreferenceDestroy"),
		S(&l.prefSet, "cublasLtMatmulPreferenceSetAttribute"),
		S(&l.heuristic, "cublasLtMatmulAlgoGetHeuristic"),
		S(&l.pMatmul, "cublasLtMatmul"),
	}
}

type legacyLib struct {
	lib         *dl.Library
	create      func(h *uintptr) int32
	destroy     func(h uintptr) int32
	getProperty func(typ int32, v *int32) int32
	setStream   func(h uintptr, s uintptr) int32
	pGemm       uintptr // cublasGemmStridedBatchedEx
}

func (l *legacyLib) symbols() []dl.Symbol {
	S := dl.Sym
	return []dl.Symbol{
		S(&l.create, "cublasCreate_v2"),
		S(&l.destroy, "cublasDestroy_v2"),
		S(&l.getProperty, "cublasGetProperty"),
		S(&l.setStream, "cublasSetStream_v2"),
		S(&l.pGemm, "cublasGemmStridedBatchedEx"),
	}
}

var (
	ltOnce     sync.Once
	lt         *ltLib
	ltErr      error
	legacyOnce sync.Once
	legacy     *legacyLib
	legacyErr  error
)

var sonames = func(base string) []string {
	return []string{base + ".so.13", base + ".so.12", base + ".so.11", base + ".so"}
}

func loadLt() (*ltLib, error) {
	ltOnce.Do(func() {
		l := &ltLib{}
		lib, err := dl.Load(dl.Spec{Name: "libcublasLt", Sonames: sonames("libcublasLt"), Toolkit: true, Wheels: true}, l.symbols())
		if err != nil {
			ltErr = fmt.Errorf("%w: %v", ErrNoCUBLAS, err)
			return
		}
		l.lib = lib
		lt = l
	})
	return lt, ltErr
}

func loadLegacy() (*legacyLib, error) {
	legacyOnce.Do(func() {
		l := &legacyLib{}
		lib, err := dl.Load(dl.Spec{Name: "libcublas", Sonames: sonames("libcublas"), Toolkit: true, Wheels: true,
			Preload: []string{"libcublasLt.so.*"}}, l.symbols())
		if err != nil {
			legacyErr = fmt.Errorf("%w: %v", ErrNoCUBLAS, err)
			return
		}
		l.lib = lib
		legacy = l
	})
	return legacy, legacyErr
}

// Versions reports the loaded libraries: cuBLASLt's version number (e.g.
// 130000 for 13.0.0) and path, and cuBLAS's "major.minor.patch" and path.
// Missing libraries give empty values and an error.
func Versions() (ltVersion int, ltPath, cublasVersion, cublasPath string, err error) {
	var errs []error
	if l, e := loadLt(); e == nil {
		ltVersion, ltPath = int(l.version()), l.lib.Path
	} else {
		errs = append(errs, e)
	}
	if l, e := loadLegacy(); e == nil {
		var ma, mi, pa int32
		l.getProperty(0, &ma)
		l.getProperty(1, &mi)
		l.getProperty(2, &pa)
		cublasVersion, cublasPath = fmt.Sprintf("%d.%d.%d", ma, mi, pa), l.lib.Path
	} else {
		errs = append(errs, e)
	}
	return ltVersion, ltPath, cublasVersion, cublasPath, errors.Join(errs...)
}

// DefaultWorkspace is the cuBLASLt workspace a Handle allocates (32 MiB, as
// NVIDIA recommends for Hopper).
const DefaultWorkspace = 32 << 20

// Handle runs GEMMs on one device. Its workspace is shared by all calls, so
// use one Handle per stream when streams run GEMMs concurrently. A Handle is
// safe for concurrent use by goroutines that share a stream.
type Handle struct {
	// TuneFlops, when positive, makes the first cuBLASLt call of each
	// product of at least this many flops (Gemm.Flops) time the algorithms
	// cuBLASLt's heuristic offers (up to 8) on the call's own buffers and
	// keep the fastest for every later call of that product, instead of the
	// heuristic's first choice (Tunings reports them). Not tuned: calls on a
	// stream that is capturing a graph, and calls whose output shares
	// memory with their addend (Beta ≠ 0). Set it before the first call.
	TuneFlops float64

	dev       *cuda.Device
	lt        *ltLib
	ltH       uintptr
	leg       *legacyLib
	legH      uintptr
	workspace *cuda.Buffer

	mu      sync.Mutex
	plans   map[planKey]*plan
	tunings []Tuning
}

// New returns a Handle on dev. It needs at least one of cuBLASLt and cuBLAS.
func New(dev *cuda.Device) (*Handle, error) {
	h := &Handle{dev: dev, plans: map[planKey]*plan{}}
	l, errLt := loadLt()
	g, errLeg := loadLegacy()
	if errLt != nil && errLeg != nil {
		return nil, errors.Join(errLt, errLeg)
	}
	err := dev.Do(func() error {
		if errLt == nil {
			if err := status(l.create(&h.ltH), "cublasLtCreate"); err != nil {
				return err
			}
			h.lt = l
		}
		if errLeg == nil {
			if err := status(g.create(&h.legH), "cublasCreate"); err != nil {
				return err
			}
			h.leg = g
		}
		return nil
	})
	if err != nil {
		h.Close()
		return nil, err
	}
	if h.lt != nil {
		ws, err := dev.Alloc(DefaultWorkspace)
		if err != nil {
			h.Close()
			return nil, err
		}
		h.workspace = ws
	}
	return h, nil
}

// Close releases the handle's descriptors, libraries' handles and workspace.
func (h *Handle) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	var errs []error
	_ = h.dev.Do(func() error {
		for k, p := range h.plans {
			p.destroy(h.lt)
			delete(h.plans, k)
		}
		if h.lt != nil && h.ltH != 0 {
			errs = append(errs, status(h.lt.destroy(h.ltH), "cublasLtDestroy"))
			h.ltH = 0
		}
		if h.leg != nil && h.legH != 0 {
			errs = append(errs, status(h.leg.destroy(h.legH), "cublasDestroy"))
			h.legH = 0
		}
		return nil
	})
	if h.workspace != nil {
		errs = append(errs, h.workspace.Free())
		h.workspace = nil
	}
	return errors.Join(errs...)
}

// HasLt reports whether cuBLASLt is in use.
func (h *Handle) HasLt() bool { return h.lt != nil }

// HasLegacy reports whether plain cuBLAS is available.
func (h *Handle) HasLegacy() bool { return h.leg != nil }

// Matmul queues C = Alpha·op(A)·op(B) + Beta·C on stream s (nil: the default
// stream). Buffer sizes, leading dimensions and types are checked first; a
// problem no library supports returns an *Error naming the status.
func (h *Handle) Matmul(s *cuda.Stream, g Gemm, a, b, c *cuda.Buffer) error {
	return h.MatmulAdd(s, g, a, b, c, c)
}

// MatmulAdd is Matmul with the addend read from c and the result written
// to d: D = Alpha·op(A)·op(B) + Beta·C, d of C's shape, type and strides
// (d may be c). A residual stream then need not be copied into the output
// before the product adds to it. cuBLAS (Legacy), which writes its addend
// in place, gets d as a copy of c first.
func (h *Handle) MatmulAdd(s *cuda.Stream, g Gemm, a, b, c, d *cuda.Buffer) error {
	g, err := g.normalized()
	if err != nil {
		return err
	}
	if err := g.checkBuffers(a, b, c); err != nil {
		return err
	}
	if d != c {
		if err := g.checkBuffers(a, b, d); err != nil {
			return fmt.Errorf("%w (the output D)", err)
		}
	}
	legacy := func() error {
		if d != c && g.Beta != 0 {
			_, ec, _ := g.CType.cudaType()
			n := need(g.M, g.N, g.LDC, g.Batch, g.StrideC, ec)
			if err := h.dev.CopyDtoDAsync(d, c, int(n), s); err != nil {
				return err
			}
		}
		return h.matmulLegacy(s, g, a, b, d)
	}
	switch g.Backend {
	case Lt:
		if h.lt == nil {
			return fmt.Errorf("cublas: cuBLASLt is not available: %w", ltErr)
		}
		return h.matmulLt(s, g, a, b, c, d)
	case Legacy:
		if h.leg == nil {
			return fmt.Errorf("cublas: cuBLAS is not available: %w", legacyErr)
		}
		return legacy()
	}
	if h.lt != nil {
		err := h.matmulLt(s, g, a, b, c, d)
		var ce *Error
		if err == nil || h.leg == nil || !errors.As(err, &ce) || ce.Status != 15 { // 15: NOT_SUPPORTED
			return err
		}
	}
	return legacy()
}

func (g Gemm) describe() string {
	t := func(b bool) string {
		if b {
			return "T"
		}
		return "N"
	}
	return fmt.Sprintf("%d×%d×%d %s%s %v·%v→%v batch %d", g.M, g.N, g.K, t(g.TransA), t(g.TransB), g.AType, g.BType, g.CType, g.Batch)
}

//go:uintptrescapes
func callGemm(fn uintptr, args ...uintptr) int32 {
	r, _, _ := purego.SyscallN(fn, args...)
	return int32(r)
}

func (h *Handle) matmulLegacy(s *cuda.Stream, g Gemm, a, b, c *cuda.Buffer) error {
	cm := g.colMajor()
	alpha, beta := g.Alpha, g.Beta
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.dev.Do(func() error {
		if err := status(h.leg.setStream(h.legH, s.Handle()), "cublasSetStream"); err != nil {
			return err
		}
		const computeType = 68 // CUBLAS_COMPUTE_32F
		algo := int64(-1)      // CUBLAS_GEMM_DEFAULT
		r := callGemm(h.leg.pGemm, h.legH, uintptr(cm.transA), uintptr(cm.transB),
			uintptr(cm.m), uintptr(cm.n), uintptr(cm.k), uintptr(unsafe.Pointer(&alpha)),
			uintptr(b.Ptr()), uintptr(cm.aType), uintptr(cm.lda), uintptr(cm.strideA),
			uintptr(a.Ptr()), uintptr(cm.bType), uintptr(cm.ldb), uintptr(cm.strideB),
			uintptr(unsafe.Pointer(&beta)),
			uintptr(c.Ptr()), uintptr(cm.cTyp), uintptr(cm.ldc), uintptr(cm.strideC),
			uintptr(g.Batch), computeType, uintptr(algo))
		return status(r, "cublasGemmStridedBatchedEx("+g.describe()+")")
	})
}
