package llm

import (
	_ "embed"
	"fmt"
	"slices"
	"sync"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/gpu"
)

var (
	//go:embed llm.cu
	llmSrc []byte
	//go:embed attn.cuh
	attnCUH []byte
	//go:embed attn_wgmma.cu
	attnWGMMASrc []byte
)

// wgVariant is one build of attn_wg64: its pipeline depth and whether it
// overlaps P V with the next block's scores.
type wgVariant struct {
	stages  int
	overlap bool
}

// wgVariants are the builds of attn_wg64, by Engine.Attention value; "wgmma"
// is the default one.
var wgVariants = map[string]wgVariant{
	"wgmma": {2, false}, "wgmma2": {2, false}, "wgmma3": {3, false}, "wgmma-ov": {3, true},
}

// name is the kernel's name expression.
func (v wgVariant) name() string { return fmt.Sprintf("attn_wg64<%d,%v>", v.stages, v.overlap) }

// smem is its dynamic shared memory: the 128 query rows and the stages'
// 64-key K and V blocks, 128 bytes a row, plus 1024 bytes for aligning the
// base.
func (v wgVariant) smem() int { return (attnBQ+v.stages*2*64)*128 + 1024 }

// wgExprs are the name expressions of every build.
func wgExprs() []string {
	seen := map[string]bool{}
	var exprs []string
	for _, v := range wgVariants {
		if n := v.name(); !seen[n] {
			seen[n] = true
			exprs = append(exprs, n)
		}
	}
	slices.Sort(exprs)
	return exprs
}

// kernels are the compiled functions of llm.cu on one device.
type kernels struct {
	embed, addNorm, ropeKV *cuda.Function
	attnRef                *cuda.Function
	attnFA64, attnFA128    *cuda.Function
	actMul                 *cuda.Function
	gemv1, gemv4           *cuda.Function
	qkvRope1, qkvRope4     *cuda.Function

	dev *cuda.Device
	// attnWG holds the builds of attn_wg64 by name expression, compiled at
	// first use (they are opt-in) and on sm_90a only; wgErr says why they
	// are missing.
	wgOnce sync.Once
	attnWG map[string]*cuda.Function
	wgErr  error
}

// wgmma returns build v of attn_wg64, compiling attn_wgmma.cu on first use.
func (k *kernels) wgmma(v wgVariant) (*cuda.Function, error) {
	k.wgOnce.Do(func() { k.attnWG, k.wgErr = compileWGMMA(k.dev, headers()) })
	if k.wgErr != nil {
		return nil, k.wgErr
	}
	return k.attnWG[v.name()], nil
}

var (
	kernMu  sync.Mutex
	kernTab = map[*cuda.Device]*kernels{}
)

// kernelsFor compiles llm.cu for dev, with package gpu's headers (once per
// process; NVRTC's output is also cached on disk), and looks its kernels up.
func kernelsFor(dev *cuda.Device) (*kernels, error) {
	kernMu.Lock()
	defer kernMu.Unlock()
	if k := kernTab[dev]; k != nil {
		return k, nil
	}
	mod, err := dev.Compile("llm.cu", llmSrc, headers()...)
	if err != nil {
		return nil, fmt.Errorf("llm: compiling llm.cu: %w", err)
	}
	k := &kernels{dev: dev}
	for _, f := range []struct {
		dst  **cuda.Function
		name string
	}{
		{&k.embed, "embed"}, {&k.addNorm, "add_rmsnorm"}, {&k.ropeKV, "rope_kv"},
		{&k.attnRef, "attn_ref"}, {&k.attnFA64, "attn_fa64"}, {&k.attnFA128, "attn_fa128"},
		{&k.actMul, "act_mul"}, {&k.gemv1, "gemv_rows1"}, {&k.gemv4, "gemv_rows4"},
		{&k.qkvRope1, "qkv_rope1"}, {&k.qkvRope4, "qkv_rope4"},
	} {
		if *f.dst, err = mod.Function(f.name); err != nil {
			return nil, fmt.Errorf("llm: kernel %s: %w", f.name, err)
		}
	}
	kernTab[dev] = k
	return k, nil
}

// headers are the compile options of this package's .cu files: package
// gpu's headers and attn.cuh.
func headers() []cuda.CompileOption {
	return append(gpu.Headers(), cuda.WithHeader("attn.cuh", attnCUH))
}

// compileWGMMA builds attn_wgmma.cu, which needs sm_90a (Hopper).
func compileWGMMA(dev *cuda.Device, hdrs []cuda.CompileOption) (map[string]*cuda.Function, error) {
	if a := dev.Properties().Arch; a != "sm_90a" {
		return nil, fmt.Errorf("llm: the wgmma attention kernel needs sm_90a (Hopper); %v is %s", dev, a)
	}
	exprs := wgExprs()
	mod, err := dev.Compile("attn_wgmma.cu", attnWGMMASrc, append(hdrs, cuda.WithNameExpressions(exprs...))...)
	if err != nil {
		return nil, fmt.Errorf("llm: compiling attn_wgmma.cu: %w", err)
	}
	fs := map[string]*cuda.Function{}
	for _, e := range exprs {
		if fs[e], err = mod.Function(e); err != nil {
			return nil, fmt.Errorf("llm: kernel %s: %w", e, err)
		}
	}
	return fs, nil
}
