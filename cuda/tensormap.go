package cuda

import (
	"fmt"
	"unsafe"
)

// TensorMap is a TMA descriptor (CUtensorMap, 128 bytes) describing a tile
// of a tensor in global memory, for the Hopper bulk tensor copy engine
// (cp.async.bulk.tensor). Pass it to a kernel by value as a
// `const __grid_constant__ CUtensorMap` parameter.
type TensorMap struct {
	opaque [16]uint64
}

// TensorDataType is an element type of a TensorMap (CUtensorMapDataType).
type TensorDataType int32

// Tensor element types.
const (
	TensorUint8    TensorDataType = 0
	TensorUint16   TensorDataType = 1
	TensorUint32   TensorDataType = 2
	TensorInt32    TensorDataType = 3
	TensorUint64   TensorDataType = 4
	TensorInt64    TensorDataType = 5
	TensorFloat16  TensorDataType = 6
	TensorFloat32  TensorDataType = 7
	TensorFloat64  TensorDataType = 8
	TensorBFloat16 TensorDataType = 9
)

var tensorTypeSize = map[TensorDataType]int{
	TensorUint8: 1, TensorUint16: 2, TensorUint32: 4, TensorInt32: 4, TensorUint64: 8,
	TensorInt64: 8, TensorFloat16: 2, TensorFloat32: 4, TensorFloat64: 8, TensorBFloat16: 2,
}

// TensorSwizzle is the shared-memory swizzle pattern (CUtensorMapSwizzle).
type TensorSwizzle int32

// Swizzle patterns; wgmma operands usually use Swizzle128B with a 64-element
// (128-byte) bf16 inner box.
const (
	SwizzleNone TensorSwizzle = 0
	Swizzle32B  TensorSwizzle = 1
	Swizzle64B  TensorSwizzle = 2
	Swizzle128B TensorSwizzle = 3
)

// TensorL2Promotion widens L2 fetches (CUtensorMapL2promotion).
type TensorL2Promotion int32

// L2 promotion sizes.
const (
	L2PromotionNone TensorL2Promotion = 0
	L2Promotion64B  TensorL2Promotion = 1
	L2Promotion128B TensorL2Promotion = 2
	L2Promotion256B TensorL2Promotion = 3
)

// TiledTensor describes a tensor and the box (tile) one TMA copy moves, for
// EncodeTiled. Dimensions are listed innermost (contiguous) first.
type TiledTensor struct {
	DataType TensorDataType
	Global   DevicePtr // base address, 16-byte aligned
	Dims     []uint64  // size of each dimension in elements, innermost first (rank 1..5)
	// Strides are the byte strides of dimensions 1..rank-1 (the innermost
	// is contiguous), each a multiple of 16.
	Strides []uint64
	Box     []uint32 // tile size per dimension in elements (each ≤ 256)
	// ElementStrides step through the box (nil: all 1).
	ElementStrides []uint32
	Swizzle        TensorSwizzle
	L2Promotion    TensorL2Promotion
	// OOBNaN fills out-of-bounds elements with NaN instead of zero.
	OOBNaN bool
}

// EncodeTiled builds a TMA descriptor (cuTensorMapEncodeTiled). Errors
// name the field at fault where twell can tell, and otherwise carry the
// driver's status.
func (dev *Device) EncodeTiled(t TiledTensor) (*TensorMap, error) {
	op := "cuTensorMapEncodeTiled"
	if dev.drv.cuTensorMapEncodeTiled == nil {
		return nil, misuse(op, ErrorNotSupported, "the driver has no cuTensorMapEncodeTiled (CUDA 12.0+)")
	}
	rank := len(t.Dims)
	esize, ok := tensorTypeSize[t.DataType]
	switch {
	case !ok:
		return nil, misuse(op, ErrorInvalidValue, "unknown data type %d", t.DataType)
	case rank < 1 || rank > 5:
		return nil, misuse(op, ErrorInvalidValue, "rank %d; TMA takes 1 to 5 dimensions", rank)
	case len(t.Strides) != rank-1:
		return nil, misuse(op, ErrorInvalidValue, "%d strides for rank %d; give the byte strides of dimensions 1..%d", len(t.Strides), rank, rank-1)
	case len(t.Box) != rank:
		return nil, misuse(op, ErrorInvalidValue, "box has %d dimensions, tensor %d", len(t.Box), rank)
	case t.ElementStrides != nil && len(t.ElementStrides) != rank:
		return nil, misuse(op, ErrorInvalidValue, "%d element strides for rank %d", len(t.ElementStrides), rank)
	case t.Global%16 != 0:
		return nil, misuse(op, ErrorInvalidValue, "global address %#x is not 16-byte aligned", uint64(t.Global))
	}
	for i, s := range t.Strides {
		if s%16 != 0 {
			return nil, misuse(op, ErrorInvalidValue, "stride of dimension %d is %d bytes, not a multiple of 16", i+1, s)
		}
	}
	for i, b := range t.Box {
		if b == 0 || b > 256 {
			return nil, misuse(op, ErrorInvalidValue, "box dimension %d is %d; it must be 1..256", i, b)
		}
	}
	if int(t.Box[0])*esize%16 != 0 {
		return nil, misuse(op, ErrorInvalidValue, "inner box dimension is %d bytes, not a multiple of 16", int(t.Box[0])*esize)
	}
	estr := t.ElementStrides
	if estr == nil {
		estr = make([]uint32, rank)
		for i := range estr {
			estr[i] = 1
		}
	}
	dims := append([]uint64(nil), t.Dims...)
	strides := append([]uint64(nil), t.Strides...)
	if len(strides) == 0 {
		strides = []uint64{0} // never read for rank 1, but the pointer must be valid
	}
	box := append([]uint32(nil), t.Box...)
	oob := int32(0)
	if t.OOBNaN {
		oob = 1
	}
	// The driver wants a 64-byte aligned destination.
	var raw [24]uint64
	p := unsafe.Pointer(&raw[0])
	p = unsafe.Add(p, (64-uintptr(p)%64)%64)
	if err := dev.lock(); err != nil {
		return nil, err
	}
	r := dev.drv.cuTensorMapEncodeTiled(p, int32(t.DataType), uint32(rank), uint64(t.Global),
		&dims[0], &strides[0], &box[0], &estr[0], 0, int32(t.Swizzle), int32(t.L2Promotion), oob)
	dev.unlock()
	if err := check(r, fmt.Sprintf("%s(rank %d, dims %v, box %v, swizzle %d)", op, rank, t.Dims, t.Box, t.Swizzle)); err != nil {
		return nil, err
	}
	tm := new(TensorMap)
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&tm.opaque[0])), 128), unsafe.Slice((*byte)(p), 128))
	return tm, nil
}
