package trainer

import (
	"errors"
	"fmt"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
)

// activations are the device buffers of one micro-batch of up to batch x
// seq tokens (M = batch·seq rows): what each layer's backward needs from
// its forward, and the shared work buffers of the backward pass. Rows are
// tokens; a smaller micro-batch uses the leading rows.
type activations struct {
	batch, seq, rows, logitRows int

	// Per layer: x the layer's input (x[L] the final residual), x2 the
	// residual after attention (fp32 [M][h]); hn1, hn2 the normed inputs
	// (bf16 [M][h]) and their rstd (fp32 [M]); qkv after RoPE (bf16
	// [M][qkvW]); att the attention output (bf16 [M][nq·hd]) and lse
	// (fp32 [batch][nq][seq]); mlp what the MLP block keeps for its
	// backward (mlpShape.saveBytes: the dense or the sparse path's views).
	// With Options.Recompute every layer's entry but x is the same buffer.
	x, x2, hn1, hn2, rstd1, rstd2, qkv, att, lse, mlp []*cuda.Buffer
	// discard takes the statistics (fp64 [2]) and firing counts (int32
	// [f]) of a recomputed forward (Options.Recompute), which must not
	// count twice.
	discard *cuda.Buffer

	ids, targets *cuda.Buffer // int32 [M]
	normF, rstdF *cuda.Buffer // final norm: bf16 [M][h], fp32 [M]
	logits       *cuda.Buffer // fp32 [logitRows][V]
	dlogits      *cuda.Buffer // bf16 [logitRows][V]
	dx, dtmp     *cuda.Buffer // fp32 [M][h]: the residual's gradient, a normed input's
	dxb          *cuda.Buffer // bf16 [M][h]
	mlpScratch                // the MLP blocks' work buffers; part also the other reductions' (partBytes)
	dqkvb        *cuda.Buffer // bf16 [M][qkvW]
	datt         *cuda.Buffer // bf16 [M][nq·hd]
	owned        []*cuda.Buffer
}

// widths returns a model's fused q/k/v width and fused MLP input width.
func widths(c model.Config) (qkvW, guW int) {
	qkvW = (c.NumAttentionHeads + 2*c.NumKeyValueHeads) * c.HeadDim
	guW = c.IntermediateSize
	if c.MLPGated {
		guW *= 2
	}
	return qkvW, guW
}

// logitBudget is the default memory of the fp32 logits that exist at once.
// Each chunk of logit rows adds its LM-head weight gradient into the fp32
// [V][h] accumulator (read and written once a chunk), so fewer chunks move
// less: at the 1.5B shape (V 49152, h 2048) 49 chunks of 64 MiB read and
// wrote the 403 MB accumulator 49 times, about 40 GB a step.
const logitBudget = 512 << 20

// logitRowsFor returns the rows of logits that exist at once for
// micro-batches of rows tokens: o's choice, or, in as few chunks as fit in
// logitBudget each, the rows split evenly among them.
func logitRowsFor(c model.Config, rows, o int) int {
	if o <= 0 && rows > 0 {
		most := max(1, logitBudget/(4*c.VocabSize))
		o = ceil(rows, ceil(rows, most))
	}
	return max(1, min(o, rows))
}

// mlpShapeOf is the MLP block shape of model c for m tokens.
func mlpShapeOf(c model.Config, m int) mlpShape {
	return mlpShape{m: m, h: c.HiddenSize, f: c.IntermediateSize, gated: c.MLPGated}
}

// partBytes is the size of the work buffer of a micro-batch's fixed-order
// reductions for micro-batches of m tokens: the largest of the MLP
// statistics' and the loss's partial sums (fp64, statPartBytes), the
// RMSNorm gain gradient's (fp32 [normParts][h]) and the embedding
// gradient's sort and pieces (embedSizes).
func partBytes(c model.Config, m int) int {
	return max(mlpShapeOf(c, m).statPartBytes(), 4*normParts*c.HiddenSize, carvedBytes(embedSizes(m, c.HiddenSize)))
}

// activationSizes lists the byte sizes of the buffers of activations for
// micro-batches of batch x seq tokens, per-layer buffers first, and the
// sparse MLP path's work buffers (none with o.MLP dense).
func activationSizes(c model.Config, batch, seq int, o Options) (perLayer, shared, sparse []int) {
	M, h, f, V := batch*seq, c.HiddenSize, c.IntermediateSize, c.VocabSize
	qkvW, guW := widths(c)
	nqhd := c.NumAttentionHeads * c.HeadDim
	lr := logitRowsFor(c, M, o.LogitRows)
	ms := mlpShapeOf(c, M)
	// x, x2, hn1, hn2, rstd1, rstd2, qkv, att, lse, mlp
	perLayer = []int{4 * M * h, 4 * M * h, 2 * M * h, 2 * M * h, 4 * M, 4 * M, 2 * M * qkvW, 2 * M * nqhd,
		4 * batch * c.NumAttentionHeads * seq, ms.saveBytes(o.MLP)}
	// ids, targets, normF, rstdF, logits, dlogits, dx, dtmp, dxb, dh, dgu, part, dqkvb, datt, x[L]
	shared = []int{4 * M, 4 * M, 2 * M * h, 4 * M, 4 * lr * V, 2 * lr * V, 4 * M * h, 4 * M * h, 2 * M * h, 4 * M * f,
		2 * M * guW, partBytes(c, M), 2 * M * qkvW, 2 * M * nqhd, 4 * M * h}
	if o.MLP != mlp.Dense {
		sparse = ms.sparseScratchBytes()
	}
	return perLayer, shared, sparse
}

// discardBytes is the size of activations.discard.
func discardBytes(c model.Config) int { return 16 + 4*c.IntermediateSize }

// ActivationBytes returns the device memory of the activations and work
// buffers of micro-batches of batch x seq tokens, attention's included,
// with o's logit rows, MLP path and recomputation.
func ActivationBytes(c model.Config, batch, seq int, o Options) int64 {
	perLayer, shared, sparse := activationSizes(c, batch, seq, o)
	n := int64(0)
	for i, s := range perLayer {
		copies := int64(c.NumHiddenLayers)
		if i > 0 && o.Recompute {
			copies = 1
		}
		n += int64(s) * copies
	}
	if o.Recompute {
		n += int64(discardBytes(c))
	}
	for _, s := range append(shared, sparse...) {
		n += int64(s)
	}
	return n + attnWorkBytes(batch, seq, c.NumAttentionHeads)
}

// newActivations allocates the buffers for micro-batches of batch x seq.
func newActivations(dev *cuda.Device, c model.Config, batch, seq int, o Options) (*activations, error) {
	a := &activations{batch: batch, seq: seq, rows: batch * seq, logitRows: logitRowsFor(c, batch*seq, o.LogitRows)}
	perLayer, shared, sparse := activationSizes(c, batch, seq, o)
	alloc := func(n int) *cuda.Buffer {
		if len(a.owned) > 0 && a.owned[len(a.owned)-1] == nil {
			return nil
		}
		buf, err := dev.Alloc(n)
		if err != nil {
			buf = nil
		}
		a.owned = append(a.owned, buf)
		return buf
	}
	L := c.NumHiddenLayers
	lists := []*[]*cuda.Buffer{&a.x, &a.x2, &a.hn1, &a.hn2, &a.rstd1, &a.rstd2, &a.qkv, &a.att, &a.lse, &a.mlp}
	for i, p := range lists {
		for l := range L {
			if l > 0 && i > 0 && o.Recompute {
				*p = append(*p, (*p)[0])
				continue
			}
			*p = append(*p, alloc(perLayer[i]))
		}
	}
	if o.Recompute {
		a.discard = alloc(discardBytes(c))
	}
	singles := []**cuda.Buffer{&a.ids, &a.targets, &a.normF, &a.rstdF, &a.logits, &a.dlogits, &a.dx, &a.dtmp, &a.dxb,
		&a.dh, &a.dgu, &a.part, &a.dqkvb, &a.datt}
	for i, p := range singles {
		*p = alloc(shared[i])
	}
	a.x = append(a.x, alloc(shared[len(shared)-1]))
	for i, p := range []**cuda.Buffer{&a.cnt, &a.chunk, &a.slots}[:len(sparse)] {
		*p = alloc(sparse[i])
	}
	if a.owned[len(a.owned)-1] == nil {
		err := a.free()
		return nil, errors.Join(fmt.Errorf("trainer: allocating %s of activations for micro-batches of %d x %d tokens failed",
			memcheck.Format(float64(ActivationBytes(c, batch, seq, o))), batch, seq), err)
	}
	return a, nil
}

// free gives the buffers back.
func (a *activations) free() error {
	var errs []error
	for _, b := range a.owned {
		if b != nil {
			errs = append(errs, b.Free())
		}
	}
	a.owned = nil
	return errors.Join(errs...)
}

// ensureActs makes the activations hold micro-batches of batch x seq
// tokens, reallocating (after checking free memory) when they are smaller.
func (b *Backend) ensureActs(batch, seq int) error {
	if a := b.acts; a != nil && seq <= a.seq && batch <= a.batch {
		return nil
	}
	nb, ns := batch, seq
	if a := b.acts; a != nil {
		nb, ns = max(nb, a.batch), max(ns, a.seq)
		if err := b.s.Synchronize(); err != nil {
			return err
		}
		if err := a.free(); err != nil {
			return err
		}
		b.acts = nil
	}
	if err := fits(b.dev, ActivationBytes(b.c, nb, ns, b.opts), b.c, nb, ns, b.opts); err != nil {
		return err
	}
	a, err := newActivations(b.dev, b.c, nb, ns, b.opts)
	if err != nil {
		return err
	}
	b.acts = a
	return nil
}
