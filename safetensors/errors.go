package safetensors

import (
	"errors"
	"fmt"
	"io/fs"
	"strconv"
)

// Error kinds, for errors.Is on the errors this package returns.
var (
	// ErrFormat marks a file or index that does not follow the safetensors format.
	ErrFormat = errors.New("invalid safetensors data")
	// ErrNotFound marks a tensor (or shard file) that is not there.
	ErrNotFound = errors.New("not found")
	// ErrMismatch marks a tensor whose dtype or shape is not the one Expect asked for.
	ErrMismatch = errors.New("tensor mismatch")
)

// Error describes a problem with one file or checkpoint, and the tensor concerned if any.
// Its text reads "safetensors: PATH: tensor "NAME": MSG".
type Error struct {
	Path   string // file, index or directory at fault
	Tensor string // tensor concerned; empty when the problem is not about one tensor
	Msg    string // what is wrong
	Kind   error  // ErrFormat, ErrNotFound or ErrMismatch; nil for I/O problems
	Err    error  // underlying cause, if any (printed after Msg)
}

// Error formats the problem with its path and tensor name.
func (e *Error) Error() string {
	s := "safetensors: " + e.Path + ": "
	if e.Tensor != "" {
		s += "tensor " + strconv.Quote(e.Tensor) + ": "
	}
	s += e.Msg
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unwrap returns the kind and the cause, so errors.Is works with both.
func (e *Error) Unwrap() []error {
	var errs []error
	if e.Kind != nil {
		errs = append(errs, e.Kind)
	}
	if e.Err != nil {
		errs = append(errs, e.Err)
	}
	return errs
}

func formatErr(path, tensor, format string, args ...any) error {
	return &Error{Path: path, Tensor: tensor, Msg: fmt.Sprintf(format, args...), Kind: ErrFormat}
}

// ioErr wraps an I/O error for path; a *fs.PathError is unwrapped since Path already names
// the file.
func ioErr(path, op string, err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		err = pe.Err
	}
	return &Error{Path: path, Msg: op, Err: err}
}
