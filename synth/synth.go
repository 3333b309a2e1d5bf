// Package synth builds synthetic MLP layers and inputs whose gate activation
// relu(x Wg^T) has a chosen density and a chosen spread of per-unit firing
// rates, so that sparse kernels can be tested and timed without a trained
// checkpoint. It also computes float64 reference outputs.
//
// The construction: feature 0 of every token is the constant 1, the other
// features are standard normal, and each gate row has unit norm over the
// random features plus a bias b_j in feature 0. The gate pre-activation of
// unit j is then b_j + N(0, 1), which fires with probability Phi(b_j): b_j is
// set from the unit's target rate.
package synth

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
)

// Dist is how firing rates spread over the MLP units.
type Dist string

// The supported distributions.
const (
	// Uniform gives every unit the same firing rate.
	Uniform Dist = "uniform"
	// Skewed gives heavy-tailed (log-normal) rates with about 30% of the
	// units never firing, as in trained sparse models.
	Skewed Dist = "skewed"
)

// ParseDist returns the Dist named s.
func ParseDist(s string) (Dist, error) {
	switch Dist(s) {
	case Uniform, Skewed:
		return Dist(s), nil
	}
	return "", fmt.Errorf("unknown distribution %q (want uniform or skewed)", s)
}

// Layer is a synthetic MLP layer in nn.Linear layout: Gate and Up are F x D,
// Down is D x F. Gate is nil for a non-gated layer, whose sparse activation
// comes from Up.
type Layer struct {
	D, F           int
	Gate, Up, Down []float32
	Rates          []float64 // target firing rate of each unit
}

// NewLayer builds a layer whose units fire with mean rate density under dist.
func NewLayer(r *rand.Rand, d, f int, density float64, dist Dist, gated bool) (*Layer, error) {
	if d < 2 || f < 1 {
		return nil, fmt.Errorf("synth: d=%d f=%d: need d >= 2 and f >= 1", d, f)
	}
	if !(density > 0 && density < 1) {
		return nil, fmt.Errorf("synth: density %g outside (0, 1)", density)
	}
	rates, err := UnitRates(r, f, density, dist)
	if err != nil {
		return nil, err
	}
	l := &Layer{D: d, F: f, Rates: rates}
	sparse := normalRows(r, f, d, 1)
	for j, p := range rates {
		row := sparse[j*d : (j+1)*d]
		norm := 0.0
		for _, v := range row[1:] {
			norm += float64(v) * float64(v)
		}
		s := 1 / math.Sqrt(norm)
		for k := range row[1:] {
			row[1+k] = float32(float64(row[1+k]) * s)
		}
		row[0] = float32(bias(p))
	}
	scale := 1 / math.Sqrt(float64(d))
	if gated {
		l.Gate = sparse
		l.Up = normalRows(r, f, d, scale)
	} else {
		l.Up = sparse
	}
	l.Down = normalRows(r, d, f, 1/math.Sqrt(density*float64(f)))
	return l, nil
}

// bias returns b with Phi(b) = p; rate 0 gives a unit that never fires.
func bias(p float64) float64 {
	if p <= 0 {
		return -40
	}
	if p >= 1 {
		return 40
	}
	return math.Sqrt2 * math.Erfinv(2*p-1)
}

func normalRows(r *rand.Rand, rows, cols int, scale float64) []float32 {
	a := make([]float32, rows*cols)
	for i := range a {
		a[i] = float32(r.NormFloat64() * scale)
	}
	return a
}

// UnitRates returns f per-unit firing rates with mean density under dist.
func UnitRates(r *rand.Rand, f int, density float64, dist Dist) ([]float64, error) {
	rates := make([]float64, f)
	switch dist {
	case Uniform:
		for j := range rates {
			rates[j] = density
		}
		return rates, nil
	case Skewed:
	default:
		return nil, fmt.Errorf("synth: unknown distribution %q", dist)
	}
	// 30% dead units; the rest log-normal (sigma 1.5), scaled so that the
	// mean rate (capped at 1) over all units equals density.
	raw := make([]float64, f)
	for j := range raw {
		if r.Float64() >= 0.3 {
			raw[j] = math.Exp(1.5 * r.NormFloat64())
		}
	}
	mean := func(s float64) float64 {
		t := 0.0
		for _, v := range raw {
			t += min(1, s*v)
		}
		return t / float64(f)
	}
	lo, hi := 0.0, 1.0
	for mean(hi) < density {
		hi *= 2
		if hi > 1e12 {
			return nil, fmt.Errorf("synth: density %g unreachable with skewed rates", density)
		}
	}
	for i := 0; i < 100; i++ {
		mid := (lo + hi) / 2
		if mean(mid) < density {
			lo = mid
		} else {
			hi = mid
		}
	}
	for j, v := range raw {
		rates[j] = min(1, hi*v)
	}
	return rates, nil
}

// Tokens returns m synthetic input rows of width d: feature 0 is 1, the
// rest standard normal.
func Tokens(r *rand.Rand, m, d int) []float32 {
	x := make([]float32, m*d)
	for i := 0; i < m; i++ {
		x[i*d] = 1
		for k := 1; k < d; k++ {
			x[i*d+k] = float32(r.NormFloat64())
		}
	}
	return x
}

// Reference computes the layer's output for token row x (len D) in float64:
// y = (relu(x Wg^T) * (x Wu^T)) Wd^T, or relu(x Wu^T) Wd^T without a gate.
// It also returns the number of active units.
func (l *Layer) Reference(x []float32) (y []float64, active int) {
	d, f := l.D, l.F
	sparse := l.Gate
	if sparse == nil {
		sparse = l.Up
	}
	y = make([]float64, d)
	for j := 0; j < f; j++ {
		g := dot64(x, sparse[j*d:(j+1)*d])
		if !(g > 0) && !math.IsNaN(g) {
			continue
		}
		active++
		h := g
		if l.Gate != nil {
			h = g * dot64(x, l.Up[j*d:(j+1)*d])
		}
		for k := 0; k < d; k++ {
			y[k] += h * float64(l.Down[k*f+j])
		}
	}
	return y, active
}

func dot64(a, b []float32) float64 {
	s := 0.0
	for i, v := range a {
		s += float64(v) * float64(b[i])
	}
	return s
}

// RelErr returns the relative error ||got - want|| / ||want|| over the rows
// listed (token indices into got, which has d values per row) against the
// float64 reference rows want.
func RelErr(got []float32, d int, rows []int, want [][]float64) float64 {
	var num, den float64
	for i, r := range rows {
		for k, w := range want[i] {
			e := float64(got[r*d+k]) - w
			num += e * e
			den += w * w
		}
	}
	if den == 0 {
		return math.Sqrt(num)
	}
	return math.Sqrt(num / den)
}

// SampleRows returns n distinct token indices in [0, m), ascending, always
// including the first and last token.
func SampleRows(r *rand.Rand, m, n int) []int {
	if n >= m {
		rows := make([]int, m)
		for i := range rows {
			rows[i] = i
		}
		return rows
	}
	set := map[int]bool{0: true, m - 1: true}
	for len(set) < n {
		set[r.IntN(m)] = true
	}
	rows := make([]int, 0, n)
	for k := range set {
		rows = append(rows, k)
	}
	slices.Sort(rows)
	return rows
}
