package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

func TestRoundTrip(t *testing.T) {
	rng, seed := testutil.Rand(t)
	for iter := range 20 {
		path := filepath.Join(t.TempDir(), "m.safetensors")
		w, err := Create(path)
		if err != nil {
			t.Fatal(err)
		}
		w.SetMetadata("iter", fmt.Sprint(iter))
		w.SetMetadata("odd \"key\" <&>", "välue\n")
		var want []Tensor
		for i := range rng.IntN(12) {
			// Names with characters JSON must escape.
			tt := randomTensor(rng, fmt.Sprintf("layers.%d.\"w\"\\<%d>", i, rng.IntN(100)))
			want = append(want, tt)
			if err := w.AddTensor(tt); err != nil {
				t.Fatalf("seed %d: %v", seed, err)
			}
		}
		if err := w.Close(); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		checkFile(t, seed, path, want, map[string]string{"format": "pt", "iter": fmt.Sprint(iter), "odd \"key\" <&>": "välue\n"})
	}
}

// checkFile opens path and compares it with want, in any order.
func checkFile(t *testing.T, seed uint64, path string, want []Tensor, meta map[string]string) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if n := binary.LittleEndian.Uint64(raw); n%8 != 0 {
		t.Errorf("seed %d: header length %d is not a multiple of 8", seed, n)
	}
	// Every tensor starts at a multiple of its element size (PyTorch views need it).
	if pf, err := Parse(path, raw); err == nil {
		for _, e := range pf.tensors {
			if e.begin%int64(e.dtype.Size()) != 0 {
				t.Errorf("seed %d: tensor %q of %s starts at data offset %d", seed, e.name, e.dtype, e.begin)
			}
		}
	}
	f, err := Open(path)
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	defer f.Close()
	var names []string
	for _, w := range want {
		names = append(names, w.Name)
		got, err := f.Expect(w.Name, w.DType, w.Shape...)
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if !bytes.Equal(got.Data, w.Data) {
			t.Fatalf("seed %d: tensor %q: data differs", seed, w.Name)
		}
	}
	slices.Sort(names)
	if !slices.Equal(f.Names(), names) {
		t.Fatalf("seed %d: names %q, want %q", seed, f.Names(), names)
	}
	if meta != nil && !mapsEqual(f.Metadata(), meta) {
		t.Fatalf("seed %d: metadata %v, want %v", seed, f.Metadata(), meta)
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

func TestAddFloat32(t *testing.T) {
	rng, seed := testutil.Rand(t)
	path := filepath.Join(t.TempDir(), "f.safetensors")
	w, err := Create(path)
	if err != nil {
		t.Fatal(err)
	}
	vals := make([]float32, 3*70000) // more than one conversion chunk
	for i := range vals {
		vals[i] = float32(rng.NormFloat64())
	}
	for _, dt := range []DType{BF16, F16, F32, F64} {
		if err := w.AddFloat32("w."+string(dt), dt, []int{3, 70000}, vals); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, dt := range []DType{BF16, F16, F32, F64} {
		tt, err := f.Expect("w."+string(dt), dt, 3, 70000)
		if err != nil {
			t.Fatal(err)
		}
		got, err := tt.Float32()
		if err != nil {
			t.Fatal(err)
		}
		for i, v := range vals {
			want := v
			switch dt {
			case BF16:
				want = bf16ToF32(f32ToBF16(v))
			case F16:
				want = f16ToF32(f32ToF16(v))
			}
			if got[i] != want {
				t.Fatalf("seed %d: %s[%d] = %v, want %v", seed, dt, i, got[i], want)
			}
		}
	}
}

func TestWriterRejectsBadTensors(t *testing.T) {
	dir := t.TempDir()
	w, err := Create(filepath.Join(dir, "x.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Add("a", F32, []int{2}, make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		err  error
		want string
	}{
		{"duplicate", w.Add("a", F32, []int{2}, make([]byte, 8)), "added twice"},
		{"short data", w.Add("b", F32, []int{3}, make([]byte, 8)), "needs 12 bytes, got 8"},
		{"bad dtype", w.Add("b", "Q4", []int{3}, make([]byte, 8)), "unknown dtype"},
		{"negative dim", w.Add("b", U8, []int{-1}, nil), "invalid shape"},
		{"overflow", w.Add("b", U8, []int{1 << 62, 1 << 62}, nil), "invalid shape"},
		{"empty name", w.Add("", U8, []int{1}, []byte{1}), "invalid tensor name"},
		{"reserved name", w.Add("__metadata__", U8, []int{1}, []byte{1}), "invalid tensor name"},
		{"value count", w.AddFloat32("b", BF16, []int{3}, make([]float32, 2)), "got 2 values"},
		{"int dtype", w.AddFloat32("b", I32, []int{2}, make([]float32, 2)), "cannot store float32"},
	} {
		if c.err == nil || !strings.Contains(c.err.Error(), c.want) {
			t.Errorf("%s: error %v, want it to contain %q", c.name, c.err, c.want)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := w.Add("c", U8, []int{1}, []byte{1}); err == nil {
		t.Error("Add after Close succeeded")
	}
	if err := w.Close(); err == nil {
		t.Error("second Close succeeded")
	}
	checkFile(t, 0, filepath.Join(dir, "x.safetensors"), []Tensor{{Name: "a", DType: F32, Shape: []int{2}, Data: make([]byte, 8)}}, nil)
	assertNoTemps(t, dir)
}

func assertNoTemps(t *testing.T, dir string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".") {
			t.Errorf("temporary file %s left in %s", e.Name(), dir)
		}
	}
}

func TestWriterIsAtomic(t *testing.T) {
	rng, _ := testutil.Rand(t)
	dir := t.TempDir()
	path := filepath.Join(dir, "m.safetensors")
	old := randomTensor(rng, "old")
	writeFile(t, path, old)

	// An aborted write, and one still in progress, leave the old file in place.
	w, err := Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Add("new", U8, []int{3}, []byte{1, 2, 3}); err != nil {
		t.Fatal(err)
	}
	checkFile(t, 0, path, []Tensor{old}, nil)
	w.Abort()
	checkFile(t, 0, path, []Tensor{old}, nil)
	assertNoTemps(t, dir)
	if err := w.Close(); err == nil {
		t.Error("Close after Abort succeeded")
	}

	// A completed write replaces it.
	nw := randomTensor(rng, "new")
	writeFile(t, path, nw)
	checkFile(t, 0, path, []Tensor{nw}, nil)
	assertNoTemps(t, dir)

	if _, err := Create(filepath.Join(dir, "missing", "x.safetensors")); err == nil {
		t.Error("Create in a missing directory succeeded")
	}
}

func writeFile(t testing.TB, path string, ts ...Tensor) {
	t.Helper()
	writeAll(t, path, Create, ts)
}

// writeSharded writes ts as a checkpoint in dir, in shards of at most
// maxShard bytes.
func writeSharded(t testing.TB, dir string, maxShard int64, ts []Tensor) {
	t.Helper()
	writeAll(t, dir, func(dir string) (*Writer, error) { return CreateSharded(dir, maxShard) }, ts)
}

// writeAll writes ts with the writer that create makes for path (Create, or
// CreateSharded with a shard size) and closes it.
func writeAll(t testing.TB, path string, create func(string) (*Writer, error), ts []Tensor) {
	t.Helper()
	w, err := create(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range ts {
		if err := w.AddTensor(tt); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestEmptyFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "e.safetensors")
	writeFile(t, path)
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if len(f.Names()) != 0 || f.Metadata()["format"] != "pt" {
		t.Errorf("names %v metadata %v", f.Names(), f.Metadata())
	}
}

func TestSharded(t *testing.T) {
	rng, seed := testutil.Rand(t)
	dir := t.TempDir()
	var want []Tensor
	var total int64
	const maxShard = 600
	// At least 30 tensors and enough bytes for several shards: random shapes can be tiny,
	// and a checkpoint that fits one shard is rightly written as a single file.
	for i := 0; i < 30 || total <= 3*maxShard; i++ {
		tt := randomTensor(rng, fmt.Sprintf("model.layers.%d.w", i))
		want = append(want, tt)
		total += int64(len(tt.Data))
	}
	writeSharded(t, dir, maxShard, want)
	assertNoTemps(t, dir)

	var idx struct {
		Metadata struct {
			TotalSize int64 `json:"total_size"`
		} `json:"metadata"`
		WeightMap map[string]string `json:"weight_map"`
	}
	raw, err := os.ReadFile(filepath.Join(dir, IndexFileName))
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	if err := json.Unmarshal(raw, &idx); err != nil {
		t.Fatal(err)
	}
	if idx.Metadata.TotalSize != total || len(idx.WeightMap) != len(want) {
		t.Fatalf("seed %d: index total_size %d with %d tensors, want %d with %d", seed, idx.Metadata.TotalSize, len(idx.WeightMap), total, len(want))
	}
	shards, _ := filepath.Glob(filepath.Join(dir, "model-*-of-*.safetensors"))
	if len(shards) < 2 {
		t.Fatalf("seed %d: %d shards for %d bytes at most %d each", seed, len(shards), total, maxShard)
	}
	for _, s := range shards {
		f, err := Open(s)
		if err != nil {
			t.Fatal(err)
		}
		var size int64
		nonEmpty := 0 // a tensor over the limit has a shard of its own, but for empty ones
		for _, n := range f.Names() {
			tt, _ := f.Tensor(n)
			size += int64(len(tt.Data))
			if len(tt.Data) > 0 {
				nonEmpty++
			}
			if idx.WeightMap[n] != filepath.Base(s) {
				t.Errorf("seed %d: index maps %q to %q, found in %q", seed, n, idx.WeightMap[n], s)
			}
		}
		if size > maxShard && nonEmpty > 1 {
			t.Errorf("seed %d: shard %s holds %d bytes in %d non-empty tensors, limit %d", seed, s, size, nonEmpty, maxShard)
		}
		f.Close()
	}

	c, err := OpenDir(dir)
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	checkCheckpoint(t, seed, c, want)
	if c.Metadata()["total_size"] != fmt.Sprint(total) {
		t.Errorf("metadata %v", c.Metadata())
	}
	c.Close()

	// Saving again into the same directory with one shard replaces the sharded checkpoint.
	writeSharded(t, dir, 1<<30, want[:3])
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 || ents[0].Name() != SingleFileName {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Fatalf("directory holds %v, want only %s", names, SingleFileName)
	}
	c, err = OpenCheckpoint(dir)
	if err != nil {
		t.Fatal(err)
	}
	checkCheckpoint(t, seed, c, want[:3])
	c.Close()
}

func checkCheckpoint(t *testing.T, seed uint64, c *Checkpoint, want []Tensor) {
	t.Helper()
	consumed := map[string]bool{}
	for _, w := range want {
		got, err := c.Expect(w.Name, w.DType, w.Shape...)
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if !bytes.Equal(got.Data, w.Data) {
			t.Fatalf("seed %d: tensor %q differs", seed, w.Name)
		}
		consumed[w.Name] = true
	}
	if u := c.Unused(consumed); len(u) != 0 || len(c.Names()) != len(want) {
		t.Fatalf("seed %d: unused %v, %d names, want %d", seed, u, len(c.Names()), len(want))
	}
}

func TestCreateShardedRejectsBadSize(t *testing.T) {
	if _, err := CreateSharded(t.TempDir(), 0); err == nil {
		t.Error("max shard size 0 accepted")
	}
	var e *Error
	_, err := CreateSharded(t.TempDir(), -5)
	if !errors.As(err, &e) {
		t.Errorf("error %v is not an *Error", err)
	}
}
