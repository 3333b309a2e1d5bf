package trainer

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/train"
)

// TestStageTimes profiles two steps (two micro-batches, clipping, AdamW):
// each names every stage of the step once (the sparse MLP's kernels each a
// stage of their own), with the per-layer stages run
// once per layer and micro-batch, no time negative and some time spent;
// with profiling off nothing is reported, and the profiled step leaves the
// same weights as an unprofiled one.
func TestStageTimes(t *testing.T) {
	dev := cudatest.Device(t)
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 11))
	c := testModel(true, false)
	w := model.RandomWeights(c, r)
	const micro, batch, seq = 2, 4, 64
	toks := [][]int{randomTokens(r, batch*(seq+1), c.VocabSize), randomTokens(r, batch*(seq+1), c.VocabSize)}
	h := train.AdamW{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.1}
	run := func(profile bool) ([][]StageTime, [][]float32) {
		b, err := New(dev, c, cloneWeights(w), Options{Batch: batch, Seq: seq, MLP: mlp.Sparse})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		if err := b.Profile(profile); err != nil {
			t.Fatal(err)
		}
		var out [][]StageTime
		for range 2 {
			err := b.BeginStep(micro)
			for _, tk := range toks {
				if err == nil {
					err = b.Accumulate(tk, batch, seq, 0.01)
				}
			}
			if err == nil {
				_, err = b.EndStep()
			}
			if err == nil {
				_, err = b.ClipGradients(0.01)
			}
			if err == nil {
				err = b.Update(h, 1e-3)
			}
			var st []StageTime
			if err == nil {
				st, err = b.StageTimes()
			}
			if err != nil {
				t.Fatalf("seed %d: %v", seed, err)
			}
			out = append(out, st)
		}
		gw, err := b.Weights()
		if err != nil {
			t.Fatal(err)
		}
		return out, flatTensors(c, gw)
	}
	plain, w0 := run(false)
	if plain[0] != nil || plain[1] != nil {
		t.Errorf("seed %d: profiling off, StageTimes gave %v", seed, plain)
	}
	prof, w1 := run(true)
	for i := range w0 {
		if k := firstDiff(w0[i], w1[i]); k >= 0 {
			t.Errorf("seed %d: tensor %d differs at %d with profiling on", seed, i, k)
		}
	}
	L := c.NumHiddenLayers
	want := map[string]int{"embedding": micro, "norm fwd": micro * (2*L + 1), "qkv fwd": micro * L, "attention fwd": micro * L,
		"mlp fwd: gate GEMM": micro * L, "mlp fwd: down SpMM": micro * L, "lm head fwd": micro, "cross-entropy": micro,
		"lm head bwd": micro, "mlp bwd: grad SDDMM": micro * L, "mlp bwd: dx SpMM": micro * L,
		"attention bwd": micro * L, "qkv bwd": micro * L, "embedding bwd": micro, "host wait": 2, "clipping": 1, "adamw": 1}
	for s, st := range prof {
		var names []string
		total := 0.0
		for _, x := range st {
			names = append(names, x.Name)
			if x.MS < 0 {
				t.Errorf("seed %d: step %d: stage %s took %v ms", seed, s, x.Name, x.MS)
			}
			total += x.MS
			if n, ok := want[x.Name]; ok && x.Count != n {
				t.Errorf("seed %d: step %d: stage %s ran %d times, want %d", seed, s, x.Name, x.Count, n)
			}
		}
		for n := range want {
			if !slices.Contains(names, n) {
				t.Errorf("seed %d: step %d: no stage %q in %v", seed, s, n, names)
			}
		}
		if total <= 0 {
			t.Errorf("seed %d: step %d: %v ms in all", seed, s, total)
		}
	}
}
