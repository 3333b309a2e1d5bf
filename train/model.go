package train

import (
	"fmt"
	"math"

	"github.com/twell-ai/twell/model"
)

// LayerParams holds one decoder layer's parameters (or their gradients) in
// the Hugging Face layouts of model.LayerWeights.
type LayerParams[T Float] struct {
	AttnNorm, Q, K, V, O, MLPNorm, Gate, Up, Down []T
}

// Params holds a model's parameters, or their gradients.
type Params[T Float] struct {
	Embed  []T
	Layers []LayerParams[T]
	Norm   []T
	LMHead []T // nil when tied to Embed
}

// list returns pointers to every tensor, in a fixed order (the order of the
// optimizer state in checkpoints).
func (p *Params[T]) list() []*[]T {
	out := []*[]T{&p.Embed}
	for i := range p.Layers {
		l := &p.Layers[i]
		out = append(out, &l.AttnNorm, &l.Q, &l.K, &l.V, &l.O, &l.MLPNorm)
		if l.Gate != nil {
			out = append(out, &l.Gate)
		}
		out = append(out, &l.Up, &l.Down)
	}
	out = append(out, &p.Norm)
	if p.LMHead != nil {
		out = append(out, &p.LMHead)
	}
	return out
}

// zerosLike returns parameters of p's shapes filled with zeros.
func zerosLike[T, U Float](p *Params[U]) *Params[T] {
	z := func(s []U) []T {
		if s == nil {
			return nil
		}
		return make([]T, len(s))
	}
	out := &Params[T]{Embed: z(p.Embed), Norm: z(p.Norm), LMHead: z(p.LMHead)}
	for _, l := range p.Layers {
		out.Layers = append(out.Layers, LayerParams[T]{
			AttnNorm: z(l.AttnNorm), Q: z(l.Q), K: z(l.K), V: z(l.V), O: z(l.O),
			MLPNorm: z(l.MLPNorm), Gate: z(l.Gate), Up: z(l.Up), Down: z(l.Down),
		})
	}
	return out
}

// convert copies p into a new Params of element type T.
func convert[T, U Float](p *Params[U]) *Params[T] {
	out := zerosLike[T](p)
	src, dst := p.list(), out.list()
	for i := range src {
		for j, v := range *src[i] {
			(*dst[i])[j] = T(v)
		}
	}
	return out
}

// FromWeights wraps model weights as training parameters (sharing memory).
func FromWeights(w *model.Weights) *Params[float32] {
	p := &Params[float32]{Embed: w.Embed, Norm: w.Norm, LMHead: w.LMHead}
	for _, l := range w.Layers {
		p.Layers = append(p.Layers, LayerParams[float32]{
			AttnNorm: l.AttnNorm, Q: l.Q, K: l.K, V: l.V, O: l.O,
			MLPNorm: l.MLPNorm, Gate: l.Gate, Up: l.Up, Down: l.Down,
		})
	}
	return p
}

// Weights returns model weights sharing p's memory.
func (p *Params[T]) weights() *model.Weights {
	pp, ok := any(p).(*Params[float32])
	if !ok {
		pp = convert[float32](p)
	}
	w := &model.Weights{Embed: pp.Embed, Norm: pp.Norm, LMHead: pp.LMHead}
	for _, l := range pp.Layers {
		w.Layers = append(w.Layers, model.LayerWeights{
			AttnNorm: l.AttnNorm, Q: l.Q, K: l.K, V: l.V, O: l.O,
			MLPNorm: l.MLPNorm, Gate: l.Gate, Up: l.Up, Down: l.Down,
		})
	}
	return w
}

// layerCache holds what one layer's backward needs from its forward.
type layerCache[T Float] struct {
	x, hn1, inv1, q, k, v, p, att, x2, hn2, inv2, g, u, h []T
}

// lossAndGrad runs the model on tokens (batch x (seq+1): inputs are the
// first seq tokens of each row, targets the last seq), adds the gradient of
// cross-entropy + lambda * L1 into g (which must start at zero; nil skips
// the backward pass) and returns the statistics.
func lossAndGrad[T Float](c model.Config, p, g *Params[T], tokens []int, batch, seq int, lambda float64) (*StepStats, error) {
	h, hd, nq, nkv, f := c.HiddenSize, c.HeadDim, c.NumAttentionHeads, c.NumKeyValueHeads, c.IntermediateSize
	V, L := c.VocabSize, c.NumHiddenLayers
	if len(tokens) != batch*(seq+1) {
		return nil, fmt.Errorf("train: %d tokens for a batch of %d x (%d+1)", len(tokens), batch, seq)
	}
	m := batch * seq
	ids := make([]int, m)
	targets := make([]int, m)
	for b := 0; b < batch; b++ {
		for t := 0; t < seq; t++ {
			ids[b*seq+t] = tokens[b*(seq+1)+t]
			targets[b*seq+t] = tokens[b*(seq+1)+t+1]
		}
	}
	for i, id := range tokens {
		if id < 0 || id >= V {
			return nil, fmt.Errorf("train: token %d at position %d outside the vocabulary [0, %d)", id, i, V)
		}
	}
	cos, sin := model.RoPEAngles(c, seq)
	gated := c.MLPGated
	as := attnShape{batch: batch, seq: seq, heads: nq, kvHeads: nkv, headDim: hd}
	st := &StepStats{Active: make([][]int32, L), L0: make([]float64, L)}

	x := make([]T, m*h)
	for t, id := range ids {
		copy(x[t*h:(t+1)*h], p.Embed[id*h:(id+1)*h])
	}
	caches := make([]layerCache[T], L)
	l1Scale := lambda / float64(L) / float64(m)
	for li := range p.Layers {
		lp := &p.Layers[li]
		lc := &caches[li]
		lc.x = x
		lc.hn1, lc.inv1 = make([]T, m*h), make([]T, m)
		rmsNormForward(lc.hn1, lc.inv1, x, lp.AttnNorm, m, h, c.RMSNormEps)
		lc.q, lc.k, lc.v = make([]T, m*nq*hd), make([]T, m*nkv*hd), make([]T, m*nkv*hd)
		linearForward(lc.q, lc.hn1, lp.Q, m, h, nq*hd)
		linearForward(lc.k, lc.hn1, lp.K, m, h, nkv*hd)
		linearForward(lc.v, lc.hn1, lp.V, m, h, nkv*hd)
		applyRopeAll(lc.q, lc.k, cos, sin, m, seq, nq, nkv, hd, 1)
		lc.p, lc.att = make([]T, batch*nq*seq*seq), make([]T, m*nq*hd)
		attentionForward(lc.att, lc.p, lc.q, lc.k, lc.v, as)
		proj := make([]T, m*h)
		linearForward(proj, lc.att, lp.O, m, nq*hd, h)
		x2 := make([]T, m*h)
		for i := range x2 {
			x2[i] = x[i] + proj[i]
		}
		lc.x2 = x2
		lc.hn2, lc.inv2 = make([]T, m*h), make([]T, m)
		rmsNormForward(lc.hn2, lc.inv2, x2, lp.MLPNorm, m, h, c.RMSNormEps)
		lc.u, lc.h = make([]T, m*f), make([]T, m*f)
		linearForward(lc.u, lc.hn2, lp.Up, m, h, f)
		active := make([]int32, f)
		var sumAbs float64
		nnz := 0
		if gated {
			lc.g = make([]T, m*f)
			linearForward(lc.g, lc.hn2, lp.Gate, m, h, f)
			for i, gv := range lc.g {
				if gv > 0 {
					lc.h[i] = gv * lc.u[i]
					active[i%f]++
					nnz++
				}
			}
		} else {
			for i, uv := range lc.u {
				if uv > 0 {
					lc.h[i] = uv
					active[i%f]++
					nnz++
				}
			}
		}
		for _, hv := range lc.h {
			sumAbs += math.Abs(float64(hv))
		}
		st.L1 += l1Scale * sumAbs
		st.Active[li] = active
		st.L0[li] = float64(nnz) / float64(m)
		y := make([]T, m*h)
		linearForward(y, lc.h, lp.Down, m, f, h)
		next := make([]T, m*h)
		for i := range next {
			next[i] = x2[i] + y[i]
		}
		x = next
	}
	// Final norm, LM head, loss.
	normed, invF := make([]T, m*h), make([]T, m)
	rmsNormForward(normed, invF, x, p.Norm, m, h, c.RMSNormEps)
	head := p.LMHead
	if c.TieWordEmbeddings {
		head = p.Embed
	}
	logits := make([]T, m*V)
	linearForward(logits, normed, head, m, h, V)
	dlogits := make([]T, m*V)
	st.Loss = crossEntropy(dlogits, logits, targets, V)
	if g == nil {
		return st, nil // evaluation: no backward pass
	}

	// Backward.
	dhead := g.LMHead
	if c.TieWordEmbeddings {
		dhead = g.Embed
	}
	dnormed := make([]T, m*h)
	linearBackward(dnormed, dhead, dlogits, normed, head, m, h, V)
	dx := make([]T, m*h)
	rmsNormBackward(dx, g.Norm, dnormed, x, p.Norm, invF, m, h)
	tmp := make([]T, m*h)
	for li := L - 1; li >= 0; li-- {
		lp, lg, lc := &p.Layers[li], &g.Layers[li], &caches[li]
		// MLP branch: y = h Wd^T.
		dh := make([]T, m*f)
		linearBackward(dh, lg.Down, dx, lc.h, lp.Down, m, f, h)
		for i, hv := range lc.h {
			switch {
			case hv > 0:
				dh[i] += T(l1Scale)
			case hv < 0:
				dh[i] -= T(l1Scale)
			}
		}
		dhn2 := make([]T, m*h)
		du := make([]T, m*f)
		if gated {
			dg := make([]T, m*f)
			for i, gv := range lc.g {
				if gv > 0 {
					dg[i] = dh[i] * lc.u[i]
					du[i] = dh[i] * gv
				}
			}
			linearBackward(dhn2, lg.Gate, dg, lc.hn2, lp.Gate, m, h, f)
			linearBackward(tmp, lg.Up, du, lc.hn2, lp.Up, m, h, f)
			for i := range dhn2 {
				dhn2[i] += tmp[i]
			}
		} else {
			for i, uv := range lc.u {
				if uv > 0 {
					du[i] = dh[i]
				}
			}
			linearBackward(dhn2, lg.Up, du, lc.hn2, lp.Up, m, h, f)
		}
		rmsNormBackward(tmp, lg.MLPNorm, dhn2, lc.x2, lp.MLPNorm, lc.inv2, m, h)
		for i := range dx {
			dx[i] += tmp[i]
		}
		// Attention branch.
		datt := make([]T, m*nq*hd)
		linearBackward(datt, lg.O, dx, lc.att, lp.O, m, nq*hd, h)
		dq, dk, dv := make([]T, m*nq*hd), make([]T, m*nkv*hd), make([]T, m*nkv*hd)
		attentionBackward(dq, dk, dv, datt, lc.p, lc.q, lc.k, lc.v, as)
		applyRopeAll(dq, dk, cos, sin, m, seq, nq, nkv, hd, -1)
		dhn1 := make([]T, m*h)
		linearBackward(dhn1, lg.Q, dq, lc.hn1, lp.Q, m, h, nq*hd)
		linearBackward(tmp, lg.K, dk, lc.hn1, lp.K, m, h, nkv*hd)
		for i := range dhn1 {
			dhn1[i] += tmp[i]
		}
		linearBackward(tmp, lg.V, dv, lc.hn1, lp.V, m, h, nkv*hd)
		for i := range dhn1 {
			dhn1[i] += tmp[i]
		}
		rmsNormBackward(tmp, lg.AttnNorm, dhn1, lc.x, lp.AttnNorm, lc.inv1, m, h)
		for i := range dx {
			dx[i] += tmp[i]
		}
	}
	for t, id := range ids {
		row := g.Embed[id*h : (id+1)*h]
		for i, v := range dx[t*h : (t+1)*h] {
			row[i] += v
		}
	}
	return st, nil
}
