// Package sparsify turns a randomly initialised model into one whose ReLU
// gates fire like a trained sparse model's, so that speed can be measured
// and engines compared without a trained checkpoint.
package sparsify

import (
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/twell-ai/twell/cpu"
	"github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/synth"
)

// embedBias is the constant that Gates writes into feature 0 of
// every token embedding.
const embedBias = 1.0

// Gates makes a randomly initialised model behave like a trained
// sparse one, so that speed can be measured without a checkpoint. Feature 0
// of every embedding becomes a constant that no layer writes to (row 0 of
// every output projection is zeroed), so each normalised MLP input carries
// a positive component along it; each gate row's weight on feature 0 then
// acts as a bias. The biases are calibrated layer by layer on a forward pass
// over random tokens, so that unit j fires on a fraction p_j of tokens, the
// rates drawn from dist with mean density. The attention and MLP outputs
// are scaled down (attnScale, mlpScale) so that the rates hold at every
// position and depth. The sparse projection is the gate,
// or the up projection of a non-gated MLP.
func Gates(m *model.Model, density float64, dist synth.Dist, r *rand.Rand) error {
	c := m.Config
	h, f := c.HiddenSize, c.IntermediateSize
	if h < 2 {
		return fmt.Errorf("sparsify: hidden size %d too small to sparsify", h)
	}
	w := m.Weights
	for i := 0; i < c.VocabSize; i++ {
		w.Embed[i*h] = embedBias
	}
	for li := range w.Layers {
		l := &w.Layers[li]
		clear(l.O[:c.NumAttentionHeads*c.HeadDim]) // row 0 of o_proj
		for i := range l.O {
			l.O[i] *= attnScale
		}
		for i := range l.Down {
			l.Down[i] *= mlpScale
		}
		clear(l.Down[:f]) // row 0 of down_proj
		l.AttnNorm[0], l.MLPNorm[0] = 1, 1
	}
	e, err := llm.New(m, llm.Options{})
	if err != nil {
		return err
	}
	defer e.Close()
	rates := make([][]float64, len(w.Layers))
	for li := range rates {
		var err error
		if rates[li], err = synth.UnitRates(r, f, density, dist); err != nil {
			return err
		}
	}
	e.ObserveMLPInput = func(li int, hn []float32, T int) error {
		l := &w.Layers[li]
		sparse := l.Gate
		if sparse == nil {
			sparse = l.Up
		}
		cpu.ParallelFor(f, func(j int) {
			row := sparse[j*h : (j+1)*h]
			row[0] = 0
			// s_t = -(hn_t . row) / hn_t[0]: the unit fires on token t when
			// row[0] > s_t. Fit s with a normal and take its p quantile.
			var sum, sq float64
			for t := 0; t < T; t++ {
				s := -float64(cpu.Dot(hn[t*h:(t+1)*h], row)) / float64(hn[t*h])
				sum += s
				sq += s * s
			}
			mean := sum / float64(T)
			std := math.Sqrt(max(sq/float64(T)-mean*mean, 1e-12))
			p := rates[li][j]
			var z float64 // Phi^-1(p)
			switch {
			case p <= 0:
				z = -40
			case p >= 1:
				z = 40
			default:
				z = math.Sqrt2 * math.Erfinv(2*p-1)
			}
			row[0] = float32(mean + std*z)
		})
		return e.RepackLayer(li)
	}
	const seqs, seqLen = 4, 64
	caches := make([]engine.Cache, seqs)
	defer func() { // the CPU engine's caches hold memory until freed
		for _, c := range caches {
			if c != nil {
				c.Free()
			}
		}
	}()
	toks := make([][]int, seqs)
	for i := range toks {
		if caches[i], err = e.NewCache(seqLen); err != nil {
			return err
		}
		toks[i] = make([]int, seqLen)
		for j := range toks[i] {
			toks[i][j] = r.IntN(c.VocabSize)
		}
	}
	_, _, err = e.Forward(caches, toks, false)
	return err
}

// attnScale and mlpScale scale every attention and MLP output projection.
// With random weights the attention output is an average over the
// positions before a token, so its size falls with the position (about
// 1/sqrt(t)), and with it the size of the normalised MLP input's other
// components against the constant one: unscaled, a unit calibrated to fire
// on 0.5% of tokens fired on 9% at positions 0-7 and 0.13% past 256 (3
// layers of the 1.5B shape). And a unit fires on fresh tokens with larger
// gate values than on the calibration tokens, where its bias was set just
// below the few that fire it: its output adds to the next layers' inputs,
// which then spread more than where they were calibrated, so the density
// grew with depth (0.5% to 0.9% over 8 layers; 28 layers decoding at
// position 512 averaged 3%). Scaled down, the residual stream stays near
// the embedding, and the gates fire at their calibrated rates at every
// position and depth (0.48-0.52% over 8 layers), as a trained model's do.
// The work of every kernel is the same.
const (
	attnScale = 0.01
	mlpScale  = 0.1
)
