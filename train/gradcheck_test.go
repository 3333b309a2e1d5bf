package train

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/twell-ai/twell/model"
)

func randVec(r *rand.Rand, n int, std float64) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = r.NormFloat64() * std
	}
	return v
}

func dotf(a, b []float64) float64 {
	s := 0.0
	for i := range a {
		s += a[i] * b[i]
	}
	return s
}

// checkGrad compares grad (the analytic gradient of loss at x) with central
// finite differences at every entry of x; where a kink lies within the step
// (the one-sided differences disagree), grad must lie between them.
func checkGrad(t *testing.T, what string, seed uint64, x, grad []float64, loss func() float64) {
	t.Helper()
	const eps = 1e-6
	for i := range x {
		old := x[i]
		x[i] = old + eps
		lp := loss()
		x[i] = old - eps
		lm := loss()
		x[i] = old
		num := (lp - lm) / (2 * eps)
		tol := 1e-6 + 1e-4*math.Abs(num)
		if math.Abs(num-grad[i]) <= tol {
			continue
		}
		// A kink (a ReLU or an |h| of the L1 term switching) within eps of
		// the point: the central difference then mixes the slopes of its
		// two sides, and the analytic gradient, the slope on the point's
		// side, must lie between the one-sided differences.
		l0 := loss()
		right, left := (lp-l0)/eps, (l0-lm)/eps
		if math.Abs(right-left) > tol && grad[i] >= min(left, right)-tol && grad[i] <= max(left, right)+tol {
			continue
		}
		t.Fatalf("seed %d: %s: entry %d: analytic %.9g, finite difference %.9g (one-sided %.9g and %.9g)",
			seed, what, i, grad[i], num, left, right)
	}
}

func TestLayerGradients(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 1))

	// RMSNorm: loss = dy . rmsnorm(x, w).
	rows, h := 3, 7
	x, w, dy := randVec(r, rows*h, 1), randVec(r, h, 1), randVec(r, rows*h, 1)
	y, inv := make([]float64, rows*h), make([]float64, rows)
	loss := func() float64 { rmsNormForward(y, inv, x, w, rows, h, 1e-5); return dotf(dy, y) }
	loss()
	dx, dw := make([]float64, rows*h), make([]float64, h)
	rmsNormBackward(dx, dw, dy, x, w, inv, rows, h)
	checkGrad(t, "rmsnorm dx", seed, x, dx, loss)
	checkGrad(t, "rmsnorm dw", seed, w, dw, loss)

	// Linear.
	m, in, out := 4, 5, 3
	x, w, dy = randVec(r, m*in, 1), randVec(r, out*in, 1), randVec(r, m*out, 1)
	y = make([]float64, m*out)
	loss = func() float64 { linearForward(y, x, w, m, in, out, nil); return dotf(dy, y) }
	dx, dw = make([]float64, m*in), make([]float64, out*in)
	linearBackward(dx, dw, dy, x, w, m, in, out, nil)
	checkGrad(t, "linear dx", seed, x, dx, loss)
	checkGrad(t, "linear dw", seed, w, dw, loss)

	// Attention with grouped KV heads.
	as := attnShape{batch: 2, seq: 5, heads: 4, kvHeads: 2, headDim: 3}
	mt := as.batch * as.seq
	q, k, v := randVec(r, mt*as.heads*as.headDim, 1), randVec(r, mt*as.kvHeads*as.headDim, 1), randVec(r, mt*as.kvHeads*as.headDim, 1)
	do := randVec(r, mt*as.heads*as.headDim, 1)
	o, p := make([]float64, len(q)), make([]float64, as.batch*as.heads*as.seq*as.seq)
	loss = func() float64 { attentionForward(o, p, q, k, v, as); return dotf(do, o) }
	loss()
	dq, dk, dv := make([]float64, len(q)), make([]float64, len(k)), make([]float64, len(v))
	attentionBackward(dq, dk, dv, do, p, q, k, v, as)
	checkGrad(t, "attention dq", seed, q, dq, loss)
	checkGrad(t, "attention dk", seed, k, dk, loss)
	checkGrad(t, "attention dv", seed, v, dv, loss)

	// RoPE: the inverse rotation is the backward.
	c := model.Config{HeadDim: 6, RopeTheta: 10000}
	cos, sin := model.RoPEAngles(c, 4)
	qr, kr := randVec(r, 4*2*6, 1), randVec(r, 4*1*6, 1)
	dq, dk = randVec(r, len(qr), 1), randVec(r, len(kr), 1)
	q2, k2 := append([]float64(nil), qr...), append([]float64(nil), kr...)
	loss = func() float64 {
		copy(q2, qr)
		copy(k2, kr)
		applyRopeAll(q2, k2, cos, sin, 4, 4, 2, 1, 6, 1)
		return dotf(dq, q2) + dotf(dk, k2)
	}
	gq, gk := append([]float64(nil), dq...), append([]float64(nil), dk...)
	applyRopeAll(gq, gk, cos, sin, 4, 4, 2, 1, 6, -1)
	checkGrad(t, "rope dq", seed, qr, gq, loss)
	checkGrad(t, "rope dk", seed, kr, gk, loss)

	// Cross-entropy, one target ignored.
	vocab := 6
	logits := randVec(r, 4*vocab, 2)
	targets := []int{1, -1, 5, 0}
	dl := make([]float64, len(logits))
	loss = func() float64 { return crossEntropy(make([]float64, len(logits)), logits, targets, vocab) }
	crossEntropy(dl, logits, targets, vocab)
	checkGrad(t, "cross-entropy", seed, logits, dl, loss)
}

func tinyTrainConfig(gated, tied bool) model.Config {
	return model.Config{
		ModelType: "llama", HiddenSize: 8, IntermediateSize: 12, NumHiddenLayers: 2,
		NumAttentionHeads: 2, NumKeyValueHeads: 1, HeadDim: 4, VocabSize: 11,
		MaxPositionEmbeddings: 16, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: model.ActReLU, TieWordEmbeddings: tied, MLPGated: gated,
	}
}

func TestWholeModelGradient(t *testing.T) {
	for _, gated := range []bool{true, false} {
		for _, tied := range []bool{true, false} {
			t.Run(fmt.Sprintf("gated=%v tied=%v", gated, tied), func(t *testing.T) {
				seed := rand.Uint64()
				r := rand.New(rand.NewPCG(seed, 2))
				c := tinyTrainConfig(gated, tied)
				p := convert[float64](FromWeights(model.RandomWeights(c, r)))
				for _, tp := range p.list() { // larger weights than 0.02 so every path matters
					for i := range *tp {
						(*tp)[i] = r.NormFloat64() * 0.5
					}
				}
				batch, seq := 2, 5
				tokens := make([]int, batch*(seq+1))
				for i := range tokens {
					tokens[i] = r.IntN(c.VocabSize)
				}
				const lambda = 0.05
				g := zerosLike[float64](p)
				if _, err := lossAndGrad(c, p, g, tokens, batch, seq, lambda, nil); err != nil {
					t.Fatal(err)
				}
				loss := func() float64 {
					st, err := lossAndGrad(c, p, zerosLike[float64](p), tokens, batch, seq, lambda, nil)
					if err != nil {
						t.Fatal(err)
					}
					return st.Loss + st.L1
				}
				names := []string{"embed"}
				for li := range p.Layers {
					for _, n := range []string{"attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down"} {
						if n == "gate" && !gated {
							continue
						}
						names = append(names, fmt.Sprintf("layer %d %s", li, n))
					}
				}
				names = append(names, "norm", "lm_head")
				for i, tp := range p.list() {
					checkGrad(t, names[i], seed, *tp, *g.list()[i], loss)
				}
			})
		}
	}
}

// TestFloat32MatchesFloat64 checks the float32 path (blocked GEMMs) against
// the float64 path on the same model and batch.
func TestFloat32MatchesFloat64(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 3))
	c := tinyTrainConfig(true, true)
	c.HiddenSize, c.IntermediateSize, c.VocabSize, c.HeadDim = 32, 64, 50, 16
	p32 := FromWeights(model.RandomWeights(c, r))
	for _, tp := range p32.list() {
		for i := range *tp {
			(*tp)[i] = float32(r.NormFloat64() * 0.3)
		}
	}
	p64 := convert[float64](p32)
	batch, seq := 3, 7
	tokens := make([]int, batch*(seq+1))
	for i := range tokens {
		tokens[i] = r.IntN(c.VocabSize)
	}
	g32, g64 := zerosLike[float32](p32), zerosLike[float64](p64)
	s32, err := lossAndGrad(c, p32, g32, tokens, batch, seq, 0.01, nil)
	if err != nil {
		t.Fatal(err)
	}
	s64, _ := lossAndGrad(c, p64, g64, tokens, batch, seq, 0.01, nil)
	if math.Abs(s32.Loss-s64.Loss) > 1e-4*s64.Loss || math.Abs(s32.L1-s64.L1) > 1e-3*s64.L1+1e-9 {
		t.Fatalf("seed %d: float32 loss %g l1 %g, float64 %g %g", seed, s32.Loss, s32.L1, s64.Loss, s64.L1)
	}
	a, b := g32.list(), g64.list()
	for i := range a {
		var num, den float64
		for j, v := range *a[i] {
			d := float64(v) - (*b[i])[j]
			num += d * d
			den += (*b[i])[j] * (*b[i])[j]
		}
		if math.Sqrt(num) > 1e-3*math.Sqrt(den)+1e-7 {
			t.Fatalf("seed %d: tensor %d gradient rel err %g", seed, i, math.Sqrt(num/den))
		}
	}
}
