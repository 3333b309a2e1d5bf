package cpu

import (
	"fmt"
	"math"
	"slices"
	"sync"
)

// AttentionShape is the head layout of a causal attention call: Heads query
// heads share KVHeads key/value heads (grouped-query attention) of HeadDim
// values each.
type AttentionShape struct {
	Heads, KVHeads, HeadDim int
}

// AttentionSeq is one sequence's part of a causal attention call: its N new
// queries, at positions Pos0 .. Pos0+N-1, attend to the keys and values at
// positions 0 .. Pos0+N-1, their own included. All rows are strided: query
// i of head h is Q[i*QStride+h*HeadDim:][:HeadDim] and its output goes to
// Out[i*OutStride+h*HeadDim:]; the key of KV head g at position p is
// K[p*KVStride+g*HeadDim:][:HeadDim], the value likewise in V.
type AttentionSeq struct {
	Q, Out             []float32
	QStride, OutStride int
	K, V               []float32
	KVStride           int
	Pos0, N            int
}

// attnChunk is how many keys one step of a query panel takes: the score
// tile (attnChunk x 32) and the chunk's packed keys and values stay in L1/L2.
const attnChunk = 192

// attnPanel is the number of query rows (heads of a KV group times tokens)
// computed together: the GEMM micro-kernel's nr, with queries as columns.
const attnPanel = nr

// attnMinRows: a sequence with fewer query rows than this per KV head
// (decode steps) takes the decode path, where a panel would be mostly
// padding.
const attnMinRows = 16

// attnDecodeChunk is how many keys one work item of the decode path takes.
const attnDecodeChunk = 256

// Attention computes softmax(scale * Q K^T) V, causally masked, for every
// sequence in seqs.
//
// Prefill: query rows that share a KV head are processed in panels of 32
// (flash attention style, with a running max and sum per row). For each
// chunk of keys the micro-kernel computes the transposed scores S^T = K Q^T,
// so that the softmax runs down the columns with whole-vector operations and
// the exponentiated tile is already the packed operand of O^T += V^T P^T. No
// score matrix larger than one chunk is held.
//
// Decode (few new tokens): the keys are split into chunks that run in
// parallel (flash-decoding), each reading its keys and values position by
// position for all heads at once. Reading one head's keys across positions
// instead would jump a whole cache row between 256-byte reads and miss the
// TLB on nearly every one. The chunks' partial softmaxes are merged at the end.
func Attention(seqs []AttentionSeq, sh AttentionShape, scale float32) error {
	if err := checkAttention(seqs, sh); err != nil {
		return err
	}
	group := sh.Heads / sh.KVHeads
	hd := sh.HeadDim
	hdPad := (hd + mr - 1) / mr * mr
	type pack struct {
		seq, g int
		k, v   []float32 // keys packed [L/mr][hd][mr], values [hdPad/mr][L][mr]
		l      int       // key positions, padded to a multiple of mr
	}
	type item struct {
		seq, g, first int // panel items: KV head and first query row; decode items: first key
		pack          *pack
		cost          int
	}
	var packs []*pack
	var items []item
	parts := make([][]float32, len(seqs)) // decode path: per chunk and row, max, sum and output
	for s := range seqs {
		sq := &seqs[s]
		rows := sq.N * group
		if rows < attnMinRows {
			keys := sq.Pos0 + sq.N
			parts[s] = make([]float32, (keys+attnDecodeChunk-1)/attnDecodeChunk*sq.N*sh.Heads*(hd+2))
			for k0 := 0; k0 < keys; k0 += attnDecodeChunk {
				items = append(items, item{seq: s, first: k0, cost: min(attnDecodeChunk, keys-k0) * sq.N * sh.Heads * hd})
			}
			continue
		}
		for g := 0; g < sh.KVHeads; g++ {
			l := (sq.Pos0 + sq.N + mr - 1) / mr * mr
			p := &pack{seq: s, g: g, l: l}
			packs = append(packs, p)
			for r := 0; r < rows; r += attnPanel {
				last := min(rows, r+attnPanel) - 1
				items = append(items, item{seq: s, g: g, first: r, pack: p, cost: (sq.Pos0 + last/group + 1) * hd * attnPanel})
			}
		}
	}
	parallelFor(len(packs), func(i int) {
		p := packs[i]
		sq := &seqs[p.seq]
		p.k, p.v = make([]float32, p.l*hd), make([]float32, hdPad*p.l)
		packKV(p.k, p.v, sq.K, sq.V, sq.KVStride, p.g*hd, sq.Pos0+sq.N, hd, p.l)
	})
	// The longest items first, so that no core is left with one at the end.
	slices.SortFunc(items, func(a, b item) int { return b.cost - a.cost })
	parallelFor(len(items), func(i int) {
		it := items[i]
		sq := &seqs[it.seq]
		w := scratchPool.Get().(*attnScratch)
		if it.pack == nil {
			rows := sq.N * sh.Heads
			c := it.first / attnDecodeChunk
			attendChunk(sq, sh, it.first, scale, parts[it.seq][c*rows*(hd+2):(c+1)*rows*(hd+2)], w)
		} else {
			w.size(hd, hdPad)
			attendPanel(sq, sh, it.g, it.first, it.pack.k, it.pack.v, it.pack.l, scale, w)
		}
		scratchPool.Put(w)
	})
	parallelFor(len(seqs), func(s int) {
		if parts[s] != nil {
			mergeChunks(&seqs[s], sh, parts[s])
		}
	})
	return nil
}

func checkAttention(seqs []AttentionSeq, sh AttentionShape) error {
	if sh.Heads < 1 || sh.KVHeads < 1 || sh.HeadDim < 1 || sh.Heads%sh.KVHeads != 0 {
		return fmt.Errorf("cpu: attention: %d query heads, %d KV heads of %d values: want positive sizes and query heads a multiple of KV heads", sh.Heads, sh.KVHeads, sh.HeadDim)
	}
	qw, kvw := sh.Heads*sh.HeadDim, sh.KVHeads*sh.HeadDim
	for s, sq := range seqs {
		switch {
		case sq.N < 1 || sq.Pos0 < 0:
			return fmt.Errorf("cpu: attention: sequence %d: %d queries from position %d", s, sq.N, sq.Pos0)
		case sq.QStride < qw || sq.OutStride < qw || sq.KVStride < kvw:
			return fmt.Errorf("cpu: attention: sequence %d: row strides %d (Q), %d (Out), %d (K, V) below the %d and %d values of a row", s, sq.QStride, sq.OutStride, sq.KVStride, qw, kvw)
		case len(sq.Q) < (sq.N-1)*sq.QStride+qw || len(sq.Out) < (sq.N-1)*sq.OutStride+qw:
			return fmt.Errorf("cpu: attention: sequence %d: Q has %d values, Out %d, too few for %d rows", s, len(sq.Q), len(sq.Out), sq.N)
		case min(len(sq.K), len(sq.V)) < (sq.Pos0+sq.N-1)*sq.KVStride+kvw:
			return fmt.Errorf("cpu: attention: sequence %d: K has %d values, V %d, too few for %d positions", s, len(sq.K), len(sq.V), sq.Pos0+sq.N)
		}
	}
	return nil
}

// packKV packs the first n positions of one KV head (its values start at
// column off of rows of the given stride): keys as the A operand of
// S^T = K Q^T (groups of mr positions, [group][hd][mr]) and values as the A
// operand of O^T = V^T P^T (groups of mr head dimensions, [group][l][mr]).
// Padding is zero.
func packKV(kp, vp, k, v []float32, stride, off, n, hd, l int) {
	for p := 0; p < n; p++ {
		krow := k[p*stride+off:][:hd]
		kg := kp[p/mr*hd*mr+p%mr:]
		for d, x := range krow {
			kg[d*mr] = x
		}
		vrow := v[p*stride+off:][:hd]
		for d0 := 0; d0 < hd; d0 += mr {
			copy(vp[(d0/mr*l+p)*mr:][:mr], vrow[d0:min(hd, d0+mr)])
		}
	}
}

// attnScratch is one worker's tiles for attendPanel and attendChunk.
type attnScratch struct {
	q, st, ot           []float32 // queries [hd][32], scores [attnChunk][32], output [hdPad][32]
	scores              []float32 // the decode path's scores, rows x attnDecodeChunk
	m, mNew, sum, alpha [attnPanel]float32
	qpos                [attnPanel]int // query positions
}

var scratchPool = sync.Pool{New: func() any { return new(attnScratch) }}

// size makes the tiles fit head dimension hd.
func (w *attnScratch) size(hd, hdPad int) {
	if len(w.q) < hd*attnPanel {
		w.q = make([]float32, hd*attnPanel)
	}
	if len(w.ot) < hdPad*attnPanel {
		w.ot = make([]float32, hdPad*attnPanel)
	}
	if w.st == nil {
		w.st = make([]float32, attnChunk*attnPanel)
	}
}

// attendPanel computes the query rows first .. first+31 of KV head g (row r
// is token r/group, head g*group + r%group) from the packed keys kp and
// values vp (l positions).
func attendPanel(sq *AttentionSeq, sh AttentionShape, g, first int, kp, vp []float32, l int, scale float32, w *attnScratch) {
	hd, group := sh.HeadDim, sh.Heads/sh.KVHeads
	hdPad := (hd + mr - 1) / mr * mr
	rows := min(attnPanel, sq.N*group-first)
	// Queries as the B operand [hd][32], scaled by log2(e) too, so that
	// softmax is a power of two.
	qs := scale * math.Log2E
	q := w.q[:hd*attnPanel]
	clear(q)
	for j := 0; j < rows; j++ {
		i, h := (first+j)/group, g*group+(first+j)%group
		for d, v := range sq.Q[i*sq.QStride+h*hd:][:hd] {
			q[d*attnPanel+j] = v * qs
		}
		w.qpos[j] = sq.Pos0 + i
	}
	for j := rows; j < attnPanel; j++ {
		w.qpos[j] = w.qpos[rows-1] // padding columns: zero queries, harmless
	}
	for j := range w.m {
		w.m[j], w.sum[j] = float32(math.Inf(-1)), 0
	}
	ot := w.ot[:hdPad*attnPanel]
	clear(ot)
	minPos, maxPos := w.qpos[0], w.qpos[attnPanel-1]
	for c0 := 0; c0 <= maxPos; c0 += attnChunk {
		n := (min(attnChunk, maxPos+1-c0) + mr - 1) / mr * mr
		st := w.st[:n*attnPanel]
		for pg := 0; pg < n/mr; pg++ {
			microkernel(hd, kp[(c0/mr+pg)*hd*mr:], q, st[pg*mr*attnPanel:], attnPanel, false)
		}
		if c0+n-1 > minPos { // keys past some query: mask them
			for i := max(0, minPos+1-c0); i < n; i++ {
				row := st[i*attnPanel:][:attnPanel]
				for j, qp := range w.qpos {
					if c0+i > qp {
						row[j] = float32(math.Inf(-1))
					}
				}
			}
		}
		w.mNew = w.m
		colMaxKernel(st, n, w.mNew[:])
		rescale := false
		for j := range w.alpha {
			a := exp2Go(w.m[j] - w.mNew[j])
			w.alpha[j], w.m[j] = a, w.mNew[j]
			w.sum[j] *= a
			rescale = rescale || a != 1
		}
		if rescale && c0 > 0 {
			scaleRowsKernel(ot, hdPad, w.alpha[:])
		}
		exp2TileKernel(st, n, w.m[:], w.sum[:])
		for dg := 0; dg < hdPad/mr; dg++ {
			microkernel(n, vp[(dg*l+c0)*mr:], st, ot[dg*mr*attnPanel:], attnPanel, true)
		}
	}
	for j := 0; j < rows; j++ {
		i, h := (first+j)/group, g*group+(first+j)%group
		inv := 1 / w.sum[j]
		out := sq.Out[i*sq.OutStride+h*hd:][:hd]
		for d := range out {
			out[d] = ot[d*attnPanel+j] * inv
		}
	}
}

// attendChunk is one work item of the decode path: keys k0 .. k0+255 (or
// up to the last) for every query row (token i, head h: row i*Heads + h) of
// sq. It writes, per row, the chunk's maximum score, the sum of its
// exponentials and the unnormalised output into part (rows of hd + 2).
func attendChunk(sq *AttentionSeq, sh AttentionShape, k0 int, scale float32, part []float32, w *attnScratch) {
	hd, group, heads := sh.HeadDim, sh.Heads/sh.KVHeads, sh.Heads
	rows := sq.N * heads
	k1 := min(k0+attnDecodeChunk, sq.Pos0+sq.N)
	const C = attnDecodeChunk
	if len(w.scores) < rows*C {
		w.scores = make([]float32, rows*C)
	}
	sc := w.scores[:rows*C]
	negInf := float32(math.Inf(-1))
	qs := scale * math.Log2E
	// Scores, position by position: one key row holds every KV head.
	for p := k0; p < k1; p++ {
		krow := sq.K[p*sq.KVStride:]
		for i := 0; i < sq.N; i++ {
			masked := p > sq.Pos0+i
			q := sq.Q[i*sq.QStride:]
			for h := 0; h < heads; h++ {
				v := negInf
				if !masked {
					g := h / group
					v = Dot(q[h*hd:(h+1)*hd], krow[g*hd:(g+1)*hd]) * qs
				}
				sc[(i*heads+h)*C+p-k0] = v
			}
		}
	}
	for r := 0; r < rows; r++ {
		row := sc[r*C : (r+1)*C]
		for j := k1 - k0; j < C; j++ {
			row[j] = negInf
		}
		// the row as C/32 rows of 32: column maxima and sums, then reduced
		for j := range w.m {
			w.m[j], w.sum[j] = negInf, 0
		}
		colMaxKernel(row, C/32, w.m[:])
		m := slices.Max(w.m[:])
		o := part[r*(hd+2):][:hd+2]
		clear(o)
		o[0] = m
		if math.IsInf(float64(m), -1) { // every key of the chunk is after this row's token
			continue
		}
		for j := range w.m {
			w.m[j] = m
		}
		exp2TileKernel(row, C/32, w.m[:], w.sum[:])
		for _, v := range w.sum {
			o[1] += v
		}
	}
	// Outputs, position by position again.
	for p := k0; p < k1; p++ {
		vrow := sq.V[p*sq.KVStride:]
		for r := 0; r < rows; r++ {
			if e := sc[r*C+p-k0]; e != 0 {
				g := r % heads / group
				Axpy(e, vrow[g*hd:(g+1)*hd], part[r*(hd+2)+2:][:hd])
			}
		}
	}
}

// mergeChunks combines the decode path's per-chunk partial softmaxes of sq
// (part: chunks of rows of hd + 2: max, sum, output) into its outputs.
func mergeChunks(sq *AttentionSeq, sh AttentionShape, part []float32) {
	hd, heads := sh.HeadDim, sh.Heads
	rows := sq.N * heads
	chunks := len(part) / (rows * (hd + 2))
	for r := 0; r < rows; r++ {
		m := float32(math.Inf(-1))
		for c := 0; c < chunks; c++ {
			m = max(m, part[(c*rows+r)*(hd+2)])
		}
		i, h := r/heads, r%heads
		out := sq.Out[i*sq.OutStride+h*hd:][:hd]
		clear(out)
		sum := float32(0)
		for c := 0; c < chunks; c++ {
			pc := part[(c*rows+r)*(hd+2):][:hd+2]
			if pc[1] == 0 {
				continue
			}
			a := exp2Go(pc[0] - m)
			sum += a * pc[1]
			Axpy(a, pc[2:], out)
		}
		inv := 1 / sum
		for d := range out {
			out[d] *= inv
		}
	}
}
