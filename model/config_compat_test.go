package model

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/safetensors"
)

// TestWriteHFCompatFiles writes files for safetensors/testdata/hf_compat.py, which checks
// them with Python safetensors and transformers (on a machine that has them). It runs only
// when TWELL_HF_COMPAT_DIR names the output directory.
func TestWriteHFCompatFiles(t *testing.T) {
	dir := testutil.Getenv(t, "TWELL_HF_COMPAT_DIR", "the directory for safetensors/testdata/hf_compat.py to check")
	rng, seed := testutil.Rand(t)
	t.Logf("seed %d", seed)

	// Every dtype, with float values that exercise rounding, subnormals and overflow.
	if err := os.MkdirAll(filepath.Join(dir, "single"), 0o755); err != nil {
		t.Fatal(err)
	}
	w, err := safetensors.Create(filepath.Join(dir, "single", "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	w.SetMetadata("source", "twell")
	vals := make([]float32, 999)
	for i := range vals {
		vals[i] = float32(rng.NormFloat64() * math.Pow(2, float64(rng.IntN(60)-40)))
	}
	vals[0], vals[1], vals[2] = 70000, float32(math.Inf(-1)), 1e-7
	for _, dt := range []safetensors.DType{safetensors.U8, safetensors.F32, safetensors.BF16, safetensors.F16, safetensors.F64} {
		if dt == safetensors.U8 {
			if err := w.Add("u8", dt, []int{3}, []byte{1, 2, 255}); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := w.AddFloat32(string(dt), dt, []int{27, 37}, vals); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Add("i32", safetensors.I32, []int{2}, []byte{1, 0, 0, 0, 0xfe, 0xff, 0xff, 0xff}); err != nil {
		t.Fatal(err)
	}
	if err := w.Add("scalar_i64", safetensors.I64, nil, []byte{7, 0, 0, 0, 0, 0, 0, 0}); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}

	// A tiny sparse Llama, single-file and sharded.
	c := SparseLM1B5()
	c.HiddenSize, c.IntermediateSize, c.NumHiddenLayers = 64, 256, 2
	c.NumAttentionHeads, c.NumKeyValueHeads, c.HeadDim, c.VocabSize, c.MaxPositionEmbeddings = 4, 2, 16, 128, 64
	for _, sub := range []string{"tiny", "tiny_sharded"} {
		d := filepath.Join(dir, sub)
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := c.Save(d); err != nil {
			t.Fatal(err)
		}
		max := int64(1 << 40)
		if sub == "tiny_sharded" {
			max = 40000
		}
		w, err := safetensors.CreateSharded(d, max)
		if err != nil {
			t.Fatal(err)
		}
		add := func(name string, shape ...int) {
			n := 1
			for _, s := range shape {
				n *= s
			}
			v := make([]float32, n)
			for i := range v {
				v[i] = float32(rng.NormFloat64() * 0.05)
				if len(shape) == 1 {
					v[i] += 1 // norm weights
				}
			}
			if err := w.AddFloat32(name, safetensors.BF16, shape, v); err != nil {
				t.Fatal(err)
			}
		}
		h, f, kv := c.HiddenSize, c.IntermediateSize, c.NumKeyValueHeads*c.HeadDim
		add("model.embed_tokens.weight", c.VocabSize, h)
		for l := range c.NumHiddenLayers {
			p := fmt.Sprintf("model.layers.%d.", l)
			add(p+"input_layernorm.weight", h)
			add(p+"self_attn.q_proj.weight", c.NumAttentionHeads*c.HeadDim, h)
			add(p+"self_attn.k_proj.weight", kv, h)
			add(p+"self_attn.v_proj.weight", kv, h)
			add(p+"self_attn.o_proj.weight", h, c.NumAttentionHeads*c.HeadDim)
			add(p+"post_attention_layernorm.weight", h)
			add(p+"mlp.gate_proj.weight", f, h)
			add(p+"mlp.up_proj.weight", f, h)
			add(p+"mlp.down_proj.weight", h, f)
		}
		add("model.norm.weight", h)
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
	}
}
