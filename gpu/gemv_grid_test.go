package gpu

import (
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// TestBalancedGrid checks balancedGrid's rule on random widths and SM
// counts: a grid covers the f/4 warps' shares exactly, with at most sms
// blocks of 8 to 16 warps, and no fewer warps a block would do; none only
// when no count of 8 to 16 warps does. The SparseLM shape on 132 SMs
// gives 128 blocks of 11 warps.
func TestBalancedGrid(t *testing.T) {
	if g := balancedGrid(5632, 132); g != (mlpGrid{blocks: 128, warps: 11}) {
		t.Fatalf("f 5632 on 132 SMs: %+v, want 128 blocks of 11 warps", g)
	}
	r, seed := testutil.Rand(t)
	for range 2000 {
		f, sms := 32*(1+r.IntN(1024)), 1+r.IntN(200)
		g := balancedGrid(f, sms)
		fits := func(w int) bool { return (f/4)%w == 0 && (f/4)/w <= sms }
		if g.blocks == 0 {
			for w := 8; w <= 16; w++ {
				if fits(w) {
					t.Fatalf("seed %d: f %d on %d SMs: no grid, but %d warps a block fit", seed, f, sms, w)
				}
			}
			continue
		}
		if g.warps < 8 || g.warps > 16 || g.blocks*g.warps*4 != f || g.blocks > sms {
			t.Fatalf("seed %d: f %d on %d SMs: %+v", seed, f, sms, g)
		}
		for w := 8; w < g.warps; w++ {
			if fits(w) {
				t.Fatalf("seed %d: f %d on %d SMs: %d warps a block, but %d fit", seed, f, sms, g.warps, w)
			}
		}
	}
}
