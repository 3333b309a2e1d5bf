package model

import (
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twell-ai/twell/safetensors"
	"github.com/twell-ai/twell/synth"
)

func tinyConfig() Config {
	bos := 1
	return Config{
		ModelType: "llama", Architectures: []string{"LlamaForCausalLM"},
		HiddenSize: 64, IntermediateSize: 512, NumHiddenLayers: 2,
		NumAttentionHeads: 4, NumKeyValueHeads: 2, HeadDim: 16,
		VocabSize: 97, MaxPositionEmbeddings: 128, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: ActReLU, TieWordEmbeddings: true, MLPGated: true,
		BOSTokenID: &bos, EOSTokenIDs: []int{2}, TorchDType: "float32",
	}
}

func tinyModel(t *testing.T, r *rand.Rand, c Config, density float64) *Model {
	t.Helper()
	m, err := New(c, RandomWeights(c, r))
	if err != nil {
		t.Fatal(err)
	}
	if err := m.SparsifyGates(density, synth.Skewed, r); err != nil {
		t.Fatal(err)
	}
	return m
}

// refForward computes all-position logits of one sequence in float64,
// written independently of Forward: a direct transcription of HF Llama.
func refForward(c Config, w *Weights, ids []int) [][]float64 {
	h, hd, nq, nkv, f := c.HiddenSize, c.HeadDim, c.NumAttentionHeads, c.NumKeyValueHeads, c.IntermediateSize
	T := len(ids)
	x := make([][]float64, T)
	for t, id := range ids {
		x[t] = make([]float64, h)
		for i := range x[t] {
			x[t][i] = float64(w.Embed[id*h+i])
		}
	}
	norm := func(v []float64, g []float32) []float64 {
		ss := 0.0
		for _, a := range v {
			ss += a * a
		}
		inv := 1 / math.Sqrt(ss/float64(len(v))+c.RMSNormEps)
		out := make([]float64, len(v))
		for i, a := range v {
			out[i] = a * inv * float64(g[i])
		}
		return out
	}
	lin := func(v []float64, W []float32, rows int) []float64 {
		out := make([]float64, rows)
		for j := range out {
			for i, a := range v {
				out[j] += a * float64(W[j*len(v)+i])
			}
		}
		return out
	}
	rope := func(v []float64, p int) {
		half := hd / 2
		for i := 0; i < half; i++ {
			ang := float64(p) / math.Pow(c.RopeTheta, float64(2*i)/float64(hd))
			a, b := v[i], v[i+half]
			v[i] = a*math.Cos(ang) - b*math.Sin(ang)
			v[i+half] = b*math.Cos(ang) + a*math.Sin(ang)
		}
	}
	for _, l := range w.Layers {
		q, k, v := make([][]float64, T), make([][]float64, T), make([][]float64, T)
		for t := range x {
			hn := norm(x[t], l.AttnNorm)
			q[t], k[t], v[t] = lin(hn, l.Q, nq*hd), lin(hn, l.K, nkv*hd), lin(hn, l.V, nkv*hd)
			for hh := 0; hh < nq; hh++ {
				rope(q[t][hh*hd:(hh+1)*hd], t)
			}
			for hh := 0; hh < nkv; hh++ {
				rope(k[t][hh*hd:(hh+1)*hd], t)
			}
		}
		for t := range x {
			att := make([]float64, nq*hd)
			for hh := 0; hh < nq; hh++ {
				kh := hh / (nq / nkv)
				s := make([]float64, t+1)
				mx := math.Inf(-1)
				for p := 0; p <= t; p++ {
					for i := 0; i < hd; i++ {
						s[p] += q[t][hh*hd+i] * k[p][kh*hd+i]
					}
					s[p] /= math.Sqrt(float64(hd))
					mx = math.Max(mx, s[p])
				}
				sum := 0.0
				for p := range s {
					s[p] = math.Exp(s[p] - mx)
					sum += s[p]
				}
				for p := range s {
					for i := 0; i < hd; i++ {
						att[hh*hd+i] += s[p] / sum * v[p][kh*hd+i]
					}
				}
			}
			o := lin(att, l.O, h)
			for i := range o {
				x[t][i] += o[i]
			}
			hn := norm(x[t], l.MLPNorm)
			g, u := lin(hn, l.Gate, f), lin(hn, l.Up, f)
			hid := make([]float64, f)
			for j := range hid {
				hid[j] = math.Max(g[j], 0) * u[j]
			}
			y := lin(hid, l.Down, h)
			for i := range y {
				x[t][i] += y[i]
			}
		}
	}
	logits := make([][]float64, T)
	for t := range x {
		logits[t] = lin(norm(x[t], w.Norm), w.Embed, c.VocabSize)
	}
	return logits
}

func randomIDs(r *rand.Rand, n, vocab int) []int {
	ids := make([]int, n)
	for i := range ids {
		ids[i] = r.IntN(vocab)
	}
	return ids
}

func maxRelDiff(got []float32, want []float64) float64 {
	var num, den float64
	for i, w := range want {
		num = math.Max(num, math.Abs(float64(got[i])-w))
		den = math.Max(den, math.Abs(w))
	}
	return num / den
}

func TestForwardMatchesFloat64Reference(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 1))
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.02)
	ids := randomIDs(r, 11, c.VocabSize)
	want := refForward(c, m.Weights, ids)
	for _, path := range []string{"sparse", "dense", "auto"} {
		if err := m.SetMLPPath(path); err != nil {
			t.Fatal(err)
		}
		logits, st, err := m.Forward([]*Cache{m.NewCache(32)}, [][]int{ids}, true)
		if err != nil {
			t.Fatal(err)
		}
		for pos := range ids {
			if e := maxRelDiff(logits[pos], want[pos]); e > 1e-2 {
				t.Fatalf("seed %d: %s path, position %d: logits differ by %g (relative to max)", seed, path, pos, e)
			}
		}
		if path == "sparse" && !st.SparseLayer[0] {
			t.Errorf("sparse path did not run the sparse tail")
		}
		if path != "dense" && (st.ActiveUnits[0] == 0 || st.ActiveUnits[0] > int64(len(ids)*c.IntermediateSize/4)) {
			t.Errorf("seed %d: layer 0 had %d active units over %d tokens: not sparse", seed, st.ActiveUnits[0], len(ids))
		}
	}
}

func TestDecodeWithCacheMatchesRecompute(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 2))
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.02)
	ids := randomIDs(r, 9, c.VocabSize)
	full, _, err := m.Forward([]*Cache{m.NewCache(16)}, [][]int{ids}, true)
	if err != nil {
		t.Fatal(err)
	}
	cache := m.NewCache(16)
	if _, _, err := m.Forward([]*Cache{cache}, [][]int{ids[:4]}, false); err != nil {
		t.Fatal(err)
	}
	for i := 4; i < len(ids); i++ {
		step, _, err := m.Forward([]*Cache{cache}, [][]int{{ids[i]}}, false)
		if err != nil {
			t.Fatal(err)
		}
		for v := range step[0] {
			if d := math.Abs(float64(step[0][v] - full[i][v])); d > 1e-4 {
				t.Fatalf("seed %d: position %d logit %d: cached decode %g, recompute %g", seed, i, v, step[0][v], full[i][v])
			}
		}
	}
}

func TestBF16DecodeStaysClose(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 8))
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.02)
	ids := randomIDs(r, 6, c.VocabSize)
	full, _, err := m.Forward([]*Cache{m.NewCache(8)}, [][]int{ids}, true)
	if err != nil {
		t.Fatal(err)
	}
	m.UseBF16ForDecode()
	cache := m.NewCache(8)
	m.Forward([]*Cache{cache}, [][]int{ids[:5]}, false)
	step, _, err := m.Forward([]*Cache{cache}, [][]int{{ids[5]}}, false)
	if err != nil {
		t.Fatal(err)
	}
	want := make([]float64, len(full[5]))
	for i, v := range full[5] {
		want[i] = float64(v)
	}
	if e := maxRelDiff(step[0], want); e > 2e-2 || e == 0 {
		t.Fatalf("seed %d: bf16 decode logits differ from float32 by %g (want bf16-sized, under 2e-2)", seed, e)
	}
}

func TestBatchedPrefillMatchesSeparate(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 3))
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.02)
	a, b := randomIDs(r, 7, c.VocabSize), randomIDs(r, 3, c.VocabSize)
	both, _, err := m.Forward([]*Cache{m.NewCache(8), m.NewCache(8)}, [][]int{a, b}, false)
	if err != nil {
		t.Fatal(err)
	}
	for i, ids := range [][]int{a, b} {
		one, _, err := m.Forward([]*Cache{m.NewCache(8)}, [][]int{ids}, false)
		if err != nil {
			t.Fatal(err)
		}
		for v := range one[0] {
			if d := math.Abs(float64(one[0][v] - both[i][v])); d > 1e-4 {
				t.Fatalf("seed %d: sequence %d logit %d: batched %g, alone %g", seed, i, v, both[i][v], one[0][v])
			}
		}
	}
}

func TestModelSaveLoadRoundTrip(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 4))
	c := tinyConfig()
	c.TieWordEmbeddings = false
	m := tinyModel(t, r, c, 0.05)
	dir := t.TempDir()
	if err := Save(dir, c, m.Weights, safetensors.F32); err != nil {
		t.Fatal(err)
	}
	m2, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	ids := randomIDs(r, 5, c.VocabSize)
	l1, _, _ := m.Forward([]*Cache{m.NewCache(8)}, [][]int{ids}, false)
	l2, _, err := m2.Forward([]*Cache{m2.NewCache(8)}, [][]int{ids}, false)
	if err != nil {
		t.Fatal(err)
	}
	for v := range l1[0] {
		if l1[0][v] != l2[0][v] {
			t.Fatalf("seed %d: logit %d changed across save/load: %g vs %g", seed, v, l1[0][v], l2[0][v])
		}
	}
}

func TestLoadErrorsNameTheTensor(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 5))
	c := tinyConfig()
	w := RandomWeights(c, r)
	dir := t.TempDir()
	if err := Save(dir, c, w, safetensors.BF16); err != nil {
		t.Fatal(err)
	}
	// Wrong shape: save a config with a different MLP width over the same weights.
	bad := c
	bad.IntermediateSize = 256
	if err := bad.Save(filepath.Join(dir, "config.json")); err != nil {
		t.Fatal(err)
	}
	_, err := Load(dir)
	if err == nil || !strings.Contains(err.Error(), "model.layers.0.mlp.up_proj.weight") || !strings.Contains(err.Error(), "want [256 64]") {
		t.Fatalf("wrong shape: err = %v", err)
	}
	// Missing tensor: a config with one more layer.
	bad = c
	bad.NumHiddenLayers = 3
	bad.Save(filepath.Join(dir, "config.json"))
	if _, err := Load(dir); err == nil || !strings.Contains(err.Error(), `"model.layers.2.input_layernorm.weight" missing`) {
		t.Fatalf("missing tensor: err = %v", err)
	}
	// Extra tensor: a config with one layer fewer.
	bad = c
	bad.NumHiddenLayers = 1
	bad.Save(filepath.Join(dir, "config.json"))
	if _, err := Load(dir); err == nil || !strings.Contains(err.Error(), "model.layers.1.") {
		t.Fatalf("extra tensor: err = %v", err)
	}
	os.Remove(filepath.Join(dir, "model.safetensors"))
	c.Save(filepath.Join(dir, "config.json"))
	if _, err := Load(dir); err == nil {
		t.Fatal("missing weights file accepted")
	}
}

func TestSparsifyGatesReachesDensity(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 7))
	c := tinyConfig()
	c.HiddenSize, c.IntermediateSize, c.NumHiddenLayers, c.VocabSize = 128, 1024, 4, 500
	c.HeadDim = 32
	for _, density := range []float64{0.005, 0.05} {
		m := tinyModel(t, r, c, density)
		ids := make([][]int, 4)
		caches := make([]*Cache, 4)
		for i := range ids {
			ids[i] = randomIDs(r, 32, c.VocabSize)
			caches[i] = m.NewCache(32)
		}
		_, st, err := m.Forward(caches, ids, false)
		if err != nil {
			t.Fatal(err)
		}
		for li, a := range st.ActiveUnits {
			got := float64(a) / float64(st.Tokens*c.IntermediateSize)
			if got > 2.5*density+0.002 || got < density/2.5 {
				t.Errorf("seed %d: density %g: layer %d fires %.4f of units", seed, density, li, got)
			}
		}
	}
}

func TestForwardRejectsBadTokens(t *testing.T) {
	r := rand.New(rand.NewPCG(6, 6))
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.02)
	if _, _, err := m.Forward([]*Cache{m.NewCache(4)}, [][]int{{1, 500}}, false); err == nil || !strings.Contains(err.Error(), "id 500") {
		t.Fatalf("out-of-vocabulary id: err = %v", err)
	}
	if _, _, err := m.Forward([]*Cache{m.NewCache(2)}, [][]int{{1, 2, 3}}, false); err == nil || !strings.Contains(err.Error(), "past its cache") {
		t.Fatalf("cache overflow: err = %v", err)
	}
}

// TestPackingIsLazy: New packs nothing; settings made before the first
// Forward (MLP path, bf16 decode copies) apply to the packing it does, with
// the same logits, bit for bit, as when they are made after it.
func TestPackingIsLazy(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 11))
	c := tinyConfig()
	w := RandomWeights(c, r)
	lazy, err := New(c, w)
	if err != nil {
		t.Fatal(err)
	}
	if lazy.layers != nil || lazy.head != nil {
		t.Fatal("New packed the weights")
	}
	eager, err := New(c, w)
	if err != nil {
		t.Fatal(err)
	}
	ids := randomIDs(r, 3, c.VocabSize) // few tokens: the bf16 copies serve them
	if _, _, err := eager.Forward([]*Cache{eager.NewCache(8)}, [][]int{ids}, false); err != nil {
		t.Fatal(err)
	}
	var got [2][][]float32
	for i, m := range []*Model{lazy, eager} {
		if err := m.SetMLPPath("sparse"); err != nil {
			t.Fatal(err)
		}
		m.UseBF16ForDecode()
		logits, st, err := m.Forward([]*Cache{m.NewCache(8)}, [][]int{ids}, true)
		if err != nil {
			t.Fatal(err)
		}
		for li, sp := range st.SparseLayer {
			if !sp {
				t.Errorf("seed %d: model %d layer %d did not run the sparse path set before packing", seed, i, li)
			}
		}
		got[i] = logits
	}
	for p := range got[0] {
		for v := range got[0][p] {
			if math.Float32bits(got[0][p][v]) != math.Float32bits(got[1][p][v]) {
				t.Fatalf("seed %d: position %d logit %d: lazy %g, eager %g", seed, p, v, got[0][p][v], got[1][p][v])
			}
		}
	}
	// and the bf16 copies were used: float32 weights give other logits
	plain, _ := New(c, w)
	if err := plain.SetMLPPath("sparse"); err != nil {
		t.Fatal(err)
	}
	f32, _, err := plain.Forward([]*Cache{plain.NewCache(8)}, [][]int{ids}, true)
	if err != nil {
		t.Fatal(err)
	}
	if d := maxRelDiff(f32[0], toF64(got[0][0])); d == 0 || d > 1e-2 {
		t.Errorf("seed %d: bf16 decode logits differ from float32 by %g, want bf16-sized and nonzero", seed, d)
	}
}

func toF64(x []float32) []float64 {
	y := make([]float64, len(x))
	for i, v := range x {
		y[i] = float64(v)
	}
	return y
}
