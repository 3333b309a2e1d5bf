package main

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/nccl"
	"github.com/twell-ai/twell/dist"
	"github.com/twell-ai/twell/gpu/trainer"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/train"
)

// rendezvousTimeout bounds the wait for every rank to start.
const rendezvousTimeout = 5 * time.Minute

// rankBackend returns the GPU backend of one rank of a data-parallel run:
// the GPU of its local rank, joined to the other ranks through NCCL after
// a rendezvous at rank 0 that hands out the NCCL id and checks that every
// rank runs the same configuration. The communicator is closed with the
// backend.
func rankBackend(ctx context.Context, f *trainFlags, cfg *train.Config, w *model.Weights, stderr io.Writer) (train.Backend, *trainer.Backend, error) {
	e := f.env
	where := fmt.Sprintf("rank %d of %d", e.Rank, e.WorldSize)
	dev, err := cuda.Open(e.LocalRank)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: GPU %d (LOCAL_RANK): %w", where, e.LocalRank, err)
	}
	var payload []byte
	if e.Rank == 0 {
		id, err := nccl.NewUniqueID()
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %w", where, err)
		}
		payload = id.Internal[:]
	}
	digest, err := runDigest(f, cfg)
	if err != nil {
		return nil, nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, rendezvousTimeout)
	defer cancel()
	got, err := dist.Rendezvous(rctx, e, digest, payload)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", where, err)
	}
	var id nccl.UniqueID
	if len(got) != len(id.Internal) {
		return nil, nil, fmt.Errorf("%s: the rendezvous gave an NCCL id of %d bytes, want %d", where, len(got), len(id.Internal))
	}
	copy(id.Internal[:], got)
	comm, err := nccl.NewComm(dev, id, e.Rank, e.WorldSize)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", where, err)
	}
	b, err := trainer.New(dev, cfg.ModelConfig(), w, trainer.Options{Batch: cfg.Batch, Seq: cfg.Seq, MLP: f.mlp, DenseAbove: f.denseAbove,
		Recompute: f.recompute, Comm: comm})
	if err != nil {
		comm.Abort()
		return nil, nil, fmt.Errorf("%s: %w", where, err)
	}
	if e.Rank == 0 {
		fmt.Fprintf(stderr, "training data-parallel on %d GPUs (this one: %v); each step's %d micro-batches shared among them\n", e.WorldSize, dev, cfg.Accum)
		if cfg.Accum < e.WorldSize {
			fmt.Fprintf(stderr, "note: accum %d is below the %d ranks: ranks %d to %d have no micro-batch; raise accum (the global batch is accum x batch)\n",
				cfg.Accum, e.WorldSize, cfg.Accum, e.WorldSize-1)
		}
	}
	return &commBackend{Backend: b, comm: comm}, b, nil
}

// runDigest identifies what every rank must agree on: the config and the
// flags that change the arithmetic.
func runDigest(f *trainFlags, cfg *train.Config) ([32]byte, error) {
	b, err := json.Marshal(struct {
		Cfg        *train.Config
		MLP        string
		DenseAbove float64
		Resume     bool
	}{cfg, f.mlp.String(), f.denseAbove, f.resume})
	if err != nil {
		return [32]byte{}, err
	}
	return sha256.Sum256(b), nil
}

// commBackend is a rank's backend that also closes its communicator.
type commBackend struct {
	*trainer.Backend
	comm *nccl.Comm
}

// Close frees the backend, then the communicator.
func (c *commBackend) Close() error {
	err := c.Backend.Close()
	if cerr := c.comm.Close(); err == nil {
		err = cerr
	}
	return err
}
