package trainer

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/synth"
)

// TestMLPBlockSparseMatchesDense runs one MLP block's forward and backward
// on both paths with the same bf16 operands, at a trained-like density and
// at an untrained one (every row far past any fixed width): outputs,
// gradients and statistics agree within bf16 rounding, and the sparse path
// repeats itself bit for bit (the busy units of m 1100 and up sum their
// gradients in parts).
func TestMLPBlockSparseMatchesDense(t *testing.T) {
	dev := cudatest.Device(t)
	for _, tc := range []struct {
		m, h, f int
		density float64
		gated   bool
	}{
		{300, 64, 256, 0.05, true}, {300, 64, 256, 0.5, true}, {130, 136, 512, 0.02, true},
		{300, 64, 256, 0.05, false}, {97, 2048, 64, 0.3, true}, {1100, 64, 128, 0.3, true},
		{3000, 64, 128, 0.5, true},  // units past one staging of sp_cols, in several parts
		{6000, 64, 256, 0.5, true},  // more entries than 4096 slots of 256: longer parts
		{70, 64, 16384, 0.01, true}, // f past 48 KiB of 16-bit column counters
		{40, 2312, 512, 0.5, true},  // rows wider than one pass of the row kernels, past one staging
		{40, 2312, 512, 0.5, false},
	} {
		t.Run(fmt.Sprintf("m%d_h%d_f%d_%g_gated=%v", tc.m, tc.h, tc.f, tc.density, tc.gated), func(t *testing.T) {
			seed := rand.Uint64()
			r := rand.New(rand.NewPCG(seed, 5))
			sl, err := synth.NewLayer(r, tc.h, tc.f, tc.density, synth.Skewed, tc.gated)
			if err != nil {
				t.Fatal(err)
			}
			x := synth.Tokens(r, tc.m, tc.h)
			dy := make([]float32, tc.m*tc.h)
			for i := range dy {
				dy[i] = float32(r.NormFloat64())
			}
			b, err := NewMLPBlock(dev, tc.m, tc.h, tc.f, tc.gated, 0.1)
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			if err := b.Load(sl.Gate, sl.Up, sl.Down, x, dy); err != nil {
				t.Fatal(err)
			}
			var res [3]*MLPBlockResult
			for i, sparse := range []bool{false, true, true} {
				if err := b.Reset(); err != nil {
					t.Fatal(err)
				}
				if err := b.Run(sparse); err != nil {
					t.Fatal(err)
				}
				if res[i], err = b.Result(); err != nil {
					t.Fatal(err)
				}
			}
			d, s := res[0], res[1]
			// A gate value within rounding of 0 may fire on one path only
			// (the GEMMs differ in output type and shape).
			diff, total := 0, 0
			for j := range d.Active {
				diff += int(max(d.Active[j]-s.Active[j], s.Active[j]-d.Active[j]))
				total += int(d.Active[j])
			}
			if total == 0 || diff > 1+total/10000 {
				t.Errorf("seed %d: firing counts differ by %d of %d", seed, diff, total)
			}
			if e := (s.L0 - d.L0) / d.L0; d.L0 <= 0 || e > 1e-3 || e < -1e-3 {
				t.Errorf("seed %d: L0 dense %g, sparse %g", seed, d.L0, s.L0)
			}
			if e := (s.L1 - d.L1) / d.L1; e > 1e-2 || e < -1e-2 {
				t.Errorf("seed %d: L1 dense %g, sparse %g", seed, d.L1, s.L1)
			}
			for _, c := range []struct {
				name      string
				got, want []float32
			}{{"out", s.Out, d.Out}, {"dx", s.DX, d.DX}, {"dgate", s.DGate, d.DGate}, {"dup", s.DUp, d.DUp}, {"ddown", s.DDown, d.DDown}} {
				// bf16 rounding points differ (the dense path keeps fp32
				// pre-activations): a few 1e-3.
				if e := relDiff(c.got, c.want); e > 2e-2 {
					t.Errorf("seed %d: %s: sparse against dense relative error %.3g", seed, c.name, e)
				} else {
					t.Logf("%s: relative error %.2g", c.name, e)
				}
			}
			again := res[2]
			for _, c := range [][2][]float32{{s.Out, again.Out}, {s.DX, again.DX}, {s.DGate, again.DGate}, {s.DUp, again.DUp}, {s.DDown, again.DDown}} {
				if firstDiff(c[0], c[1]) >= 0 {
					t.Errorf("seed %d: the sparse path did not repeat itself bit for bit", seed)
				}
			}
			if firstDiff([]float64{s.L1, s.L0}, []float64{again.L1, again.L0}) >= 0 || !slices.Equal(s.Active, again.Active) {
				t.Errorf("seed %d: the sparse path's statistics did not repeat: L1 %v, %v; L0 %v, %v", seed, s.L1, again.L1, s.L0, again.L0)
			}
		})
	}
}
