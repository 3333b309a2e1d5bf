package enginetest

import (
	"errors"
	"fmt"

	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/sample"
)

// HostPicks is an engine.DeviceSampling over any engine that makes its
// "device" picks with package sample from the engine's Forward: what the
// GPU engine's picks must equal, for tests of the code that drives an
// engine's picks (package generate) without a GPU. It counts the passes
// that picked and the decoders made.
type HostPicks struct {
	engine.Engine
	Passes, Decoders int
}

// ForwardSample runs Forward and returns each sequence's pick of draws[i]
// (greedy when draws is nil) among the first vocab logits (all when 0); -1
// where no logit is above -Inf.
func (h *HostPicks) ForwardSample(caches []engine.Cache, tokens [][]int, vocab int, draws []sample.Draw) ([]int, *engine.Stats, error) {
	if draws != nil && len(draws) != len(tokens) {
		return nil, nil, fmt.Errorf("%d draws for %d sequences", len(draws), len(tokens))
	}
	h.Passes++
	logits, st, err := h.Forward(caches, tokens, false)
	if err != nil {
		return nil, nil, err
	}
	picks, err := Picks(logits, vocab, draws)
	if err != nil {
		return nil, nil, err
	}
	return picks, st, nil
}

// Picks returns package sample's pick of draws[i] (greedy when draws is
// nil) among the first vocab values (all when 0) of each row of logits,
// -1 where no value is above -Inf: the picks an engine.DeviceSampling must
// make.
func Picks(logits [][]float32, vocab int, draws []sample.Draw) ([]int, error) {
	picks := make([]int, len(logits))
	for i, l := range logits {
		d := sample.Draw{TopP: 1}
		if draws != nil {
			d = draws[i]
		}
		var err error
		if picks[i], err = PickOf(l, vocab, d); errors.Is(err, sample.ErrNoCandidate) {
			picks[i] = -1
		} else if err != nil {
			return nil, err
		}
	}
	return picks, nil
}

// PickOf is package sample's pick of draw d among the first vocab logits
// (all when 0).
func PickOf(logits []float32, vocab int, d sample.Draw) (int, error) {
	o := sample.Greedy()
	o.Temperature, o.TopK, o.TopP, o.Seed = d.Temperature, d.TopK, d.TopP, d.Seed
	s, err := sample.New(o)
	if err != nil {
		return 0, err
	}
	if vocab > 0 && vocab < len(logits) {
		logits = logits[:vocab]
	}
	return s.Pick(logits, nil, d.Index)
}

// NewDecoder returns a Decoder that runs each queued step at once through
// ForwardSample, step n's draws at their Index + n.
func (h *HostPicks) NewDecoder(caches []engine.Cache, vocab int, draws []sample.Draw) (engine.Decoder, error) {
	if len(caches) == 0 || (draws != nil && len(draws) != len(caches)) {
		return nil, fmt.Errorf("%d caches, %d draws", len(caches), len(draws))
	}
	h.Decoders++
	return &hostDecoder{h: h, caches: caches, vocab: vocab, draws: draws}, nil
}

// hostDecoder is HostPicks' Decoder.
type hostDecoder struct {
	h      *HostPicks
	caches []engine.Cache
	vocab  int
	draws  []sample.Draw
	last   []int   // the picks of the last step queued
	ready  [][]int // picks not yet returned by Next
	steps  uint64
}

func (d *hostDecoder) Queue(tokens []int) error {
	switch {
	case len(d.ready) >= 2:
		return errors.New("two steps queued whose picks were not read")
	case tokens == nil && d.last == nil:
		return errors.New("no step was queued to pick the tokens of this one")
	case tokens == nil:
		tokens = d.last
	case len(tokens) != len(d.caches):
		return fmt.Errorf("%d tokens for %d sequences", len(tokens), len(d.caches))
	}
	toks := make([][]int, len(tokens))
	for i, t := range tokens {
		toks[i] = []int{max(t, 0)} // a sequence with nothing to sample feeds 0, as on the GPU
	}
	var draws []sample.Draw
	for _, dr := range d.draws {
		dr.Index += d.steps
		draws = append(draws, dr)
	}
	picks, _, err := d.h.ForwardSample(d.caches, toks, d.vocab, draws)
	if err != nil {
		return err
	}
	d.steps++
	d.last = picks
	d.ready = append(d.ready, picks)
	return nil
}

func (d *hostDecoder) Next() ([]int, error) {
	if len(d.ready) == 0 {
		return nil, errors.New("no step queued whose picks were not read")
	}
	p := d.ready[0]
	d.ready = d.ready[1:]
	for i, id := range p {
		if id < 0 {
			return p, fmt.Errorf("sequence %d: %w: no logit above -Inf", i, sample.ErrNoCandidate)
		}
	}
	return p, nil
}

func (d *hostDecoder) Close() error { return nil }
