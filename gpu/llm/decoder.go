package llm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unsafe"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/sample"
)

// Decode steps with the picks made on the device.
//
// A step that returns logits ends with the host: the logits are copied
// back, the host picks the next tokens and only then queues the next step,
// while the GPU waits (docs/gpu-llm.md has the figures). ForwardSample and
// a Decoder pick on the device instead (pick_rows, pick.cu, after the LM
// head: greedy picks, or draws at a temperature with top-k and top-p). A
// Decoder feeds the picks to the next step by a device copy into that
// step's token ids, queued between the upload of its metadata and its
// layers; so the host queues step n+1 before it has step n's picks, and the
// GPU runs the steps back to back. Each step's metadata goes up from
// page-locked memory (an upload from pageable memory may wait for the
// stream), one of two slots as for the picks. The picks come back to the
// host 8 bytes a sequence (the pick and a no-candidate flag) into one of
// two page-locked slots, each step's copy followed by an event that Next
// waits for.

// maxQueued is the most steps a Decoder keeps queued whose picks Next has
// not returned: one running, one queued behind it.
const maxQueued = 2

// Decoder runs decode steps of one batch of sequences on the engine, each
// step's picks made on the device (engine.Decoder). It is not safe for
// concurrent use, nor for use beside another goroutine's calls into the
// engine.
type Decoder struct {
	e      *Engine
	caches []*cache
	vocab  int
	picks  *cuda.Buffer                // int32 [2][S]: the last queued step's picks, then its no-candidate flags
	params *cuda.Buffer                // the sequences' draws (drawParams), nil for greedy picks
	host   [maxQueued]*cuda.HostBuffer // the picks of the steps in flight, slot = step % maxQueued
	stage  [maxQueued]*cuda.HostBuffer // the metadata of the steps in flight, uploaded from here
	done   [maxQueued]*cuda.Event      // recorded after each slot's copy
	queued int                         // steps queued
	read   int                         // steps whose picks Next returned
	err    error                       // the error that stopped the decoder
}

// NewDecoder returns a Decoder for the sequences whose caches are given
// (made by this engine, each at most once), picking among the first vocab
// logits of each step (the whole vocabulary when vocab is 0): sequence i's
// n-th step (from 0) draws as draws[i] with Index draws[i].Index + n, or
// greedily when draws is nil.
func (e *Engine) NewDecoder(ecaches []engine.Cache, vocab int, draws []sample.Draw) (engine.Decoder, error) {
	if e.closed {
		return nil, errors.New("llm: engine was closed")
	}
	if len(ecaches) == 0 {
		return nil, errors.New("llm: decoder: no sequences")
	}
	vocab, err := e.pickVocab(vocab)
	if err != nil {
		return nil, err
	}
	params, err := drawWords(draws, len(ecaches))
	if err != nil {
		return nil, fmt.Errorf("llm: decoder: %w", err)
	}
	d := &Decoder{e: e, caches: make([]*cache, len(ecaches)), vocab: vocab}
	seen := make(map[*cache]int, len(ecaches))
	for i, c := range ecaches {
		kc, ok := c.(*cache)
		if !ok || kc.e != e {
			return nil, fmt.Errorf("llm: decoder: cache %d was not made by this engine", i)
		}
		if o, dup := seen[kc]; dup {
			return nil, fmt.Errorf("llm: decoder: sequences %d and %d share one cache", o, i)
		}
		seen[kc] = i
		d.caches[i] = kc
	}
	n := 8 * len(ecaches)
	if d.picks, err = e.dev.Alloc(n); err != nil {
		return nil, fmt.Errorf("llm: decoder: %w", err)
	}
	if params != nil {
		if d.params, err = e.dev.Alloc(len(params)); err == nil {
			err = e.dev.CopyHtoD(d.params, params)
		}
		if err != nil {
			return nil, errors.Join(fmt.Errorf("llm: decoder: %w", err), d.free())
		}
	}
	for i := range d.host {
		if d.host[i], err = e.dev.AllocHost(n); err == nil {
			d.done[i], err = e.dev.NewEvent()
		}
		if err != nil {
			return nil, errors.Join(fmt.Errorf("llm: decoder: %w", err), d.free())
		}
	}
	if e.decoders == nil {
		e.decoders = map[*Decoder]bool{}
	}
	e.decoders[d] = true
	return d, nil
}

// Queue queues one decode step: it appends tokens[i] to sequence i, or, with
// tokens nil, the token the previous queued step picked for it. It returns
// without waiting for the GPU, unless maxQueued steps are in flight whose
// picks Next has not returned: that is an error. A failed Queue changes no
// cache, unless the error came after the step's kernels were queued: then
// the decoder is stopped (every later call returns the error).
func (d *Decoder) Queue(tokens []int) error {
	if err := d.usable(); err != nil {
		return err
	}
	S := len(d.caches)
	switch {
	case d.queued-d.read >= maxQueued:
		return fmt.Errorf("llm: decoder: %d steps queued whose picks were not read: call Next first", maxQueued)
	case tokens == nil && d.queued == 0:
		return errors.New("llm: decoder: no step was queued to pick the tokens of this one")
	case tokens != nil && len(tokens) != S:
		return fmt.Errorf("llm: decoder: %d tokens for %d sequences", len(tokens), S)
	}
	e := d.e
	toks := make([][]int, S)
	for i := range toks {
		toks[i] = []int{0} // the picks overwrite these on the device
		if tokens != nil {
			toks[i][0] = tokens[i]
		}
	}
	b, err := e.plan(d.caches, toks, false)
	if err != nil {
		return err
	}
	if err := e.pool.grow(d.caches, toks); err != nil {
		return err
	}
	// From here kernels that read the step's pages may be queued.
	e.inflight = true
	if err := d.queue(b, tokens == nil); err != nil {
		d.err = errors.Join(err, e.settle())
		e.pool.ungrow(d.caches)
		return err
	}
	for _, c := range d.caches {
		c.n++
	}
	d.queued++
	return nil
}

// queue queues the step b: its metadata, the previous picks as its token
// ids when fed, its layers, the LM head, the picks and their copy back.
func (d *Decoder) queue(b *batch, fed bool) error {
	e, s, S := d.e, d.e.stream, len(d.caches)
	b.setPages(d.caches)
	slot := d.queued % maxQueued
	// The slot's last upload ran before the step that Next last read.
	if st := d.stage[slot]; st == nil || len(st.Bytes()) < 4*len(b.words) {
		if st != nil {
			if err := st.Free(); err != nil {
				return err
			}
		}
		var err error
		if d.stage[slot], err = e.dev.AllocHost(4 * len(b.words)); err != nil {
			return err
		}
	}
	if err := e.prepare(b, d.stage[slot]); err != nil {
		return err
	}
	if fed {
		if err := e.dev.CopyDtoDAsync(view(e.ws.meta, 4*b.ids, 4*S), d.picks, 4*S, s); err != nil {
			return err
		}
	}
	if _, err := e.decoderLayers(b, false); err != nil {
		return err
	}
	if err := e.headPicks(b, d.picks, d.vocab, d.params, uint64(d.queued)); err != nil {
		return err
	}
	if err := e.dev.CopyDtoHAsync(d.host[slot].Bytes(), d.picks, s); err != nil {
		return err
	}
	return d.done[slot].Record(s)
}

// pickThreads is pick_rows' block (PICK_THREADS in pick.cu).
const pickThreads = 1024

// pickVocab checks the number of logits the picks choose among (0: the
// whole vocabulary) and returns it.
func (e *Engine) pickVocab(vocab int) (int, error) {
	V := e.cfg.VocabSize
	if vocab < 0 || vocab > V {
		return 0, fmt.Errorf("llm: picks: vocab %d outside [0, %d] (0 is the whole vocabulary)", vocab, V)
	}
	if vocab == 0 {
		vocab = V
	}
	return vocab, nil
}

// drawParamsSize is the size of pick.cu's DrawParams.
const drawParamsSize = 32

// drawWords returns the draws of S sequences as pick_rows reads them
// (DrawParams), or nil when every draw is greedy (draws nil, or each at
// temperature 0), or the first draw out of range.
func drawWords(draws []sample.Draw, S int) ([]byte, error) {
	if draws == nil {
		return nil, nil
	}
	if len(draws) != S {
		return nil, fmt.Errorf("%d draws for %d sequences", len(draws), S)
	}
	greedy := true
	for i, d := range draws {
		o := sample.Options{Temperature: d.Temperature, TopK: d.TopK, TopP: d.TopP, RepetitionPenalty: 1}
		if err := o.Validate(); err != nil {
			return nil, fmt.Errorf("sequence %d: %w", i, err)
		}
		greedy = greedy && d.Temperature == 0
	}
	if greedy {
		return nil, nil
	}
	w := make([]byte, drawParamsSize*S)
	for i, d := range draws {
		p := w[drawParamsSize*i:]
		// A temperature past 1e30 draws as uniformly as 1e30 does, and
		// keeps 1/T a normal float32; one that rounds to 0 in float32 is
		// greedy.
		binary.LittleEndian.PutUint32(p[0:], math.Float32bits(float32(min(d.Temperature, 1e30))))
		binary.LittleEndian.PutUint32(p[4:], math.Float32bits(float32(d.TopP)))
		binary.LittleEndian.PutUint32(p[8:], uint32(min(d.TopK, math.MaxInt32)))
		binary.LittleEndian.PutUint64(p[16:], d.Seed)
		binary.LittleEndian.PutUint64(p[24:], d.Index)
	}
	return w, nil
}

// headPicks queues the head of b (headQueue) and, after each chunk of its
// logits, pick_rows: the pick of row r among the first vocab logits into
// picks[r] (int32), its no-candidate flag into picks[b.rows+r]. params holds
// the rows' draws (drawWords), their Index advanced by step, or is nil for
// greedy picks.
func (e *Engine) headPicks(b *batch, picks *cuda.Buffer, vocab int, params *cuda.Buffer, step uint64) error {
	n := b.rows
	p, none := view(picks, 0, 4*n), view(picks, 4*n, 4*n)
	return e.headQueue(b, func(r0, rc int) error {
		var pr any = cuda.DevicePtr(0)
		if params != nil {
			pr = view(params, drawParamsSize*r0, drawParamsSize*rc)
		}
		return e.k.pick.LaunchEx(cuda.LaunchConfig{Grid: cuda.Dim3{uint32(rc), 1, 1}, Block: cuda.Dim3{pickThreads, 1, 1},
			Stream: e.stream, EarlyStart: e.early()},
			e.ws.logits, int32(e.cfg.VocabSize), int32(vocab), pr, step, view(p, 4*r0, 4*rc), view(none, 4*r0, 4*rc))
	})
}

// ForwardSample runs a pass as Forward does (without allLogits) but
// returns, for each sequence, the token draws[i] picks after its last new
// token among the first vocab logits (the whole vocabulary when vocab is
// 0), made on the device: only the picks come back to the host. draws nil
// picks greedily. A sequence with no logit above -Inf gets -1.
func (e *Engine) ForwardSample(ecaches []engine.Cache, tokens [][]int, vocab int, draws []sample.Draw) ([]int, *engine.Stats, error) {
	vocab, err := e.pickVocab(vocab)
	if err != nil {
		return nil, nil, err
	}
	S := len(tokens)
	params, err := drawWords(draws, S)
	if err != nil {
		return nil, nil, fmt.Errorf("llm: picks: %w", err)
	}
	if err := e.picksFor(S); err != nil {
		return nil, nil, err
	}
	g := &e.picks
	st, err := e.forward(ecaches, tokens, false, func(b *batch) error {
		var pb *cuda.Buffer
		if params != nil {
			// The stream is idle between passes: the page-locked copy is free.
			pb = g.params
			if err := e.dev.CopyHtoDAsync(pb, g.paramsHost.Bytes()[:copy(g.paramsHost.Bytes(), params)], e.stream); err != nil {
				return err
			}
		}
		if err := e.headPicks(b, g.picks, vocab, pb, 0); err != nil {
			return err
		}
		return e.dev.CopyDtoHAsync(g.host.Bytes()[:8*S], g.picks, e.stream)
	})
	if err != nil {
		return nil, nil, err
	}
	out, none := readPicks(g.host, S)
	for _, i := range none {
		out[i] = -1
	}
	return out, st, nil
}

// passPicks are ForwardSample's buffers: picks and flags on the device and
// their page-locked copy, the draws on the device and where they are
// uploaded from.
type passPicks struct {
	picks, params    *cuda.Buffer
	host, paramsHost *cuda.HostBuffer
	seqs             int // sequences they hold
}

// picksFor grows ForwardSample's buffers to S sequences (the stream is
// idle).
func (e *Engine) picksFor(S int) error {
	g := &e.picks
	if g.seqs >= S {
		return nil
	}
	if err := g.free(); err != nil {
		return err
	}
	var err error
	if g.picks, err = e.dev.Alloc(8 * S); err == nil {
		if g.params, err = e.dev.Alloc(drawParamsSize * S); err == nil {
			if g.host, err = e.dev.AllocHost(8 * S); err == nil {
				g.paramsHost, err = e.dev.AllocHost(drawParamsSize * S)
			}
		}
	}
	if err != nil {
		return errors.Join(fmt.Errorf("llm: picks: %w", err), g.free())
	}
	g.seqs = S
	return nil
}

// free frees the buffers.
func (g *passPicks) free() error {
	var errs []error
	for _, b := range []*cuda.Buffer{g.picks, g.params} {
		if b != nil {
			errs = append(errs, b.Free())
		}
	}
	for _, h := range []*cuda.HostBuffer{g.host, g.paramsHost} {
		if h != nil {
			errs = append(errs, h.Free())
		}
	}
	*g = passPicks{}
	return errors.Join(errs...)
}

// Next waits for the oldest queued step whose picks it has not returned and
// returns each sequence's greedy pick: the token after the one that step
// appended. A sequence with no logit above -Inf is an error wrapping
// sample.ErrNoCandidate (its pick, the lowest index that is not NaN, is
// still returned and was fed to any step queued after).
func (d *Decoder) Next() ([]int, error) {
	if err := d.usable(); err != nil {
		return nil, err
	}
	if d.read == d.queued {
		return nil, errors.New("llm: decoder: no step queued whose picks were not read")
	}
	slot := d.read % maxQueued
	if err := d.done[slot].Synchronize(); err != nil {
		d.err = err
		return nil, err
	}
	d.read++
	if d.read == d.queued {
		// Work queued after this step may still run for another decoder.
		d.e.inflight = false
		for o := range d.e.decoders {
			d.e.inflight = d.e.inflight || o.read < o.queued
		}
	}
	out, none := readPicks(d.host[slot], len(d.caches))
	if len(none) > 0 {
		return out, fmt.Errorf("llm: decoder: sequence %d: %w: no logit above -Inf", none[0], sample.ErrNoCandidate)
	}
	return out, nil
}

// readPicks returns the S picks that headPicks left in h (copied from the
// device) and the sequences whose no-candidate flag is set.
func readPicks(h *cuda.HostBuffer, S int) (picks, none []int) {
	w := unsafe.Slice((*int32)(unsafe.Pointer(&h.Bytes()[0])), 2*S)
	picks = make([]int, S)
	for i := range picks {
		picks[i] = int(w[i])
		if w[S+i] != 0 {
			none = append(none, i)
		}
	}
	return picks, none
}

// Close waits for the queued steps and frees what the decoder holds. The
// caches keep the tokens of every queued step, read or not.
func (d *Decoder) Close() error {
	if d.e == nil {
		return nil
	}
	var err error
	if !d.e.closed {
		err = d.e.settle()
	}
	delete(d.e.decoders, d)
	err = errors.Join(err, d.free())
	d.e = nil
	return err
}

// free frees the decoder's buffers and events.
func (d *Decoder) free() error {
	var errs []error
	if d.picks != nil {
		errs = append(errs, d.picks.Free())
		d.picks = nil
	}
	if d.params != nil {
		errs = append(errs, d.params.Free())
		d.params = nil
	}
	for i := range d.host {
		if d.host[i] != nil {
			errs = append(errs, d.host[i].Free())
			d.host[i] = nil
		}
		if d.stage[i] != nil {
			errs = append(errs, d.stage[i].Free())
			d.stage[i] = nil
		}
		if d.done[i] != nil {
			errs = append(errs, d.done[i].Destroy())
			d.done[i] = nil
		}
	}
	return errors.Join(errs...)
}

// usable returns why the decoder cannot be used, or nil.
func (d *Decoder) usable() error {
	switch {
	case d.e == nil:
		return errors.New("llm: decoder was closed")
	case d.e.closed:
		return errors.New("llm: engine was closed")
	case d.err != nil:
		return fmt.Errorf("llm: decoder stopped: %w", d.err)
	}
	for i, c := range d.caches {
		if c.pt == nil {
			return fmt.Errorf("llm: decoder: cache %d was freed", i)
		}
	}
	return nil
}

// settle waits until the stream has run the decode steps queued by
// Decoders, so that the host may free or reuse what they read.
func (e *Engine) settle() error {
	if !e.inflight {
		return nil
	}
	e.inflight = false
	return e.stream.Synchronize()
}
