package llm

import (
	"fmt"
	"math"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cpu"
	"github.com/twell-ai/twell/engine"
)

// Forward appends tokens[i] to sequence i (whose cache is caches[i]) and
// returns, for each sequence, the logits of its last new token, or of every
// new token when allLogits is set (rows of VocabSize values). The caches
// take the pages their new tokens need from the engine's pool first; when
// it has too few the error wraps engine.ErrOutOfPages and no cache changes.
func (e *Engine) Forward(caches []engine.Cache, tokens [][]int, allLogits bool) (_ [][]float32, _ *engine.Stats, err error) {
	c := e.model.Config
	if len(caches) != len(tokens) {
		return nil, nil, fmt.Errorf("cpu/llm: %d caches for %d sequences", len(caches), len(tokens))
	}
	kcs, err := e.caches(caches)
	if err != nil {
		return nil, nil, err
	}
	if err := e.pack(); err != nil {
		return nil, nil, err
	}
	h, hd := c.HiddenSize, c.HeadDim
	nq, nkv := c.NumAttentionHeads, c.NumKeyValueHeads
	// Flatten the batch: token t belongs to sequence seqOf[t] at position pos[t].
	var seqOf, pos []int
	for s, toks := range tokens {
		if len(toks) == 0 {
			return nil, nil, fmt.Errorf("cpu/llm: sequence %d has no new tokens", s)
		}
		if kcs[s].n+len(toks) > kcs[s].Capacity() {
			return nil, nil, fmt.Errorf("cpu/llm: sequence %d would reach %d tokens, past its cache of %d", s, kcs[s].n+len(toks), kcs[s].Capacity())
		}
		for i, id := range toks {
			if id < 0 || id >= c.VocabSize {
				return nil, nil, fmt.Errorf("cpu/llm: sequence %d token %d: id %d outside the vocabulary [0, %d)", s, i, id, c.VocabSize)
			}
			seqOf = append(seqOf, s)
			pos = append(pos, kcs[s].n+i)
		}
	}
	news := make([]int, len(tokens))
	for s, toks := range tokens {
		news[s] = len(toks)
	}
	if err := e.grow(kcs, news); err != nil {
		return nil, nil, err
	}
	defer func() {
		if err != nil { // give back what the new tokens took
			e.ungrow(kcs)
		}
	}()
	w := e.model.Weights
	T := len(seqOf)
	x := make([]float32, T*h)
	t := 0
	for _, toks := range tokens {
		for _, id := range toks {
			if e.embed16 != nil {
				bf16.ToFloat32s(x[t*h:(t+1)*h], e.embed16[id*h:(id+1)*h])
			} else {
				copy(x[t*h:(t+1)*h], w.Embed[id*h:(id+1)*h])
			}
			t++
		}
	}
	st := engine.NewStats(T, len(e.layers))
	qkvW := (nq + 2*nkv) * hd
	hn := make([]float32, T*h)
	qkv := make([]float32, T*qkvW)
	att := make([]float32, T*nq*hd)
	proj := make([]float32, T*h)
	maxPos := 0
	for _, p := range pos {
		maxPos = max(maxPos, p)
	}
	cos, sin := e.rope.Tables(maxPos + 1)
	seqs := make([]cpu.AttentionSeq, len(tokens))
	attShape := cpu.AttentionShape{Heads: nq, KVHeads: nkv, HeadDim: hd}
	attScale := float32(1 / math.Sqrt(float64(hd)))
	kvw := nkv * hd
	for li := range e.layers {
		l := e.layers[li]
		lw := &w.Layers[li]
		rmsNorm(hn, x, lw.AttnNorm, T, h, c.RMSNormEps)
		if err := cpu.Gemm(qkv, hn, T, l.qkv); err != nil {
			return nil, nil, err
		}
		cpu.ParallelFor(T, func(t int) {
			row := qkv[t*qkvW : (t+1)*qkvW]
			p := pos[t]
			for hh := 0; hh < nq+nkv; hh++ { // queries and keys get RoPE
				applyRoPE(row[hh*hd:(hh+1)*hd], cos[p*hd/2:(p+1)*hd/2], sin[p*hd/2:(p+1)*hd/2])
			}
			kc := kcs[seqOf[t]]
			copy(kc.k[li][p*kvw:(p+1)*kvw], row[nq*hd:nq*hd+kvw])
			copy(kc.v[li][p*kvw:(p+1)*kvw], row[nq*hd+kvw:])
		})
		t0 := 0
		for s, toks := range tokens {
			seqs[s] = cpu.AttentionSeq{
				Q: qkv[t0*qkvW : (t0+len(toks))*qkvW], QStride: qkvW,
				Out: att[t0*nq*hd : (t0+len(toks))*nq*hd], OutStride: nq * hd,
				K: kcs[s].k[li], V: kcs[s].v[li], KVStride: kvw,
				Pos0: kcs[s].n, N: len(toks),
			}
			t0 += len(toks)
		}
		if err := cpu.Attention(seqs, attShape, attScale); err != nil {
			return nil, nil, fmt.Errorf("cpu/llm: layer %d attention: %w", li, err)
		}
		if err := cpu.Gemm(proj, att, T, l.o); err != nil {
			return nil, nil, err
		}
		addInto(x, proj)
		rmsNorm(hn, x, lw.MLPNorm, T, h, c.RMSNormEps)
		if e.ObserveMLPInput != nil {
			if err := e.ObserveMLPInput(li, hn, T); err != nil {
				return nil, nil, err
			}
			l = e.layers[li]
		}
		_, active, path, err := l.mlp.Forward(proj, hn, T, e.layout)
		if err != nil {
			return nil, nil, fmt.Errorf("cpu/llm: layer %d MLP: %w", li, err)
		}
		st.Paths[li] = path
		if active >= 0 {
			st.MeanActive[li] = float64(active) / float64(T)
		}
		addInto(x, proj)
	}
	for s, toks := range tokens {
		kcs[s].n += len(toks)
	}
	logits, err := e.logits(x, tokens, allLogits)
	if err != nil {
		return nil, nil, err
	}
	return logits, st, nil
}

// logits returns the logits of the rows of x (the final residual stream)
// that Forward was asked for.
func (e *Engine) logits(x []float32, tokens [][]int, allLogits bool) ([][]float32, error) {
	c := e.model.Config
	h := c.HiddenSize
	var rows []int
	t := 0
	for _, toks := range tokens {
		if allLogits {
			for i := range toks {
				rows = append(rows, t+i)
			}
		} else {
			rows = append(rows, t+len(toks)-1)
		}
		t += len(toks)
	}
	sel := make([]float32, len(rows)*h)
	for i, r := range rows {
		copy(sel[i*h:(i+1)*h], x[r*h:(r+1)*h])
	}
	normed := make([]float32, len(sel))
	rmsNorm(normed, sel, e.model.Weights.Norm, len(rows), h, c.RMSNormEps)
	logits := make([]float32, len(rows)*c.VocabSize)
	if err := cpu.Gemm(logits, normed, len(rows), e.head); err != nil {
		return nil, err
	}
	out := make([][]float32, len(rows))
	for i := range rows {
		out[i] = logits[i*c.VocabSize : (i+1)*c.VocabSize]
	}
	return out, nil
}

// applyRoPE rotates one head vector in place, in Hugging Face's rotate_half
// convention: pairs (i, i + headDim/2).
func applyRoPE(v, cos, sin []float32) {
	half := len(v) / 2
	for i := 0; i < half; i++ {
		a, b := v[i], v[i+half]
		v[i] = a*cos[i] - b*sin[i]
		v[i+half] = b*cos[i] + a*sin[i]
	}
}

func rmsNorm(dst, x, w []float32, rows, h int, eps float64) {
	cpu.ParallelFor(rows, func(r int) {
		row := x[r*h : (r+1)*h]
		ss := 0.0
		for _, v := range row {
			ss += float64(v) * float64(v)
		}
		inv := float32(1 / math.Sqrt(ss/float64(h)+eps))
		out := dst[r*h : (r+1)*h]
		for i, v := range row {
			out[i] = v * inv * w[i]
		}
	})
}

func addInto(x, y []float32) {
	for i, v := range y {
		x[i] += v
	}
}
