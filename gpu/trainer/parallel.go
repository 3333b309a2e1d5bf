package trainer

import (
	"fmt"
	"time"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/nccl"
	"github.com/twell-ai/twell/train"
)

// Data parallelism with a sharded optimizer (ZeRO stage 1), when
// Options.Comm is set. Every rank holds the whole model (fp32 master
// weights and their bf16 copy) and a whole gradient buffer, but only its
// shard of the AdamW moments: values [lo, hi) of the flat parameter order,
// the flat buffers padded to a multiple of shardAlign values per rank so
// that the shards are equal. A step:
//
//   - each rank runs the micro-batches train.MicroBatchRank gives it,
//     scaling their gradients by the step's total micro-batch count;
//   - EndStep sums the statistics over the ranks (all-reduce) and
//     reduce-scatters the gradient, so that each rank holds the summed
//     gradient of its shard;
//   - ClipGradients sums the squares of every shard (all-reduce of one
//     float64);
//   - Update runs AdamW on the rank's shard, then all-gathers the fp32 and
//     bf16 weights.
//
// Each of those waits for its collectives, bounded by Options.CommTimeout:
// past it the communicator is aborted. With one rank the collectives copy
// or do nothing, so the results equal a single GPU's bit for bit.

// shardAlign is the granularity of a shard in values (256 bytes of fp32).
const shardAlign = 64

// DefaultCommTimeout bounds a wait for collectives when
// Options.CommTimeout is 0: long enough for another rank to write a
// checkpoint or evaluate in between.
const DefaultCommTimeout = 30 * time.Minute

// shard sets the padded length and the shard of rank (of world ranks; 0:
// a single GPU) in the flat buffers.
func (b *Backend) shard(rank, world int) {
	if world == 0 {
		b.nPad, b.lo, b.hi = b.n, 0, b.n
		return
	}
	unit := shardAlign * world
	b.nPad = (b.n + unit - 1) / unit * unit
	per := b.nPad / world
	b.lo, b.hi = rank*per, (rank+1)*per
}

// stateBytes is the device memory of the weights, gradients, moments and
// bf16 copy.
func (b *Backend) stateBytes() int64 {
	return int64(10)*int64(b.nPad) + 8*int64(b.hi-b.lo)
}

// owned returns the part [a, e) of tensor i's values whose moments this
// rank holds (a >= e: none).
func (b *Backend) owned(i int) (a, e int) {
	return max(b.off[i], b.lo), min(b.off[i]+b.specs[i].Size(), b.hi)
}

// momentView returns values [a, e) of the flat order in the moment
// buffer buf (this rank's shard).
func (b *Backend) momentView(sl *slicer, buf *cuda.Buffer, a, e int) *cuda.Buffer {
	return sl.at(buf, 4*(a-b.lo), 4*(e-a))
}

// timeout is the bound of a wait for collectives.
func (b *Backend) timeout() time.Duration {
	if b.opts.CommTimeout > 0 {
		return b.opts.CommTimeout
	}
	return DefaultCommTimeout
}

// Ranks returns this backend's rank and the number of ranks of its
// data-parallel run (0, 0 without Options.Comm).
func (b *Backend) Ranks() (rank, world int) {
	if b.opts.Comm == nil {
		return 0, 0
	}
	return b.opts.Comm.Rank(), b.opts.Comm.Size()
}

// AnyStop tells the other ranks whether this one asks to stop and returns
// whether any does; it waits for every rank, so all stop at the same step.
func (b *Backend) AnyStop(stop bool) (bool, error) {
	if b.opts.Comm == nil {
		return stop, nil
	}
	v := []int32{0}
	if stop {
		v[0] = 1
	}
	if err := b.s.Synchronize(); err != nil {
		return false, err
	}
	if err := b.dev.CopyHtoD(b.flag, cuda.Bytes(v)); err != nil {
		return false, err
	}
	if err := b.opts.Comm.AllReduce(b.flag, b.flag, 1, nccl.Int32, nccl.Max, b.s); err != nil {
		return false, err
	}
	if err := b.opts.Comm.Wait(b.s, b.timeout()); err != nil {
		return false, err
	}
	if err := b.dev.CopyDtoH(cuda.Bytes(v), b.flag); err != nil {
		return false, err
	}
	return v[0] != 0, nil
}

// localMicroBatches is how many of a step's n micro-batches this rank runs.
func (b *Backend) localMicroBatches(n int) int {
	rank, world := b.Ranks()
	if world == 0 {
		return n
	}
	k := 0
	for a := range n {
		if train.MicroBatchRank(a, world) == rank {
			k++
		}
	}
	return k
}

// reduceStep queues the sums over the ranks of the step's statistics and
// (reduce-scattered) gradient, and waits for them.
func (b *Backend) reduceStep() error {
	L, f := b.c.NumHiddenLayers, b.c.IntermediateSize
	if err := b.opts.Comm.AllReduce(b.stats, b.stats, 1+2*L, nccl.Float64, nccl.Sum, b.s); err != nil {
		return err
	}
	if err := b.opts.Comm.AllReduce(b.active, b.active, L*f, nccl.Int32, nccl.Sum, b.s); err != nil {
		return err
	}
	sl := &slicer{}
	mine := sl.at(b.g, 4*b.lo, 4*(b.hi-b.lo))
	if sl.err != nil {
		return sl.err
	}
	if err := b.opts.Comm.ReduceScatter(b.g, mine, b.hi-b.lo, nccl.Float32, nccl.Sum, b.s); err != nil {
		return err
	}
	return b.opts.Comm.Wait(b.s, b.timeout())
}

// gatherWeights all-gathers every rank's updated shard of the fp32
// weights and their bf16 copy, and waits for it (bounded, as every wait
// for collectives: a later plain synchronisation would hang on a dead
// rank).
func (b *Backend) gatherWeights() error {
	sl := &slicer{}
	per := b.hi - b.lo
	w, wb := sl.at(b.w, 4*b.lo, 4*per), sl.at(b.wb, 2*b.lo, 2*per)
	if sl.err != nil {
		return sl.err
	}
	if err := b.opts.Comm.AllGather(w, b.w, per, nccl.Float32, b.s); err != nil {
		return err
	}
	if err := b.opts.Comm.AllGather(wb, b.wb, per, nccl.BFloat16, b.s); err != nil {
		return err
	}
	return b.opts.Comm.Wait(b.s, b.timeout())
}

// gatherMoment gathers every rank's shard of the moment buffer m into the
// gradient buffer (free between steps) and downloads it.
func (b *Backend) gatherMoment(m *cuda.Buffer) ([][]float32, error) {
	if err := b.opts.Comm.AllGather(m, b.g, b.hi-b.lo, nccl.Float32, b.s); err != nil {
		return nil, err
	}
	if err := b.opts.Comm.Wait(b.s, b.timeout()); err != nil {
		return nil, err
	}
	return b.download(b.g)
}

// uploadShard copies this rank's shard of one fp32 value per parameter,
// given tensor by tensor, into the moment buffer dst.
func (b *Backend) uploadShard(dst *cuda.Buffer, ts [][]float32) error {
	flat := make([]float32, b.nPad)
	b.flatten(flat, ts)
	if len(flat) < b.hi {
		return fmt.Errorf("trainer: shard [%d, %d) of %d values", b.lo, b.hi, len(flat))
	}
	return b.dev.CopyHtoD(dst, cuda.Bytes(flat[b.lo:b.hi]))
}
