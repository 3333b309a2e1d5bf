package llm

import (
	_ "embed"
	"fmt"
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

// wgStages is the cp.async pipeline depth of the one build of attn_wg64
// (attn_wgmma.cu): on an H200, 3 stages took 14.3 ms at 4 layers of the
// SparseLM shape where 2 took 14.4 and mma.sync (attn_fa64) 21.3.
const wgStages = 3

// wgName is the name expression of the wgmma attention kernel.
var wgName = fmt.Sprintf("attn_wg64<%d>", wgStages)

// wgSmem is its dynamic shared memory: the 128 query rows and the stages'
// 64-key K and V blocks, 128 bytes a row, plus 1024 bytes for aligning the
// base.
const wgSmem = (attnBQ+wgStages*2*64)*128 + 1024

// kernels are the compiled functions of llm.cu on one device.
type kernels struct {
	embed, addNorm, ropeKV *cuda.Function
	attnRef                *cuda.Function
	attnFA64, attnFA128    *cuda.Function
	actMul                 *cuda.Function
	gemv1, gemv4           *cuda.Function
	qkvRope1, qkvRope4     *cuda.Function

	dev *cuda.Device
	// attnWG is attn_wg64, compiled at first use and on sm_90a only;
	// wgErr says why it is missing.
	wgOnce sync.Once
	attnWG *cuda.Function
	wgErr  error
}

// wgmma returns attn_wg64, compiling attn_wgmma.cu on first use.
func (k *kernels) wgmma() (*cuda.Function, error) {
	k.wgOnce.Do(func() { k.attnWG, k.wgErr = compileWGMMA(k.dev, headers()) })
	return k.attnWG, k.wgErr
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
func compileWGMMA(dev *cuda.Device, hdrs []cuda.CompileOption) (*cuda.Function, error) {
	if a := dev.Properties().Arch; a != "sm_90a" {
		return nil, fmt.Errorf("llm: the wgmma attention kernel needs sm_90a (Hopper); %v is %s", dev, a)
	}
	mod, err := dev.Compile("attn_wgmma.cu", attnWGMMASrc, append(hdrs, cuda.WithNameExpressions(wgName))...)
	if err != nil {
		return nil, fmt.Errorf("llm: compiling attn_wgmma.cu: %w", err)
	}
	fn, err := mod.Function(wgName)
	if err != nil {
		return nil, fmt.Errorf("llm: kernel %s: %w", wgName, err)
	}
	return fn, nil
}
