package trainer

import (
	"fmt"
	"slices"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/mlp"
)

// layerViews are one layer's parameter views (fused where the layout
// allows: q, k, v are consecutive tensors, and so are gate and up).
type layerViews struct {
	attnNorm, qkv, o, mlpNorm, gu, down       *cuda.Buffer // fp32 parameters (norms) or bf16 (matrices)
	gAttnNorm, gQKV, gO, gMLPNorm, gGU, gDown *cuda.Buffer // fp32 gradients
}

// layer returns layer l's views.
func (b *Backend) layer(sl *slicer, l int) layerViews {
	i := b.layerBase(l)
	up := i + tGateOrUp
	if b.c.MLPGated {
		up++
	}
	return layerViews{
		attnNorm: b.tensorView(sl, b.w, 4, i+tAttnNorm, i+tQ), qkv: b.tensorView(sl, b.wb, 2, i+tQ, i+tO),
		o: b.tensorView(sl, b.wb, 2, i+tO, i+tMLPNorm), mlpNorm: b.tensorView(sl, b.w, 4, i+tMLPNorm, i+tGateOrUp),
		gu: b.tensorView(sl, b.wb, 2, i+tGateOrUp, up+1), down: b.tensorView(sl, b.wb, 2, up+1, up+2),
		gAttnNorm: b.tensorView(sl, b.g, 4, i+tAttnNorm, i+tQ), gQKV: b.tensorView(sl, b.g, 4, i+tQ, i+tO),
		gO: b.tensorView(sl, b.g, 4, i+tO, i+tMLPNorm), gMLPNorm: b.tensorView(sl, b.g, 4, i+tMLPNorm, i+tGateOrUp),
		gGU: b.tensorView(sl, b.g, 4, i+tGateOrUp, up+1), gDown: b.tensorView(sl, b.g, 4, up+1, up+2),
	}
}

// pass describes one micro-batch: its shape and where its statistics go.
type pass struct {
	batch, seq, m int
	backward      bool
	stats, active *cuda.Buffer // fp64 [1+2L], int32 [L][f]
	lossScale     float64      // per token NLL into stats[0]
	gradScale     float32      // d(loss)/d(NLL of a token)
	l1Stat        float64      // per |h| into a layer's L1 statistic
	l1Grad        float32      // gradient of the L1 term per unit of sign(h)
	l0Scale       float64      // per firing into a layer's L0 statistic
}

// uploadTokens checks tokens (batch rows of seq+1 ids) and queues the
// copies of the inputs and targets.
func (b *Backend) uploadTokens(tokens []int, batch, seq int) error {
	V := b.c.VocabSize
	if batch <= 0 || seq <= 0 {
		return fmt.Errorf("trainer: a micro-batch of %d x %d tokens", batch, seq)
	}
	if len(tokens) != batch*(seq+1) {
		return fmt.Errorf("trainer: %d tokens for a batch of %d x (%d+1)", len(tokens), batch, seq)
	}
	for i, id := range tokens {
		if id < 0 || id >= V {
			return fmt.Errorf("trainer: token %d at position %d outside the vocabulary [0, %d)", id, i, V)
		}
	}
	if err := b.ensureActs(batch, seq); err != nil {
		return err
	}
	m := batch * seq
	ids, targets := make([]int32, m), make([]int32, m)
	for r := 0; r < batch; r++ {
		for t := 0; t < seq; t++ {
			ids[r*seq+t] = int32(tokens[r*(seq+1)+t])
			targets[r*seq+t] = int32(tokens[r*(seq+1)+t+1])
		}
	}
	if err := b.dev.CopyHtoDAsync(b.acts.ids, cuda.Bytes(ids), b.s); err != nil {
		return err
	}
	return b.dev.CopyHtoDAsync(b.acts.targets, cuda.Bytes(targets), b.s)
}

// forwardBackward queues the forward pass of the micro-batch whose tokens
// were uploaded and, when p.backward, its backward pass, adding gradients
// into b.g and statistics into p.stats and p.active.
func (b *Backend) forwardBackward(p pass) error {
	c, a := b.c, b.acts
	m, h, f, V, L := p.m, c.HiddenSize, c.IntermediateSize, c.VocabSize, c.NumHiddenLayers
	nq, nkv, hd := c.NumAttentionHeads, c.NumKeyValueHeads, c.HeadDim
	qkvW, _ := widths(c)
	cos, sin, err := b.ropeTables(p.seq)
	if err != nil {
		return err
	}
	att, err := b.attentionFor(p.batch, p.seq)
	if err != nil {
		return err
	}
	sl := &slicer{}
	rows := func(buf *cuda.Buffer, esize, width int) *cuda.Buffer { return sl.at(buf, 0, esize*m*width) }
	layers := make([]layerViews, L)
	for l := range layers {
		layers[l] = b.layer(sl, l)
	}
	embed := b.tensorView(sl, b.w, 4, 0, 1)
	gEmbed := b.tensorView(sl, b.g, 4, 0, 1)
	norm := b.tensorView(sl, b.w, 4, b.normIndex(), b.normIndex()+1)
	gNorm := b.tensorView(sl, b.g, 4, b.normIndex(), b.normIndex()+1)
	head := b.tensorView(sl, b.wb, 2, b.headIndex(), b.headIndex()+1)
	gHead := b.tensorView(sl, b.g, 4, b.headIndex(), b.headIndex()+1)
	lse := make([]*cuda.Buffer, L)
	for l := range lse {
		lse[l] = sl.at(a.lse[l], 0, 4*p.batch*nq*p.seq)
	}
	dqkvb, datt := rows(a.dqkvb, 2, qkvW), rows(a.datt, 2, nq*hd)
	if sl.err != nil {
		return sl.err
	}
	r := b.run
	eps := c.RMSNormEps
	sparse, err := b.mlpPaths(m)
	if err != nil {
		return err
	}
	if p.backward {
		for l, s := range sparse {
			b.stepSparse[l] = b.stepSparse[l] || s
		}
	}

	// Forward.
	if err := b.mark("embedding"); err != nil {
		return err
	}
	if err := r.embedFwd(a.x[0], embed, a.ids, m, h); err != nil {
		return err
	}
	// layerForward queues layer l's forward, adding its statistics into
	// stat and its firing counts into active.
	layerForward := func(l int, stat, active *cuda.Buffer) error {
		lv := layers[l]
		att1, qkv := rows(a.att[l], 2, nq*hd), rows(a.qkv[l], 2, qkvW)
		if sl.err != nil {
			return sl.err
		}
		err := inOrder(
			b.at("norm fwd"),
			func() error { return r.rmsNormFwd(a.hn1[l], a.rstd1[l], a.x[l], lv.attnNorm, m, h, eps) },
			b.at("qkv fwd"),
			func() error { return b.linear(qkv, a.hn1[l], lv.qkv, m, h, qkvW, cublas.BF16) },
			b.at("rope fwd"),
			func() error { return r.ropeBF16(qkv, cos, sin, m, p.seq, nq+nkv, hd, qkvW) },
			b.at("attention fwd"),
			func() error { return att.forward(b.s, att1, qkv, lse[l]) },
			b.at("o fwd"),
			func() error { return b.linearOnto(a.x2[l], a.x[l], att1, lv.o, m, nq*hd, h) },
			b.at("norm fwd"),
			func() error { return r.rmsNormFwd(a.hn2[l], a.rstd2[l], a.x2[l], lv.mlpNorm, m, h, eps) },
			func() error { // its stages marked step by step
				ma := b.mlpArgsFor(l, lv, m, p)
				ma.stat, ma.active, ma.noBackward, ma.inline = stat, active, !p.backward, b.prof != nil
				steps, err := b.mlpForwardSteps(ma, sparse[l])
				if err != nil {
					return err
				}
				return b.runMarked("mlp fwd", steps)
			},
		)
		if err != nil {
			return fmt.Errorf("trainer: layer %d forward: %w", l, err)
		}
		return nil
	}
	for l := range layers {
		if err := layerForward(l, sl.at(p.stats, 8*(1+2*l), 16), sl.at(p.active, 4*l*f, 4*f)); err != nil {
			return err
		}
	}
	if err := inOrder(b.at("norm fwd"), func() error { return r.rmsNormFwd(a.normF, a.rstdF, a.x[L], norm, m, h, eps) }); err != nil {
		return err
	}

	// Cross-entropy, chunk by chunk of rows; the backward of the LM head
	// leaves the final norm's output gradient in dtmp.
	var dlogits *cuda.Buffer
	if p.backward {
		dlogits = a.dlogits
	}
	// Each row's loss goes to a.part, summed after the last chunk.
	lossAt := sl.at(p.stats, 0, 8)
	for r0 := 0; r0 < m; r0 += a.logitRows {
		n := min(a.logitRows, m-r0)
		normed, targets := sl.at(a.normF, 2*r0*h, 2*n*h), sl.at(a.targets, 4*r0, 4*n)
		dnormed, loss := sl.at(a.dtmp, 4*r0*h, 4*n*h), sl.at(a.part, 8*r0, 8*n)
		if sl.err != nil {
			return sl.err
		}
		err := inOrder(
			b.at("lm head fwd"),
			func() error { return b.linear(a.logits, normed, head, n, h, V, cublas.F32) },
			b.at("cross-entropy"),
			func() error {
				return r.crossEntropy(a.logits, targets, dlogits, loss, n, V, p.gradScale, p.lossScale)
			})
		if err == nil && p.backward {
			err = inOrder(
				b.at("lm head bwd"),
				func() error { return b.linearDX(dnormed, dlogits, head, n, h, V, cublas.F32) },
				func() error { return b.linearDW(gHead, dlogits, normed, n, h, V) })
		}
		if err != nil {
			return fmt.Errorf("trainer: cross-entropy of rows [%d, %d): %w", r0, r0+n, err)
		}
	}
	if err := r.sumF64(lossAt, a.part, m, 1); err != nil || !p.backward {
		return err
	}

	// Backward: dx is the gradient of the residual stream.
	dx, dtmp, dxb := rows(a.dx, 4, h), rows(a.dtmp, 4, h), rows(a.dxb, 2, h)
	if sl.err != nil {
		return sl.err
	}
	if err := inOrder(
		b.at("norm bwd"),
		func() error { return b.dev.Memset8(dx, 0, b.s) },
		func() error { return r.rmsNormBwd(dx, dxb, gNorm, dtmp, a.x[L], norm, a.rstdF, a.part, m, h) }); err != nil {
		return err
	}
	for l := L - 1; l >= 0; l-- {
		// With recomputation the shared buffers hold the last layer's
		// activations; every other layer runs its forward again first,
		// its statistics discarded (they were counted in the forward pass).
		if b.opts.Recompute && l < L-1 {
			if err := layerForward(l, sl.at(a.discard, 0, 16), sl.at(a.discard, 16, 4*f)); err != nil {
				return fmt.Errorf("trainer: recomputing: %w", err)
			}
		}
		lv := layers[l]
		att1, qkv := rows(a.att[l], 2, nq*hd), rows(a.qkv[l], 2, qkvW)
		if sl.err != nil {
			return sl.err
		}
		err := inOrder(
			// MLP: x[l+1] = x2 + MLP(hn2). Each norm backward leaves dx in
			// bf16 in dxb too, for the products that follow it.
			func() error { // its stages marked step by step
				ma := b.mlpArgsFor(l, lv, m, p)
				ma.dy, ma.dx = dxb, dtmp
				steps, err := b.mlpBackwardSteps(ma, sparse[l])
				if err != nil {
					return err
				}
				return b.runMarked("mlp bwd", steps)
			},
			b.at("norm bwd"),
			func() error {
				return r.rmsNormBwd(dx, dxb, lv.gMLPNorm, dtmp, a.x2[l], lv.mlpNorm, a.rstd2[l], a.part, m, h)
			},
			// Attention: x2 = x + att·Woᵀ.
			b.at("o bwd"),
			func() error { return b.linearDW(lv.gO, dxb, att1, m, nq*hd, h) },
			func() error { return b.linearDX(datt, dxb, lv.o, m, nq*hd, h, cublas.BF16) },
			// The attention backward writes dqkv in bf16, RoPE's rotation
			// already turned back.
			b.at("attention bwd"),
			func() error {
				return att.backward(b.s, attnGrad{bf16: dqkvb, cos: cos, sin: sin}, datt, qkv, att1, lse[l])
			},
			b.at("qkv bwd"),
			func() error { return b.linearDW(lv.gQKV, dqkvb, a.hn1[l], m, h, qkvW) },
			func() error { return b.linearDX(dtmp, dqkvb, lv.qkv, m, h, qkvW, cublas.F32) },
			b.at("norm bwd"),
			func() error {
				var next *cuda.Buffer // layer 0's dx goes to the embedding, in fp32
				if l > 0 {
					next = dxb
				}
				return r.rmsNormBwd(dx, next, lv.gAttnNorm, dtmp, a.x[l], lv.attnNorm, a.rstd1[l], a.part, m, h)
			},
		)
		if err != nil {
			return fmt.Errorf("trainer: layer %d backward: %w", l, err)
		}
	}
	return inOrder(b.at("embedding bwd"), func() error { return r.embedBwd(gEmbed, a.ids, dx, a.part, m, h, V) })
}

// inOrder runs the steps in order and returns the first error, queuing
// nothing after it.
func inOrder(steps ...func() error) error {
	for _, f := range steps {
		if err := f(); err != nil {
			return err
		}
	}
	return nil
}

// mlpPaths returns which layers run their MLP sparse for micro-batches of
// m tokens.
func (b *Backend) mlpPaths(m int) ([]bool, error) {
	out := slices.Clone(b.sparse)
	if b.opts.MLP == mlp.Dense {
		return make([]bool, len(out)), nil
	}
	if err := sparseOK(m, b.c.HiddenSize, b.c.IntermediateSize, sharedPerBlock(b.dev)); err != nil {
		if b.opts.MLP == mlp.Sparse {
			return nil, err
		}
		return make([]bool, len(out)), nil
	}
	return out, nil
}

// mlpArgsFor returns layer l's MLP operands for a micro-batch of m tokens
// (but the statistics buffers and the backward's dy and dx).
func (b *Backend) mlpArgsFor(l int, lv layerViews, m int, p pass) mlpArgs {
	a := b.acts
	return mlpArgs{mlpShape: mlpShapeOf(b.c, m), x: a.hn2[l], wgu: lv.gu, wd: lv.down, base: a.x2[l], out: a.x[l+1],
		region: a.mlp[l], sc: a.mlpScratch, l1Stat: p.l1Stat, l0Scale: p.l0Scale, gGU: lv.gGU, gDown: lv.gDown,
		l1Grad: p.l1Grad}
}
