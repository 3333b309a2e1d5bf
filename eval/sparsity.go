package eval

import "github.com/twell-ai/twell/engine"

// layerSum accumulates one layer's active-unit counts.
type layerSum struct {
	active float64 // sum over measured calls of MeanActive*Tokens
	tokens int64   // tokens of the measured calls
}

// sparsity accumulates the MLP statistics of Forward calls.
type sparsity struct {
	layers []layerSum
	tokens int64
}

func (s *sparsity) add(st *engine.Stats) {
	if st == nil {
		return
	}
	s.tokens += int64(st.Tokens)
	for l, a := range st.MeanActive {
		if l >= len(s.layers) || a < 0 {
			continue
		}
		s.layers[l].active += a * float64(st.Tokens)
		s.layers[l].tokens += int64(st.Tokens)
	}
}

// LayerSparsity is the MLP activity of one layer over the tokens an
// Evaluator ran.
type LayerSparsity struct {
	Layer int `json:"layer"`
	// Tokens is the number of tokens whose activity was measured (calls
	// where the backend did not measure it, a dense MLP for example, are
	// left out).
	Tokens int64 `json:"tokens"`
	// MeanActive is the mean number of active MLP units per token, and
	// Fraction that over the MLP width; both nil when nothing was
	// measured.
	MeanActive *float64 `json:"mean_active"`
	Fraction   *float64 `json:"fraction"`
}

// Sparsity returns, per layer, the mean active MLP units per token over
// every Forward call the evaluator made (context prefills and choice
// continuations included), weighted by each call's tokens, and the number
// of tokens run in all.
func (ev *Evaluator) Sparsity() ([]LayerSparsity, int64) {
	width := float64(ev.e.Config().IntermediateSize)
	out := make([]LayerSparsity, len(ev.sp.layers))
	for l, s := range ev.sp.layers {
		out[l] = LayerSparsity{Layer: l, Tokens: s.tokens}
		if s.tokens > 0 {
			m := s.active / float64(s.tokens)
			f := m / width
			out[l].MeanActive, out[l].Fraction = &m, &f
		}
	}
	return out, ev.sp.tokens
}
