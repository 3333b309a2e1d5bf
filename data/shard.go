package data

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"

	"github.com/edsrzf/mmap-go"
)

// Shard file format (all integers little-endian):
//
//	offset size field
//	     0    4 magic "TWSH"
//	     4    2 format version (ShardVersion)
//	     6    2 token width in bytes: 2 (uint16) or 4 (uint32)
//	     8    8 token count
//	    16    4 vocabulary size; every token is < this
//	    20    4 CRC-32C (Castagnoli) of the payload
//	    24    4 CRC-32C of header bytes 0..23
//	    28    4 reserved, zero
//	    32    - payload: token count tokens of the given width
//
// The file is exactly ShardHeaderSize + count*width bytes long.
const (
	shardMagic = "TWSH"
	// ShardVersion is the shard format version this package writes and reads.
	ShardVersion = 1
	// ShardHeaderSize is the size in bytes of the header in front of the tokens.
	ShardHeaderSize = 32
	// ShardExt is the file name extension of token shards.
	ShardExt = ".twsh"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Dtype is the storage type of the tokens in a shard; its value is the token width in bytes.
type Dtype uint16

const (
	// Uint16 stores tokens as 2-byte unsigned integers (vocabularies up to 65536).
	Uint16 Dtype = 2
	// Uint32 stores tokens as 4-byte unsigned integers.
	Uint32 Dtype = 4
)

// DtypeFor returns the narrowest Dtype that holds every token of a vocabulary of the given size.
func DtypeFor(vocabSize int) Dtype {
	if vocabSize <= 1<<16 {
		return Uint16
	}
	return Uint32
}

// Size returns the width of one token in bytes.
func (d Dtype) Size() int { return int(d) }

// String returns "uint16" or "uint32".
func (d Dtype) String() string {
	switch d {
	case Uint16:
		return "uint16"
	case Uint32:
		return "uint32"
	}
	return fmt.Sprintf("Dtype(%d)", uint16(d))
}

// maxVocab is the largest vocabulary size whose tokens fit d.
func (d Dtype) maxVocab() uint64 {
	if d == Uint16 {
		return 1 << 16
	}
	return 1 << 32
}

// ShardHeader is the decoded header of a shard file.
type ShardHeader struct {
	Version    uint16 // format version (ShardVersion)
	Dtype      Dtype  // token storage type
	Tokens     uint64 // number of tokens in the payload
	VocabSize  uint32 // every token is < VocabSize
	PayloadCRC uint32 // CRC-32C of the payload
}

// appendHeader appends the 32-byte encoding of h.
func (h ShardHeader) appendHeader(dst []byte) []byte {
	start := len(dst)
	dst = append(dst, shardMagic...)
	dst = binary.LittleEndian.AppendUint16(dst, h.Version)
	dst = binary.LittleEndian.AppendUint16(dst, uint16(h.Dtype))
	dst = binary.LittleEndian.AppendUint64(dst, h.Tokens)
	dst = binary.LittleEndian.AppendUint32(dst, h.VocabSize)
	dst = binary.LittleEndian.AppendUint32(dst, h.PayloadCRC)
	dst = binary.LittleEndian.AppendUint32(dst, crc32.Checksum(dst[start:], castagnoli))
	return binary.LittleEndian.AppendUint32(dst, 0)
}

// parseHeader decodes and checks the header of a shard of fileSize bytes whose first bytes are b.
// Errors say what is wrong without the file name; the caller adds it.
func parseHeader(b []byte, fileSize int64) (ShardHeader, error) {
	var h ShardHeader
	if len(b) < len(shardMagic) || string(b[:4]) != shardMagic {
		if len(b) < len(shardMagic) && string(b) == shardMagic[:len(b)] {
			return h, fmt.Errorf("truncated: %d bytes, a shard header needs %d", len(b), ShardHeaderSize)
		}
		return h, fmt.Errorf("not a twell token shard (starts with %q, want magic %q)", b[:min(len(b), 4)], shardMagic)
	}
	if len(b) < ShardHeaderSize {
		return h, fmt.Errorf("truncated: %d bytes, a shard header needs %d", len(b), ShardHeaderSize)
	}
	le := binary.LittleEndian
	h.Version = le.Uint16(b[4:])
	if h.Version != ShardVersion {
		return h, fmt.Errorf("format version %d is not supported (this build reads version %d)", h.Version, ShardVersion)
	}
	if got, want := crc32.Checksum(b[:24], castagnoli), le.Uint32(b[24:]); got != want {
		return h, fmt.Errorf("corrupt header: header checksum %08x, computed %08x", want, got)
	}
	h.Dtype = Dtype(le.Uint16(b[6:]))
	h.Tokens = le.Uint64(b[8:])
	h.VocabSize = le.Uint32(b[16:])
	h.PayloadCRC = le.Uint32(b[20:])
	if h.Dtype != Uint16 && h.Dtype != Uint32 {
		return h, fmt.Errorf("token width %d bytes in header is neither 2 (uint16) nor 4 (uint32)", uint16(h.Dtype))
	}
	if h.VocabSize == 0 {
		return h, errors.New("vocabulary size in header is 0")
	}
	if uint64(h.VocabSize) > h.Dtype.maxVocab() {
		return h, fmt.Errorf("vocabulary size %d does not fit %s tokens", h.VocabSize, h.Dtype)
	}
	if r := le.Uint32(b[28:]); r != 0 {
		return h, fmt.Errorf("reserved header field is %#x, want 0", r)
	}
	payload := fileSize - ShardHeaderSize
	if h.Tokens > uint64(payload)/uint64(h.Dtype.Size()) {
		return h, fmt.Errorf("truncated: header says %d tokens (%d payload bytes) but the file has %d payload bytes",
			h.Tokens, h.Tokens*uint64(h.Dtype.Size()), payload)
	}
	if want := int64(h.Tokens) * int64(h.Dtype.Size()); payload != want {
		return h, fmt.Errorf("%d bytes after the last of the %d tokens the header announces", payload-want, h.Tokens)
	}
	return h, nil
}

// Shard is a verified token shard: its header and its tokens, either memory-mapped from a
// file or held in memory. It is safe for concurrent reads. Close releases a mapping.
type Shard struct {
	name    string
	hdr     ShardHeader
	payload []byte
	mm      mmap.MMap
}

// OpenShard opens, memory-maps and verifies the shard file at path: header, size, payload
// checksum and token range. Errors name the file and what is wrong with it.
func OpenShard(path string) (*Shard, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("data: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("data: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("data: shard %s: not a regular file", path)
	}
	var b []byte
	var mm mmap.MMap
	if st.Size() >= 1<<20 {
		mm, err = mmap.Map(f, mmap.RDONLY, 0)
		if err == nil {
			b = mm
		}
	}
	if b == nil { // small file, or mapping refused: read it
		if b, err = io.ReadAll(f); err != nil {
			return nil, fmt.Errorf("data: shard %s: %w", path, err)
		}
	}
	s, err := parseShard(path, b, int64(len(b)))
	if err != nil {
		if mm != nil {
			mm.Unmap()
		}
		return nil, err
	}
	s.mm = mm
	return s, nil
}

// ReadShard verifies the shard in b (a whole shard file) and returns it; the Shard refers to b,
// which must not be changed afterwards. name is used in error messages.
func ReadShard(name string, b []byte) (*Shard, error) {
	return parseShard(name, b, int64(len(b)))
}

func parseShard(name string, b []byte, size int64) (*Shard, error) {
	h, err := parseHeader(b[:min(len(b), ShardHeaderSize)], size)
	if err != nil {
		return nil, fmt.Errorf("data: shard %s: %w", name, err)
	}
	s := &Shard{name: name, hdr: h, payload: b[ShardHeaderSize:]}
	if got := crc32.Checksum(s.payload, castagnoli); got != h.PayloadCRC {
		return nil, fmt.Errorf("data: shard %s: corrupt payload: checksum %08x in header, computed %08x", name, h.PayloadCRC, got)
	}
	if i, tok := s.firstOutOfRange(); i >= 0 {
		return nil, fmt.Errorf("data: shard %s: token %d at position %d is not below the vocabulary size %d", name, tok, i, h.VocabSize)
	}
	return s, nil
}

// firstOutOfRange returns the position and value of the first token >= VocabSize, or -1.
func (s *Shard) firstOutOfRange() (int, uint64) {
	v := s.hdr.VocabSize
	if s.hdr.Dtype == Uint16 {
		if v >= 1<<16 {
			return -1, 0
		}
		for i := 0; i+1 < len(s.payload); i += 2 {
			if t := binary.LittleEndian.Uint16(s.payload[i:]); uint32(t) >= v {
				return i / 2, uint64(t)
			}
		}
		return -1, 0
	}
	for i := 0; i+3 < len(s.payload); i += 4 {
		if t := binary.LittleEndian.Uint32(s.payload[i:]); t >= v {
			return i / 4, uint64(t)
		}
	}
	return -1, 0
}

// Name returns the path or name the shard was opened with.
func (s *Shard) Name() string { return s.name }

// Header returns the shard's header.
func (s *Shard) Header() ShardHeader { return s.hdr }

// Len returns the number of tokens in the shard.
func (s *Shard) Len() int { return int(s.hdr.Tokens) }

// VocabSize returns the vocabulary size recorded in the header.
func (s *Shard) VocabSize() int { return int(s.hdr.VocabSize) }

// Token returns token i; it panics if i is out of range, like a slice index.
func (s *Shard) Token(i int) int {
	if i < 0 || i >= s.Len() {
		panic(fmt.Sprintf("data: token index %d out of range [0,%d) in shard %s", i, s.Len(), s.name))
	}
	if s.hdr.Dtype == Uint16 {
		return int(binary.LittleEndian.Uint16(s.payload[2*i:]))
	}
	return int(binary.LittleEndian.Uint32(s.payload[4*i:]))
}

// Read copies tokens off, off+1, ... into dst and returns how many it copied: len(dst), or fewer
// at the end of the shard (0 when off >= Len).
func (s *Shard) Read(dst []int32, off int) int {
	if off < 0 || off >= s.Len() {
		return 0
	}
	n := min(len(dst), s.Len()-off)
	if s.hdr.Dtype == Uint16 {
		p := s.payload[2*off : 2*(off+n)]
		for i := range n {
			dst[i] = int32(binary.LittleEndian.Uint16(p[2*i:]))
		}
		return n
	}
	p := s.payload[4*off : 4*(off+n)]
	for i := range n {
		dst[i] = int32(binary.LittleEndian.Uint32(p[4*i:]))
	}
	return n
}

// Close releases the memory mapping, if any. The Shard must not be used afterwards.
func (s *Shard) Close() error {
	s.payload = nil
	if s.mm != nil {
		err := s.mm.Unmap()
		s.mm = nil
		return err
	}
	return nil
}

// ShardWriter writes a shard. Tokens are streamed to a temporary file beside the target; Close
// writes the header, syncs and renames the file into place, so a shard file is either complete
// or absent. A ShardWriter created by NewMemShardWriter writes into memory instead.
type ShardWriter struct {
	path  string
	tmp   *os.File
	w     *bufio.Writer
	mem   []byte // memory mode: header placeholder + payload
	inMem bool
	dtype Dtype
	vocab uint32
	n     uint64
	crc   hash.Hash32
	buf   []byte
	err   error
}

// CreateShard starts writing a shard with tokens below vocabSize to path.
func CreateShard(path string, vocabSize int) (*ShardWriter, error) {
	if vocabSize <= 0 || int64(vocabSize) >= 1<<32 {
		return nil, fmt.Errorf("data: shard %s: vocabulary size %d out of range [1, 2^32)", path, vocabSize)
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return nil, fmt.Errorf("data: %w", err)
	}
	w := &ShardWriter{path: path, tmp: f, w: bufio.NewWriterSize(f, 1<<20), dtype: DtypeFor(vocabSize),
		vocab: uint32(vocabSize), crc: crc32.New(castagnoli)}
	if _, err := w.w.Write(make([]byte, ShardHeaderSize)); err != nil {
		w.Abort()
		return nil, fmt.Errorf("data: shard %s: %w", path, err)
	}
	return w, nil
}

// NewMemShardWriter starts writing a shard into memory; Bytes returns the finished file after
// Close.
func NewMemShardWriter(name string, vocabSize int) (*ShardWriter, error) {
	if vocabSize <= 0 || int64(vocabSize) >= 1<<32 {
		return nil, fmt.Errorf("data: shard %s: vocabulary size %d out of range [1, 2^32)", name, vocabSize)
	}
	return &ShardWriter{path: name, inMem: true, mem: make([]byte, ShardHeaderSize, 1<<16),
		dtype: DtypeFor(vocabSize), vocab: uint32(vocabSize), crc: crc32.New(castagnoli)}, nil
}

// Len returns the number of tokens written so far.
func (w *ShardWriter) Len() int { return int(w.n) }

// Write appends tokens; a token outside [0, vocabSize) is an error and nothing of tokens is
// written.
func (w *ShardWriter) Write(tokens []int) error {
	if w.err != nil {
		return w.err
	}
	for i, t := range tokens {
		if t < 0 || uint64(t) >= uint64(w.vocab) {
			return fmt.Errorf("data: shard %s: token %d (index %d of this write) is outside the vocabulary [0,%d)", w.path, t, i, w.vocab)
		}
	}
	size := w.dtype.Size()
	w.buf = w.buf[:0]
	for _, t := range tokens {
		if size == 2 {
			w.buf = binary.LittleEndian.AppendUint16(w.buf, uint16(t))
		} else {
			w.buf = binary.LittleEndian.AppendUint32(w.buf, uint32(t))
		}
	}
	w.crc.Write(w.buf)
	w.n += uint64(len(tokens))
	if w.inMem {
		w.mem = append(w.mem, w.buf...)
		return nil
	}
	if _, err := w.w.Write(w.buf); err != nil {
		w.err = fmt.Errorf("data: shard %s: %w", w.path, err)
	}
	return w.err
}

func (w *ShardWriter) header() []byte {
	h := ShardHeader{Version: ShardVersion, Dtype: w.dtype, Tokens: w.n, VocabSize: w.vocab, PayloadCRC: w.crc.Sum32()}
	return h.appendHeader(nil)
}

// Close finishes the shard: writes the header and, for a file, syncs it and renames it into
// place. On error the temporary file is removed.
func (w *ShardWriter) Close() error {
	if w.inMem {
		copy(w.mem, w.header())
		return w.err
	}
	if w.tmp == nil {
		return fmt.Errorf("data: shard %s: already closed", w.path)
	}
	err := w.err
	if err == nil {
		err = w.w.Flush()
	}
	if err == nil {
		_, err = w.tmp.WriteAt(w.header(), 0)
	}
	if err == nil {
		err = w.tmp.Sync()
	}
	if err == nil {
		err = w.tmp.Chmod(0o644)
	}
	if cerr := w.tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(w.tmp.Name(), w.path)
	}
	if err != nil {
		os.Remove(w.tmp.Name())
		w.tmp = nil
		return fmt.Errorf("data: shard %s: %w", w.path, err)
	}
	w.tmp = nil
	return nil
}

// Abort discards a shard being written.
func (w *ShardWriter) Abort() {
	if w.tmp != nil {
		w.tmp.Close()
		os.Remove(w.tmp.Name())
		w.tmp = nil
	}
	w.mem = nil
}

// Checksum returns the CRC-32C of the tokens written so far (the header's payload checksum
// once the shard is closed).
func (w *ShardWriter) Checksum() uint32 { return w.crc.Sum32() }

// Bytes returns the finished shard file of a memory writer after Close.
func (w *ShardWriter) Bytes() []byte { return w.mem }

// WriteShard writes tokens (each < vocabSize) as one shard file at path, atomically.
func WriteShard(path string, vocabSize int, tokens []int) error {
	w, err := CreateShard(path, vocabSize)
	if err != nil {
		return err
	}
	if err := w.Write(tokens); err != nil {
		w.Abort()
		return err
	}
	return w.Close()
}
