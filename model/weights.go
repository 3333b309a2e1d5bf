package model

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"unsafe"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/safetensors"
)

// LayerWeights holds one decoder layer's weights in the Hugging Face
// (nn.Linear) layouts: a projection W maps x to x W^T.
type LayerWeights struct {
	AttnNorm []float32 // input_layernorm, [hidden]
	Q        []float32 // q_proj, [heads*head_dim, hidden]
	K        []float32 // k_proj, [kv_heads*head_dim, hidden]
	V        []float32 // v_proj, [kv_heads*head_dim, hidden]
	O        []float32 // o_proj, [hidden, heads*head_dim]
	MLPNorm  []float32 // post_attention_layernorm, [hidden]
	Gate     []float32 // mlp.gate_proj, [intermediate, hidden]; nil if not gated
	Up       []float32 // mlp.up_proj, [intermediate, hidden]
	Down     []float32 // mlp.down_proj, [hidden, intermediate]
}

// Weights holds a Llama model's weights in float32.
type Weights struct {
	Embed  []float32 // embed_tokens, [vocab, hidden]
	Layers []LayerWeights
	Norm   []float32 // final norm, [hidden]
	LMHead []float32 // lm_head, [vocab, hidden]; nil when tied to Embed
}

// tensorSpec names one tensor, its shape and where it lives in Weights.
type tensorSpec struct {
	name  string
	shape []int
	dst   *[]float32
	layer int // the layer of a projection or MLP matrix, -1 for the rest
}

func (w *Weights) specs(c Config) []tensorSpec {
	h, hd, q, kv, f := c.HiddenSize, c.HeadDim, c.NumAttentionHeads, c.NumKeyValueHeads, c.IntermediateSize
	specs := []tensorSpec{{"model.embed_tokens.weight", []int{c.VocabSize, h}, &w.Embed, -1}}
	for i := range w.Layers {
		l := &w.Layers[i]
		p := fmt.Sprintf("model.layers.%d.", i)
		specs = append(specs,
			tensorSpec{p + "input_layernorm.weight", []int{h}, &l.AttnNorm, -1},
			tensorSpec{p + "self_attn.q_proj.weight", []int{q * hd, h}, &l.Q, i},
			tensorSpec{p + "self_attn.k_proj.weight", []int{kv * hd, h}, &l.K, i},
			tensorSpec{p + "self_attn.v_proj.weight", []int{kv * hd, h}, &l.V, i},
			tensorSpec{p + "self_attn.o_proj.weight", []int{h, q * hd}, &l.O, i},
			tensorSpec{p + "post_attention_layernorm.weight", []int{h}, &l.MLPNorm, -1},
			tensorSpec{p + "mlp.up_proj.weight", []int{f, h}, &l.Up, i},
			tensorSpec{p + "mlp.down_proj.weight", []int{h, f}, &l.Down, i},
		)
		if c.MLPGated {
			specs = append(specs, tensorSpec{p + "mlp.gate_proj.weight", []int{f, h}, &l.Gate, i})
		}
	}
	specs = append(specs, tensorSpec{"model.norm.weight", []int{h}, &w.Norm, -1})
	if !c.TieWordEmbeddings {
		specs = append(specs, tensorSpec{"lm_head.weight", []int{c.VocabSize, h}, &w.LMHead, -1})
	}
	return specs
}

// RoundBF16 rounds every weight of a model with config c to the nearest
// bfloat16 value, as saving it in bf16 and loading it again would: the CPU
// engine then holds the projection and MLP weights in bf16 alone, and the
// GPU runs on the very weights the CPU sees.
func (w *Weights) RoundBF16(c Config) {
	for _, s := range w.specs(c) {
		v := *s.dst
		for i, f := range v {
			v[i] = bf16.Round(f)
		}
	}
}

// LoadWeights reads the weights of a model with config c from a safetensors
// checkpoint (bf16, f16 or f32). Missing tensors, wrong shapes, NaN or
// infinite values and tensors the model does not use are errors naming the
// tensor.
func LoadWeights(c Config, ck *safetensors.Checkpoint) (*Weights, error) {
	w, _, err := loadWeights(c, ck, false)
	return w, err
}

// loadWeights is LoadWeights; with deferLayers it checks every tensor but
// reads only those outside the layers' matrices (embeddings, norms, LM
// head), and reports whether the matrices it left are all stored in bf16.
func loadWeights(c Config, ck *safetensors.Checkpoint, deferLayers bool) (w *Weights, layersBF16 bool, err error) {
	need := c.WeightBytes()
	if deferLayers { // embeddings, LM head, norms, and the layers' slice headers
		vocab, h, layers := float64(c.VocabSize), float64(c.HiddenSize), float64(c.NumHiddenLayers)
		heads := 2.0
		if c.TieWordEmbeddings {
			heads = 1
		}
		need = 4*(heads*vocab*h+(2*layers+1)*h) + layers*float64(unsafe.Sizeof(LayerWeights{}))
	}
	if err := memcheck.Fits(fmt.Sprintf("loading %s (%d layers, float32)", c.name(), c.NumHiddenLayers), need, ""); err != nil {
		return nil, false, fmt.Errorf("model: %w", err)
	}
	w = &Weights{Layers: make([]LayerWeights, c.NumHiddenLayers)}
	used := map[string]bool{}
	layersBF16 = true
	var errs []error
	for _, s := range w.specs(c) {
		used[s.name] = true
		t, err := checkTensor(ck, s)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if deferLayers && s.layer >= 0 {
			layersBF16 = layersBF16 && t.DType == safetensors.BF16
			continue
		}
		v, err := t.Float32()
		if err != nil {
			errs = append(errs, err)
			continue
		}
		*s.dst = v
	}
	if c.TieWordEmbeddings {
		used["lm_head.weight"] = true // some tied checkpoints store a copy; it is ignored
	}
	for _, n := range ck.Unused(used) {
		if strings.HasSuffix(n, "rotary_emb.inv_freq") {
			continue // older checkpoints store the RoPE table; it is recomputed
		}
		errs = append(errs, fmt.Errorf("model: tensor %q is not part of a %d-layer Llama", n, c.NumHiddenLayers))
	}
	if len(errs) > 0 {
		if len(errs) > 8 {
			errs = append(errs[:8], fmt.Errorf("... and %d more", len(errs)-8))
		}
		return nil, false, errors.Join(errs...)
	}
	return w, layersBF16, nil
}

// checkTensor returns the tensor s names from ck, checked: present, a float
// type, s's shape, finite values.
func checkTensor(ck *safetensors.Checkpoint, s tensorSpec) (safetensors.Tensor, error) {
	if !ck.Has(s.name) {
		return safetensors.Tensor{}, fmt.Errorf("model: %s: tensor %q missing", ck.Path(), s.name)
	}
	t, err := ck.Tensor(s.name)
	if err != nil {
		return t, err
	}
	if !t.DType.IsFloat() {
		return t, fmt.Errorf("model: tensor %q has dtype %s, want a float type", s.name, t.DType)
	}
	if !slices.Equal(t.Shape, s.shape) {
		return t, fmt.Errorf("model: tensor %q has shape %v, want %v", s.name, t.Shape, s.shape)
	}
	if err := t.CheckFinite(); err != nil {
		return t, fmt.Errorf("model: %s: %w", ck.Path(), err)
	}
	return t, nil
}

// Save writes the weights as model.safetensors (dtype BF16 or F32) in dir.
func (w *Weights) Save(c Config, dir string, dtype safetensors.DType) error {
	sw, err := safetensors.Create(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		return err
	}
	for _, s := range w.specs(c) {
		if err := sw.AddFloat32(s.name, dtype, s.shape, *s.dst); err != nil {
			sw.Abort()
			return err
		}
	}
	return sw.Close()
}

// RandomWeights returns weights for c drawn like a freshly initialised model
// (normal, std 0.02; norms 1).
func RandomWeights(c Config, r *rand.Rand) *Weights {
	h, hd, q, kv, f := c.HiddenSize, c.HeadDim, c.NumAttentionHeads, c.NumKeyValueHeads, c.IntermediateSize
	normal := func(n int, std float64) []float32 {
		a := make([]float32, n)
		for i := range a {
			a[i] = float32(r.NormFloat64() * std)
		}
		return a
	}
	ones := func(n int) []float32 {
		a := make([]float32, n)
		for i := range a {
			a[i] = 1
		}
		return a
	}
	w := &Weights{Embed: normal(c.VocabSize*h, 0.02), Norm: ones(h)}
	for i := 0; i < c.NumHiddenLayers; i++ {
		l := LayerWeights{
			AttnNorm: ones(h), MLPNorm: ones(h),
			Q: normal(q*hd*h, 0.02), K: normal(kv*hd*h, 0.02), V: normal(kv*hd*h, 0.02),
			O:  normal(h*q*hd, 0.02/math.Sqrt(2*float64(c.NumHiddenLayers))),
			Up: normal(f*h, 0.02), Down: normal(h*f, 0.02/math.Sqrt(2*float64(c.NumHiddenLayers))),
		}
		if c.MLPGated {
			l.Gate = normal(f*h, 0.02)
		}
		w.Layers = append(w.Layers, l)
	}
	if !c.TieWordEmbeddings {
		w.LMHead = normal(c.VocabSize*h, 0.02)
	}
	return w
}

// Save writes config.json and model.safetensors for a model into dir,
// creating it if needed.
func Save(dir string, c Config, w *Weights, dtype safetensors.DType) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := c.Save(filepath.Join(dir, "config.json")); err != nil {
		return err
	}
	return w.Save(c, dir, dtype)
}

// ParamCount returns the number of parameters of a model with config c
// (a tied LM head is counted once), or math.MaxInt64 when the count does
// not fit (a config no machine can hold).
func (c Config) ParamCount() int64 {
	n := c.params()
	if n >= math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(n)
}

// params counts the parameters in float64, which cannot overflow.
func (c Config) params() float64 {
	h, f, hd := float64(c.HiddenSize), float64(c.IntermediateSize), float64(c.HeadDim)
	per := h*hd*float64(c.NumAttentionHeads)*2 + h*hd*float64(c.NumKeyValueHeads)*2 + 2*h
	mlp := 2.0
	if c.MLPGated {
		mlp = 3
	}
	per += mlp * h * f
	n := float64(c.VocabSize)*h + float64(c.NumHiddenLayers)*per + h
	if !c.TieWordEmbeddings {
		n += float64(c.VocabSize) * h
	}
	return n
}

// WeightBytes returns the memory the float32 weights of a model with
// config c take.
func (c Config) WeightBytes() float64 { return 4 * c.params() }
