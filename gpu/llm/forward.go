package llm

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"unsafe"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/gpu"
	"github.com/twell-ai/twell/mlp"
)

// attnBQ is the number of queries of one attention work item (ATT_BQ).
const attnBQ = 128

// batch is the host side of one forward pass: the flattened tokens and the
// metadata the kernels read (see rope.cu).
type batch struct {
	T, S, items, rows int
	maxPos            int
	words             []int32 // the metadata, uploaded as one buffer
	// offsets (in int32 words) of the sections of words
	pt, tokSeq, tokPos, ids, seqQ0, seqN, seqPast, item, row int
	// tables[s] is the offset of sequence s's page table (2 words a page);
	// pages[s] the number of pages in it.
	tables, pages []int
	// resid is the residual buffer the decoder layers leave their output
	// in (ws.resid, or ws.resid2 after an odd number of fused norms), and
	// delta the last layer's output still to be added to it.
	resid *cuda.Buffer
	delta *cuda.Buffer
}

// plan validates a forward pass like model.Model.Forward does and lays out
// its metadata.
func (e *Engine) plan(caches []*cache, tokens [][]int, allLogits bool) (*batch, error) {
	c := e.cfg
	if len(caches) != len(tokens) {
		return nil, fmt.Errorf("llm: %d caches for %d sequences", len(caches), len(tokens))
	}
	if len(tokens) == 0 {
		return nil, errors.New("llm: no sequences")
	}
	b := &batch{S: len(tokens)}
	seen := make(map[*cache]int, len(caches))
	for s, toks := range tokens {
		cache := caches[s]
		switch {
		case cache == nil:
			return nil, fmt.Errorf("llm: sequence %d has a nil cache", s)
		case cache.e != e:
			return nil, fmt.Errorf("llm: sequence %d: cache belongs to another engine", s)
		case cache.pt == nil:
			return nil, fmt.Errorf("llm: sequence %d: cache was freed", s)
		case len(toks) == 0:
			return nil, fmt.Errorf("llm: sequence %d has no new tokens", s)
		case cache.n < 0 || cache.n+len(toks) > cache.cap:
			return nil, fmt.Errorf("llm: sequence %d would reach %d tokens, past its cache of %d", s, cache.n+len(toks), cache.cap)
		}
		if o, dup := seen[cache]; dup {
			return nil, fmt.Errorf("llm: sequences %d and %d share one cache", o, s)
		}
		seen[cache] = s
		for i, id := range toks {
			if id < 0 || id >= c.VocabSize {
				return nil, fmt.Errorf("llm: sequence %d token %d: id %d outside the vocabulary [0, %d)", s, i, id, c.VocabSize)
			}
		}
		b.T += len(toks)
		b.items += (len(toks) + attnBQ - 1) / attnBQ
		b.maxPos = max(b.maxPos, cache.n+len(toks)-1)
		if allLogits {
			b.rows += len(toks)
		} else {
			b.rows++
		}
	}
	if b.T > math.MaxInt32/max(c.HiddenSize, 1) {
		return nil, fmt.Errorf("llm: %d tokens in one forward pass is too many", b.T)
	}
	// Layout: seq_pt (2 words each, first: 8-byte aligned), the int32
	// sections, then the page tables (8-byte aligned). The tables come last:
	// their length changes from one decode step to the next, and the
	// sections before them must stay where a recorded graph reads them.
	off := 0
	next := func(n int) int { o := off; off += n; return o }
	b.pt = next(2 * b.S)
	b.tokSeq, b.tokPos, b.ids = next(b.T), next(b.T), next(b.T)
	b.seqQ0, b.seqN, b.seqPast = next(b.S), next(b.S), next(b.S)
	b.item, b.row = next(2*b.items), next(b.rows)
	off += off & 1
	b.tables, b.pages = make([]int, b.S), make([]int, b.S)
	for s, toks := range tokens {
		b.pages[s] = e.pool.pagesFor(caches[s].n + len(toks))
		b.tables[s] = next(2 * b.pages[s])
	}
	w := make([]int32, off)
	b.words = w
	work := make([]attnItem, b.items)
	t, it, r := 0, 0, 0
	for s, toks := range tokens {
		cache := caches[s]
		w[b.seqQ0+s], w[b.seqN+s], w[b.seqPast+s] = int32(t), int32(len(toks)), int32(cache.n)
		for i, id := range toks {
			w[b.tokSeq+t+i], w[b.tokPos+t+i], w[b.ids+t+i] = int32(s), int32(cache.n+i), int32(id)
		}
		for q0 := 0; q0 < len(toks); q0 += attnBQ {
			work[it] = attnItem{s: int32(s), q0: int32(q0), keys: cache.n + min(q0+attnBQ, len(toks))}
			it++
		}
		if allLogits {
			for i := range toks {
				w[b.row+r] = int32(t + i)
				r++
			}
		} else {
			w[b.row+r] = int32(t + len(toks) - 1)
			r++
		}
		t += len(toks)
	}
	orderItems(work, b.S)
	for i, a := range work {
		w[b.item+2*i], w[b.item+2*i+1] = a.s, a.q0
	}
	return b, nil
}

// orderItems orders the attention work items of a pass of S sequences
// sequence by sequence, the sequences with the most keys first, and each
// sequence's items longest first. CTAs start in item order (nq heads an
// item), so the CTAs resident at once read the keys and values of few
// sequences, which stay in the L2 for all the items of the sequence (64 x
// 2048-token prefill on an H100: L2 hit rate 75.9% against 9.5% with the
// items longest first over the whole pass, when each resident item was
// another sequence's); under the causal mask an item's cost grows with its
// keys, so within a sequence the short ones come last.
func orderItems(work []attnItem, S int) {
	most := make([]int, S)
	for _, a := range work {
		most[a.s] = max(most[a.s], a.keys)
	}
	slices.SortStableFunc(work, func(x, y attnItem) int {
		if c := cmp.Compare(most[y.s], most[x.s]); c != 0 {
			return c
		}
		if c := cmp.Compare(x.s, y.s); c != 0 {
			return c
		}
		return cmp.Compare(y.keys, x.keys)
	})
}

// attnItem is one attention work item: a sequence, its first query, and
// the keys its last query reads.
type attnItem struct {
	s, q0 int32
	keys  int
}

// putU64 writes v into words w[i] and w[i+1], low word first.
func putU64(w []int32, i int, v uint64) { w[i], w[i+1] = int32(uint32(v)), int32(uint32(v>>32)) }

// setPages writes the page tables of the caches, which hold the pages of
// their new tokens now (kvPool.grow).
func (b *batch) setPages(caches []*cache) {
	for s, kc := range caches {
		for i, pg := range kc.pt.pages[:b.pages[s]] {
			putU64(b.words, b.tables[s]+2*i, pg)
		}
	}
}

// realloc returns b if it holds n bytes, else a new buffer (freeing b).
func (e *Engine) realloc(b *cuda.Buffer, n int) (*cuda.Buffer, error) {
	if b != nil && b.Len() >= n {
		return b, nil
	}
	if b != nil {
		// A Decoder's steps may still read b.
		if err := e.settle(); err != nil {
			return nil, err
		}
		if err := b.Free(); err != nil {
			return nil, err
		}
	}
	e.gen++
	return e.dev.Alloc(n)
}

// workspaceFor grows the workspace for a pass of T tokens with rows logit
// rows and metadata of metaBytes; a decode step (T sequences of one token)
// that runs the decode attention kernel also needs its buffer.
func (e *Engine) workspaceFor(T, rows, metaBytes int, decode bool) error {
	c := e.cfg
	h, hd, nq, nkv := c.HiddenSize, c.HeadDim, c.NumAttentionHeads, c.NumKeyValueHeads
	ws := &e.ws
	var err error
	if ws.tokens < T {
		if ws.resid, err = e.realloc(ws.resid, 4*T*h); err != nil {
			return err
		}
		if ws.hn, err = e.realloc(ws.hn, 2*T*max(h, nq*hd)); err != nil {
			return err
		}
		if ws.qkv, err = e.realloc(ws.qkv, 2*T*(nq+2*nkv)*hd); err != nil {
			return err
		}
		if ws.proj, err = e.realloc(ws.proj, 2*T*h); err != nil {
			return err
		}
		ws.tokens = T
	}
	if mt := min(T, e.chunk()); ws.mlpTok < mt {
		if d := e.firstDense(); d != nil {
			if err := d.Reserve(mt); err != nil {
				return err
			}
		}
		ws.mlpTok = mt
	}
	if r := min(rows, headChunk); ws.rows < r {
		if ws.sel, err = e.realloc(ws.sel, 2*r*h); err != nil {
			return err
		}
		if ws.logits, err = e.realloc(ws.logits, 4*r*c.VocabSize); err != nil {
			return err
		}
		ws.rows = r
	}
	if e.fuseNorms(T) && ws.resid2 == nil {
		if ws.resid2, err = e.realloc(nil, 4*h); err != nil {
			return err
		}
	}
	if decode && e.decodeSplit() && ws.decSeq < T {
		if ws.dec, err = e.realloc(ws.dec, decBytes(c, T)); err != nil {
			return err
		}
		// The counters start at 0; each decode launch leaves them at 0.
		if err = e.dev.Memset8(ws.dec, 0, e.stream); err != nil {
			return err
		}
		ws.decSeq = T
	}
	if ws.meta == nil || ws.meta.Len() < metaBytes {
		// Page tables grow with the sequences: room to spare, so that the
		// decode graphs, which read the buffer where they were recorded,
		// are seldom recorded again for it.
		n := metaBytes
		if ws.meta != nil {
			n = max(n, 2*ws.meta.Len())
		}
		ws.meta, err = e.realloc(ws.meta, n)
	}
	return err
}

func (e *Engine) chunk() int {
	if e.MLPChunk > 0 {
		return e.MLPChunk
	}
	return DefaultMLPChunk
}

// ropeFor makes the device RoPE tables cover positions [0, n).
func (e *Engine) ropeFor(n int) error {
	cos, sin := e.rope.Tables(n)
	if len(cos) == 0 {
		return errors.New("llm: empty RoPE table")
	}
	if &cos[0] == e.ropePtr && len(cos) == e.ropeLen {
		return nil
	}
	var err error
	if e.cosB, err = e.realloc(e.cosB, 4*len(cos)); err != nil {
		return err
	}
	if e.sinB, err = e.realloc(e.sinB, 4*len(sin)); err != nil {
		return err
	}
	if err := e.dev.CopyHtoDAsync(e.cosB, cuda.Bytes(cos), e.stream); err != nil {
		return err
	}
	if err := e.dev.CopyHtoDAsync(e.sinB, cuda.Bytes(sin), e.stream); err != nil {
		return err
	}
	e.ropePtr, e.ropeLen = &cos[0], len(cos)
	return nil
}

// view returns n bytes of b from byte off (the arguments are known good).
func view(b *cuda.Buffer, off, n int) *cuda.Buffer {
	v, err := b.Slice(off, n)
	if err != nil {
		panic(fmt.Sprintf("llm: workspace view: %v", err)) // a bug: sizes are checked when planned
	}
	return v
}

// Forward appends tokens[i] to sequence i (whose cache is caches[i]) and
// returns, for each sequence, the logits of its last new token, or of every
// new token when allLogits is set (rows of VocabSize float32 values), as
// model.Model.Forward does. Sequences may have different lengths; a
// sequence's new tokens attend to its cached positions and to each other
// causally. The call returns when the GPU work is done.
//
// Stats.MeanActive is, per layer, the mean number of active MLP units per
// token of the layer's latest measured MLP call (the MLP copies its count
// back on its first calls, then on every 8th: see package gpu); -1 where
// nothing was measured (the dense path, or a layer without a TwELL MLP).
// Decode steps replayed from a CUDA graph measure nothing: they report the
// last value measured before. With Profile set, Stats.StepMS is the GPU
// time of each kind of step summed over the layers: "embed", "norm" (both
// add_rmsnorm calls), "qkv", "rope", "attention", "o_proj", "mlp" and
// "head" (final norm, LM head, logits copy); nil for steps replayed from a
// CUDA graph.
func (e *Engine) Forward(ecaches []engine.Cache, tokens [][]int, allLogits bool) ([][]float32, *engine.Stats, error) {
	var logits [][]float32
	st, err := e.forward(ecaches, tokens, allLogits, func(b *batch) (err error) {
		logits, err = e.logits(b)
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	return logits, st, nil
}

// forward runs a pass as Forward does, with head queuing what follows the
// decoder layers (the LM head and what reads its logits), and waits for it.
func (e *Engine) forward(ecaches []engine.Cache, tokens [][]int, allLogits bool, head func(*batch) error) (*engine.Stats, error) {
	if e.closed {
		return nil, errors.New("llm: engine was closed")
	}
	if err := e.settle(); err != nil {
		return nil, err
	}
	caches := make([]*cache, len(ecaches))
	for i, c := range ecaches {
		kc, ok := c.(*cache)
		if !ok || kc.e != e {
			return nil, fmt.Errorf("llm: cache %d was not made by this engine", i)
		}
		caches[i] = kc
	}
	b, err := e.plan(caches, tokens, allLogits)
	if err != nil {
		return nil, err
	}
	if err := e.pool.grow(caches, tokens); err != nil {
		return nil, err
	}
	done := false
	defer func() {
		if !done {
			e.pool.ungrow(caches)
		}
	}()
	b.setPages(caches)
	st, err := e.queue(b)
	if err != nil {
		return nil, err
	}
	if err := head(b); err != nil {
		return nil, err
	}
	if e.profOn {
		e.prof.mark(e.dev, e.stream, "head")
	}
	if err := e.stream.Synchronize(); err != nil {
		return nil, err
	}
	if e.profOn {
		if st.StepMS, err = e.prof.collect(); err != nil {
			return nil, fmt.Errorf("llm: profile: %w", err)
		}
	}
	for s, toks := range tokens {
		caches[s].n += len(toks)
	}
	done = true
	for i, l := range e.layers {
		if l.mlp != nil && e.mlpPath != mlp.Dense {
			if a, ok := l.mlp.LastActive(); ok {
				st.MeanActive[i] = a
			}
		}
	}
	return st, nil
}

// queue uploads the metadata and queues the decoder layers: from a CUDA
// graph for decode steps once every MLP's path has settled (graphs.go),
// else kernel by kernel.
func (e *Engine) queue(b *batch) (*engine.Stats, error) {
	if err := e.prepare(b, nil); err != nil {
		return nil, err
	}
	return e.decoderLayers(b, e.Profile)
}

// decoderLayers queues the embedding and decoder layers of b, whose
// metadata is uploaded: from a CUDA graph for decode steps once every MLP's
// path has settled, else kernel by kernel, profiled if profile is set.
func (e *Engine) decoderLayers(b *batch, profile bool) (*engine.Stats, error) {
	st := engine.NewStats(b.T, len(e.layers))
	if ok, err := e.replay(b, st); ok || err != nil {
		e.profOn = false
		return st, err
	}
	e.profOn = profile
	return st, e.layersQueue(b, st, nil)
}

// prepare sizes the workspace and RoPE tables for b, points each
// sequence's seq_pt at its page table in the metadata buffer, and uploads
// the metadata: from stage, page-locked memory of at least its size, when
// not nil (an upload from pageable memory may wait for the stream).
func (e *Engine) prepare(b *batch, stage *cuda.HostBuffer) error {
	if err := e.workspaceFor(b.T, b.rows, 4*len(b.words), b.T == b.S); err != nil {
		return err
	}
	meta := uint64(e.ws.meta.Ptr())
	for s, off := range b.tables {
		putU64(b.words, b.pt+2*s, meta+4*uint64(off))
	}
	if err := e.ropeFor(b.maxPos + 1); err != nil {
		return err
	}
	src := cuda.Bytes(b.words)
	if stage != nil {
		src = stage.Bytes()[:copy(stage.Bytes(), src)]
	}
	return e.dev.CopyHtoDAsync(e.ws.meta, src, e.stream)
}

// layersQueue queues the embedding and the decoder layers of b, whose
// metadata prepare uploaded. paths, if not nil, fixes each layer's MLP path
// and leaves out the MLPs' bookkeeping (for recording into a graph).
func (e *Engine) layersQueue(b *batch, st *engine.Stats, paths []mlp.Path) error {
	c := e.cfg
	h, hd, nq, nkv := c.HiddenSize, c.HeadDim, c.NumAttentionHeads, c.NumKeyValueHeads
	T := b.T
	ws, s := &e.ws, e.stream
	sec := func(off, n int) *cuda.Buffer { return view(ws.meta, 4*off, 4*max(n, 1)) }
	pt, tokSeq, tokPos, ids := sec(b.pt, 2*b.S), sec(b.tokSeq, T), sec(b.tokPos, T), sec(b.ids, T)
	seqQ0, seqN, seqPast := sec(b.seqQ0, b.S), sec(b.seqN, b.S), sec(b.seqPast, b.S)
	page := e.pool.size
	items := sec(b.item, 2*b.items)
	qkvW := (nq + 2*nkv) * hd
	eps := float32(c.RMSNormEps)
	prof := func(step string) {}
	if e.profOn && paths == nil {
		e.prof.begin(e.dev, s)
		prof = func(step string) { e.prof.mark(e.dev, s, step) }
	}
	if err := embedRows(e.k.embed, s, e.embed, ids, ws.resid, T, h); err != nil {
		return fmt.Errorf("llm: embed: %w", err)
	}
	prof("embed")
	attn, err := e.attentionKernel(T)
	if err != nil {
		return err
	}
	dec, decode := e.decodeAttention(b)
	early := e.early()
	// With fused norms the residual stream moves between two buffers: a
	// fused kernel reads cur and writes the sum to other.
	fuse := e.fuseNorms(T)
	cur, other := ws.resid, ws.resid2
	// With AttnRope a prefill pass on attn_wg64 rotates its queries in the
	// attention: rope_kv (which the pass runs: no decode-sized projections)
	// then leaves them as the q/k/v GEMM wrote them.
	keepQ := e.AttnRope && attn.wg && !decode && !e.gemv(T, h)
	var qcos, qsin *cuda.Buffer
	if keepQ {
		qcos, qsin = e.cosB, e.sinB
	}
	var delta *cuda.Buffer // what the next norm adds to cur (bf16 rows; nil: nothing)
	for li, l := range e.layers {
		rope := ropeArgs{qkv: ws.qkv, cos: e.cosB, sin: e.sinB, tokSeq: tokSeq, tokPos: tokPos, pt: pt, page: page,
			T: T, layer: li, nq: nq, nkv: nkv, hd: hd, qkvW: qkvW, early: early, keepQ: keepQ}
		norm := normArgs{resid: cur, delta: delta, w: l.attnNorm, out: ws.hn, n: T, d: h, eps: eps, early: early}
		if fuse && e.gemv(T, h) {
			if err := rope.qkvRopeNormed(e.k.qkvRope1N, s, norm, other, l.qkv, h); err != nil {
				return fmt.Errorf("llm: layer %d norm + qkv + rope: %w", li, err)
			}
			cur, other = other, cur
			prof("qkv")
		} else if err := e.normQKV(s, li, norm, rope, l, decode && dec.cos != nil, prof); err != nil {
			return err
		}
		aa := attnArgs{qkv: ws.qkv, out: ws.hn, items: items, seqQ0: seqQ0, seqN: seqN, seqPast: seqPast,
			pt: pt, cos: qcos, sin: qsin, page: page, nItems: b.items, layer: li, nq: nq, nkv: nkv, hd: hd, qkvW: qkvW}
		launch := attn.launch
		if decode {
			launch = dec.launch
		}
		if err := launch(s, aa); err != nil {
			return fmt.Errorf("llm: layer %d attention: %w", li, err)
		}
		prof("attention")
		if err := e.project(T, h, nq*hd, ws.hn, l.o, ws.proj); err != nil {
			return fmt.Errorf("llm: layer %d o_proj: %w", li, err)
		}
		delta = ws.proj
		prof("o_proj")
		var fixed *mlp.Path
		if paths != nil {
			fixed = &paths[li]
		}
		if fuse && l.mlp != nil && e.mlpPath != mlp.Dense && fixed != nil && *fixed == mlp.Sparse {
			l.mlp.Serial = e.Serial
			in := gpu.NormedInput{Resid: cur, Delta: delta, ResidOut: other, Weight: l.mlpNorm, Eps: eps}
			if err := l.mlp.QueueNormed(s, ws.proj, in); err != nil {
				return fmt.Errorf("llm: layer %d norm + MLP: %w", li, err)
			}
			delta = ws.proj
			cur, other = other, cur
			st.Paths[li] = mlp.Sparse
			prof("mlp")
			continue
		}
		if err := (normArgs{resid: cur, delta: delta, w: l.mlpNorm, out: ws.hn, n: T, d: h, eps: eps, early: early}).launch(e.k.addNorm, s); err != nil {
			return fmt.Errorf("llm: layer %d norm: %w", li, err)
		}
		prof("norm")
		sparse, err := e.mlp(l, T, fixed)
		if err != nil {
			return fmt.Errorf("llm: layer %d MLP: %w", li, err)
		}
		delta = ws.proj
		if sparse {
			st.Paths[li] = mlp.Sparse
		}
		prof("mlp")
	}
	b.resid, b.delta = cur, delta
	return nil
}

// normQKV queues layer li's attention norm (norm) and its q/k/v
// projection with RoPE and the cache write (rope): for decode-sized passes
// qkv_rope, else the projection and rope_kv (unless noRope: the decode
// attention does its work, Engine.DecRope).
func (e *Engine) normQKV(s *cuda.Stream, li int, norm normArgs, rope ropeArgs, l layer, noRope bool, prof func(string)) error {
	if err := norm.launch(e.k.addNorm, s); err != nil {
		return fmt.Errorf("llm: layer %d norm: %w", li, err)
	}
	prof("norm")
	T, h := rope.T, e.cfg.HiddenSize
	if e.gemv(T, h) {
		// Decode step: projection, RoPE and cache write in one kernel.
		fn := gemvKernel(e.k.qkvRope1, e.k.qkvRope4, T)
		if err := rope.qkvRope(fn, s, norm.out, l.qkv, h); err != nil {
			return fmt.Errorf("llm: layer %d qkv + rope: %w", li, err)
		}
		prof("qkv")
		return nil
	}
	if err := e.project(T, rope.qkvW, h, norm.out, l.qkv, rope.qkv); err != nil {
		return fmt.Errorf("llm: layer %d qkv: %w", li, err)
	}
	prof("qkv")
	if noRope {
		return nil
	}
	if err := rope.ropeKV(e.k.ropeKV, s); err != nil {
		return fmt.Errorf("llm: layer %d rope: %w", li, err)
	}
	prof("rope")
	return nil
}

// fuseNorms reports whether a pass of T tokens fuses its norms into the
// kernels after them (Engine.FuseNorms): one token, and a hidden size the
// register-resident norm takes with add_rmsnorm's block (normBlock), so
// that the fused kernels' values are add_rmsnorm's bit for bit.
func (e *Engine) fuseNorms(T int) bool {
	h := e.cfg.HiddenSize
	return e.FuseNorms && T == 1 && gpu.NormFuses(h) && normBlock(h)[0] == 256
}

// mlp queues layer l's MLP from ws.hn into ws.proj, in chunks of at most
// MLPChunk tokens, and reports whether every chunk ran the sparse path.
// fixed, if not nil, is the TwELL MLP's path, run without bookkeeping.
func (e *Engine) mlp(l layer, T int, fixed *mlp.Path) (bool, error) {
	h := e.cfg.HiddenSize
	ws, s := &e.ws, e.stream
	ch := e.chunk()
	sparse := l.mlp != nil && e.mlpPath != mlp.Dense
	if sparse && fixed == nil && e.HotUnits && !l.mlp.Calibrated() && T >= gpu.CalibrationTokens {
		// The first pass large enough measures which units fire most: the
		// layer's input of this pass, at most CalibrationMaxTokens rows and
		// one MLP chunk (the workspace's bound).
		m := min(T, gpu.CalibrationMaxTokens, ch)
		if _, err := l.mlp.Calibrate(s, view(ws.hn, 0, 2*m*h), m); err != nil {
			e.hotErr, e.HotUnits = fmt.Errorf("llm: calibrating the hot units: %w", err), false
		}
	}
	for off := 0; off < T; off += ch {
		m := min(ch, T-off)
		x, y := view(ws.hn, 2*off*h, 2*m*h), view(ws.proj, 2*off*h, 2*m*h)
		if l.mlp != nil {
			l.mlp.Serial = e.Serial
			if fixed != nil {
				if err := l.mlp.Queue(s, y, x, m, *fixed); err != nil {
					return false, err
				}
				sparse = sparse && *fixed == mlp.Sparse
				continue
			}
			if e.mlpPath == mlp.Dense {
				if err := l.mlp.Dense(s, y, x, m); err != nil {
					return false, err
				}
				continue
			}
			p, err := l.mlp.Forward(s, y, x, m)
			if err != nil {
				return false, err
			}
			sparse = sparse && p == mlp.Sparse
			continue
		}
		if err := l.dense.Forward(s, y, x, m); err != nil {
			return false, err
		}
	}
	return sparse, nil
}

// logitsOut returns where Forward's n logits go: a fresh slice, or with
// ReuseLogits the engine's page-locked buffer (grown when too small).
func (e *Engine) logitsOut(n int) ([]float32, error) {
	if !e.ReuseLogits {
		return make([]float32, n), nil
	}
	if e.hostLogits == nil || len(e.hostLogits.Bytes()) < 4*n {
		if e.hostLogits != nil {
			// The stream is idle between Forward calls: no copy is in flight.
			if err := e.hostLogits.Free(); err != nil {
				return nil, err
			}
			e.hostLogits = nil
		}
		h, err := e.dev.AllocHost(4 * n)
		if err != nil {
			return nil, fmt.Errorf("llm: page-locked logits buffer: %w", err)
		}
		e.hostLogits = h
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&e.hostLogits.Bytes()[0])), n), nil
}

// logits queues the head of b (headQueue) and the download of its logits.
func (e *Engine) logits(b *batch) ([][]float32, error) {
	V := e.cfg.VocabSize
	out, err := e.logitsOut(b.rows * V)
	if err != nil {
		return nil, err
	}
	err = e.headQueue(b, func(r0, rc int) error {
		return e.dev.CopyDtoHAsync(cuda.Bytes(out[r0*V:(r0+rc)*V]), e.ws.logits, e.stream)
	})
	if err != nil {
		return nil, err
	}
	rows := make([][]float32, b.rows)
	for i := range rows {
		rows[i] = out[i*V : (i+1)*V : (i+1)*V]
	}
	return rows, nil
}

// headQueue queues the final norm of the rows of b whose logits are wanted and
// the LM head, in chunks of at most headChunk rows; after each chunk it
// calls each(r0, rc) to queue what reads the chunk's rc rows of logits,
// rows r0 onwards, from ws.logits before the next chunk overwrites them.
func (e *Engine) headQueue(b *batch, each func(r0, rc int) error) error {
	c := e.cfg
	h, V := c.HiddenSize, c.VocabSize
	ws, s := &e.ws, e.stream
	resid := b.resid
	if resid == nil {
		resid = ws.resid
	}
	for r0 := 0; r0 < b.rows; r0 += headChunk {
		rc := min(headChunk, b.rows-r0)
		rows := view(ws.meta, 4*(b.row+r0), 4*rc)
		norm := normArgs{resid: resid, delta: b.delta, rows: rows, w: e.norm, out: ws.sel, n: rc, d: h, eps: float32(c.RMSNormEps), early: e.early()}
		if err := norm.launch(e.k.addNorm, s); err != nil {
			return fmt.Errorf("llm: final norm: %w", err)
		}
		if err := e.blas.Matmul(s, cublas.Gemm{M: rc, N: V, K: h, TransB: true, CType: cublas.F32}, ws.sel, e.head, ws.logits); err != nil {
			return fmt.Errorf("llm: LM head: %w", err)
		}
		if err := each(r0, rc); err != nil {
			return err
		}
	}
	return nil
}
