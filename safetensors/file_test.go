package safetensors

import (
	"encoding/binary"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

const okEntry = `"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}`

func TestCorruptFiles(t *testing.T) {
	d8 := []byte{1, 2, 3, 4, 5, 6, 7, 8}
	d12 := append(d8[:8:8], 9, 10, 11, 12)
	huge := binary.LittleEndian.AppendUint64(nil, 1<<63)
	for _, c := range []struct {
		name   string
		file   []byte
		tensor string // expected in the error, "" for none
		want   string
	}{
		{"empty", nil, "", "too short"},
		{"short", []byte{1, 2, 3}, "", "too short"},
		{"huge header length", append(huge, "{}"...), "", "exceeds the 100000000-byte limit"},
		{"header past end", append(binary.LittleEndian.AppendUint64(nil, 50), "{}"...), "", "exceeds the 2 bytes after"},
		{"zero header", rawFile("", nil), "", "too small"},
		{"array", rawFile("[]", nil), "", "not a JSON object"},
		{"leading space", rawFile(" {}", nil), "", "not a JSON object"},
		{"unterminated", rawFile(`{"a":`, nil), "", "not valid JSON"},
		{"open object", rawFile(`{`+okEntry, d8), "", "not valid JSON"},
		{"garbage after", rawFile(`{`+okEntry+`} x`, d8), "", "data after"},
		{"two objects", rawFile(`{`+okEntry+`}{}`, d8), "", "data after"},
		{"bad utf8", rawFile("{\"\xff\":1}", nil), "", "UTF-8"},
		{"unknown dtype", rawFile(`{"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}}`, d8), "a", `unknown dtype "Q4"`},
		{"sub-byte dtype", rawFile(`{"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}`, d8[:1]), "a", `unknown dtype "F4"`},
		{"shape vs bytes", rawFile(`{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}`, d8), "a", "needs 12 bytes"},
		{"offsets past data", rawFile(`{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}`, d8), "a", "outside the 8-byte data section"},
		{"reversed offsets", rawFile(`{"a":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}}`, d8), "a", "reversed"},
		{"negative offset", rawFile(`{"a":{"dtype":"U8","shape":[8],"data_offsets":[-1,7]}}`, d8), "a", "outside"},
		{"three offsets", rawFile(`{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,4,8]}}`, d8), "a", "must hold 2 numbers"},
		{"no dtype", rawFile(`{"a":{"shape":[2],"data_offsets":[0,8]}}`, d8), "a", "no dtype"},
		{"no shape", rawFile(`{"a":{"dtype":"F32","data_offsets":[0,8]}}`, d8), "a", "no shape"},
		{"no offsets", rawFile(`{"a":{"dtype":"F32","shape":[2]}}`, d8), "a", "no data_offsets"},
		{"null entry", rawFile(`{"a":null}`, nil), "a", "no dtype"},
		{"entry not object", rawFile(`{"a":5}`, nil), "a", "malformed header entry"},
		{"fractional dim", rawFile(`{"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,8]}}`, d8), "a", "malformed"},
		{"negative dim", rawFile(`{"a":{"dtype":"U8","shape":[-8],"data_offsets":[0,8]}}`, d8), "a", "negative dimension"},
		{"overflowing shape", rawFile(`{"a":{"dtype":"U8","shape":[4611686018427387904,4],"data_offsets":[0,8]}}`, d8), "a", "too many elements"},
		{"overflowing bytes", rawFile(`{"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}}`, d8), "a", "more than 2^63"},
		{"duplicate", rawFile(`{`+okEntry+`,`+okEntry+`}`, d8), "a", "listed twice"},
		{"overlap", rawFile(`{`+okEntry+`,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}`, d12), "b", `overlap tensor "a"`},
		{"zero-size inside", rawFile(`{`+okEntry+`,"z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}}`, d8), "z", "overlap"},
		{"hole", rawFile(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}`, d12), "", "bytes [4 8) of the data section belong to no tensor"},
		{"leading hole", rawFile(`{"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, d8), "", "bytes [0 4)"},
		{"trailing bytes", rawFile(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, d8), "", "trailing bytes"},
		{"data without tensors", rawFile(`{}`, d8), "", "trailing bytes"},
		{"metadata not strings", rawFile(`{"__metadata__":{"n":1}}`, nil), "", "__metadata__ must map strings to strings"},
		{"metadata twice", rawFile(`{"__metadata__":{},"__metadata__":{}}`, nil), "__metadata__", "listed twice"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse("bad.safetensors", c.file)
			if err == nil {
				t.Fatal("no error")
			}
			msg := err.Error()
			if !errors.Is(err, ErrFormat) || !strings.Contains(msg, c.want) || !strings.Contains(msg, "bad.safetensors") {
				t.Fatalf("error %q: want ErrFormat naming the file and saying %q", msg, c.want)
			}
			if c.tensor != "" && !strings.Contains(msg, `tensor "`+c.tensor+`"`) {
				t.Fatalf("error %q does not name tensor %q", msg, c.tensor)
			}
		})
	}
}

func TestAcceptsEdgeCases(t *testing.T) {
	for _, c := range []struct {
		name string
		file []byte
	}{
		{"empty object", rawFile("{}", nil)},
		{"padded header", rawFile("{}      ", nil)},
		{"null metadata", rawFile(`{"__metadata__":null}`, nil)},
		{"scalar", rawFile(`{"s":{"dtype":"I64","shape":[],"data_offsets":[0,8]}}`, []byte{1, 0, 0, 0, 0, 0, 0, 0})},
		{"zero-size tensors", rawFile(`{"z":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]},"y":{"dtype":"BF16","shape":[4,0],"data_offsets":[0,0]},`+okEntry+`,"w":{"dtype":"U8","shape":[0],"data_offsets":[8,8]}}`, []byte{1, 2, 3, 4, 5, 6, 7, 8})},
		{"unsorted keys and unknown fields", rawFile(`{"b":{"data_offsets":[4,8],"shape":[1],"dtype":"F32","x":1},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, []byte{1, 2, 3, 4, 5, 6, 7, 8})},
	} {
		if _, err := Parse(c.name, c.file); err != nil {
			t.Errorf("%s: %v", c.name, err)
		}
	}
}

// Cutting a valid file anywhere, or growing it, must give an error and never a panic.
func TestTruncatedAndExtended(t *testing.T) {
	rng, seed := testutil.Rand(t)
	path := filepath.Join(t.TempDir(), "m.safetensors")
	writeFile(t, path, randomTensor(rng, "a"), randomTensor(rng, "b"), Tensor{Name: "c", DType: BF16, Shape: []int{3}, Data: randomBytes(rng, 6)})
	full, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for n := range len(full) {
		if _, err := Parse("cut", full[:n]); err == nil {
			t.Fatalf("seed %d: file cut to %d of %d bytes parsed", seed, n, len(full))
		}
	}
	if _, err := Parse("long", append(full, 0)); err == nil {
		t.Fatalf("seed %d: file with an extra byte parsed", seed)
	}
	// The same through Open, which maps the file.
	if err := os.WriteFile(path, full[:len(full)-1], 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(path); err == nil || !strings.Contains(err.Error(), path) {
		t.Fatalf("Open of truncated file: %v", err)
	}
}

func TestOpenErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := Open(filepath.Join(dir, "nope.safetensors")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
	if _, err := Open(dir); err == nil {
		t.Error("opening a directory succeeded")
	}
	empty := filepath.Join(dir, "empty.safetensors") // cannot be mapped: exercises the read fallback
	if err := os.WriteFile(empty, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(empty); !errors.Is(err, ErrFormat) {
		t.Errorf("empty file: %v", err)
	}
}

func TestExpectAndUnused(t *testing.T) {
	rng, _ := testutil.Rand(t)
	path := filepath.Join(t.TempDir(), "m.safetensors")
	up := Tensor{Name: "model.layers.3.mlp.up_proj.weight", DType: BF16, Shape: []int{4, 8}, Data: randomBytes(rng, 64)}
	writeFile(t, path, up, randomTensor(rng, "extra.b"), randomTensor(rng, "extra.a"))
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Expect(up.Name, BF16, 4, 8); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Expect(up.Name, "", 4, 8); err != nil {
		t.Fatal("empty dtype should accept any:", err)
	}
	_, err = f.Expect(up.Name, BF16, 4, 16)
	want := `safetensors: ` + path + `: tensor "model.layers.3.mlp.up_proj.weight": shape [4 8], want [4 16]`
	if err == nil || err.Error() != want || !errors.Is(err, ErrMismatch) {
		t.Errorf("shape mismatch error %q, want %q", err, want)
	}
	if _, err = f.Expect(up.Name, F32, 4, 8); err == nil || !strings.Contains(err.Error(), "dtype BF16, want F32") {
		t.Errorf("dtype mismatch error %v", err)
	}
	if _, err = f.Expect("lm_head.weight", BF16, 4, 8); !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), `"lm_head.weight"`) {
		t.Errorf("missing tensor error %v", err)
	}
	if got := f.Unused(map[string]bool{up.Name: true}); strings.Join(got, ",") != "extra.a,extra.b" {
		t.Errorf("Unused = %v", got)
	}
	tt, _ := f.Tensor(up.Name)
	tt.Shape[0] = 99 // callers get their own shape
	if tt2, _ := f.Tensor(up.Name); tt2.Shape[0] != 4 {
		t.Error("Tensor shares its shape slice")
	}
	f.Close()
	if _, err := f.Tensor(up.Name); err == nil {
		t.Error("Tensor after Close succeeded")
	}
}

// writeIndex writes an index JSON mapping tensor names to shard files.
func writeIndexFile(t *testing.T, dir, body string) string {
	t.Helper()
	p := filepath.Join(dir, IndexFileName)
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestCheckpointErrors(t *testing.T) {
	rng, _ := testutil.Rand(t)
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "s1.safetensors"), randomTensor(rng, "a"), randomTensor(rng, "b"))
	writeFile(t, filepath.Join(dir, "s2.safetensors"), randomTensor(rng, "c"))

	ok := writeIndexFile(t, dir, `{"metadata":{"total_size":1,"note":"x"},"weight_map":{"a":"s1.safetensors","b":"s1.safetensors","c":"s2.safetensors"}}`)
	c, err := OpenIndex(ok)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(c.Names(), ",") != "a,b,c" || len(c.Files()) != 2 || c.Metadata()["note"] != "x" || c.Metadata()["total_size"] != "1" {
		t.Errorf("names %v, %d files, metadata %v", c.Names(), len(c.Files()), c.Metadata())
	}
	if _, err := c.Tensor("c"); err != nil {
		t.Error(err)
	}
	if _, err := c.Expect("d", ""); !errors.Is(err, ErrNotFound) {
		t.Errorf("missing tensor: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Error(err)
	}

	for _, tc := range []struct {
		name, index, want string
		kind              error
	}{
		{"not json", `{"weight_map":`, "not valid JSON", ErrFormat},
		{"empty map", `{"weight_map":{}}`, "no weight_map entries", ErrFormat},
		{"missing shard", `{"weight_map":{"a":"s1.safetensors","b":"s1.safetensors","c":"s3.safetensors"}}`, `shard file "s3.safetensors" is missing`, ErrNotFound},
		{"escaping path", `{"weight_map":{"a":"../s1.safetensors"}}`, "not a relative path", ErrFormat},
		{"absolute path", `{"weight_map":{"a":"/etc/passwd"}}`, "not a relative path", ErrFormat},
		{"tensor not in shard", `{"weight_map":{"a":"s1.safetensors","b":"s1.safetensors","c":"s1.safetensors"}}`, `tensor "c": listed in the index for shard "s1.safetensors"`, ErrNotFound},
		{"tensor not in index", `{"weight_map":{"a":"s1.safetensors","c":"s2.safetensors"}}`, `tensor "b": present in shard`, ErrFormat},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := writeIndexFile(t, dir, tc.index)
			_, err := OpenIndex(p)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), p) || !errors.Is(err, tc.kind) {
				t.Fatalf("error %v, want %v naming %s and saying %q", err, tc.kind, p, tc.want)
			}
		})
	}

	// A corrupt shard is reported with its own path.
	if err := os.WriteFile(filepath.Join(dir, "s2.safetensors"), []byte("garbage!garbage!"), 0o644); err != nil {
		t.Fatal(err)
	}
	writeIndexFile(t, dir, `{"weight_map":{"a":"s1.safetensors","b":"s1.safetensors","c":"s2.safetensors"}}`)
	if _, err := OpenDir(dir); err == nil || !strings.Contains(err.Error(), "s2.safetensors") {
		t.Errorf("corrupt shard: %v", err)
	}
	if _, err := OpenDir(t.TempDir()); !errors.Is(err, ErrNotFound) {
		t.Errorf("empty directory: %v", err)
	}
	if _, err := OpenCheckpoint(filepath.Join(dir, "none")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing path: %v", err)
	}
	c, err = OpenCheckpoint(filepath.Join(dir, "s1.safetensors"))
	if err != nil || len(c.Names()) != 2 {
		t.Fatalf("single file checkpoint: %v", err)
	}
	c.Close()
}
