package model

import (
	"math/rand/v2"
	"testing"
)

// TestRoPEAnglesRoundToTables checks that the float64 angles and the float32
// tables share one definition: a fresh table of n positions is float32 of
// RoPEAngles, for plain RoPE and every scaling variant.
func TestRoPEAnglesRoundToTables(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 1))
	for _, sc := range []*RopeScaling{
		nil,
		{Type: "linear", Factor: 2},
		{Type: "dynamic", Factor: 2},
		{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositionEmbeddings: 64},
	} {
		c := Config{HeadDim: 2 * (1 + r.IntN(32)), RopeTheta: 1000 + r.Float64()*1e5, MaxPositionEmbeddings: 64, RopeScaling: sc}
		n := 1 + r.IntN(128)
		cos, sin := RoPEAngles(c, n)
		tc, ts := NewRoPETables(c).Tables(n)
		half := c.HeadDim / 2
		if len(cos) != n*half || len(sin) != n*half || len(tc) < n*half {
			t.Fatalf("seed %d: scaling %+v: %d angles, %d table entries, want %d", seed, sc, len(cos), len(tc), n*half)
		}
		for i := range cos {
			if float32(cos[i]) != tc[i] || float32(sin[i]) != ts[i] {
				t.Fatalf("seed %d: scaling %+v, head_dim %d, n %d: entry %d: float32(%v, %v) != table (%v, %v)",
					seed, sc, c.HeadDim, n, i, cos[i], sin[i], tc[i], ts[i])
			}
		}
	}
}
