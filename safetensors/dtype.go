package safetensors

// DType is a safetensors element type, spelled as in the file header ("BF16", "F32", ...).
type DType string

// The element types this package reads. Only BF16, F16, F32 and F64 convert to float32;
// the others are available as raw little-endian bytes through Tensor.Data.
const (
	BF16   DType = "BF16"
	F16    DType = "F16"
	F32    DType = "F32"
	F64    DType = "F64"
	I8     DType = "I8"
	I16    DType = "I16"
	I32    DType = "I32"
	I64    DType = "I64"
	U8     DType = "U8"
	U16    DType = "U16"
	U32    DType = "U32"
	U64    DType = "U64"
	Bool   DType = "BOOL"
	F8E4M3 DType = "F8_E4M3"
	F8E5M2 DType = "F8_E5M2"
)

// dtypeSizes lists the supported dtypes and their element sizes in bytes. Sub-byte types
// of newer safetensors versions (F4, F6_*) are deliberately absent: they are rejected.
var dtypeSizes = map[DType]int{
	BF16: 2, F16: 2, F32: 4, F64: 8,
	I8: 1, I16: 2, I32: 4, I64: 8,
	U8: 1, U16: 2, U32: 4, U64: 8,
	Bool: 1, F8E4M3: 1, F8E5M2: 1,
}

// Size returns the size of one element in bytes, or 0 for an unsupported dtype.
func (d DType) Size() int { return dtypeSizes[d] }

// Valid reports whether d is a dtype this package supports.
func (d DType) Valid() bool { return dtypeSizes[d] > 0 }

// IsFloat reports whether Tensor.Float32 can convert elements of this dtype.
func (d DType) IsFloat() bool { return d == BF16 || d == F16 || d == F32 || d == F64 }

// String returns the header spelling of the dtype.
func (d DType) String() string { return string(d) }
