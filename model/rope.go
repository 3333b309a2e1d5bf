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
func (r *ropeTable) invFreq(seqLen int) []float64 { return ropeInvFreq(r.c, seqLen) }

// ropeInvFreq returns the inverse frequencies of the rotary embedding of a
// model with config c, for sequences of seqLen tokens (only "dynamic"
// scaling depends on seqLen).
func ropeInvFreq(c Config, seqLen int) []float64 {
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
			cs, sn := ropeAngle(p, f)
			r.cos[p*half+i], r.sin[p*half+i] = float32(cs), float32(sn)
		}
	}
	r.n = size
	return r.cos, r.sin
}

// ropeAngle returns the cosine and sine of the rotation of position p at
// inverse frequency invFreq: the one definition that the float32 tables and
// RoPEAngles share.
func ropeAngle(p int, invFreq float64) (cos, sin float64) {
	a := float64(p) * invFreq
	return math.Cos(a), math.Sin(a)
}

// RoPEAngles returns the rotary-embedding angles of a model with config c
// for positions [0, n) in float64, as cos and sin, each laid out
// [position][HeadDim/2] (the pairs (i, i + HeadDim/2) of Hugging Face's
// rotate_half). They are the values that the float32 tables of
// Model.Forward and RoPETables round: a fresh RoPETables' Tables(n) holds
// exactly float32 of these. Training uses them in float32 and, for its
// gradient checks, in float64.
func RoPEAngles(c Config, n int) (cos, sin []float64) {
	inv := ropeInvFreq(c, n)
	half := len(inv)
	cos, sin = make([]float64, n*half), make([]float64, n*half)
	for p := 0; p < n; p++ {
		for i, f := range inv {
			cos[p*half+i], sin[p*half+i] = ropeAngle(p, f)
		}
	}
	return cos, sin
}
