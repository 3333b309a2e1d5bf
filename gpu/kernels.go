package gpu

import (
	_ "embed"
	"fmt"
	"sync"

	"github.com/twell-ai/twell/cuda"
)

var (
	//go:embed common.cuh
	commonCUH []byte
	//go:embed wgmma.cuh
	wgmmaCUH []byte
	//go:embed rowdot.cuh
	rowdotCUH []byte
	//go:embed d2t_mma.cu
	d2tMMASrc []byte
	//go:embed d2t_wgmma.cu
	d2tWGMMASrc []byte
	//go:embed t2d.cu
	t2dSrc []byte
	//go:embed dense.cu
	denseSrc []byte
	//go:embed gemv.cu
	gemvSrc []byte
)

// kernels are the compiled modules of one device. Each .cu file is compiled
// on first use; a failure is kept and returned to every caller, so that one
// broken kernel (say wgmma on a non-Hopper GPU) leaves the others usable.
type kernels struct {
	dev *cuda.Device

	mmaOnce, denseOnce   sync.Once
	mma                  map[int]*cuda.Function // D2T by S
	mmaErr               error
	wgOnce               sync.Once
	wg                   map[int]*cuda.Function // wgmma D2T by S
	wgErr                error
	reluMul, reluInplace *cuda.Function
	denseErr             error
	gath                 gatheredSet
	gemvOnce             sync.Once
	gemv                 gemvSet
	gemvErr              error

	t2dMu sync.Mutex
	t2d   map[int]*t2dSet // by chunks per row, ceil(d/256)
}

type t2dSet struct {
	gated, plain       *cuda.Function // one warp per token (TailWarp)
	t2uGated, t2uPlain *cuda.Function // TailSorted: up projection and compaction
	ws16, ws8          *cuda.Function // TailSorted: weight-stationary down projection
	// TailSorted's counting sort of the tokens by list length
	lenHist, lenOffsets, lenScatter *cuda.Function
	fbGated, fbPlain                *cuda.Function
	err                             error
}

// gemvSet are the kernels of the small-batch sparse MLP (gemv.cu), by
// rows per call (1, 2 or 4: the template's MB) and, for act, gated or not.
type gemvSet struct {
	actGated, actPlain, down map[int]*cuda.Function
	// The LIST forms (MB = 4), which recompute the rows D2T flagged.
	fbActGated, fbActPlain, fbDown *cuda.Function
}

// gemvRows are the batch sizes gemv.cu is instantiated for; a call of m
// tokens uses the smallest that holds m.
var gemvRows = []int{1, 2, 4}

// gemvMaxRows is the largest batch the small-batch sparse MLP takes.
const gemvMaxRows = 4

// fbGroup is how many flagged rows the LIST forms of gemv.cu take at a time.
const fbGroup = 4

// gemvExprs lists the kernels of gemv.cu: gated act, plain act and down
// per batch size of gemvRows, then the same three LIST forms.
func gemvExprs() []string {
	var exprs []string
	for _, mb := range gemvRows {
		exprs = append(exprs, fmt.Sprintf("gemv_act<%d,true,false>", mb), fmt.Sprintf("gemv_act<%d,false,false>", mb),
			fmt.Sprintf("gemv_down<%d,false>", mb))
	}
	return append(exprs, fmt.Sprintf("gemv_act<%d,true,true>", fbGroup), fmt.Sprintf("gemv_act<%d,false,true>", fbGroup),
		fmt.Sprintf("gemv_down<%d,true>", fbGroup))
}

// gemvKernels compiles gemv.cu once and returns its kernels.
func (k *kernels) gemvKernels() (*gemvSet, error) {
	k.gemvOnce.Do(func() {
		exprs := gemvExprs()
		fs, err := k.compile("gemv.cu", gemvSrc, exprs)
		if err != nil {
			k.gemvErr = err
			return
		}
		k.gemv = gemvSet{actGated: map[int]*cuda.Function{}, actPlain: map[int]*cuda.Function{}, down: map[int]*cuda.Function{}}
		for i, mb := range gemvRows {
			k.gemv.actGated[mb], k.gemv.actPlain[mb], k.gemv.down[mb] = fs[exprs[3*i]], fs[exprs[3*i+1]], fs[exprs[3*i+2]]
		}
		n := len(exprs)
		k.gemv.fbActGated, k.gemv.fbActPlain, k.gemv.fbDown = fs[exprs[n-3]], fs[exprs[n-2]], fs[exprs[n-1]]
	})
	return &k.gemv, k.gemvErr
}

// gatheredSet are the kernels of the gathered dense pass over flagged rows.
type gatheredSet struct {
	gather, scatter    *cuda.Function
	actGated, actPlain *cuda.Function
}

var (
	kernMu  sync.Mutex
	kernTab = map[*cuda.Device]*kernels{}
)

func kernelsFor(dev *cuda.Device) *kernels {
	kernMu.Lock()
	defer kernMu.Unlock()
	k := kernTab[dev]
	if k == nil {
		k = &kernels{dev: dev, t2d: map[int]*t2dSet{}}
		kernTab[dev] = k
	}
	return k
}

// Headers returns the compile options that let a .cu file include this
// package's device headers: common.cuh (types, bf16 helpers, dot8,
// cp.async, L2 hints), rowdot.cuh (weight-row dot products for a few
// tokens) and wgmma.cuh (Hopper only). Package gpu/llm compiles its
// kernels with them.
func Headers() []cuda.CompileOption {
	return []cuda.CompileOption{cuda.WithHeader("common.cuh", commonCUH), cuda.WithHeader("rowdot.cuh", rowdotCUH),
		cuda.WithHeader("wgmma.cuh", wgmmaCUH)}
}

func (k *kernels) compile(name string, src []byte, exprs []string, opts ...cuda.CompileOption) (map[string]*cuda.Function, error) {
	opts = append(append(opts, Headers()...), cuda.WithNameExpressions(exprs...))
	mod, err := k.dev.Compile(name, src, opts...)
	if err != nil {
		return nil, fmt.Errorf("gpu: compiling %s: %w", name, err)
	}
	fs := map[string]*cuda.Function{}
	for _, e := range exprs {
		f, err := mod.Function(e)
		if err != nil {
			return nil, fmt.Errorf("gpu: %s: kernel %s: %w", name, e, err)
		}
		fs[e] = f
	}
	return fs, nil
}

// d2tMMA returns the mma.sync D2T kernel for S words per tile.
func (k *kernels) d2tMMA(s int) (*cuda.Function, error) {
	k.mmaOnce.Do(func() {
		exprs := []string{"d2t_mma<32>", "d2t_mma<64>", "d2t_mma<128>"}
		fs, err := k.compile("d2t_mma.cu", d2tMMASrc, exprs)
		if err != nil {
			k.mmaErr = err
			return
		}
		k.mma = map[int]*cuda.Function{32: fs[exprs[0]], 64: fs[exprs[1]], 128: fs[exprs[2]]}
	})
	if k.mmaErr != nil {
		return nil, k.mmaErr
	}
	return k.mma[s], nil
}

// d2tWGMMA returns the Hopper D2T kernel for S words per tile.
func (k *kernels) d2tWGMMA(s int) (*cuda.Function, error) {
	k.wgOnce.Do(func() {
		p := k.dev.Properties()
		if p.Arch != "sm_90a" {
			k.wgErr = fmt.Errorf("gpu: the wgmma D2T kernel needs sm_90a (Hopper); %v is %s", k.dev, p.Arch)
			return
		}
		fs, err := k.compile("d2t_wgmma.cu", d2tWGMMASrc, wgmmaExprs())
		if err != nil {
			k.wgErr = err
			return
		}
		k.wg = map[int]*cuda.Function{}
		for _, s := range []int{32, 64, 128} {
			k.wg[s] = fs[wgmmaName(s)]
		}
	})
	if k.wgErr != nil {
		return nil, k.wgErr
	}
	return k.wg[s], nil
}

// wgmmaName is the name expression of the wgmma D2T kernel for S words per
// tile.
func wgmmaName(s int) string { return fmt.Sprintf("d2t_wgmma<%d,%d>", s, wgmmaStages) }

// wgmmaExprs are the name expressions of d2t_wgmma.cu.
func wgmmaExprs() []string { return []string{wgmmaName(32), wgmmaName(64), wgmmaName(128)} }

// wgmmaStages is the pipeline depth of d2t_wgmma: its bf16 tile (66 KiB)
// leaves room for 3 stages.
const wgmmaStages = 3

// wgmmaSmem returns the dynamic shared memory the wgmma D2T kernel needs,
// with 1024 bytes of slack for aligning the base (see d2t_wgmma.cu).
func wgmmaSmem(s int) int {
	const stage = 16384 + 32768
	return wgmmaStages*stage + 128*132*4 + 3*s*4 + (2*wgmmaStages+2)*8 + 1024
}

// compileDense compiles dense.cu once: the dense MLP's elementwise kernels
// and those of the gathered dense pass over flagged rows.
func (k *kernels) compileDense() error {
	k.denseOnce.Do(func() {
		exprs := []string{"relu_mul", "relu_inplace", "gather_rows", "scatter_rows", "act_exact<true>", "act_exact<false>"}
		fs, err := k.compile("dense.cu", denseSrc, exprs)
		if err != nil {
			k.denseErr = err
			return
		}
		k.reluMul, k.reluInplace = fs[exprs[0]], fs[exprs[1]]
		k.gath = gatheredSet{gather: fs[exprs[2]], scatter: fs[exprs[3]], actGated: fs[exprs[4]], actPlain: fs[exprs[5]]}
	})
	return k.denseErr
}

// dense returns the elementwise kernels of the dense MLP.
func (k *kernels) dense() (reluMul, reluInplace *cuda.Function, err error) {
	err = k.compileDense()
	return k.reluMul, k.reluInplace, err
}

// gathered returns the kernels of the gathered dense pass.
func (k *kernels) gathered() (*gatheredSet, error) {
	return &k.gath, k.compileDense()
}

// t2dFor returns the T2D and fallback kernels for hidden size d.
func (k *kernels) t2dFor(d int) (*t2dSet, error) {
	nch := (d + 255) / 256
	k.t2dMu.Lock()
	defer k.t2dMu.Unlock()
	if set, ok := k.t2d[nch]; ok {
		return set, set.err
	}
	exprs := []string{"t2d<true>", "t2d<false>", "row_fallback<true>", "row_fallback<false>",
		"t2u<true>", "t2u<false>", "t2d_ws<16>", "t2d_ws<8>", "len_hist", "len_offsets", "len_scatter"}
	set := &t2dSet{}
	fs, err := k.compile("t2d.cu", t2dSrc, exprs, cuda.WithOptions(fmt.Sprintf("-DTW_NCH=%d", nch)))
	if err != nil {
		set.err = err
	} else {
		set.gated, set.plain, set.fbGated, set.fbPlain = fs[exprs[0]], fs[exprs[1]], fs[exprs[2]], fs[exprs[3]]
		set.t2uGated, set.t2uPlain, set.ws16, set.ws8 = fs[exprs[4]], fs[exprs[5]], fs[exprs[6]], fs[exprs[7]]
		set.lenHist, set.lenOffsets, set.lenScatter = fs[exprs[8]], fs[exprs[9]], fs[exprs[10]]
	}
	k.t2d[nch] = set
	return set, set.err
}
