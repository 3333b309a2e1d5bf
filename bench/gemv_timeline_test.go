package bench

import (
	"math"
	"sort"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// TestGEMVTimelineOf checks the timeline summary against a direct
// computation on random stamps: per launch the median and the last block's
// time after the earliest first stamp, then their medians over launches;
// and a launch's blocks (gemvBlocks) against the same offsets.
func TestGEMVTimelineOf(t *testing.T) {
	if GEMVTimelineOf(nil, []string{"a"}) != nil {
		t.Fatal("no launches: want nil")
	}
	r, seed := testutil.Rand(t)
	points := []string{"entry", "mid", "end"}
	for trial := range 50 {
		launches, blocks := 1+r.IntN(5), 1+r.IntN(9)
		steps := make([][][]uint64, launches)
		for i := range steps {
			base := uint64(1e12) + r.Uint64N(1e9)
			steps[i] = make([][]uint64, blocks)
			for b := range steps[i] {
				t := base + r.Uint64N(5000)
				for range points {
					steps[i][b] = append(steps[i][b], t)
					t += r.Uint64N(20000)
				}
			}
		}
		sms := make([]int, blocks)
		for i := range sms {
			sms[i] = r.IntN(132)
		}
		bl := gemvBlocks(steps[0], sms)
		t0 := steps[0][0][0]
		for _, b := range steps[0] {
			t0 = min(t0, b[0])
		}
		for i, b := range bl {
			if b.SM != sms[i] || len(b.US) != len(points) {
				t.Fatalf("seed %d: trial %d: block %d: %+v", seed, trial, i, b)
			}
			for p, us := range b.US {
				if want := float64(steps[0][i][p]-t0) / 1000; math.Abs(us-want) > 1e-9 || us < 0 {
					t.Fatalf("seed %d: trial %d: block %d point %d: %v us, want %v", seed, trial, i, p, us, want)
				}
			}
		}
		got := GEMVTimelineOf(steps, points)
		for p, name := range points {
			var meds, lasts []float64
			for _, bl := range steps {
				t0 := bl[0][0]
				for _, b := range bl {
					t0 = min(t0, b[0])
				}
				var at []float64
				for _, b := range bl {
					at = append(at, float64(b[p]-t0)/1000)
				}
				sort.Float64s(at)
				m := at[len(at)/2]
				if len(at)%2 == 0 {
					m = (at[len(at)/2-1] + at[len(at)/2]) / 2
				}
				meds, lasts = append(meds, m), append(lasts, at[len(at)-1])
			}
			want := GEMVPhase{Point: name, MedianUS: Median(meds), LastUS: Median(lasts)}
			if math.Abs(got[p].MedianUS-want.MedianUS) > 1e-9 || math.Abs(got[p].LastUS-want.LastUS) > 1e-9 || got[p].Point != name {
				t.Fatalf("seed %d: trial %d: point %d: got %+v, want %+v", seed, trial, p, got[p], want)
			}
			if p > 0 && got[p].LastUS < got[p-1].LastUS {
				t.Fatalf("seed %d: trial %d: the last block reaches %q before %q", seed, trial, name, points[p-1])
			}
		}
	}
}
