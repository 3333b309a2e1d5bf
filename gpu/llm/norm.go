package llm

import "github.com/twell-ai/twell/cuda"

// normArgs are the operands of add_rmsnorm (norm.cu) over n rows of d
// values: with rows nil, row r of the fp32 residual stream resid gets
// delta's row r added (delta nil: nothing) and is written back; with rows
// set (the final norm), row b reads resid row rows[b] and resid is not
// written. out (bf16) gets the normed rows scaled by w (fp32 [d]). early
// launches it with early start (it waits with grid_wait).
type normArgs struct {
	resid, delta, rows, w, out *cuda.Buffer
	n, d                       int
	eps                        float32
	early                      bool
}

// launch queues add_rmsnorm: one block per row.
func (a normArgs) launch(fn *cuda.Function, s *cuda.Stream) error {
	return fn.LaunchEx(cuda.LaunchConfig{Grid: cuda.Dim3{uint32(a.n), 1, 1}, Block: normBlock(a.d), Stream: s, EarlyStart: a.early},
		a.resid, optional(a.delta), optional(a.rows), a.w, a.out, int32(a.d), a.eps)
}

// normBlock returns the block size of add_rmsnorm for hidden size h: its
// register-resident form holds 16 values per thread.
func normBlock(h int) cuda.Dim3 {
	if h > 16*256 {
		return cuda.Dim3{1024, 1, 1}
	}
	return cuda.Dim3{256, 1, 1}
}

// embedRows queues embed (norm.cu): resid[t] = table[ids[t]] for T tokens
// of d values, one block each.
func embedRows(fn *cuda.Function, s *cuda.Stream, table, ids, resid *cuda.Buffer, T, d int) error {
	return fn.Launch(cuda.Dim3{uint32(T), 1, 1}, cuda.Dim3{256, 1, 1}, 0, s, table, ids, resid, int32(d))
}

// optional returns b as a kernel argument, or a null pointer for nil.
func optional(b *cuda.Buffer) any {
	if b == nil {
		return cuda.DevicePtr(0)
	}
	return b
}
