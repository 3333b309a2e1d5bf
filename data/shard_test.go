package data

import (
	"bytes"
	"encoding/binary"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// randTokens returns n random tokens below vocab.
func randTokens(r *rand.Rand, n, vocab int) []int {
	t := make([]int, n)
	for i := range t {
		t[i] = r.IntN(vocab)
	}
	return t
}

// rawShard builds shard bytes by hand (valid checksums) so tests can make shards the writer
// refuses to write.
func rawShard(d Dtype, vocab uint32, tokens []uint64) []byte {
	var payload []byte
	for _, t := range tokens {
		if d == Uint16 {
			payload = binary.LittleEndian.AppendUint16(payload, uint16(t))
		} else {
			payload = binary.LittleEndian.AppendUint32(payload, uint32(t))
		}
	}
	h := ShardHeader{Version: ShardVersion, Dtype: d, Tokens: uint64(len(tokens)), VocabSize: vocab,
		PayloadCRC: crc32.Checksum(payload, castagnoli)}
	return append(h.appendHeader(nil), payload...)
}

func TestShardRoundTrip(t *testing.T) {
	r, seed := testutil.Rand(t)
	dir := t.TempDir()
	for trial := range 12 {
		vocab := 1 + r.IntN(300)
		switch trial % 3 {
		case 1:
			vocab = 1 << 16 // largest uint16 vocabulary
		case 2:
			vocab = 1<<16 + 1 + r.IntN(200000)
		}
		n := r.IntN(5000)
		if trial == 0 {
			n = 0
		}
		if trial == 5 {
			n = 700000 // > 1 MiB: memory-mapped
		}
		toks := randTokens(r, n, vocab)
		path := filepath.Join(dir, "s.twsh")
		if err := WriteShard(path, vocab, toks); err != nil {
			t.Fatalf("seed %d trial %d: WriteShard: %v", seed, trial, err)
		}
		s, err := OpenShard(path)
		if err != nil {
			t.Fatalf("seed %d trial %d: OpenShard: %v", seed, trial, err)
		}
		if s.Len() != n || s.VocabSize() != vocab || s.Header().Dtype != DtypeFor(vocab) {
			t.Fatalf("seed %d trial %d: got len %d vocab %d dtype %v, want %d %d %v", seed, trial, s.Len(), s.VocabSize(), s.Header().Dtype, n, vocab, DtypeFor(vocab))
		}
		got := make([]int32, n+3)
		off := 0
		if n > 0 {
			off = r.IntN(n)
		}
		if c := s.Read(got, off); c != n-off {
			t.Fatalf("seed %d trial %d: Read at %d copied %d, want %d", seed, trial, off, c, n-off)
		}
		for i := off; i < n; i++ {
			if int(got[i-off]) != toks[i] || s.Token(i) != toks[i] {
				t.Fatalf("seed %d trial %d: token %d: Read %d, Token %d, want %d", seed, trial, i, got[i-off], s.Token(i), toks[i])
			}
		}
		if err := s.Close(); err != nil {
			t.Fatalf("seed %d: Close: %v", seed, err)
		}
		// The memory writer makes the same bytes, written in pieces.
		mw, err := NewMemShardWriter("mem", vocab)
		if err != nil {
			t.Fatal(err)
		}
		for rest := toks; len(rest) > 0; {
			k := min(len(rest), 1+r.IntN(999))
			if err := mw.Write(rest[:k]); err != nil {
				t.Fatal(err)
			}
			rest = rest[k:]
		}
		if err := mw.Close(); err != nil {
			t.Fatal(err)
		}
		file, _ := os.ReadFile(path)
		if !bytes.Equal(mw.Bytes(), file) {
			t.Fatalf("seed %d trial %d: memory shard differs from file shard", seed, trial)
		}
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("seed %d: temporary files left: %v", seed, ents)
	}
}

func TestShardWriterRejectsOutOfRange(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "bad.twsh")
	err := WriteShard(path, 100, []int{1, 2, 100})
	if err == nil || !strings.Contains(err.Error(), "token 100") {
		t.Fatalf("want an error naming token 100, got %v", err)
	}
	if _, serr := os.Stat(path); !os.IsNotExist(serr) {
		t.Errorf("a failed write left %s behind", path)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("temporary files left: %v", ents)
	}
	if _, err := CreateShard(path, 0); err == nil {
		t.Error("vocabulary size 0 accepted")
	}
}

func TestShardErrors(t *testing.T) {
	r, seed := testutil.Rand(t)
	good := rawShard(Uint16, 1000, []uint64{1, 2, 3, 999, 0, 7})
	mod := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	cases := []struct {
		name string
		b    []byte
		want string
	}{
		{"empty", nil, "truncated"},
		{"short magic", []byte("TW"), "truncated"},
		{"header cut", good[:ShardHeaderSize-1-r.IntN(20)], "truncated"},
		{"payload cut", good[:len(good)-1-r.IntN(11)], "truncated"},
		{"json file", []byte(`{"not": "a shard"}`), "not a twell token shard"},
		{"safetensors-like", append([]byte{8, 0, 0, 0, 0, 0, 0, 0}, "{}"...), "not a twell token shard"},
		{"trailing bytes", append(bytes.Clone(good), 0, 0), "bytes after the last"},
		{"version", mod(func(b []byte) []byte { b[4] = 2; return b }), "format version 2"},
		{"header bit", mod(func(b []byte) []byte { b[8+r.IntN(16)] ^= 1 << r.IntN(8); return b }), "corrupt header"},
		{"payload bit", mod(func(b []byte) []byte { b[ShardHeaderSize+r.IntN(12)] ^= 1 << r.IntN(8); return b }), "corrupt payload"},
		{"out of range", rawShard(Uint16, 10, []uint64{1, 10}), "token 10 at position 1"},
		{"uint16 vocab too big", rawShard(Uint16, 1<<16+1, nil), "does not fit uint16"},
		{"zero vocab", rawShard(Uint32, 0, nil), "vocabulary size in header is 0"},
		{"width", func() []byte {
			b := rawShard(Uint16, 10, nil)
			b[6] = 3
			binary.LittleEndian.PutUint32(b[24:], crc32.Checksum(b[:24], castagnoli))
			return b
		}(), "token width 3"},
	}
	dir := t.TempDir()
	for _, c := range cases {
		path := filepath.Join(dir, strings.ReplaceAll(c.name, " ", "_")+".twsh")
		if err := os.WriteFile(path, c.b, 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := OpenShard(path)
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), path) {
			t.Errorf("seed %d: %s: want an error naming %s and %q, got %v", seed, c.name, path, c.want, err)
		}
		_, err = ReadShard("mem:"+c.name, c.b)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("seed %d: ReadShard %s: want %q, got %v", seed, c.name, c.want, err)
		}
	}
	if _, err := OpenShard(filepath.Join(dir, "missing.twsh")); err == nil || !strings.Contains(err.Error(), "missing.twsh") {
		t.Errorf("missing file: got %v", err)
	}
	if _, err := OpenShard(dir); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("folder: got %v", err)
	}
}

func FuzzReadShard(f *testing.F) {
	f.Add(rawShard(Uint16, 1000, []uint64{1, 2, 3, 999}))
	f.Add(rawShard(Uint32, 70000, []uint64{69999, 0}))
	f.Add(rawShard(Uint16, 1, nil))
	f.Add([]byte("TWSH"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := ReadShard("fuzz", b)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "data: shard fuzz: ") {
				t.Fatalf("error does not name the shard: %v", err)
			}
			return
		}
		// A shard that parses re-encodes to the same bytes (the writer picks the narrowest type).
		if s.Header().Dtype != DtypeFor(s.VocabSize()) {
			return
		}
		toks := make([]int, s.Len())
		for i := range toks {
			toks[i] = s.Token(i)
		}
		w, err := NewMemShardWriter("again", s.VocabSize())
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Write(toks); err != nil {
			t.Fatal(err)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(w.Bytes(), b) {
			t.Fatalf("accepted shard does not re-encode to the same bytes")
		}
	})
}
