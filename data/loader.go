package data

import (
	"errors"
	"fmt"
	"io"
	"math/bits"
)

// LoaderConfig sets the batch shape and the order of a Loader.
type LoaderConfig struct {
	// Batch is the number of sequences (rows) per batch on this rank.
	Batch int
	// SeqLen is T: each row holds T+1 consecutive tokens, the inputs and the shifted targets.
	SeqLen int
	// Seed fixes the order of the windows.
	Seed uint64
	// Rank and World split each global batch of World*Batch rows between data-parallel
	// workers: rank r gets rows r*Batch .. (r+1)*Batch-1. World 0 means 1.
	Rank, World int
}

// LoaderState is the position of a Loader: everything needed, with the same dataset, to go on
// exactly where it stopped. It encodes to small JSON for checkpoints.
type LoaderState struct {
	Seed        uint64 `json:"seed"`
	SeqLen      int    `json:"seq_len"`
	TrainTokens int64  `json:"train_tokens"` // identifies the dataset the position refers to
	Windows     uint64 `json:"windows"`      // windows handed out so far, over all ranks
}

// Loader yields training batches of token windows. The training tokens are cut into W windows
// of SeqLen+1 tokens that start SeqLen apart (so consecutive windows share one token), with a
// start offset that changes every epoch; each epoch visits every window once, in an order
// that depends only on the seed and the epoch. A batch may run from one epoch into the next.
// The position is a count of windows, so State and Restore resume exactly.
type Loader struct {
	d       *Dataset
	cfg     LoaderConfig
	n       int64  // training tokens
	windows uint64 // W, windows per epoch
	slack   int64  // largest start offset
	pos     uint64
}

// NewLoader returns a Loader over the training split, at the start of epoch 0.
func (d *Dataset) NewLoader(cfg LoaderConfig) (*Loader, error) {
	if cfg.World == 0 {
		cfg.World = 1
	}
	switch {
	case cfg.Batch <= 0:
		return nil, fmt.Errorf("data: loader batch %d, want > 0", cfg.Batch)
	case cfg.SeqLen <= 0:
		return nil, fmt.Errorf("data: loader sequence length %d, want > 0", cfg.SeqLen)
	case cfg.World < 0 || cfg.Rank < 0 || cfg.Rank >= cfg.World:
		return nil, fmt.Errorf("data: loader rank %d of world %d", cfg.Rank, cfg.World)
	}
	n := d.train.len()
	t := int64(cfg.SeqLen)
	w := (n - 1) / t
	if w <= 0 {
		return nil, fmt.Errorf("data: the training split has %d tokens, fewer than one sequence of %d+1", n, cfg.SeqLen)
	}
	if w >= 2 {
		w-- // leave room for a start offset of up to SeqLen-1 tokens
	}
	l := &Loader{d: d, cfg: cfg, n: n, windows: uint64(w), slack: min(n-1-w*t, t-1)}
	return l, nil
}

// WindowsPerEpoch returns W, the number of windows in an epoch.
func (l *Loader) WindowsPerEpoch() uint64 { return l.windows }

// Epoch returns how many epochs have been consumed, as a fraction.
func (l *Loader) Epoch() float64 { return float64(l.pos) / float64(l.windows) }

// BatchLen returns Batch*(SeqLen+1), the number of tokens Next writes.
func (l *Loader) BatchLen() int { return l.cfg.Batch * (l.cfg.SeqLen + 1) }

// Next returns the next batch: Batch rows of SeqLen+1 tokens, row after row. It reuses dst
// when it is large enough.
func (l *Loader) Next(dst []int32) ([]int32, error) {
	if l.d.shards == nil {
		return nil, errors.New("data: loader used after its dataset was closed")
	}
	b, t := l.cfg.Batch, l.cfg.SeqLen
	if cap(dst) < b*(t+1) {
		dst = make([]int32, b*(t+1))
	}
	dst = dst[:b*(t+1)]
	first := l.pos + uint64(l.cfg.Rank*b)
	for j := range b {
		off := l.windowStart(first + uint64(j))
		l.d.train.read(dst[j*(t+1):(j+1)*(t+1)], off)
	}
	l.pos += uint64(l.cfg.World * b)
	return dst, nil
}

// windowStart returns the token offset of global window g. It only reads the loader's fixed
// settings, so it is safe to call concurrently.
func (l *Loader) windowStart(g uint64) int64 {
	e, k := g/l.windows, g%l.windows
	perm := newFeistel(l.windows, l.cfg.Seed, e)
	shift := int64(0)
	if l.slack > 0 {
		shift = int64(mix64(l.cfg.Seed^mix64(e^0x5348494654)) % uint64(l.slack+1))
	}
	return shift + int64(perm.at(k))*int64(l.cfg.SeqLen)
}

// Window fills dst, which must hold SeqLen+1 tokens, with global window i of the loader's
// order: the window that Next hands out as row i of the concatenated batches (for all ranks
// together). It depends only on i, the seed and the dataset, so it suits trainers that
// address windows by number; it is safe for concurrent use.
func (l *Loader) Window(dst []int, i int64) error {
	if len(dst) != l.cfg.SeqLen+1 {
		return fmt.Errorf("data: window of %d tokens, this loader's windows have %d", len(dst), l.cfg.SeqLen+1)
	}
	if i < 0 {
		return fmt.Errorf("data: window %d is negative", i)
	}
	if l.d.shards == nil {
		return errors.New("data: loader used after its dataset was closed")
	}
	buf := make([]int32, len(dst))
	l.d.train.read(buf, l.windowStart(uint64(i)))
	for j, t := range buf {
		dst[j] = int(t)
	}
	return nil
}

// State returns the loader's position.
func (l *Loader) State() LoaderState {
	return LoaderState{Seed: l.cfg.Seed, SeqLen: l.cfg.SeqLen, TrainTokens: l.n, Windows: l.pos}
}

// Restore moves the loader to a position from State. The sequence length and the dataset
// must be the ones the state was taken with; the seed is taken from the state.
func (l *Loader) Restore(s LoaderState) error {
	if s.SeqLen != l.cfg.SeqLen {
		return fmt.Errorf("data: loader state is for sequence length %d, this loader has %d", s.SeqLen, l.cfg.SeqLen)
	}
	if s.TrainTokens != l.n {
		return fmt.Errorf("data: loader state is for a training split of %d tokens, this dataset has %d", s.TrainTokens, l.n)
	}
	l.cfg.Seed = s.Seed
	l.pos = s.Windows
	return nil
}

// mix64 is the SplitMix64 finalizer, a fast bijective scrambler of 64-bit values.
func mix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// feistel is a keyed permutation of [0, n): a 4-round Feistel network on 2*half bits, with
// cycle walking to stay below n. It needs no table, so any position is found directly.
type feistel struct {
	n    uint64
	half uint
	mask uint64
	keys [4]uint64
}

func newFeistel(n, seed, epoch uint64) feistel {
	b := uint(bits.Len64(n - 1))
	b = max(b+b&1, 2)
	f := feistel{n: n, half: b / 2, mask: 1<<(b/2) - 1}
	for i := range f.keys {
		f.keys[i] = mix64(seed ^ mix64(epoch*4+uint64(i)+0x7f4a7c15))
	}
	return f
}

// at returns the image of k (k < n).
func (f feistel) at(k uint64) uint64 {
	for {
		l, r := k>>f.half, k&f.mask
		for _, key := range f.keys {
			l, r = r, l^(mix64(r^key)&f.mask)
		}
		k = l<<f.half | r
		if k < f.n {
			return k
		}
	}
}

// ValIter walks the validation tokens of one source in order, as windows of SeqLen+1 tokens
// that start SeqLen apart, so every token but the first is predicted exactly once. Tokens
// after the last whole window are left out.
type ValIter struct {
	s       *stream
	batch   int
	seqLen  int
	next    int64
	windows int64
}

// Val returns an iterator over the validation split of source, in batches of up to batch
// windows of seqLen+1 tokens.
func (d *Dataset) Val(source string, batch, seqLen int) (*ValIter, error) {
	if batch <= 0 || seqLen <= 0 {
		return nil, fmt.Errorf("data: validation batch %d and sequence length %d, want both > 0", batch, seqLen)
	}
	s, ok := d.val[source]
	if !ok {
		return nil, fmt.Errorf("data: source %q has no validation split (sources with one: %v)", source, d.ValSources())
	}
	return &ValIter{s: s, batch: batch, seqLen: seqLen, windows: (s.len() - 1) / int64(seqLen)}, nil
}

// Window fills dst, which must hold SeqLen+1 tokens, with window i (0 <= i < Windows) of the
// validation split, independently of the iterator's position.
func (it *ValIter) Window(dst []int, i int64) error {
	if len(dst) != it.seqLen+1 {
		return fmt.Errorf("data: window of %d tokens, this iterator's windows have %d", len(dst), it.seqLen+1)
	}
	if i < 0 || i >= it.Windows() {
		return fmt.Errorf("data: validation window %d outside [0,%d)", i, it.Windows())
	}
	buf := make([]int32, len(dst))
	it.s.read(buf, i*int64(it.seqLen))
	for j, t := range buf {
		dst[j] = int(t)
	}
	return nil
}

// Windows returns the number of windows the iterator yields in all.
func (it *ValIter) Windows() int64 { return max(it.windows, 0) }

// Tokens returns the number of tokens predicted over all windows (Windows*SeqLen).
func (it *ValIter) Tokens() int64 { return it.Windows() * int64(it.seqLen) }

// Reset goes back to the first window.
func (it *ValIter) Reset() { it.next = 0 }

// Next fills dst (reused when large enough) with the next rows, row after row, and returns
// them and their number: batch, fewer for the last batch, or 0 and io.EOF at the end.
func (it *ValIter) Next(dst []int32) ([]int32, int, error) {
	rows := int(min(int64(it.batch), it.windows-it.next))
	if rows <= 0 {
		return dst[:0], 0, io.EOF
	}
	w := it.seqLen + 1
	if cap(dst) < rows*w {
		dst = make([]int32, it.batch*w)
	}
	dst = dst[:rows*w]
	for j := range rows {
		it.s.read(dst[j*w:(j+1)*w], (it.next+int64(j))*int64(it.seqLen))
	}
	it.next += int64(rows)
	return dst, rows, nil
}
