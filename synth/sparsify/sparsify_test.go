package sparsify

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/twell-ai/twell/cpu"
	"github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/synth"
)

// TestGatesFireAtTheirRate calibrates a small random model and counts, on
// fresh random tokens, how often its gates fire in every layer, early in a
// sequence and late: the mean density must be the one asked for, at every
// position and depth.
func TestGatesFireAtTheirRate(t *testing.T) {
	for _, c := range []struct {
		density float64
		dist    synth.Dist
	}{{0.02, synth.Uniform}, {0.01, synth.Skewed}} {
		t.Run(fmt.Sprintf("%g_%v", c.density, c.dist), func(t *testing.T) {
			seed := rand.Uint64()
			r := rand.New(rand.NewPCG(seed, 1))
			cfg := model.Config{ModelType: "llama", VocabSize: 1024, HiddenSize: 512, IntermediateSize: 1408,
				NumHiddenLayers: 8, NumAttentionHeads: 8, NumKeyValueHeads: 2, HeadDim: 64, MaxPositionEmbeddings: 512,
				RMSNormEps: 1e-5, RopeTheta: 10000, HiddenAct: model.ActReLU, MLPGated: true}
			m, err := model.New(cfg, model.RandomWeights(cfg, r))
			if err != nil {
				t.Fatal(err)
			}
			if err := Gates(m, c.density, c.dist, r); err != nil {
				t.Fatal(err)
			}
			e, err := llm.New(m, llm.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			const seqs, seqLen, early = 4, 256, 8
			h, f := cfg.HiddenSize, cfg.IntermediateSize
			e.ObserveMLPInput = func(li int, hn []float32, T int) error {
				gate := m.Weights.Layers[li].Gate
				var fired [2]float64 // early, late
				var tokens [2]float64
				for tk := range T {
					late := 0
					if tk%seqLen >= early {
						late = 1
					}
					for j := range f {
						if cpu.Dot(hn[tk*h:(tk+1)*h], gate[j*h:(j+1)*h]) > 0 {
							fired[late]++
						}
					}
					tokens[late]++
				}
				for i, name := range []string{"early", "late"} {
					got := fired[i] / tokens[i] / float64(f)
					if got < 0.75*c.density || got > 1.33*c.density {
						t.Errorf("seed %d: layer %d, %s positions: density %.4f, want %g", seed, li, name, got, c.density)
					}
				}
				return nil
			}
			caches := make([]engine.Cache, seqs)
			toks := make([][]int, seqs)
			for i := range toks {
				if caches[i], err = e.NewCache(seqLen); err != nil {
					t.Fatal(err)
				}
				defer caches[i].Free()
				toks[i] = make([]int, seqLen)
				for k := range toks[i] {
					toks[i][k] = r.IntN(cfg.VocabSize)
				}
			}
			if _, _, err := e.Forward(caches, toks, false); err != nil {
				t.Fatal(err)
			}
		})
	}
}
