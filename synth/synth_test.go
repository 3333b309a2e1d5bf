package synth

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

func TestDensityIsReached(t *testing.T) {
	r, seed := testutil.Rand(t)
	d, f, m := 128, 1024, 200
	for _, dist := range []Dist{Uniform, Skewed} {
		for _, density := range []float64{0.005, 0.05, 0.3} {
			l, err := NewLayer(r, d, f, density, dist, true)
			if err != nil {
				t.Fatal(err)
			}
			x := Tokens(r, m, d)
			fired := make([]int, f)
			total := 0
			for i := 0; i < m; i++ {
				for j := 0; j < f; j++ {
					if dot64(x[i*d:(i+1)*d], l.Gate[j*d:(j+1)*d]) > 0 {
						fired[j]++
						total++
					}
				}
			}
			got := float64(total) / float64(m*f)
			if math.Abs(got-density) > 0.25*density+0.002 {
				t.Errorf("seed %d: %s density %g: measured %g", seed, dist, density, got)
			}
			dead := 0
			for _, n := range fired {
				if n == 0 {
					dead++
				}
			}
			// dead units ~ Binomial(f, 0.3): mean 307, sd 14.7 for f = 1024;
			// 0.22 f is 5.6 sd below (live units that never fired only add)
			if dist == Skewed && float64(dead)/float64(f) < 0.22 {
				t.Errorf("seed %d: skewed density %g: only %d of %d units never fired", seed, density, dead, f)
			}
		}
	}
}

func TestBadArguments(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, density := range []float64{0, 1, -0.1, math.NaN()} {
		if _, err := NewLayer(r, 8, 8, density, Uniform, true); err == nil {
			t.Errorf("density %g accepted", density)
		}
	}
	if _, err := ParseDist("zipf"); err == nil {
		t.Error("unknown distribution accepted")
	}
}
