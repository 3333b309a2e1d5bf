package safetensors

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// seedFiles returns a few valid files for the fuzz corpora.
func seedFiles(t testing.TB) [][]byte {
	dir := t.TempDir()
	var out [][]byte
	for i, ts := range [][]Tensor{
		nil,
		{{Name: "w", DType: BF16, Shape: []int{2, 3}, Data: []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}}},
		{{Name: "a", DType: F32, Shape: []int{}, Data: []byte{0, 0, 128, 63}}, {Name: "b", DType: U8, Shape: []int{0}, Data: nil},
			{Name: "c", DType: F16, Shape: []int{1, 2}, Data: []byte{0, 60, 0, 188}}},
	} {
		p := filepath.Join(dir, "seed"+string(rune('0'+i))+".safetensors")
		writeFile(t, p, ts...)
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, b)
	}
	return out
}

// FuzzOpen feeds arbitrary bytes to the file parser: it must return an error or a File
// whose every tensor is consistent with its dtype and shape, and never panic. Each tensor's
// CheckFinite must agree with an element-by-element scan.
func FuzzOpen(f *testing.F) {
	for _, b := range seedFiles(f) {
		f.Add(b)
	}
	f.Add(rawFile(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, make([]byte, 8)))
	f.Fuzz(func(t *testing.T, data []byte) {
		sf, err := Parse("fuzz", data)
		if err != nil {
			return
		}
		for _, n := range sf.Names() {
			tt, err := sf.Tensor(n)
			if err != nil {
				t.Fatal(err)
			}
			if len(tt.Data) != tt.NumElements()*tt.DType.Size() {
				t.Fatalf("tensor %q: %d bytes for shape %v of %s", n, len(tt.Data), tt.Shape, tt.DType)
			}
			if tt.DType.IsFloat() && tt.NumElements() < 1<<20 {
				if _, err := tt.Float32(); err != nil {
					t.Fatal(err)
				}
			}
			if tt.NumElements() < 1<<20 {
				checkAgainstRef(t, tt, "FuzzOpen")
			}
		}
	})
}

// FuzzParseHeader feeds arbitrary header text with an arbitrary data size; an accepted
// header must describe tensors that exactly tile the data section.
func FuzzParseHeader(f *testing.F) {
	for _, b := range seedFiles(f) {
		n := int(b[0]) | int(b[1])<<8
		f.Add(b[8:8+n], uint16(len(b)-8-n))
	}
	f.Add([]byte(`{"__metadata__":{"k":"v"},"x":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}`), uint16(3))
	f.Fuzz(func(t *testing.T, hdr []byte, dataLen uint16) {
		_, entries, err := parseHeader("fuzz", hdr, int64(dataLen))
		if err != nil {
			return
		}
		covered := make([]bool, dataLen)
		for _, e := range entries {
			for i := e.begin; i < e.end; i++ {
				if covered[i] {
					t.Fatalf("byte %d covered twice", i)
				}
				covered[i] = true
			}
		}
		if i := bytes.IndexByte(boolBytes(covered), 0); i >= 0 {
			t.Fatalf("byte %d not covered", i)
		}
	})
}

func boolBytes(b []bool) []byte {
	out := make([]byte, len(b))
	for i, v := range b {
		if v {
			out[i] = 1
		}
	}
	return out
}
