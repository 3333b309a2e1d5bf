package safetensors

import (
	"encoding/binary"
	"math/rand/v2"
)

// rawFile assembles a file from a header and data section, padding nothing.
func rawFile(header string, data []byte) []byte {
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	b = append(b, header...)
	return append(b, data...)
}

// randomBytes returns n random bytes, never all zero for n > 0.
func randomBytes(rng *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	if n > 0 {
		b[rng.IntN(n)] |= 1
	}
	return b
}

var allDTypes = []DType{BF16, F16, F32, F64, I8, I16, I32, I64, U8, U16, U32, U64, Bool, F8E4M3, F8E5M2}

// randomTensor makes a tensor of a random dtype and shape (scalars and zero-size
// dimensions included) with random bytes.
func randomTensor(rng *rand.Rand, name string) Tensor {
	dt := allDTypes[rng.IntN(len(allDTypes))]
	shape := make([]int, rng.IntN(4))
	n := 1
	for i := range shape {
		shape[i] = 1 + rng.IntN(7)
		if rng.IntN(30) == 0 {
			shape[i] = 0
		}
		n *= shape[i]
	}
	return Tensor{Name: name, DType: dt, Shape: shape, Data: randomBytes(rng, n*dt.Size())}
}
