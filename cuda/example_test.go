package cuda_test

import (
	_ "embed"
	"fmt"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
)

// The kernel source sits beside its launcher and is embedded in the binary.
//
//go:embed testdata/vecadd.cu
var exampleSrc []byte

// Example shows the path every GPU kernel in twell follows: embed the .cu
// source, compile it with NVRTC for the device (cached on disk), look the
// kernel up and launch it on device buffers.
func Example() {
	dev, err := cuda.Open(0)
	if err != nil {
		fmt.Println("no GPU, the CPU backend would be used:", cuda.NoGPU(err))
		return
	}
	mod, err := dev.Compile("vecadd.cu", exampleSrc)
	if err != nil {
		fmt.Println(err) // NVRTC's log, with file and line
		return
	}
	add, err := mod.Function("add_bf16")
	if err != nil {
		fmt.Println(err)
		return
	}
	const n = 1000
	a, b := make([]uint16, n), make([]uint16, n)
	for i := range a {
		a[i], b[i] = bf16.FromFloat32(float32(i)), bf16.FromFloat32(0.5)
	}
	da, _ := dev.Alloc(2 * n)
	db, _ := dev.Alloc(2 * n)
	out, _ := dev.Alloc(2 * n)
	defer da.Free()
	defer db.Free()
	defer out.Free()
	_ = dev.CopyHtoD(da, cuda.Bytes(a))
	_ = dev.CopyHtoD(db, cuda.Bytes(b))
	if err := add.Launch(cuda.Dim3{(n + 255) / 256, 1, 1}, cuda.Dim3{256, 1, 1}, 0, nil, out, da, db, n); err != nil {
		fmt.Println(err)
		return
	}
	res := make([]uint16, n)
	if err := dev.CopyDtoH(cuda.Bytes(res), out); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(bf16.ToFloat32(res[3]))
}
