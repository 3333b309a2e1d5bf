package train

import (
	"fmt"
	"math/rand/v2"
)

// Source supplies training windows of seq+1 tokens. Window i must depend
// only on i (and the source's own fixed settings), so that a resumed run
// sees exactly the batches the interrupted one would have.
type Source interface {
	Window(dst []int, i int64) error
}

// StreamSource draws windows at pseudo-random offsets of a token stream:
// window i starts at an offset derived from (seed, i).
type StreamSource struct {
	tokens []int
	seed   uint64
}

// NewStreamSource returns a source over tokens.
func NewStreamSource(tokens []int, seed uint64) *StreamSource {
	return &StreamSource{tokens: tokens, seed: seed}
}

// Window fills dst with window i.
func (s *StreamSource) Window(dst []int, i int64) error {
	n := len(s.tokens) - len(dst)
	if n < 0 {
		return fmt.Errorf("train: %d tokens of data, fewer than one window of %d", len(s.tokens), len(dst))
	}
	r := rand.New(rand.NewPCG(s.seed, uint64(i)))
	off := r.IntN(n + 1)
	copy(dst, s.tokens[off:off+len(dst)])
	return nil
}

// Windows returns the windows of seq+1 tokens that tile tokens in order
// (consecutive windows share one token), at most limit of them: the held-out
// windows of a run.
func Windows(tokens []int, seq, limit int) [][]int {
	var out [][]int
	for off := 0; off+seq+1 <= len(tokens) && len(out) < limit; off += seq {
		out = append(out, tokens[off:off+seq+1])
	}
	return out
}
