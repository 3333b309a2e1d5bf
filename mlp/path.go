// Package mlp names how a sparse MLP block runs (the TwELL sparse path, the
// plain dense path, or a choice per call) and holds the one rule that
// makes that choice from a measured activation density. Both engines, the
// CPU and GPU MLP kernels and the benchmarks use it.
package mlp

import (
	"fmt"
	"strings"

	"github.com/twell-ai/twell/internal/enum"
)

// Path is how an MLP call runs.
type Path uint8

// The paths.
const (
	// Auto chooses per call: sparse while the measured density is at or
	// below the threshold, dense above it (the GPU also consults timings).
	Auto Path = iota
	// Sparse always runs the TwELL path (D2T, then the sparse finish).
	Sparse
	// Dense always runs the plain dense MLP (three GEMMs): the baseline.
	Dense
)

// String returns "auto", "sparse" or "dense".
func (p Path) String() string { return enum.String(p, "mlp.Path", "auto", "sparse", "dense") }

// ParsePath reads "auto", "sparse" or "dense" (any case).
func ParsePath(s string) (Path, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "auto", "":
		return Auto, nil
	case "sparse":
		return Sparse, nil
	case "dense":
		return Dense, nil
	}
	return Auto, fmt.Errorf("MLP path %q: want auto, sparse or dense", s)
}

// Set parses s into p, so that a Path is a flag.Value.
func (p *Path) Set(s string) error {
	v, err := ParsePath(s)
	if err != nil {
		return err
	}
	*p = v
	return nil
}

// Choose is the decision rule: the path a call runs when p was asked for
// and the activation density (active units / MLP width, in [0, 1]) was
// measured, given the density above which the dense path is faster. Sparse
// and Dense are kept as asked; Auto becomes Dense above denseAbove and
// Sparse otherwise (a NaN density counts as dense).
func Choose(p Path, density, denseAbove float64) Path {
	if p != Auto {
		return p
	}
	if density <= denseAbove {
		return Sparse
	}
	return Dense
}
