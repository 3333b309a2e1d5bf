package gpu

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/twell"
)

// checkChooseHot checks chooseHot's promises on counts: whole blocks of the
// most frequent units, at least one block left sparse, each chosen block
// worth its dense cost and the next one not, and the gain their sum.
func checkChooseHot(t *testing.T, seed uint64, counts []int64, tokens, d int, gated bool) []int {
	t.Helper()
	hot, gain := chooseHot(counts, tokens, d, gated)
	f := len(counts)
	if len(hot)%hotBlock != 0 || len(hot) > max(0, f-hotBlock) {
		t.Fatalf("seed %d: %d hot units of %d, want a multiple of %d leaving a block", seed, len(hot), f, hotBlock)
	}
	in := make([]bool, f)
	minHot := int64(math.MaxInt64)
	for i, p := range hot {
		if p < 0 || p >= f || in[p] {
			t.Fatalf("seed %d: hot position %d repeated or out of range", seed, p)
		}
		in[p] = true
		minHot = min(minHot, counts[p])
		if i > 0 && counts[p] > counts[hot[i-1]] {
			t.Fatalf("seed %d: hot units not most frequent first: %d after %d", seed, counts[p], counts[hot[i-1]])
		}
	}
	rows, flops := 1.0, 2*float64(d)
	if gated {
		rows, flops = 2, 4*float64(d)
	}
	pair, unit := rows*2*float64(d)/hotPairRate, flops/hotGEMMRate+hotElemBytes/hotElemRate
	blockGain := func(ps []int) float64 {
		var n int64
		for _, p := range ps {
			n += counts[p]
		}
		return float64(n)/float64(tokens)*pair - hotBlock*unit
	}
	var sum float64
	for b := 0; b < len(hot); b += hotBlock {
		g := blockGain(hot[b : b+hotBlock])
		if g <= 0 {
			t.Errorf("seed %d: hot block %d gains %g <= 0", seed, b/hotBlock, g)
		}
		sum += g
	}
	if math.Abs(sum-gain) > 1e-9*math.Abs(sum)+1e-18 {
		t.Errorf("seed %d: gain %g, want the blocks' sum %g", seed, gain, sum)
	}
	var rest []int
	for p := range counts {
		if !in[p] {
			rest = append(rest, p)
			if len(hot) > 0 && counts[p] > minHot {
				t.Fatalf("seed %d: unit at %d fires %d times, more than a hot unit's %d", seed, p, counts[p], minHot)
			}
		}
	}
	if len(hot)+hotBlock <= f-hotBlock {
		slices.SortStableFunc(rest, func(a, b int) int { return int(counts[b] - counts[a]) })
		if g := blockGain(rest[:hotBlock]); g > 0 {
			t.Errorf("seed %d: the next block would gain %g > 0 but was left sparse", seed, g)
		}
	}
	return hot
}

// TestChooseHot checks the choice on random counts, on uniform rates (none
// worth it) and on the skewed synthetic rates of the SparseLM shape (the
// first 256 units hold about half of the pairs: one block, or two where
// the draw puts the second block's rate over the break-even).
func TestChooseHot(t *testing.T) {
	r, seed := testutil.Rand(t)
	for i := 0; i < 200; i++ {
		f := hotBlock * (1 + r.IntN(24))
		tokens := 1 + r.IntN(20000)
		counts := make([]int64, f)
		scale := r.Float64()
		for j := range counts {
			if r.IntN(3) > 0 {
				counts[j] = int64(float64(tokens) * scale * math.Exp(2*r.NormFloat64()) / 20)
			}
			counts[j] = min(counts[j], int64(tokens))
		}
		checkChooseHot(t, seed, counts, tokens, 64*(1+r.IntN(64)), r.IntN(2) == 0)
	}
	const d, f, tokens = 2048, 5632, 16384
	for _, c := range []struct {
		dist     synth.Dist
		min, max int
	}{{synth.Uniform, 0, 0}, {synth.Skewed, 256, 512}} {
		rates, err := synth.UnitRates(r, f, 0.005, c.dist)
		if err != nil {
			t.Fatal(err)
		}
		counts := make([]int64, f)
		for j, p := range rates {
			counts[j] = int64(math.Round(p * tokens))
		}
		if hot := checkChooseHot(t, seed, counts, tokens, d, true); len(hot) < c.min || len(hot) > c.max {
			t.Errorf("seed %d: %s rates at 0.5%%: %d hot units, want %d to %d", seed, c.dist, len(hot), c.min, c.max)
		}
	}
	if hot, gain := chooseHot(make([]int64, 1024), 0, 2048, true); hot != nil || gain != 0 {
		t.Errorf("no tokens: hot %v gain %g, want none", hot, gain)
	}
}

// FuzzChooseHot feeds chooseHot arbitrary counts.
func FuzzChooseHot(f *testing.F) {
	f.Add([]byte{1, 2, 3}, uint16(100), uint8(3), true)
	f.Fuzz(func(t *testing.T, b []byte, tokens uint16, dk uint8, gated bool) {
		n := hotBlock * (1 + len(b)%8)
		counts := make([]int64, n)
		for i := range counts {
			if len(b) > 0 {
				counts[i] = int64(b[i%len(b)]) * int64(i%7)
			}
		}
		if len(b) >= 8 {
			counts[0] = int64(binary.LittleEndian.Uint64(b) >> 2)
		}
		checkChooseHot(t, 0, counts, int(tokens)+1, 64*(1+int(dk%64)), gated)
	})
}

// TestHotOrder: the order is a permutation with the hot positions last, in
// their order, the others ascending.
func TestHotOrder(t *testing.T) {
	r, seed := testutil.Rand(t)
	for i := 0; i < 100; i++ {
		f := 1 + r.IntN(3000)
		hot := r.Perm(f)[:r.IntN(f+1)]
		perm := hotOrder(f, hot)
		if !slices.Equal(perm[f-len(hot):], hot) {
			t.Fatalf("seed %d: hot positions not last in their order", seed)
		}
		rest := perm[:f-len(hot)]
		if !slices.IsSorted(rest) {
			t.Fatalf("seed %d: the other positions are not ascending", seed)
		}
		seen := slices.Clone(perm)
		slices.Sort(seen)
		for j, p := range seen {
			if p != j {
				t.Fatalf("seed %d: not a permutation of %d positions", seed, f)
			}
		}
	}
}

// hotPaths runs the sparse path with hot units on a GPU against float64:
// the sparse tails, the dense path (all units, in the new order) and the
// automatic path.
func hotPaths(t *testing.T, seed uint64, l *MLP, sl *synth.Layer, x []float32, rows []int, m int) {
	t.Helper()
	want := refRowsBF16(sl, x, sl.D, rows)
	for _, path := range []string{"sparse-warp", "sparse-sorted", "dense", "auto"} {
		y := runPath(t, l.dev, l, path, x, m)
		if e := synth.RelErr(y, sl.D, rows, want); !(e <= 1e-2) {
			t.Errorf("seed %d: %s (%d hot units): rel err %.3g vs float64, want <= 1e-2", seed, path, l.hotK, e)
		}
	}
}

// TestCalibrateMatchesFloat64 calibrates the SparseLM shape with skewed
// rates: it must choose hot units, keep the MLP's output (float64
// reference, every tail, the dense and the automatic path), permute the
// gate so that D2T's packed units map back through UnitOrder to the
// uncalibrated ones, and report counts that name the most frequent units. A second calibration restores the first order
// before it counts.
func TestCalibrateMatchesFloat64(t *testing.T) {
	dev, blas := setup(t)
	r, seed := testutil.Rand(t)
	const d, f = 2048, 5632
	sl := newLayer(t, r, d, f, 0.005, synth.Skewed, true)
	l := newMLP(t, dev, blas, sl, twell.DefaultLayout, seed)
	m := 2500 + r.IntN(600)
	x := synth.Tokens(r, m, d)
	xb := upload(t, dev, x)
	before, err := l.D2T(nil, xb, m)
	if err != nil {
		t.Fatal(err)
	}
	for round := 0; round < 2; round++ {
		cm := CalibrationTokens + r.IntN(300)
		cal := upload(t, dev, synth.Tokens(r, cm, d))
		c, err := l.Calibrate(nil, cal, cm)
		if err != nil {
			t.Fatalf("seed %d: Calibrate: %v", seed, err)
		}
		if len(c.Hot) == 0 || l.HotUnits() != len(c.Hot) || l.hotK == 0 {
			t.Fatalf("seed %d: %d hot units (HotUnits %d, for %d tokens %d), want some", seed, len(c.Hot), l.HotUnits(), m, l.hotK)
		}
		if c.Tokens < cm-cm/100 || c.Covered < 0.3 || c.Covered > 0.8 {
			t.Errorf("seed %d: %d of %d tokens counted, hot units hold %.2f of the pairs; want about half", seed, c.Tokens, cm, c.Covered)
		}
		order := l.UnitOrder()
		if !slices.Equal(order[f-len(c.Hot):], c.Hot) {
			t.Fatalf("seed %d: UnitOrder does not end with the hot units", seed)
		}
		for _, u := range c.Hot {
			for v, n := range c.Counts {
				if n > c.Counts[u] && !slices.Contains(c.Hot, v) {
					t.Fatalf("seed %d: unit %d fires %d times, more than hot unit %d's %d", seed, v, n, u, c.Counts[u])
				}
			}
		}
		after, err := l.D2T(nil, xb, m)
		if err != nil {
			t.Fatal(err)
		}
		checkPermutedPacking(t, seed, before, after, order)
		hotPaths(t, seed, l, sl, x, synth.SampleRows(r, m, 48), m)
	}
}

// checkPermutedPacking checks that the packed gate after calibration holds,
// row by row, the same (unit, value) pairs as before it, its columns
// mapped back to units through order. Rows flagged in either are skipped.
func checkPermutedPacking(t *testing.T, seed uint64, before, after *Packed, order []int) {
	t.Helper()
	s, rw := before.Layout.S(), before.Cols/before.Layout.C
	entries := func(p *Packed, r int, unit func(int) int) []uint64 {
		var out []uint64
		for tile := 0; tile < p.Cols/p.Layout.Tile; tile++ {
			w := p.Words[r*rw+tile*s:]
			for i := 1; i <= int(w[0]); i++ {
				out = append(out, uint64(unit(int(w[i]&0xffff)))<<16|uint64(w[i]>>16))
			}
		}
		slices.Sort(out)
		return out
	}
	for r := 0; r < before.Rows; r++ {
		if _, ok := slices.BinarySearch(before.Overflow, r); ok {
			continue
		}
		if _, ok := slices.BinarySearch(after.Overflow, r); ok {
			continue
		}
		a := entries(before, r, func(j int) int { return j })
		b := entries(after, r, func(j int) int { return order[j] })
		if !slices.Equal(a, b) {
			t.Fatalf("seed %d: row %d: packed units after calibration differ from before (%d against %d entries)", seed, r, len(b), len(a))
		}
	}
}

// TestHotUnitsForced runs the hot-unit path on small shapes where the cost
// model would choose none, with hot blocks set by hand (a random order, 256
// or more units dense): every D2T kernel, C = 8 and 2, gated and not, and
// the stress rows of TestOverflowStress (every unit active, NaN, Inf),
// which the flagged-row paths must recompute over every unit.
func TestHotUnitsForced(t *testing.T) {
	dev, blas := setup(t)
	for _, kern := range kernelsToTest(dev) {
		for _, c := range []struct {
			d, f  int
			p     float64
			C     int
			gated bool
		}{{256, 768, 0.02, 8, true}, {320, 1024, 0.05, 2, true}, {256, 512, 0.03, 8, false}} {
			t.Run(fmt.Sprintf("%v/d%d_f%d_C%d_gated%v", kern, c.d, c.f, c.C, c.gated), func(t *testing.T) {
				r, seed := testutil.Rand(t)
				sl := newLayer(t, r, c.d, c.f, c.p, synth.Skewed, c.gated)
				l := newMLP(t, dev, blas, sl, twell.Layout{Tile: 256, C: c.C}, seed)
				l.Kernel = kern
				forceHot(t, seed, l, r, hotBlock*(1+r.IntN(c.f/hotBlock-1)))
				m := 300 + r.IntN(300)
				x := synth.Tokens(r, m, c.d)
				hotPaths(t, seed, l, sl, x, synth.SampleRows(r, m, 48), m)
				allOn, nanRow, infRow := 3, 5, m-1
				x[allOn*c.d] = -1000
				x[nanRow*c.d+7] = float32(math.NaN())
				x[infRow*c.d+9] = float32(math.Inf(1))
				rows := make([]int, m)
				for i := range rows {
					rows[i] = i
				}
				want := refRows(sl, x, c.d, rows)
				for _, path := range []string{"sparse-warp", "sparse-sorted"} {
					checkStress(t, seed, path+" (hot units)", runPath(t, dev, l, path, x, m), want, rows, c.d, m)
				}
			})
		}
	}
}

// forceHot reorders l's units by a random permutation and makes the last k
// of them hot for calls of any size.
func forceHot(t *testing.T, seed uint64, l *MLP, r *rand.Rand, k int) {
	t.Helper()
	hk, err := l.k.hot()
	if err != nil {
		t.Fatal(err)
	}
	if err := l.reorder(nil, hk, r.Perm(l.F)); err != nil {
		t.Fatalf("seed %d: reorder: %v", seed, err)
	}
	l.hotK, l.calibrated = k, true
}

// TestHotUnitsKeepTilesSparse: at 2% skewed density the hot units fill
// several tiles; after calibration, calls of every size (decode-sized ones
// that D2T takes too) must leave them out of D2T, or their tiles overflow
// and flag most rows. The calibrated MLP's flagged rows stay within a few
// of the uncalibrated one's on the same batch, its output matches float64,
// and a second calibration (which counts in the first order again) chooses
// as many hot units.
func TestHotUnitsKeepTilesSparse(t *testing.T) {
	dev, blas := setup(t)
	r, seed := testutil.Rand(t)
	const d, f = 512, 2048
	sl := newLayer(t, r, d, f, 0.02, synth.Skewed, true)
	plain := newMLP(t, dev, blas, sl, twell.DefaultLayout, seed)
	l := newMLP(t, dev, blas, sl, twell.DefaultLayout, seed)
	var hot int
	for round := 0; round < 2; round++ {
		cm := CalibrationTokens
		c, err := l.Calibrate(nil, upload(t, dev, synth.Tokens(r, cm, d)), cm)
		if err != nil {
			t.Fatalf("seed %d: Calibrate: %v", seed, err)
		}
		if len(c.Hot) == 0 || (round == 1 && len(c.Hot) < hot-hotBlock) {
			t.Fatalf("seed %d: round %d: %d hot units (first round %d)", seed, round, len(c.Hot), hot)
		}
		hot = len(c.Hot)
		for _, m := range []int{9, 40 + r.IntN(100), 700 + r.IntN(300)} {
			x := synth.Tokens(r, m, d)
			xb := upload(t, dev, x)
			flagged := func(l *MLP) int {
				if err := l.Sparse(nil, cudatest.Alloc(t, dev, 2*m*d), xb, m); err != nil {
					t.Fatalf("seed %d: %v", seed, err)
				}
				if err := dev.Synchronize(); err != nil {
					t.Fatal(err)
				}
				var n [1]int32
				if err := dev.CopyDtoH(cuda.Bytes(n[:]), l.ws.sp.ovf); err != nil {
					t.Fatal(err)
				}
				return int(n[0])
			}
			if got, base := flagged(l), flagged(plain); got > base+2 {
				t.Errorf("seed %d: round %d, m %d: %d rows flagged with %d hot units against %d without", seed, round, m, got, hot, base)
			}
			hotPaths(t, seed, l, sl, x, synth.SampleRows(r, m, 24), m)
		}
	}
}

// TestHotTilesMatchFloat64: on Hopper the wgmma D2T computes the hot units'
// gate and up products as extra tiles and stores h = relu(gate) up
// (non-gated relu(up)) densely, as bf16. Each stored value must be h from
// the float64 products of the bf16 operands (within the three bf16
// roundings of gate, up and h, and fp32 accumulation), in the hot unit's
// column of the row's token, for 1 and 2 hot tiles, gated and not, a token
// count that is not a multiple of the tiles' 256 rows, after a random unit
// order; rows past the call's tokens are not written, and the kernel
// counts the hot units that fired.
func TestHotTilesMatchFloat64(t *testing.T) {
	dev, blas := setup(t)
	if dev.Properties().Arch != "sm_90a" {
		t.Skip("the hot tiles run in the wgmma D2T (sm_90a)")
	}
	for _, c := range []struct {
		d, f, hot int
		gated     bool
	}{{256, 1024, 512, true}, {320, 768, 256, true}, {256, 768, 256, false}} {
		t.Run(fmt.Sprintf("d%d_f%d_hot%d_gated%v", c.d, c.f, c.hot, c.gated), func(t *testing.T) {
			r, seed := testutil.Rand(t)
			sl := newLayer(t, r, c.d, c.f, 0.02, synth.Skewed, c.gated)
			l := newMLP(t, dev, blas, sl, twell.DefaultLayout, seed)
			forceHot(t, seed, l, r, c.hot)
			m := 300 + r.IntN(400)
			x := synth.Tokens(r, m, c.d)
			xb := upload(t, dev, x)
			// Fill the workspace with a marker first: a bigger call sizes it,
			// so rows m.. exist and must keep the marker.
			const marker = 0x7fc1
			big := m + 200
			dn, err := l.hotSlice(l.F - c.hot)
			if err != nil {
				t.Fatal(err)
			}
			hws, err := dn.workspace(big, &l.ws.hot, l.realloc)
			if err != nil {
				t.Fatal(err)
			}
			if err := dev.Memset32(hws.g, marker<<16|marker, nil); err != nil {
				t.Fatal(err)
			}
			if err := l.QueueD2T(nil, xb, m); err != nil {
				t.Fatalf("seed %d: %v", seed, err)
			}
			if err := dev.Synchronize(); err != nil {
				t.Fatal(err)
			}
			got := make([]uint16, big*c.hot)
			if err := dev.CopyDtoH(cuda.Bytes(got), hws.g); err != nil {
				t.Fatal(err)
			}
			order := l.UnitOrder()
			xr := roundBF16(x)
			first := sl.Up
			if c.gated {
				first = sl.Gate
			}
			wg, wu := roundBF16(first), roundBF16(sl.Up)
			// dot returns row's product with unit u's weights w, and the
			// sum of the products' magnitudes.
			dot := func(row, u int, w []float32) (sum, mag float64) {
				for k := 0; k < c.d; k++ {
					p := float64(xr[row*c.d+k]) * float64(w[u*c.d+k])
					sum += p
					mag += math.Abs(p)
				}
				return sum, mag
			}
			const step = 1.0 / 128 // a bf16 rounding's relative error is at most half of this
			bad, fired := 0, 0
			for row := 0; row < big; row++ {
				for i := 0; i < c.hot; i++ {
					h := got[row*c.hot+i]
					if row >= m {
						if h != marker && bad < 5 {
							bad++
							t.Errorf("seed %d: row %d (of %d) unit %d written: %#x", seed, row, m, i, h)
						}
						continue
					}
					u := order[l.F-c.hot+i]
					g, gmag := dot(row, u, wg)
					want, tol := max(g, 0), 1.5*step*max(g, 0)+1e-5*gmag
					if g > 0 {
						fired++
					}
					if c.gated {
						up, umag := dot(row, u, wu)
						want, tol = want*up, 1.5*step*math.Abs(max(g, 0)*up)+1e-5*(gmag*math.Abs(up)+umag*max(g, 0))
					}
					if d := math.Abs(float64(bf16.ToFloat32(h)) - want); d > tol && bad < 5 {
						bad++
						t.Errorf("seed %d: row %d hot unit %d: h %g, want %g (tolerance %g)", seed, row, i, bf16.ToFloat32(h), want, tol)
					}
				}
			}
			// The counter holds every unit that fired in the call's rows:
			// the packed ones counted by the packers, the hot ones by the
			// consumers that store h. Allow for the few gates that round
			// differently near zero.
			want := 0
			for row := 0; row < m; row++ {
				for u := 0; u < l.F; u++ {
					if g, _ := dot(row, u, wg); g > 0 {
						want++
					}
				}
			}
			var nnz [1]uint64
			if err := dev.CopyDtoH(cuda.Bytes(nnz[:]), l.nnz); err != nil {
				t.Fatal(err)
			}
			if d := int(nnz[0]) - want; d < -2-want/1000 || d > 2+want/1000 {
				t.Errorf("seed %d: counted %d active units, want %d (%d of them hot)", seed, nnz[0], want, fired)
			}
		})
	}
}
