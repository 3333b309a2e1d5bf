package model

import (
	"fmt"
	"math"
	"path/filepath"
	"sync"

	"github.com/twell-ai/twell/cpu"
	"github.com/twell-ai/twell/safetensors"
	"github.com/twell-ai/twell/twell"
)

// Model is a Llama-style decoder ready to run on the CPU: float32 weights,
// projections packed for the GEMM, MLPs on the TwELL path where the gate is
// ReLU (chosen per batch by measured density) and dense otherwise. The
// packing happens at the first Forward, so a model that only feeds the GPU
// engine never pays for it.
type Model struct {
	Config  Config
	Weights *Weights
	// Layout is the TwELL layout of the sparse MLP activations.
	Layout twell.Layout

	packMu  sync.Mutex   // guards the first packing
	layers  []cpuLayer   // nil until packed
	head    *cpu.PackedB // LM head (the embedding when tied)
	rope    ropeTable
	mlpPath string // "auto", "sparse" or "dense"
	mlpAct  cpu.Activation
	bf16    bool // decode-sized products read bf16 weight copies
	// beforeMLP, when set, sees each layer's normalised MLP input before
	// the MLP runs (gate calibration uses it).
	beforeMLP func(layer int, hn []float32, tokens int) error
}

type cpuLayer struct {
	qkv, o *cpu.PackedB
	mlp    *cpu.MLP
}

// New makes a model of config c from weights w (their shapes checked by
// LoadWeights or RandomWeights). The CPU kernels' packed copies of the
// weights are made at the first Forward.
func New(c Config, w *Weights) (*Model, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	act, _ := c.GateActivation()
	var mact cpu.Activation
	switch act {
	case ActReLU:
		mact = cpu.ReLU
	case "silu":
		mact = cpu.SiLU
	default:
		return nil, fmt.Errorf("model: MLP activation %q not supported (want relu or silu)", act)
	}
	m := &Model{Config: c, Weights: w, Layout: twell.DefaultLayout, mlpAct: mact}
	m.rope = newRopeTable(c)
	return m, nil
}

// pack makes the packed copies of the weights unless they exist.
func (m *Model) pack() error {
	m.packMu.Lock()
	defer m.packMu.Unlock()
	if m.layers != nil {
		return nil
	}
	return m.repack()
}

// repack packs every weight for the CPU kernels; call it after changing
// Weights.
func (m *Model) repack() error {
	c, w := m.Config, m.Weights
	layers := make([]cpuLayer, len(w.Layers))
	for i := range layers {
		var err error
		if layers[i], err = m.packLayer(i); err != nil {
			return err
		}
	}
	head := w.LMHead
	if c.TieWordEmbeddings {
		head = w.Embed
	}
	var err error
	if m.head, err = cpu.PackB(head, c.VocabSize, c.HiddenSize); err != nil {
		return fmt.Errorf("model: LM head: %w", err)
	}
	if m.bf16 {
		m.head.UseBF16ForSmallM()
	}
	m.layers = layers
	return nil
}

// repackLayer packs layer i's weights again, after a change to them.
func (m *Model) repackLayer(i int) error {
	l, err := m.packLayer(i)
	if err != nil {
		return err
	}
	m.layers[i] = l
	return nil
}

// packLayer packs layer i's weights.
func (m *Model) packLayer(i int) (cpuLayer, error) {
	c, lw := m.Config, m.Weights.Layers[i]
	h, hd := c.HiddenSize, c.HeadDim
	qkvRows := (c.NumAttentionHeads + 2*c.NumKeyValueHeads) * hd
	qkv := make([]float32, 0, qkvRows*h)
	qkv = append(append(append(qkv, lw.Q...), lw.K...), lw.V...)
	var l cpuLayer
	var err error
	if l.qkv, err = cpu.PackB(qkv, qkvRows, h); err != nil {
		return l, fmt.Errorf("model: layer %d attention: %w", i, err)
	}
	if l.o, err = cpu.PackB(lw.O, h, c.NumAttentionHeads*hd); err != nil {
		return l, fmt.Errorf("model: layer %d output projection: %w", i, err)
	}
	if l.mlp, err = cpu.NewMLP(lw.Gate, lw.Up, lw.Down, h, c.IntermediateSize); err != nil {
		return l, fmt.Errorf("model: layer %d MLP: %w", i, err)
	}
	l.mlp.Act = m.mlpAct
	if m.bf16 {
		l.qkv.UseBF16ForSmallM()
		l.o.UseBF16ForSmallM()
		l.mlp.UseBF16ForSmallM()
	}
	if m.mlpPath == "sparse" {
		l.mlp.AutoDensity = 2
	}
	return l, nil
}

// Load reads a Hugging Face style checkpoint directory: config.json and
// model.safetensors (or a sharded index).
func Load(dir string) (*Model, error) {
	c, err := LoadConfig(filepath.Join(dir, "config.json"))
	if err != nil {
		return nil, err
	}
	ck, err := safetensors.OpenDir(dir)
	if err != nil {
		return nil, err
	}
	defer ck.Close()
	w, err := LoadWeights(c, ck)
	if err != nil {
		return nil, err
	}
	return New(c, w)
}

// Cache is the key/value cache of one sequence.
type Cache struct {
	k, v [][]float32 // per layer: [capacity][kvHeads*headDim]
	cap  int
	// Len is the number of positions already in the cache.
	Len int
}

// NewCache returns an empty cache for sequences of up to capacity tokens.
func (m *Model) NewCache(capacity int) *Cache {
	kvw := m.Config.NumKeyValueHeads * m.Config.HeadDim
	c := &Cache{cap: capacity}
	for range m.Config.NumHiddenLayers {
		c.k = append(c.k, make([]float32, capacity*kvw))
		c.v = append(c.v, make([]float32, capacity*kvw))
	}
	return c
}

// UseBF16ForDecode makes steps of at most 16 tokens (decoding up to 16
// sequences) read bfloat16 copies of the projection and MLP weights:
// decoding is bound by memory bandwidth, and bf16 halves the bytes. Logits
// then differ from a float32 recompute by bf16 rounding of the weights. It
// costs memory for the copies.
func (m *Model) UseBF16ForDecode() {
	m.packMu.Lock()
	defer m.packMu.Unlock()
	m.bf16 = true
	if m.layers == nil {
		return // packing will make them
	}
	for _, l := range m.layers {
		l.qkv.UseBF16ForSmallM()
		l.o.UseBF16ForSmallM()
		l.mlp.UseBF16ForSmallM()
	}
	m.head.UseBF16ForSmallM()
}

// SetMLPPath chooses how the MLPs run: "auto" (TwELL D2T, then the sparse
// or dense finish by measured density), "sparse" (always the TwELL sparse
// finish) or "dense" (the plain dense MLP, three GEMMs: the baseline).
func (m *Model) SetMLPPath(path string) error {
	var d float64
	switch path {
	case "auto", "dense":
	case "sparse":
		d = 2
	default:
		return fmt.Errorf("model: MLP path %q: want auto, sparse or dense", path)
	}
	m.packMu.Lock()
	defer m.packMu.Unlock()
	for _, l := range m.layers {
		l.mlp.AutoDensity = d
	}
	m.mlpPath = path
	return nil
}

// Stats reports what one Forward call did in its MLPs.
type Stats struct {
	Tokens      int
	ActiveUnits []int64 // per layer: total active MLP units over the tokens
	SparseLayer []bool  // per layer: whether the sparse tail ran
}

// Forward appends tokens[i] to sequence i (whose cache is caches[i]) and
// returns, for each sequence, the logits of its last new token, or of every
// new token when allLogits is set (rows of VocabSize values).
func (m *Model) Forward(caches []*Cache, tokens [][]int, allLogits bool) ([][]float32, *Stats, error) {
	c := m.Config
	if len(caches) != len(tokens) {
		return nil, nil, fmt.Errorf("model: %d caches for %d sequences", len(caches), len(tokens))
	}
	if err := m.pack(); err != nil {
		return nil, nil, err
	}
	h, hd := c.HiddenSize, c.HeadDim
	nq, nkv := c.NumAttentionHeads, c.NumKeyValueHeads
	// Flatten the batch: token t belongs to sequence seqOf[t] at position pos[t].
	var seqOf, pos []int
	for s, toks := range tokens {
		if len(toks) == 0 {
			return nil, nil, fmt.Errorf("model: sequence %d has no new tokens", s)
		}
		if caches[s].Len+len(toks) > caches[s].cap {
			return nil, nil, fmt.Errorf("model: sequence %d would reach %d tokens, past its cache of %d", s, caches[s].Len+len(toks), caches[s].cap)
		}
		for i, id := range toks {
			if id < 0 || id >= c.VocabSize {
				return nil, nil, fmt.Errorf("model: sequence %d token %d: id %d outside the vocabulary [0, %d)", s, i, id, c.VocabSize)
			}
			seqOf = append(seqOf, s)
			pos = append(pos, caches[s].Len+i)
		}
	}
	T := len(seqOf)
	x := make([]float32, T*h)
	t := 0
	for _, toks := range tokens {
		for _, id := range toks {
			copy(x[t*h:(t+1)*h], m.Weights.Embed[id*h:(id+1)*h])
			t++
		}
	}
	st := &Stats{Tokens: T, ActiveUnits: make([]int64, len(m.layers)), SparseLayer: make([]bool, len(m.layers))}
	qkvW := (nq + 2*nkv) * hd
	hn := make([]float32, T*h)
	qkv := make([]float32, T*qkvW)
	att := make([]float32, T*nq*hd)
	proj := make([]float32, T*h)
	maxPos := 0
	for _, p := range pos {
		maxPos = max(maxPos, p)
	}
	cos, sin := m.rope.tables(maxPos + 1)
	seqs := make([]cpu.AttentionSeq, len(tokens))
	attShape := cpu.AttentionShape{Heads: nq, KVHeads: nkv, HeadDim: hd}
	attScale := float32(1 / math.Sqrt(float64(hd)))
	for li, l := range m.layers {
		lw := &m.Weights.Layers[li]
		rmsNorm(hn, x, lw.AttnNorm, T, h, c.RMSNormEps)
		if err := cpu.Gemm(qkv, hn, T, l.qkv); err != nil {
			return nil, nil, err
		}
		kvw := nkv * hd
		cpu.ParallelFor(T, func(t int) {
			row := qkv[t*qkvW : (t+1)*qkvW]
			p := pos[t]
			for hh := 0; hh < nq+nkv; hh++ { // queries and keys get RoPE
				applyRope(row[hh*hd:(hh+1)*hd], cos[p*hd/2:(p+1)*hd/2], sin[p*hd/2:(p+1)*hd/2])
			}
			cache := caches[seqOf[t]]
			copy(cache.k[li][p*kvw:(p+1)*kvw], row[nq*hd:nq*hd+kvw])
			copy(cache.v[li][p*kvw:(p+1)*kvw], row[nq*hd+kvw:])
		})
		t0 := 0
		for s, toks := range tokens {
			seqs[s] = cpu.AttentionSeq{
				Q: qkv[t0*qkvW : (t0+len(toks))*qkvW], QStride: qkvW,
				Out: att[t0*nq*hd : (t0+len(toks))*nq*hd], OutStride: nq * hd,
				K: caches[s].k[li], V: caches[s].v[li], KVStride: kvw,
				Pos0: caches[s].Len, N: len(toks),
			}
			t0 += len(toks)
		}
		if err := cpu.Attention(seqs, attShape, attScale); err != nil {
			return nil, nil, fmt.Errorf("model: layer %d attention: %w", li, err)
		}
		if err := cpu.Gemm(proj, att, T, l.o); err != nil {
			return nil, nil, err
		}
		addInto(x, proj)
		rmsNorm(hn, x, lw.MLPNorm, T, h, c.RMSNormEps)
		if m.beforeMLP != nil {
			if err := m.beforeMLP(li, hn, T); err != nil {
				return nil, nil, err
			}
			l = m.layers[li]
		}
		var p *twell.Matrix
		var sparse bool
		var err error
		if m.mlpPath == "dense" {
			err = l.mlp.Dense(proj, hn, T)
		} else {
			p, sparse, err = l.mlp.Forward(proj, hn, T, m.Layout)
		}
		if err != nil {
			return nil, nil, fmt.Errorf("model: layer %d MLP: %w", li, err)
		}
		st.SparseLayer[li] = sparse
		if p != nil {
			for r := 0; r < T; r++ {
				st.ActiveUnits[li] += int64(p.RowNNZ(r))
			}
		}
		addInto(x, proj)
	}
	for s, toks := range tokens {
		caches[s].Len += len(toks)
	}
	// Logits for the rows asked for.
	var rows []int
	t = 0
	for _, toks := range tokens {
		if allLogits {
			for i := range toks {
				rows = append(rows, t+i)
			}
		} else {
			rows = append(rows, t+len(toks)-1)
		}
		t += len(toks)
	}
	sel := make([]float32, len(rows)*h)
	for i, r := range rows {
		copy(sel[i*h:(i+1)*h], x[r*h:(r+1)*h])
	}
	normed := make([]float32, len(sel))
	rmsNorm(normed, sel, m.Weights.Norm, len(rows), h, c.RMSNormEps)
	logits := make([]float32, len(rows)*c.VocabSize)
	if err := cpu.Gemm(logits, normed, len(rows), m.head); err != nil {
		return nil, nil, err
	}
	out := make([][]float32, len(rows))
	for i := range rows {
		out[i] = logits[i*c.VocabSize : (i+1)*c.VocabSize]
	}
	return out, st, nil
}

func rmsNorm(dst, x, w []float32, rows, h int, eps float64) {
	cpu.ParallelFor(rows, func(r int) {
		row := x[r*h : (r+1)*h]
		ss := 0.0
		for _, v := range row {
			ss += float64(v) * float64(v)
		}
		inv := float32(1 / math.Sqrt(ss/float64(h)+eps))
		out := dst[r*h : (r+1)*h]
		for i, v := range row {
			out[i] = v * inv * w[i]
		}
	})
}

func addInto(x, y []float32) {
	for i, v := range y {
		x[i] += v
	}
}
