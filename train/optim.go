package train

import "math"

// adamW is the CPU backend's AdamW: bias-corrected moments kept in float32.
type adamW struct {
	step int64 // updates applied so far
	m, v [][]float32
}

// newAdamW returns fresh optimizer state for parameters p.
func newAdamW(p *Params[float32]) *adamW {
	o := &adamW{}
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

// update applies one step with learning rate lr, hyperparameters h and
// gradients g.
func (o *adamW) update(p, g *Params[float32], h AdamW, lr float64) {
	o.step++
	b1c := 1 - math.Pow(h.Beta1, float64(o.step))
	b2c := 1 - math.Pow(h.Beta2, float64(o.step))
	b1, b2 := float32(h.Beta1), float32(h.Beta2)
	ps, gs := p.list(), g.list()
	for i := range ps {
		w, gr, m, v := *ps[i], *gs[i], o.m[i], o.v[i]
		wd := float32(0)
		if decays(p, i) {
			wd = float32(lr * h.WeightDecay)
		}
		stepSize := float32(lr / b1c)
		invB2c := float32(1 / math.Sqrt(b2c))
		eps := float32(h.Eps)
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
func (o *adamW) resetRange(i, lo, hi int) {
	clear(o.m[i][lo:hi])
	clear(o.v[i][lo:hi])
}
