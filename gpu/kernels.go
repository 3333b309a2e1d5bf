package gpu

import (
	_ "embed"
	"fmt"
	"sync"

	"github.com/twell-ai/twell/cuda"
)

// The device headers every .cu file of this package (and of gpu/llm)
// includes; see Headers.
var (
	//go:embed common.cuh
	commonCUH []byte
	//go:embed wgmma.cuh
	wgmmaCUH []byte
	//go:embed rowdot.cuh
	rowdotCUH []byte
	//go:embed mma.cuh
	mmaCUH []byte
)

// kernels are the compiled modules of one device. Each .cu file is compiled
// on first use; a failure is kept and returned to every caller, so that one
// broken kernel (say wgmma on a non-Hopper GPU) leaves the others usable.
type kernels struct {
	dev *cuda.Device

	mma       bySet // mma.sync D2T by S
	denseOnce sync.Once
	wgMu      sync.Mutex
	wg        map[int]*cuda.Function // wgmma D2T by S
	wgErr     error
	dn        denseSet
	denseErr  error
	gath      gatheredSet
	gemv      gemvBuild // gemv.cu
	gemvTL    gemvBuild // gemv.cu built with GEMV_TIMELINE (Options.GEMVTimeline)
	hotKs     hotSet    // hot.cu (hot units)

	t2dMu sync.Mutex
	t2d   map[int]*t2dSet // by chunks per row, ceil(d/256)
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
// cp.async, L2 hints, block sums), rowdot.cuh (weight-row dot products for
// a few tokens), mma.cuh (mma.sync and ldmatrix building blocks of the
// attention kernels) and wgmma.cuh (Hopper only). Packages gpu/llm and
// gpu/trainer compile their kernels with them.
func Headers() []cuda.CompileOption {
	return []cuda.CompileOption{cuda.WithHeader("common.cuh", commonCUH), cuda.WithHeader("rowdot.cuh", rowdotCUH),
		cuda.WithHeader("mma.cuh", mmaCUH), cuda.WithHeader("wgmma.cuh", wgmmaCUH)}
}

func (k *kernels) compile(name string, src []byte, exprs []string, opts ...cuda.CompileOption) (map[string]*cuda.Function, error) {
	_, fs, err := k.compileModule(name, src, exprs, opts...)
	return fs, err
}

// compileModule is compile that also returns the module (for its globals).
func (k *kernels) compileModule(name string, src []byte, exprs []string, opts ...cuda.CompileOption) (*cuda.Module, map[string]*cuda.Function, error) {
	opts = append(append(opts, Headers()...), cuda.WithNameExpressions(exprs...))
	mod, err := k.dev.Compile(name, src, opts...)
	if err != nil {
		return nil, nil, fmt.Errorf("gpu: compiling %s: %w", name, err)
	}
	fs := map[string]*cuda.Function{}
	for _, e := range exprs {
		f, err := mod.Function(e)
		if err != nil {
			return nil, nil, fmt.Errorf("gpu: %s: kernel %s: %w", name, e, err)
		}
		fs[e] = f
	}
	return mod, fs, nil
}

// optional returns b as a kernel argument, or a null pointer for nil.
func optional(b *cuda.Buffer) any {
	if b == nil {
		return cuda.DevicePtr(0)
	}
	return b
}

// elemGrid is the grid of the elementwise kernels of dense.cu over n bf16
// values (8 per thread, 256 threads a block), capped at 16 blocks per
// multiprocessor (the kernels loop).
func elemGrid(n int64, sms int) cuda.Dim3 {
	return cuda.Dim3{uint32(min((n/8+255)/256, int64(sms*16))), 1, 1}
}
