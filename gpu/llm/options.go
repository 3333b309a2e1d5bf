package llm

import (
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"

	"github.com/twell-ai/twell/gpu"
)

// Options are the engine settings that experiments change, read from the
// environment once per engine by OptionsFromEnv (NewEngine copies them into
// the Engine's fields and its MLPs; nothing reads the environment while the
// engine runs).
type Options struct {
	Attention string      // Engine.Attention: EnvAttention
	NoGraphs  bool        // Engine.NoGraphs: EnvGraphs = "0"
	NoGEMV    bool        // Engine.NoGEMV: EnvGEMV = "0"
	FuseNorms bool        // Engine.FuseNorms: EnvFuseNorms unset or "1"
	AttnRope  bool        // Engine.AttnRope: EnvAttnRope unset or "1"
	GEMMTune  bool        // the engine's cuBLASLt handle tunes (cublas.DefaultTuneFlops): EnvGEMMTune unset or "1"
	DecRope   bool        // Engine.DecRope: EnvDecRope unset or "1"
	MLP       gpu.Options // each TwELL layer's kernels: gpu.Switches
	// ReleaseWeights makes NewEngineWith drop each layer's float32
	// matrices from the model once they are on the device, and the model's
	// weights (Weights becomes nil) at the end: for jobs that only run the
	// model, so that a model from model.LoadDeferred is never all in host
	// memory at once. Not read from the environment.
	ReleaseWeights bool
	// KVPageSize and KVMemory are the KV cache page size in positions (0:
	// DefaultPageSize) and budget in bytes (0: none): see SetKVPages.
	KVPageSize int   // EnvKVPageSize
	KVMemory   int64 // EnvKVMemory
}

// EnvAttention names the environment variable that sets a new Engine's
// Attention field ("auto", "mma", "ref" or "wgmma3"), to compare the
// kernels.
const EnvAttention = "TWELL_LLM_ATTENTION"

// EnvGraphs names the environment variable that, set to "0", makes a new
// Engine run decode steps kernel by kernel instead of replaying CUDA graphs
// (Engine.NoGraphs).
const EnvGraphs = "TWELL_GRAPHS"

// EnvGEMV names the environment variable that, set to "0", makes a new
// Engine run every projection through cuBLASLt (NoGEMV); "1" or unset: its
// own kernels for passes of up to 4 tokens.
const EnvGEMV = "TWELL_GEMV"

// EnvFuseNorms names the environment variable that, set to "0", makes a new
// Engine run the norms of one-token passes as kernels of their own instead
// of fusing them into the kernels after them (Engine.FuseNorms; fused: b=1
// decode 921-930 against 883-895 tokens/s, H200, 2026-12-05).
const EnvFuseNorms = "TWELL_LLM_FUSE_NORMS"

// EnvAttnRope names the environment variable that, set to "0", makes a new
// Engine rotate the queries of prefill passes in rope_kv instead of in the
// wgmma attention kernel (Engine.AttnRope; in the attention: 32 x 2048-token
// prefill 207.9 / 209.4 against 205.7-207.5 tokens/ms, H200, 2026-12-05).
const EnvAttnRope = "TWELL_LLM_ATTN_ROPE"

// EnvGEMMTune names the environment variable that, set to "0", makes a new
// Engine take the cuBLASLt heuristic's first algorithm for every product
// instead of choosing the algorithm of each large product (prefill's
// projections, the dense MLP) by timing the heuristic's candidates on its
// first call (cublas.Handle.TuneFlops = cublas.DefaultTuneFlops; tuned:
// 32 x 2048-token prefill 211.5 / 209.0 against 205.7-207.5 tokens/ms,
// H200, 2026-12-05).
const EnvGEMMTune = "TWELL_GEMM_TUNE"

// EnvDecRope names the environment variable that, set to "0", makes the
// decode steps of a new Engine whose q/k/v projection runs on cuBLASLt run
// rope_kv after it instead of leaving RoPE and the cache write to the decode
// attention kernel (Engine.DecRope; in the kernel: decode at 512 cached
// tokens 4112.5 / 5893.8 / 12965.0 tokens/s at 8 / 16 / 64 sequences
// against 3960.9-4072.1 / 5691.1-5726.3 / 12336.2-12842.2, H100,
// 2026-12-06).
const EnvDecRope = "TWELL_LLM_DEC_ROPE"

// EnvKVPageSize names the environment variable that sets a new Engine's KV
// cache page size in positions (a multiple of 64).
const EnvKVPageSize = "TWELL_LLM_KV_PAGE_SIZE"

// EnvKVMemory names the environment variable that sets a new Engine's KV
// cache budget: bytes, or a number with a binary unit (KiB, MiB, GiB,
// TiB), e.g. 8GiB.
const EnvKVMemory = "TWELL_LLM_KV_MEMORY"

// Switches are the names of the environment variables that set Options:
// the engine's and its TwELL MLPs' (gpu.Switches).
var Switches = append([]string{EnvAttention, EnvGraphs, EnvGEMV, EnvFuseNorms, EnvAttnRope, EnvGEMMTune, EnvDecRope,
	EnvKVPageSize, EnvKVMemory}, gpu.Switches...)

// OptionsFromEnv returns the Options the environment sets, or an error
// naming a value it does not know.
func OptionsFromEnv() (Options, error) { return OptionsFrom(os.Getenv) }

// OptionsFrom is OptionsFromEnv with the variables' values looked up by
// getenv ("" for unset), for settings that override the environment (the
// benchmarks' variants).
func OptionsFrom(getenv func(string) string) (Options, error) {
	o := Options{Attention: getenv(EnvAttention), NoGraphs: getenv(EnvGraphs) == "0"}
	switch v := getenv(EnvGEMV); v {
	case "", "1":
	case "0":
		o.NoGEMV = true
	default:
		return o, fmt.Errorf("llm: %s=%q: want 0 or 1", EnvGEMV, v)
	}
	for _, b := range []struct {
		name string
		dst  *bool
		on   bool // unset
	}{{EnvFuseNorms, &o.FuseNorms, true}, {EnvAttnRope, &o.AttnRope, true}, {EnvGEMMTune, &o.GEMMTune, true}, {EnvDecRope, &o.DecRope, true}} {
		switch v := getenv(b.name); v {
		case "":
			*b.dst = b.on
		case "0", "1":
			*b.dst = v == "1"
		default:
			return o, fmt.Errorf("llm: %s=%q: want 0 or 1", b.name, v)
		}
	}
	switch o.Attention {
	case "", "auto", "mma", "ref":
	default:
		if _, ok := wgBuilds[o.Attention]; !ok {
			return o, fmt.Errorf("llm: %s=%q: want %s", EnvAttention, o.Attention, attentionChoices())
		}
	}
	if v := getenv(EnvKVPageSize); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return o, fmt.Errorf("llm: %s=%q: want a number of positions, a multiple of %d", EnvKVPageSize, v, PageMultiple)
		}
		o.KVPageSize = n
	}
	if v := getenv(EnvKVMemory); v != "" {
		n, ok := parseBytes(v)
		if !ok {
			return o, fmt.Errorf("llm: %s=%q: want a size in bytes, such as 8589934592 or 8GiB", EnvKVMemory, v)
		}
		o.KVMemory = n
	}
	var err error
	o.MLP, err = gpu.OptionsFrom(getenv)
	return o, err
}

// parseBytes reads a number of bytes, optionally followed by a binary unit
// (KiB, MiB, GiB, TiB).
func parseBytes(s string) (int64, bool) {
	mult := int64(1)
	for i, unit := range []string{"KiB", "MiB", "GiB", "TiB"} {
		if n, ok := strings.CutSuffix(s, unit); ok {
			s, mult = strings.TrimSpace(n), 1<<(10*(i+1))
			break
		}
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v < 0 || v > math.MaxInt64/mult {
		return 0, false
	}
	return v * mult, true
}
