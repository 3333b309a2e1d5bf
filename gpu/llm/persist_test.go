package llm

import (
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/model"
)

// TestPersistentDecodeMatchesLayers decodes batches of 1 to 8 sequences
// (prompts of random lengths, then decode steps) with the persistent decode
// kernel and layer by layer, both replayed from graphs on the sparse MLP
// path: the persistent kernel must run every decode step, its logits must
// agree with the layer-by-layer ones (1e-2) and the CPU model's (bf16Tol),
// and repeat bit for bit, also with the ring at its fewest slots. Head_dim
// 64 and 128, grouped-query attention, a separate LM head, and a 3-layer
// model of SparseLM's widths (d 2048, f 5632, 32 heads), where each block
// takes several chunks of every phase and the attention several runs a
// head.
func TestPersistentDecodeMatchesLayers(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	if p := dev.Properties(); p.Major < 9 {
		t.Skipf("the persistent decode kernel needs sm_90; %v is %s", dev, p.Arch)
	}
	wide := testConfig(64, 32, 32, true)
	wide.HiddenSize, wide.IntermediateSize, wide.NumHiddenLayers = 2048, 5632, 3
	for _, k := range []struct {
		name string
		c    model.Config
		seqs []int
	}{
		{"gqa-hd64", testConfig(64, 4, 2, true), []int{1, 2, 3, 8}},
		{"hd128-untied", testConfig(128, 2, 1, false), []int{1, 3}},
		{"sparselm-widths", wide, []int{1, 8}},
	} {
		for _, S := range k.seqs {
			t.Run(fmt.Sprintf("%s/seqs%d", k.name, S), func(t *testing.T) {
				r, seed := testutil.Rand(t)
				m := sparseModel(t, k.c, r, seed)
				prompts := make([][]int, S)
				first := 0
				for i := range prompts {
					prompts[i] = enginetest.Tokens(r, 1+r.IntN(150), k.c.VocabSize)
					first += len(prompts[i])
				}
				const steps = 6
				passes := append([][][]int{prompts}, decodeSteps(r, steps, S, k.c.VocabSize)...)
				run := func(persistent bool, slots int) [][]float32 {
					e := engineOnPath(t, dev, m, seed, "sparse")
					e.Persistent, e.PersistentSlots = persistent, slots
					got := enginetest.Passes(t, e, 160, passes...)[first:]
					if err := e.GraphError(); err != nil {
						t.Fatalf("seed %d: recording a graph: %v", seed, err)
					}
					if persistent {
						if err := e.PersistentError(); err != nil {
							t.Fatalf("seed %d: %v", seed, err)
						}
						if n := e.PersistentSteps(); n != steps {
							t.Fatalf("seed %d: %d of %d decode steps ran the persistent kernel", seed, n, steps)
						}
					}
					return got
				}
				got, layers := run(true, 0), run(false, 0)
				if d, err := enginetest.RelDiff(got, layers); err != nil || d > 1e-2 {
					t.Errorf("seed %d: persistent vs layer by layer: rel diff %.3g (err %v)", seed, d, err)
				}
				if d, err := enginetest.RelDiff(got, cpuForward(t, m, "sparse", 160, passes...)[first:]); err != nil || d > bf16Tol {
					t.Errorf("seed %d: persistent vs CPU: rel diff %.3g (err %v)", seed, d, err)
				}
				enginetest.SameBits(t, fmt.Sprintf("seed %d: persistent kernel, second run", seed), run(true, 0), got)
				// The fewest ring slots: every slot refilled the most often,
				// the same sums in the same order.
				enginetest.SameBits(t, fmt.Sprintf("seed %d: persistent kernel, %d ring slots", seed, persistMinSlot),
					run(true, persistMinSlot), got)
			})
		}
	}
}

// TestPersistentNotUsable: the persistent kernel stays off where it does not
// apply (the dense MLP path, more than 8 sequences), and those steps still
// replay the layer-by-layer graph without an error.
func TestPersistentNotUsable(t *testing.T) {
	c := testConfig(64, 4, 2, true)
	for _, k := range []struct {
		path string
		S    int
	}{{"dense", 2}, {"sparse", 9}} {
		e, r, seed := gpuEngine(t, c, k.path)
		e.Persistent = true
		prompts := make([][]int, k.S)
		for i := range prompts {
			prompts[i] = enginetest.Tokens(r, 5, c.VocabSize)
		}
		enginetest.Passes(t, e, 16, append([][][]int{prompts}, decodeSteps(r, 3, k.S, c.VocabSize)...)...)
		if e.PersistentSteps() != 0 || e.PersistentError() != nil || e.GraphReplays() == 0 {
			t.Errorf("seed %d: %s path, %d sequences: %d persistent steps (error %v), %d graph replays", seed, k.path, k.S,
				e.PersistentSteps(), e.PersistentError(), e.GraphReplays())
		}
	}
}

// TestPhaseTimes builds random timelines of the persistent kernel's
// phases (each block starting and ending each phase of each layer at its
// own time, phases one after another with a barrier between) and checks
// what PersistentPhases reads from them: per phase and layer the time from
// the first start to the last end, and from the last end to the next
// phase's first start.
func TestPhaseTimes(t *testing.T) {
	r, seed := testutil.Rand(t)
	for range 50 {
		blocks, nl := 1+r.IntN(8), 1+r.IntN(6)
		w := make([]uint64, persistPhases*2*blocks*nl)
		idx := func(b, l, p, end int) int { return ((b*nl+l)*persistPhases+p)*2 + end }
		spans := make([][]float64, persistPhases)
		gaps := make([][]float64, persistPhases)
		now := uint64(1 + r.IntN(1e6))
		var lastEnd uint64
		for l := range nl {
			for p := range persistPhases {
				first, last := uint64(math.MaxUint64), uint64(0)
				for b := range blocks {
					s := now + uint64(r.IntN(200))
					e := s + uint64(50+r.IntN(3000))
					w[idx(b, l, p, 0)], w[idx(b, l, p, 1)] = s, e
					first, last = min(first, s), max(last, e)
				}
				if before := (p + persistPhases - 1) % persistPhases; l > 0 || p > 0 {
					gaps[before] = append(gaps[before], float64(first-lastEnd)/1e3)
				}
				spans[p] = append(spans[p], float64(last-first)/1e3)
				lastEnd = last
				now = last + uint64(100+r.IntN(2000))
			}
		}
		got := phaseTimes(w, blocks, nl)
		for p, ph := range got {
			if ph.Name != persistPhaseNames[p] || !slices.Equal(ph.SpanUS, spans[p]) || !slices.Equal(ph.BarrierUS, gaps[p]) {
				t.Fatalf("seed %d: %d blocks, %d layers: phase %d: %+v, want spans %v barriers %v", seed, blocks, nl, p, ph,
					spans[p], gaps[p])
			}
		}
	}
}
