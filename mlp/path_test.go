package mlp

import (
	"math"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

func TestParsePathRoundTrip(t *testing.T) {
	for _, p := range []Path{Auto, Sparse, Dense} {
		q, err := ParsePath(p.String())
		if err != nil || q != p {
			t.Errorf("ParsePath(%q) = %v, %v; want %v", p.String(), q, err, p)
		}
	}
	for _, bad := range []string{"fast", "sparse2", "0"} {
		if _, err := ParsePath(bad); err == nil {
			t.Errorf("ParsePath(%q) accepted", bad)
		}
	}
}

func TestChoose(t *testing.T) {
	r, seed := testutil.Rand(t)
	for range 1000 {
		d, th := r.Float64(), r.Float64()
		if got := Choose(Sparse, d, th); got != Sparse {
			t.Fatalf("seed %d: Choose(Sparse, %g, %g) = %v", seed, d, th, got)
		}
		if got := Choose(Dense, d, th); got != Dense {
			t.Fatalf("seed %d: Choose(Dense, %g, %g) = %v", seed, d, th, got)
		}
		want := Sparse
		if d > th {
			want = Dense
		}
		if got := Choose(Auto, d, th); got != want {
			t.Fatalf("seed %d: Choose(Auto, %g, %g) = %v, want %v", seed, d, th, got, want)
		}
	}
	if got := Choose(Auto, math.NaN(), 0.5); got != Dense {
		t.Errorf("Choose(Auto, NaN) = %v, want dense", got)
	}
}
