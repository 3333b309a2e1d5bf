package llm

import (
	_ "embed"
	"fmt"
	"sync"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/gpu"
)

var (
	//go:embed norm.cu
	normSrc []byte
	//go:embed proj.cu
	projSrc []byte
	//go:embed rope.cu
	ropeSrc []byte
	//go:embed attn.cu
	attnSrc []byte
	//go:embed attn.cuh
	attnCUH []byte
	//go:embed kvpage.cuh
	kvPageCUH []byte
	//go:embed rope.cuh
	ropeCUH []byte
	//go:embed attn_wgmma.cu
	attnWGMMASrc []byte
	//go:embed pick.cu
	pickSrc []byte
)

// kernels are the compiled functions of this package's .cu files on one
// device.
type kernels struct {
	embed, addNorm, ropeKV *cuda.Function
	attnRef                *cuda.Function
	attnFA64, attnFA128    *cuda.Function
	// dec are the decode attention kernels by head_dim (attn_dec64,
	// attn_dec128).
	dec                map[int]decKernel
	gemv1, gemv4       *cuda.Function
	qkvRope1, qkvRope4 *cuda.Function
	qkvRope1N          *cuda.Function // qkv_rope1 with the norm before it fused in
	pick               *cuda.Function // pick_rows: the picks of ForwardSample and of a Decoder

	dev *cuda.Device
	// attnWG are the builds of the wgmma attention kernel by name
	// expression (wgBuilds), compiled at first use and on sm_90a only; wgErr
	// says why they are missing.
	wgOnce sync.Once
	attnWG map[string]*cuda.Function
	wgErr  error
}

var (
	kernMu  sync.Mutex
	kernTab = map[*cuda.Device]*kernels{}
)

// decKernel is a decode attention kernel, its CTAs resident at once on the
// device (slots; see decRuns), and whether its runs are launched as
// clusters (decAttention.cluster).
type decKernel struct {
	fn      *cuda.Function
	slots   int
	cluster bool
}

// kernelFiles are this package's .cu files (but attn_wgmma.cu, compiled at
// first use on Hopper) and the kernels looked up in each.
var kernelFiles = []struct {
	name    string
	src     *[]byte
	kernels []string
}{
	{"norm.cu", &normSrc, []string{"embed", "add_rmsnorm"}},
	{"proj.cu", &projSrc, []string{"gemv_rows1", "gemv_rows4", "qkv_rope1", "qkv_rope4", "qkv_rope1n"}},
	{"rope.cu", &ropeSrc, []string{"rope_kv"}},
	{"attn.cu", &attnSrc, []string{"attn_ref", "attn_fa64", "attn_fa128", "attn_dec64", "attn_dec128"}},
	{"pick.cu", &pickSrc, []string{"pick_rows"}},
}

// kernelsFor compiles the .cu files of kernelFiles for dev, with package
// gpu's headers (once per process; NVRTC's output is also cached on disk),
// and looks their kernels up.
func kernelsFor(dev *cuda.Device) (*kernels, error) {
	kernMu.Lock()
	defer kernMu.Unlock()
	if k := kernTab[dev]; k != nil {
		return k, nil
	}
	fs := map[string]*cuda.Function{}
	for _, file := range kernelFiles {
		mod, err := dev.Compile(file.name, *file.src, headers()...)
		if err != nil {
			return nil, fmt.Errorf("llm: compiling %s: %w", file.name, err)
		}
		for _, name := range file.kernels {
			if fs[name], err = mod.Function(name); err != nil {
				return nil, fmt.Errorf("llm: kernel %s: %w", name, err)
			}
		}
	}
	k := &kernels{dev: dev, embed: fs["embed"], addNorm: fs["add_rmsnorm"], ropeKV: fs["rope_kv"],
		attnRef: fs["attn_ref"], attnFA64: fs["attn_fa64"], attnFA128: fs["attn_fa128"],
		gemv1: fs["gemv_rows1"], gemv4: fs["gemv_rows4"],
		qkvRope1: fs["qkv_rope1"], qkvRope4: fs["qkv_rope4"],
		qkvRope1N: fs["qkv_rope1n"], pick: fs["pick_rows"], dec: map[int]decKernel{}}
	for _, hd := range []int{64, 128} {
		name, smem := fmt.Sprintf("attn_dec%d", hd), decSmem(hd)
		fn := fs[name]
		if err := fn.SetMaxDynamicShared(smem); err != nil {
			return nil, fmt.Errorf("llm: %s: %w", name, err)
		}
		n, err := fn.MaxActiveBlocksPerSM(decThreads, smem)
		if err != nil {
			return nil, fmt.Errorf("llm: %s: %w", name, err)
		}
		dk := decKernel{fn: fn, slots: max(1, n) * dev.Properties().SMs}
		if dev.Properties().ClusterLaunch {
			// The runs of a (sequence, head) merge in a cluster where the
			// device can hold one of the most runs (sizes above 8 are not
			// portable).
			c, err := fn.MaxActiveClusters(cuda.LaunchConfig{Grid: cuda.Dim3{1, decSplits, 1},
				Block: cuda.Dim3{decThreads, 1, 1}, SharedBytes: smem, Cluster: cuda.Dim3{1, decSplits, 1}})
			dk.cluster = err == nil && c > 0
		}
		k.dec[hd] = dk
	}
	kernTab[dev] = k
	return k, nil
}

// headers are the compile options of this package's .cu files: package
// gpu's headers, attn.cuh, kvpage.cuh and rope.cuh.
func headers() []cuda.CompileOption {
	return append(gpu.Headers(), cuda.WithHeader("attn.cuh", attnCUH), cuda.WithHeader("kvpage.cuh", kvPageCUH),
		cuda.WithHeader("rope.cuh", ropeCUH))
}
