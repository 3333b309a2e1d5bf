package train

import "math"

// AdamW is Adam with decoupled weight decay (Loshchilov & Hutter), with
// bias-corrected moments kept in float32.
type AdamW struct {
	Beta1, Beta2, Eps, WeightDecay float64
	// Step counts the updates applied so far.
	Step int64
	m, v [][]float32
}

// NewAdamW returns an optimizer for parameters p.
func NewAdamW(p *Params[float32], beta1, beta2, eps, weightDecay float64) *AdamW {
	o := &AdamW{Beta1: beta1, Beta2: beta2, Eps: eps, WeightDecay: weightDecay}
	for _, t := range p.list() {
		o.m = append(o.m, make([]float32, len(*t)))
		o.v = append(o.v, make([]float32, len(*t)))
	}
	return o
}

// decays reports whether weight decay applies to tensor i of p: matrices
// yes, norm gains no.
func decays(p *Params[float32], i int) bool {
	t := p.list()[i]
	for _, n := range normTensors(p) {
		if n == t {
			return false
		}
	}
	return true
}

func normTensors(p *Params[float32]) []*[]float32 {
	out := []*[]float32{&p.Norm}
	for i := range p.Layers {
		out = append(out, &p.Layers[i].AttnNorm, &p.Layers[i].MLPNorm)
	}
	return out
}

// Update applies one step with learning rate lr and gradients g.
func (o *AdamW) Update(p, g *Params[float32], lr float64) {
	o.Step++
	b1c := 1 - math.Pow(o.Beta1, float64(o.Step))
	b2c := 1 - math.Pow(o.Beta2, float64(o.Step))
	b1, b2 := float32(o.Beta1), float32(o.Beta2)
	ps, gs := p.list(), g.list()
	for i := range ps {
		w, gr, m, v := *ps[i], *gs[i], o.m[i], o.v[i]
		wd := float32(0)
		if decays(p, i) {
			wd = float32(lr * o.WeightDecay)
		}
		stepSize := float32(lr / b1c)
		invB2c := float32(1 / math.Sqrt(b2c))
		eps := float32(o.Eps)
		for j, gv := range gr {
			m[j] = b1*m[j] + (1-b1)*gv
			v[j] = b2*v[j] + (1-b2)*gv*gv
			w[j] -= wd * w[j]
			w[j] -= stepSize * m[j] / (float32(math.Sqrt(float64(v[j])))*invB2c + eps)
		}
	}
}

// resetRange zeroes the moments of entries [lo, hi) of tensor i (used when a
// dead unit is re-initialised).
func (o *AdamW) resetRange(i, lo, hi int) {
	clear(o.m[i][lo:hi])
	clear(o.v[i][lo:hi])
}

// Schedule returns the learning rate at step (0-based): linear warmup over
// warmup steps, then cosine decay from lr to minLR at total steps.
func Schedule(step, warmup, total int, lr, minLR float64) float64 {
	if step < warmup {
		return lr * float64(step+1) / float64(warmup)
	}
	if total <= warmup {
		return lr
	}
	frac := math.Min(1, float64(step-warmup)/float64(total-warmup))
	return minLR + 0.5*(lr-minLR)*(1+math.Cos(math.Pi*frac))
}

// clipGradients scales g so that its global L2 norm is at most maxNorm
// (0 disables) and returns the norm before clipping.
func clipGradients(g *Params[float32], maxNorm float64) float64 {
	ss := 0.0
	for _, t := range g.list() {
		for _, v := range *t {
			ss += float64(v) * float64(v)
		}
	}
	norm := math.Sqrt(ss)
	if maxNorm > 0 && norm > maxNorm {
		s := float32(maxNorm / norm)
		for _, t := range g.list() {
			for j := range *t {
				(*t)[j] *= s
			}
		}
	}
	return norm
}
