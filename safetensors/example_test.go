package safetensors_test

import (
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/twell-ai/twell/safetensors"
)

func Example() {
	dir, err := os.MkdirTemp("", "example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "model.safetensors")

	// Write two tensors; the file appears only when Close succeeds.
	w, err := safetensors.Create(path)
	if err != nil {
		log.Fatal(err)
	}
	if err := w.AddFloat32("norm.weight", safetensors.BF16, []int{4}, []float32{1, 0.5, -2, 3.25}); err != nil {
		log.Fatal(err)
	}
	if err := w.Add("ids", safetensors.I32, []int{2}, []byte{7, 0, 0, 0, 9, 0, 0, 0}); err != nil {
		log.Fatal(err)
	}
	if err := w.Close(); err != nil {
		log.Fatal(err)
	}

	// Read them back, checking what a model loader expects.
	ck, err := safetensors.OpenCheckpoint(dir)
	if err != nil {
		log.Fatal(err)
	}
	defer ck.Close()
	fmt.Println(ck.Names())
	t, err := ck.Expect("norm.weight", safetensors.BF16, 4)
	if err != nil {
		log.Fatal(err)
	}
	v, _ := t.Float32()
	fmt.Println(v)
	_, err = ck.Expect("norm.weight", safetensors.BF16, 8)
	fmt.Println(err != nil)
	fmt.Println("unused:", ck.Unused(map[string]bool{"norm.weight": true}))
	// Output:
	// [ids norm.weight]
	// [1 0.5 -2 3.25]
	// true
	// unused: [ids]
}
