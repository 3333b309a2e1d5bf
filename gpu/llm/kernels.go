package llm

import (
	_ "embed"
	"fmt"
	"sync"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/gpu"
)

//go:embed llm.cu
var llmSrc []byte

// kernels are the compiled functions of llm.cu on one device.
type kernels struct {
	embed, addNorm, ropeKV *cuda.Function
	attnRef                *cuda.Function
	attnFA64, attnFA128    *cuda.Function
	actMul                 *cuda.Function
	gemv1, gemv4           *cuda.Function
	qkvRope1, qkvRope4     *cuda.Function
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
	mod, err := dev.Compile("llm.cu", llmSrc, gpu.Headers()...)
	if err != nil {
		return nil, fmt.Errorf("llm: compiling llm.cu: %w", err)
	}
	k := &kernels{}
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
