// Package backend picks where a model runs (the -device flag: auto, cpu or
// cuda) and opens the engine for it: package cpu/llm on the CPU, package
// gpu/llm on an NVIDIA GPU. Jobs call it instead of choosing engines
// themselves.
package backend

import (
	"fmt"

	cpullm "github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/engine"
	gpullm "github.com/twell-ai/twell/gpu/llm"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
)

// Kind is where a model runs.
type Kind string

// The kinds.
const (
	// Auto is CUDA when a GPU is found (and takes the model), else CPU.
	Auto Kind = "auto"
	// CPU runs on the CPU engine (float32).
	CPU Kind = "cpu"
	// CUDA runs on the GPU engine (bf16) of CUDA device 0.
	CUDA Kind = "cuda"
)

// FlagUsage describes the -device flag.
const FlagUsage = "cpu, cuda or auto (auto: cuda when a GPU is found and takes the model, else cpu)"

// Parse reads a -device value: "auto", "cpu" or "cuda".
func Parse(s string) (Kind, error) {
	switch k := Kind(s); k {
	case Auto, CPU, CUDA:
		return k, nil
	}
	return "", fmt.Errorf("-device %q: want cpu, cuda or auto", s)
}

// GPUPresent reports whether a CUDA device and its driver are found.
func GPUPresent() bool {
	n, err := cuda.Count()
	return err == nil && n > 0
}

// Resolve turns Auto into CPU or CUDA: CUDA when a GPU is found and, when c
// is not nil, the GPU engine takes a model of config c. The note says why
// Auto chose the CPU despite a GPU, or is empty. CPU and CUDA are returned
// as they are.
func Resolve(k Kind, c *model.Config) (Kind, string) {
	if k != Auto {
		return k, ""
	}
	if !GPUPresent() {
		return CPU, ""
	}
	if c != nil {
		if err := gpullm.Supported(*c); err != nil {
			return CPU, fmt.Sprintf("running on the CPU: the GPU engine does not take this model: %v", err)
		}
	}
	return CUDA, ""
}

// Options are the engine settings a job chooses.
type Options struct {
	// MLPPath is how the MLPs run.
	MLPPath mlp.Path
	// DecodeBF16 makes the CPU engine's passes of at most 16 tokens read
	// bf16 copies of the weights (see cpu/llm.Options); the GPU engine
	// always runs bf16.
	DecodeBF16 bool
	// ReleaseWeights lets go of the model's float32 weights once the engine
	// no longer needs them, for jobs that only run the model: the CPU engine
	// drops each layer's matrices as it packs them (see cpu/llm.Options),
	// the GPU engine each layer's once it is on the device and then the
	// model's weights (m.Weights becomes nil; see gpu/llm.Options).
	ReleaseWeights bool
	// KVPageSize and KVMemory are the CPU engine's KV cache page size in
	// positions (0: its default) and page budget in bytes (0: none); see
	// cpu/llm.Options. The GPU engine takes its page settings after it is
	// open, from gpu/llm.Engine.SetKVPages, once the device memory left
	// beside the weights is known.
	KVPageSize int
	KVMemory   int64
}

// KVPage returns the CPU engine's KV cache page for a model of config c:
// its size in positions (pageSize, or the engine's default when 0) and its
// memory in bytes.
func KVPage(c model.Config, pageSize int) (int, int64) {
	if pageSize == 0 {
		pageSize = cpullm.DefaultPageSize(c)
	}
	return pageSize, cpullm.PageBytes(c, pageSize)
}

// Open returns the engine for m on k (CPU or CUDA; resolve Auto first).
// Close the engine when done.
func Open(k Kind, m *model.Model, o Options) (engine.Engine, error) {
	switch k {
	case CPU:
		return cpullm.New(m, cpullm.Options{MLPPath: o.MLPPath, DecodeBF16: o.DecodeBF16, ReleaseWeights: o.ReleaseWeights,
			KVPageSize: o.KVPageSize, KVMemory: o.KVMemory})
	case CUDA:
		dev, err := cuda.Open(0)
		if err != nil {
			return nil, fmt.Errorf("-device cuda: %w", err)
		}
		opts, err := gpullm.OptionsFromEnv()
		if err != nil {
			return nil, err
		}
		opts.ReleaseWeights = o.ReleaseWeights
		e, err := gpullm.NewEngineWith(dev, m, opts)
		if err != nil {
			return nil, fmt.Errorf("-device cuda: %w", err)
		}
		if err := e.SetMLPPath(o.MLPPath); err != nil {
			e.Close()
			return nil, err
		}
		return e, nil
	}
	return nil, fmt.Errorf("backend: cannot open an engine on %q (resolve auto first)", k)
}
