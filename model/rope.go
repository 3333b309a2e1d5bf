package model

import (
	"math"
	"sync"
)

// ropeTable computes the rotary embedding angles of Hugging Face's Llama,
// with its rope_scaling variants (linear, dynamic NTK, llama3).
type ropeTable struct {
	c Config

	mu       sync.Mutex
	cos, sin []float32 // [positions][headDim/2]
	n        int
}

func newRopeTable(c Config) ropeTable { return ropeTable{c: c} }

// invFreq returns the inverse frequencies for sequences of seqLen tokens.
func (r *ropeTable) invFreq(seqLen int) []float64 {
	c := r.c
	hd := c.HeadDim
	base := c.RopeTheta
	sc := c.RopeScaling
	if sc != nil && sc.Type == "dynamic" && seqLen > c.MaxPositionEmbeddings {
		ratio := sc.Factor*float64(seqLen)/float64(c.MaxPositionEmbeddings) - (sc.Factor - 1)
		base *= math.Pow(ratio, float64(hd)/float64(hd-2))
	}
	inv := make([]float64, hd/2)
	for i := range inv {
		inv[i] = 1 / math.Pow(base, float64(2*i)/float64(hd))
	}
	if sc == nil {
		return inv
	}
	switch sc.Type {
	case "linear":
		for i := range inv {
			inv[i] /= sc.Factor
		}
	case "llama3":
		old := float64(sc.OriginalMaxPositionEmbeddings)
		lowWave, highWave := old/sc.LowFreqFactor, old/sc.HighFreqFactor
		for i, f := range inv {
			wave := 2 * math.Pi / f
			switch {
			case wave < highWave:
			case wave > lowWave:
				inv[i] = f / sc.Factor
			default:
				s := (old/wave - sc.LowFreqFactor) / (sc.HighFreqFactor - sc.LowFreqFactor)
				inv[i] = (1-s)*f/sc.Factor + s*f
			}
		}
	}
	return inv
}

// tables returns cos and sin for positions [0, n), each [n][headDim/2].
func (r *ropeTable) tables(n int) (cos, sin []float32) {
	r.mu.Lock()
	defer r.mu.Unlock()
	dynamic := r.c.RopeScaling != nil && r.c.RopeScaling.Type == "dynamic"
	if n <= r.n && !(dynamic && n > r.c.MaxPositionEmbeddings) {
		return r.cos, r.sin
	}
	inv := r.invFreq(n)
	half := len(inv)
	size := max(n, 2*r.n)
	if dynamic && n > r.c.MaxPositionEmbeddings {
		size = n // the angles depend on the length itself
	}
	r.cos, r.sin = make([]float32, size*half), make([]float32, size*half)
	for p := 0; p < size; p++ {
		for i, f := range inv {
			a := float64(p) * f
			r.cos[p*half+i] = float32(math.Cos(a))
			r.sin[p*half+i] = float32(math.Sin(a))
		}
	}
	r.n = size
	return r.cos, r.sin
}

// applyRope rotates one head vector in place, in Hugging Face's
// rotate_half convention: pairs (i, i + headDim/2).
func applyRope(v, cos, sin []float32) {
	half := len(v) / 2
	for i := 0; i < half; i++ {
		a, b := v[i], v[i+half]
		v[i] = a*cos[i] - b*sin[i]
		v[i+half] = b*cos[i] + a*sin[i]
	}
}
