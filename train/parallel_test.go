package train

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sync"
	"testing"
)

// world is the shared state of an in-process fake data-parallel run: the
// micro-batches each rank ran, and rounds in which every rank takes part.
type world struct {
	n    int
	mu   sync.Mutex
	cond *sync.Cond
	// batches[a] is micro-batch a of the current step, as its rank ran it.
	batches map[int][]int
	ran     map[int]int // micro-batch -> the rank that ran it
	// A round: arrived ranks, the OR of their flags, and a generation that
	// ends it.
	arrived, gen int
	flag, result bool
	bad          error
}

func newWorld(n int) *world {
	w := &world{n: n, batches: map[int][]int{}, ran: map[int]int{}}
	w.cond = sync.NewCond(&w.mu)
	return w
}

// round waits for every rank and returns the OR of their flags.
func (w *world) round(v bool) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	g := w.gen
	w.flag = w.flag || v
	w.arrived++
	if w.arrived == w.n {
		w.result, w.flag, w.arrived = w.flag, false, 0
		w.gen++
		w.cond.Broadcast()
		return w.result
	}
	for g == w.gen {
		w.cond.Wait()
	}
	return w.result
}

// rankBackend is one rank of the fake run: it records the micro-batches
// the loop gives it and, at EndStep, feeds every rank's micro-batches in
// order to its own backend, so that each rank computes the whole step as
// a single process would (what the real backends reach by summing over
// the ranks).
type rankBackend struct {
	Backend
	w           *world
	rank        int
	total, mine int
	seq, batch  int
	l1          float64
	cancel      func() // called after step cancelAt on this rank (0: never)
	cancelAt    int
	steps       int
}

func (b *rankBackend) Ranks() (int, int)               { return b.rank, b.w.n }
func (b *rankBackend) AnyStop(stop bool) (bool, error) { return b.w.round(stop), nil }

func (b *rankBackend) BeginStep(n int) error {
	b.total, b.mine = n, 0
	return nil
}

func (b *rankBackend) Accumulate(tokens []int, batch, seq int, l1 float64) error {
	b.w.mu.Lock()
	a := b.rank + b.mine*b.w.n // the micro-batches MicroBatchRank gives this rank, in order
	if _, dup := b.w.batches[a]; dup || MicroBatchRank(a, b.w.n) != b.rank {
		b.w.bad = errors.New("a micro-batch ran twice or on the wrong rank")
	}
	b.w.batches[a], b.w.ran[a] = slices.Clone(tokens), b.rank
	b.w.mu.Unlock()
	b.mine++
	if batch != b.batch || seq != b.seq || l1 != b.l1 {
		return errors.New("a micro-batch of another shape or L1 than the config's")
	}
	return nil
}

func (b *rankBackend) EndStep() (*StepStats, error) {
	b.w.round(false) // every rank has recorded its micro-batches
	b.w.mu.Lock()
	all := make([][]int, b.total)
	for a := range all {
		all[a] = b.w.batches[a]
	}
	bad := b.w.bad
	b.w.mu.Unlock()
	b.w.round(false) // everyone has read them
	if b.rank == 0 {
		b.w.mu.Lock()
		clear(b.w.batches)
		b.w.mu.Unlock()
	}
	b.w.round(false)
	if bad != nil {
		return nil, bad
	}
	if err := b.Backend.BeginStep(b.total); err != nil {
		return nil, err
	}
	for _, toks := range all {
		if toks == nil {
			return nil, errors.New("a micro-batch ran on no rank")
		}
		if err := b.Backend.Accumulate(toks, b.batch, b.seq, b.l1); err != nil {
			return nil, err
		}
	}
	st, err := b.Backend.EndStep()
	b.steps++
	if b.cancel != nil && b.steps == b.cancelAt {
		b.cancel()
	}
	return st, err
}

func (b *rankBackend) OptimizerState() (*OptimizerState, error) {
	b.w.round(false) // the real backends gather here: every rank must come
	return b.Backend.OptimizerState()
}

// runWorld runs a fake data-parallel run of n ranks over c in out (rank
// 0; the other ranks get folders of their own, which must stay empty).
// cancelRank's context is cancelled after its cancelAt-th step (cancelAt
// 0: never). resume continues the run in out.
func runWorld(t *testing.T, c *Config, out string, n, seed int, cancelRank, cancelAt int, resume bool) ([]error, []string) {
	t.Helper()
	w := newWorld(n)
	errs := make([]error, n)
	dirs := make([]string, n)
	var wg sync.WaitGroup
	for rank := range n {
		dirs[rank] = out
		if rank > 0 {
			dirs[rank] = t.TempDir()
		}
		r := newTestRun(t, c, dirs[rank], uint64(seed))
		rb := &rankBackend{Backend: r.Backend, w: w, rank: rank, batch: c.Batch, seq: c.Seq, l1: c.L1}
		r.Backend = rb
		if resume {
			s, err := LoadCheckpoint(out)
			if err != nil {
				t.Fatal(err)
			}
			if err := r.ResumeFrom(s); err != nil {
				t.Fatal(err)
			}
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		if rank == cancelRank && cancelAt > 0 {
			rb.cancel, rb.cancelAt = cancel, cancelAt
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[rank] = r.Loop(ctx)
		}()
	}
	wg.Wait()
	return errs, dirs
}

// sansTime drops the wall time of each metrics line.
func sansTime(ms []Metrics) []Metrics {
	for i := range ms {
		ms[i].MS = 0
	}
	return ms
}

// TestParallelLoopMatchesSingle: a fake data-parallel run of 2 or 3 ranks,
// each running only its micro-batches, writes (rank 0 only) the metrics and
// checkpoint of a single-process run, value for value; an interruption on
// one rank stops every rank at the same step, and resuming finishes the
// run identically.
func TestParallelLoopMatchesSingle(t *testing.T) {
	seed := rand.IntN(1 << 30)
	for _, tc := range []struct{ ranks, accum int }{{2, 4}, {3, 6}, {3, 2}} {
		c := testConfig(t, 9, 1e-3)
		c.Accum, c.Batch, c.CheckpointEvery, c.EvalEvery = tc.accum, 2, 4, 3
		single := t.TempDir()
		if err := newTestRun(t, c, single, uint64(seed)).Loop(context.Background()); err != nil {
			t.Fatal(err)
		}
		want := sansTime(readMetrics(t, single))

		out := t.TempDir()
		errs, dirs := runWorld(t, c, out, tc.ranks, seed, 0, 0, false)
		for rank, err := range errs {
			if err != nil {
				t.Fatalf("seed %d, %d ranks: rank %d: %v", seed, tc.ranks, rank, err)
			}
		}
		if got := sansTime(readMetrics(t, out)); !reflect.DeepEqual(got, want) {
			t.Fatalf("seed %d, %d ranks, accum %d: metrics differ from the single run's:\n%+v\nwant\n%+v", seed, tc.ranks, tc.accum, got[len(got)-1], want[len(want)-1])
		}
		sameFile(t, seed, filepath.Join(single, checkpointDir, "model.safetensors"), filepath.Join(out, checkpointDir, "model.safetensors"))
		for _, d := range dirs[1:] {
			if ents, _ := os.ReadDir(d); len(ents) != 0 {
				t.Fatalf("seed %d: a rank other than 0 wrote %d entries into its folder", seed, len(ents))
			}
		}

		// Rank 1 is interrupted after its 6th step: all stop there.
		out = t.TempDir()
		errs, _ = runWorld(t, c, out, tc.ranks, seed, 1, 6, false)
		for rank, err := range errs {
			var in *Interrupted
			if !errors.As(err, &in) || in.Step != 6 {
				t.Fatalf("seed %d, %d ranks: rank %d ended with %v, want an interruption at step 6", seed, tc.ranks, rank, err)
			}
		}
		errs, _ = runWorld(t, c, out, tc.ranks, seed, 0, 0, true)
		for rank, err := range errs {
			if err != nil {
				t.Fatalf("seed %d: resumed rank %d: %v", seed, rank, err)
			}
		}
		if got := sansTime(readMetrics(t, out)); !reflect.DeepEqual(got, want) {
			t.Fatalf("seed %d, %d ranks: the interrupted and resumed run's metrics differ from the single run's", seed, tc.ranks)
		}
		sameFile(t, seed, filepath.Join(single, checkpointDir, "model.safetensors"), filepath.Join(out, checkpointDir, "model.safetensors"))
	}
}

func sameFile(t *testing.T, seed int, a, b string) {
	t.Helper()
	x, err := os.ReadFile(a)
	if err != nil {
		t.Fatal(err)
	}
	y, err := os.ReadFile(b)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(x, y) {
		t.Fatalf("seed %d: %s and %s differ", seed, a, b)
	}
}
