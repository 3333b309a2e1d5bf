package trainer

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/cuda/nccl"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/train"
)

// TestShardsCoverTheModel: for any world size the ranks' shards tile the
// padded flat buffers, equal and aligned, the parts of each tensor whose
// moments the ranks hold tile that tensor, and Update's AdamW launches
// (adamRuns) tile each rank's shard of the model.
func TestShardsCoverTheModel(t *testing.T) {
	seed := rand.Uint64()
	r := rand.New(rand.NewPCG(seed, 1))
	for range 50 {
		c := testModel(r.IntN(2) == 0, r.IntN(2) == 0)
		c.HiddenSize = 8 * (1 + r.IntN(12))
		c.IntermediateSize = 8 * (1 + r.IntN(40))
		c.VocabSize = 1 + r.IntN(3000)
		base := &Backend{c: c, specs: train.Tensors(c)}
		for _, s := range base.specs {
			base.off = append(base.off, base.n)
			base.n += s.Size()
		}
		world := 1 + r.IntN(8)
		held := make([]int, base.n) // how many ranks hold each value's moments
		for rank := range world {
			b := *base
			b.shard(rank, world)
			per := b.nPad / world
			if b.nPad < b.n || b.nPad%(world*shardAlign) != 0 || b.lo != rank*per || b.hi-b.lo != per {
				t.Fatalf("seed %d: %d values, rank %d of %d: padded %d, shard [%d, %d)", seed, b.n, rank, world, b.nPad, b.lo, b.hi)
			}
			for i := range b.specs {
				a, e := b.owned(i)
				for x := a; x < e; x++ {
					held[x]++
				}
			}
			// Update's launches tile the shard, in order, each within
			// tensors of one kind, starting at a multiple of 4 values.
			next := min(b.lo, b.n)
			for _, run := range b.adamRuns() {
				if run.a != next || run.e <= run.a || run.a%4 != 0 || run.a < b.off[run.first] || run.e > b.off[run.last]+b.specs[run.last].Size() {
					t.Fatalf("seed %d: %d values, rank %d of %d: AdamW run %+v after value %d", seed, b.n, rank, world, run, next)
				}
				for i := run.first; i <= run.last; i++ {
					if (len(b.specs[i].Shape) > 1) != run.decays {
						t.Fatalf("seed %d: AdamW run %+v holds %s", seed, run, b.specs[i].Name)
					}
				}
				next = run.e
			}
			if next != min(b.hi, b.n) {
				t.Fatalf("seed %d: %d values, rank %d of %d: AdamW runs end at %d", seed, b.n, rank, world, next)
			}
		}
		for x, h := range held {
			if h != 1 {
				t.Fatalf("seed %d: %d values, %d ranks: value %d held by %d ranks", seed, base.n, world, x, h)
			}
		}
	}
}

// oneRank returns a communicator of one rank on dev.
func oneRank(t *testing.T) *nccl.Comm {
	dev := cudatest.Device(t)
	id, err := nccl.NewUniqueID()
	if errors.Is(err, nccl.ErrNoNCCL) && os.Getenv("TWELL_REQUIRE_GPU") == "" {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	c, err := nccl.NewComm(dev, id, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestOneRankMatchesSingleGPU: a data-parallel run of one rank (NCCL, the
// sharded optimizer, every collective) gives the metrics, weights and
// optimizer state of the plain single-GPU trainer bit for bit, also across
// an interruption and resume and with dead units re-initialised.
func TestOneRankMatchesSingleGPU(t *testing.T) {
	dev := cudatest.Device(t)
	comm := oneRank(t)
	for _, path := range []mlp.Path{mlp.Auto, mlp.Dense} {
		t.Run(path.String(), func(t *testing.T) {
			seed := rand.Uint64()
			r := rand.New(rand.NewPCG(seed, 8))
			c := testModel(true, true)
			mj, _ := c.MarshalJSON()
			cfg, err := train.ParseConfig([]byte(fmt.Sprintf(`{"model": %s, "steps": 16, "batch": 4, "seq": 32, "accum": 2, "lr": 3e-3,
				"min_lr": 3e-4, "warmup": 4, "l1": 3e-2, "eval_every": 8, "eval_batches": 2, "checkpoint_every": 8, "seed": 3,
				"reinit_dead": true, "dead_window": 1024}`, mj)))
			if err != nil {
				t.Fatal(err)
			}
			toks := randomTokens(r, 20000, c.VocabSize)
			w := model.RandomWeights(c, r)
			newRun := func(out string, cm *nccl.Comm) *train.Run {
				b, err := New(dev, c, cloneWeights(w), Options{MLP: path, Comm: cm})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { b.Close() })
				return train.NewRun(cfg, out, b, train.NewStreamSource(toks[:18000], 3), train.Windows(toks[18000:], 32, 20))
			}
			plain, ranked := t.TempDir(), t.TempDir()
			if err := newRun(plain, nil).Loop(context.Background()); err != nil {
				t.Fatal(err)
			}
			r1 := newRun(ranked, comm)
			r1.StopAt = 11
			if err := r1.Loop(context.Background()); err != nil {
				t.Fatal(err)
			}
			r2 := newRun(ranked, comm)
			if err := r2.Resume(); err != nil {
				t.Fatal(err)
			}
			if err := r2.Loop(context.Background()); err != nil {
				t.Fatal(err)
			}
			sameRuns(t, seed, plain, ranked, "single GPU", "one rank", true)
		})
	}
}
