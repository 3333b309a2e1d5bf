package model

// RoPETables hands out the rotary-embedding tables that Model.Forward uses,
// for other backends (the GPU forward) that must rotate by exactly the same
// angles, scaling variants included. Like the model's own table it is
// computed on demand and kept: Tables may return a longer table than asked
// for, and for "dynamic" scaling past the trained length the angles depend
// on the longest length asked for so far, as in Model.Forward. A backend
// that asks for the same lengths in the same order as the CPU model gets
// the same values. It is safe for concurrent use.
type RoPETables struct {
	t ropeTable
}

// NewRoPETables returns the tables of a model with config c.
func NewRoPETables(c Config) *RoPETables {
	r := &RoPETables{}
	r.t = newRopeTable(c)
	return r
}

// Tables returns cos and sin for at least positions [0, n), each laid out
// [position][HeadDim/2] (the pairs (i, i + HeadDim/2) of Hugging Face's
// rotate_half). The slices are shared: do not modify them; a later call
// may return new ones.
func (r *RoPETables) Tables(n int) (cos, sin []float32) { return r.t.tables(n) }
