// Package safetensors reads and writes the Hugging Face safetensors format: an 8-byte
// little-endian header length, a JSON header that maps tensor names to dtype, shape and
// byte range, then the raw little-endian tensor bytes.
//
// Files are memory-mapped and tensors are zero-copy views; every header is checked in full
// (dtypes, shapes against byte ranges, ranges that tile the data section exactly), so a
// corrupt or truncated file is reported as an error naming the file and the tensor.
// Sharded checkpoints (model.safetensors.index.json) open as one merged Checkpoint.
package safetensors

import (
	"encoding/binary"
	"fmt"
	"os"
	"slices"

	"github.com/edsrzf/mmap-go"
)

// Tensor is one named tensor of a file. Data is a view into the file's memory: it is valid
// until the File is closed and must not be modified.
type Tensor struct {
	Name  string
	DType DType
	Shape []int
	Data  []byte
}

// NumElements returns the product of the shape (1 for a scalar).
func (t Tensor) NumElements() int {
	n := 1
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// Float32 returns the elements converted to float32. It accepts BF16, F16, F32 and F64;
// BF16 and F16 widen exactly, F64 rounds. NaN and infinities pass through as they are:
// call CheckFinite first to refuse them with the tensor's name.
func (t Tensor) Float32() ([]float32, error) {
	dst := make([]float32, t.NumElements())
	if err := t.Float32Into(dst); err != nil {
		return nil, err
	}
	return dst, nil
}

// Float32Into converts the elements into dst, which must have exactly NumElements values.
func (t Tensor) Float32Into(dst []float32) error {
	if size := t.DType.Size(); size == 0 || len(t.Data) != t.NumElements()*size {
		return fmt.Errorf("safetensors: tensor %q: %d bytes do not hold shape %v of %s", t.Name, len(t.Data), t.Shape, t.DType)
	}
	if len(dst) != t.NumElements() {
		return fmt.Errorf("safetensors: tensor %q: destination holds %d values, tensor has %d", t.Name, len(dst), t.NumElements())
	}
	if err := decodeFloat32(dst, t.DType, t.Data); err != nil {
		return fmt.Errorf("safetensors: tensor %q: %w", t.Name, err)
	}
	return nil
}

// File is one opened safetensors file. It is safe for concurrent reads; Close must not
// race with them.
type File struct {
	path    string
	data    []byte    // the whole file (a memory map or a heap copy)
	mm      mmap.MMap // non-nil when data is a memory map
	meta    map[string]string
	tensors map[string]entry
	names   []string
	dataOff int64 // file offset of the data section
}

// Open opens and validates the safetensors file at path. It memory-maps the file and falls
// back to reading it into memory when mapping is not possible.
func Open(path string) (*File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, ioErr(path, "open", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, ioErr(path, "stat", err)
	}
	if !st.Mode().IsRegular() {
		return nil, &Error{Path: path, Msg: "not a regular file", Kind: ErrFormat}
	}
	var data []byte
	mm, err := mmap.Map(f, mmap.RDONLY, 0)
	if err == nil && int64(len(mm)) == st.Size() {
		data = mm
	} else {
		if err == nil {
			mm.Unmap()
		}
		mm = nil
		// Empty files cannot be mapped; other failures (odd file systems) fall back too.
		if data, err = os.ReadFile(path); err != nil {
			return nil, ioErr(path, "read", err)
		}
	}
	sf, err := Parse(path, data)
	if err != nil {
		if mm != nil {
			mm.Unmap()
		}
		return nil, err
	}
	sf.mm = mm
	return sf, nil
}

// Parse validates a whole safetensors file held in data. The name is used in errors.
// Tensors of the returned File alias data; Close releases nothing but ends access.
func Parse(name string, data []byte) (*File, error) {
	if len(data) < 8 {
		return nil, formatErr(name, "", "file is %d bytes, too short for the 8-byte header length (truncated?)", len(data))
	}
	n := binary.LittleEndian.Uint64(data)
	rest := uint64(len(data) - 8)
	switch {
	case n > MaxHeaderSize:
		return nil, formatErr(name, "", "header length %d exceeds the %d-byte limit (not a safetensors file?)", n, MaxHeaderSize)
	case n > rest:
		return nil, formatErr(name, "", "header length %d exceeds the %d bytes after the length prefix (truncated?)", n, rest)
	case n < 2:
		return nil, formatErr(name, "", "header length %d is too small for a JSON object", n)
	}
	dataOff := 8 + int64(n)
	meta, entries, err := parseHeader(name, data[8:dataOff], int64(len(data))-dataOff)
	if err != nil {
		return nil, err
	}
	f := &File{path: name, data: data, meta: meta, tensors: make(map[string]entry, len(entries)), dataOff: dataOff}
	for _, e := range entries {
		f.tensors[e.name] = e
		f.names = append(f.names, e.name)
	}
	slices.Sort(f.names)
	return f, nil
}

// Path returns the path (or name) the file was opened with.
func (f *File) Path() string { return f.path }

// Names returns the tensor names in sorted order. The slice must not be modified.
func (f *File) Names() []string { return f.names }

// Metadata returns the header's __metadata__ map (nil if absent). It must not be modified.
func (f *File) Metadata() map[string]string { return f.meta }

// Has reports whether the file holds a tensor called name.
func (f *File) Has(name string) bool {
	_, ok := f.tensors[name]
	return ok
}

// Tensor returns the named tensor, with Data viewing the file's bytes.
func (f *File) Tensor(name string) (Tensor, error) {
	e, ok := f.tensors[name]
	if !ok {
		return Tensor{}, &Error{Path: f.path, Tensor: name, Msg: "not found", Kind: ErrNotFound}
	}
	if f.data == nil {
		return Tensor{}, &Error{Path: f.path, Tensor: name, Msg: "file is closed"}
	}
	b, end := f.dataOff+e.begin, f.dataOff+e.end
	return Tensor{Name: name, DType: e.dtype, Shape: slices.Clone(e.shape), Data: f.data[b:end:end]}, nil
}

// Expect returns the named tensor after checking its dtype and shape, for model loaders.
// An empty dtype accepts any dtype. The error names the tensor and both shapes, e.g.
// `tensor "model.layers.3.mlp.up_proj.weight": shape [5632 2048], want [5632 1024]`.
func (f *File) Expect(name string, dtype DType, shape ...int) (Tensor, error) {
	t, err := f.Tensor(name)
	if err != nil {
		return Tensor{}, err
	}
	return t, check(f.path, t, dtype, shape)
}

// Unused returns, sorted, the names of tensors that are not in consumed: after a loader has
// taken what it needs, these are the checkpoint's unexpected extra tensors.
func (f *File) Unused(consumed map[string]bool) []string { return unused(f.names, consumed) }

// Close releases the memory map. Tensor data obtained earlier must not be used afterwards.
func (f *File) Close() error {
	f.data = nil
	if f.mm == nil {
		return nil
	}
	mm := f.mm
	f.mm = nil
	if err := mm.Unmap(); err != nil {
		return &Error{Path: f.path, Msg: "unmap", Err: err}
	}
	return nil
}

func check(path string, t Tensor, dtype DType, shape []int) error {
	if dtype != "" && t.DType != dtype {
		return &Error{Path: path, Tensor: t.Name, Msg: fmt.Sprintf("dtype %s, want %s", t.DType, dtype), Kind: ErrMismatch}
	}
	if !slices.Equal(t.Shape, shape) {
		return &Error{Path: path, Tensor: t.Name, Msg: fmt.Sprintf("shape %v, want %v", t.Shape, shape), Kind: ErrMismatch}
	}
	return nil
}

func unused(names []string, consumed map[string]bool) []string {
	var out []string
	for _, n := range names {
		if !consumed[n] {
			out = append(out, n)
		}
	}
	return out
}
