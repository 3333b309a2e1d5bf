package train

import (
	"fmt"
	"math"

	"github.com/twell-ai/twell/cpu"
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
// the backward pass) and returns the statistics. Its buffers come from ws
// (nil: fresh allocations), and none of them outlives the call.
func lossAndGrad[T Float](c model.Config, p, g *Params[T], tokens []int, batch, seq int, lambda float64, ws *arena[T]) (*StepStats, error) {
	ws.reset()
	pk := ws.packer()
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

	x := ws.get(m * h)
	for t, id := range ids {
		copy(x[t*h:(t+1)*h], p.Embed[id*h:(id+1)*h])
	}
	caches := make([]layerCache[T], L)
	l1Scale := lambda / float64(L) / float64(m)
	for li := range p.Layers {
		lp := &p.Layers[li]
		lc := &caches[li]
		lc.x = x
		lc.hn1, lc.inv1 = ws.get(m*h), ws.get(m)
		rmsNormForward(lc.hn1, lc.inv1, x, lp.AttnNorm, m, h, c.RMSNormEps)
		lc.q, lc.k, lc.v = ws.get(m*nq*hd), ws.get(m*nkv*hd), ws.get(m*nkv*hd)
		linearForward(lc.q, lc.hn1, lp.Q, m, h, nq*hd, pk)
		linearForward(lc.k, lc.hn1, lp.K, m, h, nkv*hd, pk)
		linearForward(lc.v, lc.hn1, lp.V, m, h, nkv*hd, pk)
		applyRopeAll(lc.q, lc.k, cos, sin, m, seq, nq, nkv, hd, 1)
		lc.p, lc.att = ws.get(batch*nq*seq*seq), ws.get(m*nq*hd)
		attentionForward(lc.att, lc.p, lc.q, lc.k, lc.v, as)
		proj := ws.get(m * h)
		linearForward(proj, lc.att, lp.O, m, nq*hd, h, pk)
		x2 := ws.get(m * h)
		for i := range x2 {
			x2[i] = x[i] + proj[i]
		}
		lc.x2 = x2
		lc.hn2, lc.inv2 = ws.get(m*h), ws.get(m)
		rmsNormForward(lc.hn2, lc.inv2, x2, lp.MLPNorm, m, h, c.RMSNormEps)
		lc.u, lc.h = ws.get(m*f), ws.get(m*f)
		linearForward(lc.u, lc.hn2, lp.Up, m, h, f, pk)
		active := make([]int32, f)
		var sumAbs float64
		nnz := 0
		if gated {
			lc.g = ws.get(m * f)
			linearForward(lc.g, lc.hn2, lp.Gate, m, h, f, pk)
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
		y := ws.get(m * h)
		linearForward(y, lc.h, lp.Down, m, f, h, pk)
		next := ws.get(m * h)
		for i := range next {
			next[i] = x2[i] + y[i]
		}
		x = next
	}
	// Final norm, LM head, loss.
	normed, invF := ws.get(m*h), ws.get(m)
	rmsNormForward(normed, invF, x, p.Norm, m, h, c.RMSNormEps)
	head := p.LMHead
	if c.TieWordEmbeddings {
		head = p.Embed
	}
	// The LM head and the loss run over chunks of rows, so that only one
	// chunk of logits (about 4M values) exists at a time.
	var dhead []T
	if g != nil {
		dhead = g.LMHead
		if c.TieWordEmbeddings {
			dhead = g.Embed
		}
	}
	chunk := max(1, min(m, (4<<20)/V))
	logits, dlogits := ws.get(chunk*V), ws.get(chunk*V)
	dnormed := ws.get(m * h)
	n := countTargets(targets)
	for r0 := 0; r0 < m; r0 += chunk {
		rows := min(chunk, m-r0)
		lg, dl := logits[:rows*V], dlogits[:rows*V]
		nc := normed[r0*h : (r0+rows)*h]
		linearForward(lg, nc, head, rows, h, V, pk)
		if n > 0 {
			st.Loss += crossEntropySum(dl, lg, targets[r0:r0+rows], V, n)
		}
		if g != nil {
			linearBackward(dnormed[r0*h:(r0+rows)*h], dhead, dl, nc, head, rows, h, V, pk)
		}
	}
	if n > 0 {
		st.Loss /= float64(n)
	}
	if g == nil {
		return st, nil // evaluation: no backward pass
	}

	// Backward.
	dx := ws.get(m * h)
	rmsNormBackward(dx, g.Norm, dnormed, x, p.Norm, invF, m, h)
	tmp := ws.get(m * h)
	for li := L - 1; li >= 0; li-- {
		lp, lg, lc := &p.Layers[li], &g.Layers[li], &caches[li]
		// MLP branch: y = h Wd^T.
		dh := ws.get(m * f)
		linearBackward(dh, lg.Down, dx, lc.h, lp.Down, m, f, h, pk)
		for i, hv := range lc.h {
			switch {
			case hv > 0:
				dh[i] += T(l1Scale)
			case hv < 0:
				dh[i] -= T(l1Scale)
			}
		}
		dhn2 := ws.get(m * h)
		du := ws.get(m * f)
		if gated {
			dg := ws.get(m * f)
			for i, gv := range lc.g {
				if gv > 0 {
					dg[i] = dh[i] * lc.u[i]
					du[i] = dh[i] * gv
				}
			}
			linearBackward(dhn2, lg.Gate, dg, lc.hn2, lp.Gate, m, h, f, pk)
			linearBackward(tmp, lg.Up, du, lc.hn2, lp.Up, m, h, f, pk)
			for i := range dhn2 {
				dhn2[i] += tmp[i]
			}
		} else {
			for i, uv := range lc.u {
				if uv > 0 {
					du[i] = dh[i]
				}
			}
			linearBackward(dhn2, lg.Up, du, lc.hn2, lp.Up, m, h, f, pk)
		}
		rmsNormBackward(tmp, lg.MLPNorm, dhn2, lc.x2, lp.MLPNorm, lc.inv2, m, h)
		for i := range dx {
			dx[i] += tmp[i]
		}
		// Attention branch.
		datt := ws.get(m * nq * hd)
		linearBackward(datt, lg.O, dx, lc.att, lp.O, m, nq*hd, h, pk)
		dq, dk, dv := ws.get(m*nq*hd), ws.get(m*nkv*hd), ws.get(m*nkv*hd)
		attentionBackward(dq, dk, dv, datt, lc.p, lc.q, lc.k, lc.v, as)
		applyRopeAll(dq, dk, cos, sin, m, seq, nq, nkv, hd, -1)
		dhn1 := ws.get(m * h)
		linearBackward(dhn1, lg.Q, dq, lc.hn1, lp.Q, m, h, nq*hd, pk)
		linearBackward(tmp, lg.K, dk, lc.hn1, lp.K, m, h, nkv*hd, pk)
		for i := range dhn1 {
			dhn1[i] += tmp[i]
		}
		linearBackward(tmp, lg.V, dv, lc.hn1, lp.V, m, h, nkv*hd, pk)
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

// arena hands out the buffers of one lossAndGrad call and keeps them for the
// next: the calls of a run ask for the same sizes in the same order, so after
// the first step no buffer is allocated (fresh multi-megabyte allocations
// cost page faults on every step). A nil arena allocates.
type arena[T Float] struct {
	bufs [][]T
	next int
	pk   cpu.Packer // packs the products' B operands (float32 only)
}

// packer returns the arena's Packer, nil (fresh buffers) for a nil arena.
func (a *arena[T]) packer() *cpu.Packer {
	if a == nil {
		return nil
	}
	return &a.pk
}

func (a *arena[T]) reset() {
	if a != nil {
		a.next = 0
	}
}

// get returns a zeroed buffer of n values.
func (a *arena[T]) get(n int) []T {
	if a == nil {
		return make([]T, n)
	}
	if a.next == len(a.bufs) {
		a.bufs = append(a.bufs, nil)
	}
	b := a.bufs[a.next]
	if cap(b) < n {
		b = make([]T, n)
		a.bufs[a.next] = b
	} else {
		b = b[:n]
		clear(b)
	}
	a.next++
	return b
}
