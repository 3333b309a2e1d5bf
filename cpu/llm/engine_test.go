package llm_test

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/safetensors"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/synth/sparsify"
)

func tinyConfig() model.Config {
	bos := 1
	return model.Config{
		ModelType: "llama", Architectures: []string{"LlamaForCausalLM"},
		HiddenSize: 64, IntermediateSize: 512, NumHiddenLayers: 2,
		NumAttentionHeads: 4, NumKeyValueHeads: 2, HeadDim: 16,
		VocabSize: 97, MaxPositionEmbeddings: 128, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: model.ActReLU, TieWordEmbeddings: true, MLPGated: true,
		BOSTokenID: &bos, EOSTokenIDs: []int{2}, TorchDType: "float32",
	}
}

func tinyModel(t *testing.T, r *rand.Rand, c model.Config, density float64) *model.Model {
	t.Helper()
	m, err := model.New(c, model.RandomWeights(c, r))
	if err != nil {
		t.Fatal(err)
	}
	if err := sparsify.Gates(m, density, synth.Skewed, r); err != nil {
		t.Fatal(err)
	}
	return m
}

// refForward computes all-position logits of one sequence in float64,
// written independently of Forward: a direct transcription of HF Llama.
func refForward(c model.Config, w *model.Weights, ids []int) [][]float64 {
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

// newEngine returns a CPU engine for m with options o.
func newEngine(t *testing.T, m *model.Model, o llm.Options) *llm.Engine {
	t.Helper()
	e, err := llm.New(m, o)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestForwardMatchesFloat64Reference(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.02)
	ids := enginetest.Tokens(r, 11, c.VocabSize)
	want := refForward(c, m.Weights, ids)
	e := newEngine(t, m, llm.Options{})
	for _, path := range []mlp.Path{mlp.Sparse, mlp.Dense, mlp.Auto} {
		if err := e.SetMLPPath(path); err != nil {
			t.Fatal(err)
		}
		logits, st := enginetest.Forward(t, e, enginetest.Caches(t, e, 1, 32), [][]int{ids}, true)
		for pos := range ids {
			if e := enginetest.MaxRelDiff(logits[pos], want[pos]); e > 1e-2 {
				t.Fatalf("seed %d: %s path, position %d: logits differ by %g (relative to max)", seed, path, pos, e)
			}
		}
		if path == mlp.Sparse && st.Paths[0] != mlp.Sparse {
			t.Errorf("sparse path did not run the sparse tail")
		}
		if path != mlp.Dense && (st.MeanActive[0] <= 0 || st.MeanActive[0] > float64(c.IntermediateSize/4)) {
			t.Errorf("seed %d: layer 0 had %g active units per token: not sparse", seed, st.MeanActive[0])
		}
	}
}

func TestDecodeWithCacheMatchesRecompute(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.02)
	ids := enginetest.Tokens(r, 9, c.VocabSize)
	e := newEngine(t, m, llm.Options{})
	full, _ := enginetest.Forward(t, e, enginetest.Caches(t, e, 1, 16), [][]int{ids}, true)
	cache := enginetest.Caches(t, e, 1, 16)
	enginetest.Forward(t, e, cache, [][]int{ids[:4]}, false)
	for i := 4; i < len(ids); i++ {
		step, _ := enginetest.Forward(t, e, cache, [][]int{{ids[i]}}, false)
		for v := range step[0] {
			if d := math.Abs(float64(step[0][v] - full[i][v])); d > 1e-4 {
				t.Fatalf("seed %d: position %d logit %d: cached decode %g, recompute %g", seed, i, v, step[0][v], full[i][v])
			}
		}
	}
}

func TestBF16DecodeStaysClose(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.02)
	ids := enginetest.Tokens(r, 6, c.VocabSize)
	e := newEngine(t, m, llm.Options{})
	full, _ := enginetest.Forward(t, e, enginetest.Caches(t, e, 1, 8), [][]int{ids}, true)
	eb := newEngine(t, m, llm.Options{DecodeBF16: true})
	cache := enginetest.Caches(t, eb, 1, 8)
	eb.Forward(cache, [][]int{ids[:5]}, false)
	step, _ := enginetest.Forward(t, eb, cache, [][]int{{ids[5]}}, false)
	if e := enginetest.MaxRelDiff(step[0], full[5]); e > 2e-2 || e == 0 {
		t.Fatalf("seed %d: bf16 decode logits differ from float32 by %g (want bf16-sized, under 2e-2)", seed, e)
	}
}

func TestBatchedPrefillMatchesSeparate(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.02)
	a, b := enginetest.Tokens(r, 7, c.VocabSize), enginetest.Tokens(r, 3, c.VocabSize)
	e := newEngine(t, m, llm.Options{})
	both, _ := enginetest.Forward(t, e, enginetest.Caches(t, e, 2, 8), [][]int{a, b}, false)
	for i, ids := range [][]int{a, b} {
		one, _ := enginetest.Forward(t, e, enginetest.Caches(t, e, 1, 8), [][]int{ids}, false)
		for v := range one[0] {
			if d := math.Abs(float64(one[0][v] - both[i][v])); d > 1e-4 {
				t.Fatalf("seed %d: sequence %d logit %d: batched %g, alone %g", seed, i, v, both[i][v], one[0][v])
			}
		}
	}
}

func TestSparsifiedGatesReachDensity(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	c.HiddenSize, c.IntermediateSize, c.NumHiddenLayers, c.VocabSize = 128, 1024, 4, 500
	c.HeadDim = 32
	for _, density := range []float64{0.005, 0.05} {
		m := tinyModel(t, r, c, density)
		ids := make([][]int, 4)
		for i := range ids {
			ids[i] = enginetest.Tokens(r, 32, c.VocabSize)
		}
		e := newEngine(t, m, llm.Options{})
		_, st := enginetest.Forward(t, e, enginetest.Caches(t, e, 4, 32), ids, false)
		for li, a := range st.MeanActive {
			got := a / float64(c.IntermediateSize)
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
	e := newEngine(t, m, llm.Options{})
	if _, _, err := e.Forward(enginetest.Caches(t, e, 1, 4), [][]int{{1, 500}}, false); err == nil || !strings.Contains(err.Error(), "id 500") {
		t.Fatalf("out-of-vocabulary id: err = %v", err)
	}
	if _, _, err := e.Forward(enginetest.Caches(t, e, 1, 2), [][]int{{1, 2, 3}}, false); err == nil || !strings.Contains(err.Error(), "past its cache") {
		t.Fatalf("cache overflow: err = %v", err)
	}
}

// TestMLPPathSetBeforePacking: SetMLPPath before the first Forward (which
// packs the weights) applies to the packing it does, with the same logits,
// bit for bit, as when it is made after it; and DecodeBF16 copies are read.
func TestMLPPathSetBeforePacking(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	m, err := model.New(c, model.RandomWeights(c, r))
	if err != nil {
		t.Fatal(err)
	}
	ids := enginetest.Tokens(r, 3, c.VocabSize) // few tokens: the bf16 copies serve them
	lazy := newEngine(t, m, llm.Options{DecodeBF16: true})
	eager := newEngine(t, m, llm.Options{DecodeBF16: true})
	enginetest.Forward(t, eager, enginetest.Caches(t, eager, 1, 8), [][]int{ids}, false)
	var got [2][][]float32
	for i, e := range []*llm.Engine{lazy, eager} {
		if err := e.SetMLPPath(mlp.Sparse); err != nil {
			t.Fatal(err)
		}
		logits, st := enginetest.Forward(t, e, enginetest.Caches(t, e, 1, 8), [][]int{ids}, true)
		for li, p := range st.Paths {
			if p != mlp.Sparse {
				t.Errorf("seed %d: engine %d layer %d did not run the sparse path set before packing", seed, i, li)
			}
		}
		got[i] = logits
	}
	enginetest.SameBits(t, "lazy vs eager packing", got[0], got[1])
	// and the bf16 copies were used: float32 weights give other logits
	plain := newEngine(t, m, llm.Options{MLPPath: mlp.Sparse})
	f32, _ := enginetest.Forward(t, plain, enginetest.Caches(t, plain, 1, 8), [][]int{ids}, true)
	if d := enginetest.MaxRelDiff(f32[0], got[0][0]); d == 0 || d > 1e-2 {
		t.Errorf("seed %d: bf16 decode logits differ from float32 by %g, want bf16-sized and nonzero", seed, d)
	}
}

func TestModelSaveLoadRoundTrip(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	c.TieWordEmbeddings = false
	m := tinyModel(t, r, c, 0.05)
	dir := t.TempDir()
	if err := model.Save(dir, c, m.Weights, safetensors.F32); err != nil {
		t.Fatal(err)
	}
	m2, err := model.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	ids := enginetest.Tokens(r, 5, c.VocabSize)
	e1, e2 := newEngine(t, m, llm.Options{}), newEngine(t, m2, llm.Options{})
	l1, _, _ := e1.Forward(enginetest.Caches(t, e1, 1, 8), [][]int{ids}, false)
	l2, _ := enginetest.Forward(t, e2, enginetest.Caches(t, e2, 1, 8), [][]int{ids}, false)
	for v := range l1[0] {
		if l1[0][v] != l2[0][v] {
			t.Fatalf("seed %d: logit %d changed across save/load: %g vs %g", seed, v, l1[0][v], l2[0][v])
		}
	}
}

// TestPackAheadMatchesLazy: packing the weights before the first Forward
// (as generate does before its timed prefill) gives the logits of packing
// at the first Forward, bit for bit, and packing twice is a no-op.
func TestPackAheadMatchesLazy(t *testing.T) {
	r, _ := testutil.Rand(t)
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.05)
	ids := enginetest.Tokens(r, 9, c.VocabSize)
	lazy := newEngine(t, m, llm.Options{})
	ahead := newEngine(t, m, llm.Options{})
	for range 2 {
		if err := ahead.Pack(); err != nil {
			t.Fatal(err)
		}
	}
	a, _ := enginetest.Forward(t, lazy, enginetest.Caches(t, lazy, 1, 16), [][]int{ids}, true)
	b, _ := enginetest.Forward(t, ahead, enginetest.Caches(t, ahead, 1, 16), [][]int{ids}, true)
	enginetest.SameBits(t, "packed ahead vs at the first Forward", a, b)
}

// TestBF16WeightsCompact: a model whose weights are bfloat16 values (a
// bf16 checkpoint's) is packed in bf16 alone, about half the float32
// packing, and its logits are bit for bit the float32 packing's: decode
// reads bf16 whether DecodeBF16 says so or not, with the same results.
func TestBF16WeightsCompact(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	m := tinyModel(t, r, c, 0.03)
	ids := enginetest.Tokens(r, 9, c.VocabSize)
	inexact := newEngine(t, m, llm.Options{})
	if err := inexact.Pack(); err != nil {
		t.Fatal(err)
	}
	full := inexact.PackedSize()
	m.Weights.RoundBF16(c)
	want := refForward(c, m.Weights, ids)
	var runs [][][]float32
	for _, o := range []llm.Options{{}, {DecodeBF16: true}} {
		e := newEngine(t, m, o)
		if err := e.Pack(); err != nil {
			t.Fatal(err)
		}
		if got := e.PackedSize(); got != full/2 {
			t.Errorf("seed %d: %+v: packed bf16 weights take %d bytes, want half of float32's %d", seed, o, got, full)
		}
		if est := e.PackedBytes(); est < float64(e.PackedSize()) {
			t.Errorf("seed %d: %+v: estimate %g bytes under the %d packed", seed, o, est, e.PackedSize())
		}
		all, _ := enginetest.Forward(t, e, enginetest.Caches(t, e, 1, 16), [][]int{ids}, true)
		for pos := range ids {
			if d := enginetest.MaxRelDiff(all[pos], want[pos]); d > 1e-2 {
				t.Fatalf("seed %d: %+v: position %d: logits differ from float64 by %g", seed, o, pos, d)
			}
		}
		cache := enginetest.Caches(t, e, 1, 16)
		prompt, _ := enginetest.Forward(t, e, cache, [][]int{ids[:5]}, false)
		run := [][]float32{prompt[0]}
		for _, id := range ids[5:] {
			step, _ := enginetest.Forward(t, e, cache, [][]int{{id}}, false)
			run = append(run, step[0])
		}
		runs = append(runs, run)
	}
	enginetest.SameBits(t, "decode with and without DecodeBF16 on bf16 weights", runs[0], runs[1])
}

// TestReleaseWeights: an engine that lets go of the model's matrices once
// packed gives the same logits, leaves the model without them, and refuses
// to pack them again, with an error and no panic.
func TestReleaseWeights(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	c.TieWordEmbeddings = false
	m := tinyModel(t, r, c, 0.03)
	m.Weights.RoundBF16(c)
	ids := enginetest.Tokens(r, 7, c.VocabSize)
	keep := newEngine(t, m, llm.Options{})
	want, _ := enginetest.Forward(t, keep, enginetest.Caches(t, keep, 1, 16), [][]int{ids}, true)
	e := newEngine(t, m, llm.Options{ReleaseWeights: true})
	got, _ := enginetest.Forward(t, e, enginetest.Caches(t, e, 1, 16), [][]int{ids}, true)
	enginetest.SameBits(t, "with the model's weights released", want, got)
	for i, l := range m.Weights.Layers {
		if l.Q != nil || l.Up != nil || l.Down != nil || l.Gate != nil || l.O != nil {
			t.Fatalf("seed %d: layer %d still holds float32 matrices", seed, i)
		}
	}
	if m.Weights.LMHead != nil || m.Weights.Embed != nil {
		t.Fatalf("seed %d: untied LM head or bf16 embeddings kept in float32", seed)
	}
	if err := e.RepackLayer(0); err == nil || !strings.Contains(err.Error(), "released") {
		t.Fatalf("RepackLayer after release: %v", err)
	}
	again := newEngine(t, m, llm.Options{})
	if err := again.Pack(); err == nil || !strings.Contains(err.Error(), "holds no weights") {
		t.Fatalf("a second engine packing released weights: %v", err)
	}
	// The releasing engine keeps running on its copies.
	more, _ := enginetest.Forward(t, e, enginetest.Caches(t, e, 1, 16), [][]int{ids}, true)
	enginetest.SameBits(t, "a second pass after release", want, more)
}

// TestDeferredModel: an engine packing a model whose layers stay in the
// checkpoint until packed (model.LoadDeferred), releasing them as it goes,
// gives the logits of a fully loaded model's engine, bit for bit, for bf16
// and f32 checkpoints, and leaves no layer behind in float32.
func TestDeferredModel(t *testing.T) {
	r, seed := testutil.Rand(t)
	c := tinyConfig()
	c.TieWordEmbeddings = r.IntN(2) == 0
	m := tinyModel(t, r, c, 0.05)
	ids := enginetest.Tokens(r, 7, c.VocabSize)
	for _, dt := range []safetensors.DType{safetensors.BF16, safetensors.F32} {
		full, lazy := enginetest.SavedTwice(t, c, m.Weights, dt)
		e1, e2 := newEngine(t, full, llm.Options{}), newEngine(t, lazy, llm.Options{ReleaseWeights: true})
		want, _ := enginetest.Forward(t, e1, enginetest.Caches(t, e1, 1, 16), [][]int{ids}, true)
		got, _ := enginetest.Forward(t, e2, enginetest.Caches(t, e2, 1, 16), [][]int{ids}, true)
		enginetest.SameBits(t, "deferred and released vs loaded whole ("+string(dt)+")", want, got)
		if lazy.Deferred() {
			t.Fatalf("seed %d: %s: layers left in the checkpoint after packing", seed, dt)
		}
		for i, l := range lazy.Weights.Layers {
			if l.Q != nil || l.Down != nil {
				t.Fatalf("seed %d: %s: layer %d kept in float32", seed, dt, i)
			}
		}
		wantSize := e1.PackedSize()
		if dt == safetensors.BF16 { // and the bf16 embeddings the lookups read
			wantSize += int64(2 * c.VocabSize * c.HiddenSize)
			if lazy.Weights.Embed != nil {
				t.Errorf("seed %d: %s: float32 embeddings kept", seed, dt)
			}
		}
		if got := e2.PackedSize(); got != wantSize {
			t.Errorf("seed %d: %s: packed %d bytes, want %d", seed, dt, got, wantSize)
		}
	}
}
