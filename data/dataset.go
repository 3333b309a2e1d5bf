package data

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/twell-ai/twell/internal/atomicfile"
)

// Index file constants.
const (
	// IndexFile is the name of the index in a dataset folder.
	IndexFile = "index.json"
	// IndexFormat is the value of the index's "format" field.
	IndexFormat = "twell-token-shards"
	// IndexVersion is the index version this package writes and reads.
	IndexVersion = 1
)

// Index describes a dataset: how it was made, its sources and its shard files. It is stored as
// index.json in the dataset folder.
type Index struct {
	Format      string        `json:"format"`  // IndexFormat
	Version     int           `json:"version"` // IndexVersion
	Tokenizer   string        `json:"tokenizer,omitempty"`
	VocabSize   int           `json:"vocab_size"`
	EOS         int           `json:"eos"` // written after every document
	Dtype       string        `json:"dtype"`
	ShardTokens int           `json:"shard_tokens"`
	ValFrac     float64       `json:"val_frac"`
	Sources     []SourceStats `json:"sources"`
	Train       []ShardInfo   `json:"train"` // in stream order
	Val         []ShardInfo   `json:"val"`   // grouped by source, in stream order
}

// SourceStats counts what Build did with one source. Token counts include the end-of-text
// token after every document; byte counts are UTF-8 bytes of the normalized text (for
// bits-per-byte).
type SourceStats struct {
	Name           string   `json:"name"`
	Inputs         []string `json:"inputs,omitempty"`
	Files          int      `json:"files"`
	Documents      int      `json:"documents"` // read, before dropping any
	Empty          int      `json:"empty"`
	Duplicates     int      `json:"duplicates"`
	TrainDocuments int      `json:"train_documents"`
	ValDocuments   int      `json:"val_documents"`
	TrainTokens    int64    `json:"train_tokens"`
	ValTokens      int64    `json:"val_tokens"`
	TrainBytes     int64    `json:"train_bytes"`
	ValBytes       int64    `json:"val_bytes"`
}

// ShardInfo describes one shard file of a dataset.
type ShardInfo struct {
	File   string `json:"file"`             // name inside the dataset folder
	Source string `json:"source,omitempty"` // validation shards: the source they hold out
	Tokens int64  `json:"tokens"`
	CRC32C uint32 `json:"crc32c"` // payload checksum, as in the shard header
}

// TrainTokens returns the number of training tokens.
func (x *Index) TrainTokens() int64 {
	var n int64
	for _, s := range x.Train {
		n += s.Tokens
	}
	return n
}

// write stores the index as JSON at path, atomically.
func (x *Index) write(path string) error {
	b, err := json.MarshalIndent(x, "", "  ")
	if err != nil {
		return fmt.Errorf("data: %w", err)
	}
	b = append(b, '\n')
	if err := atomicfile.WriteFile(path, b); err != nil {
		return fmt.Errorf("data: writing %s: %w", path, err)
	}
	return nil
}

// check validates the fields of an index read from name.
func (x *Index) check(name string) error {
	if x.Format != IndexFormat {
		return fmt.Errorf("data: %s: format %q, want %q", name, x.Format, IndexFormat)
	}
	if x.Version != IndexVersion {
		return fmt.Errorf("data: %s: version %d is not supported (this build reads version %d)", name, x.Version, IndexVersion)
	}
	if x.VocabSize <= 0 || int64(x.VocabSize) >= 1<<32 {
		return fmt.Errorf("data: %s: vocab_size %d out of range", name, x.VocabSize)
	}
	if x.EOS < 0 || x.EOS >= x.VocabSize {
		return fmt.Errorf("data: %s: eos %d outside the vocabulary [0,%d)", name, x.EOS, x.VocabSize)
	}
	if len(x.Train) == 0 {
		return fmt.Errorf("data: %s: no train shards", name)
	}
	sources := map[string]bool{}
	for _, s := range x.Sources {
		sources[s.Name] = true
	}
	files := map[string]bool{}
	for i, s := range append(append([]ShardInfo{}, x.Train...), x.Val...) {
		field := fmt.Sprintf("train[%d]", i)
		if i >= len(x.Train) {
			field = fmt.Sprintf("val[%d]", i-len(x.Train))
		}
		if s.File == "" || s.File != filepath.Base(s.File) || strings.ContainsAny(s.File, `/\`) || !strings.HasSuffix(s.File, ShardExt) {
			return fmt.Errorf("data: %s: %s.file %q is not a shard file name", name, field, s.File)
		}
		if files[s.File] {
			return fmt.Errorf("data: %s: %s.file %q is listed twice", name, field, s.File)
		}
		files[s.File] = true
		if s.Tokens < 0 {
			return fmt.Errorf("data: %s: %s.tokens %d is negative", name, field, s.Tokens)
		}
		if i >= len(x.Train) && !sources[s.Source] {
			return fmt.Errorf("data: %s: %s.source %q is not one of the sources", name, field, s.Source)
		}
	}
	return nil
}

// stream is a sequence of shards read as one run of tokens.
type stream struct {
	shards []*Shard
	starts []int64 // starts[i] is the stream offset of shards[i]; one more entry: the length
}

func newStream(shards []*Shard) *stream {
	s := &stream{shards: shards, starts: make([]int64, len(shards)+1)}
	for i, sh := range shards {
		s.starts[i+1] = s.starts[i] + int64(sh.Len())
	}
	return s
}

// len returns the number of tokens.
func (s *stream) len() int64 { return s.starts[len(s.shards)] }

// read fills dst with the tokens at off, off+1, ...; the range must be inside the stream.
func (s *stream) read(dst []int32, off int64) {
	i := sort.Search(len(s.shards), func(i int) bool { return s.starts[i+1] > off })
	for len(dst) > 0 {
		n := s.shards[i].Read(dst, int(off-s.starts[i]))
		dst = dst[n:]
		off += int64(n)
		i++
	}
}

// Dataset is an opened dataset: its index and verified shards. It is safe for concurrent use;
// each Loader and ValIter it makes is not.
type Dataset struct {
	// Index is the dataset's index.
	Index  Index
	dir    string
	train  *stream
	val    map[string]*stream
	shards []*Shard
}

// Open reads the dataset in folder dir: its index.json and every shard, each checked against
// its header checksum and against the index (token count, vocabulary, checksum).
func Open(dir string) (*Dataset, error) {
	name := filepath.Join(dir, IndexFile)
	b, err := os.ReadFile(name)
	if errors.Is(err, fs.ErrNotExist) {
		if _, derr := os.Stat(dir); derr != nil {
			return nil, fmt.Errorf("data: %w", derr)
		}
		return nil, fmt.Errorf("data: %s is not a dataset folder: it has no %s", dir, IndexFile)
	}
	if err != nil {
		return nil, fmt.Errorf("data: %w", err)
	}
	var idx Index
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&idx); err != nil {
		return nil, fmt.Errorf("data: %s: %w", name, err)
	}
	if err := idx.check(name); err != nil {
		return nil, err
	}
	return newDataset(idx, dir, func(file string) (*Shard, error) {
		return OpenShard(filepath.Join(dir, file))
	})
}

// newDataset opens the shards of a checked index with open.
func newDataset(idx Index, dir string, open func(file string) (*Shard, error)) (*Dataset, error) {
	d := &Dataset{Index: idx, dir: dir, val: map[string]*stream{}}
	get := func(info ShardInfo) (*Shard, error) {
		s, err := open(info.File)
		if err != nil {
			return nil, err
		}
		d.shards = append(d.shards, s)
		h := s.Header()
		switch {
		case int64(h.Tokens) != info.Tokens:
			return nil, fmt.Errorf("data: shard %s has %d tokens, the index says %d", s.Name(), h.Tokens, info.Tokens)
		case int(h.VocabSize) != idx.VocabSize:
			return nil, fmt.Errorf("data: shard %s has vocabulary size %d, the index says %d", s.Name(), h.VocabSize, idx.VocabSize)
		case h.PayloadCRC != info.CRC32C:
			return nil, fmt.Errorf("data: shard %s has checksum %08x, the index says %08x (a shard of another build?)", s.Name(), h.PayloadCRC, info.CRC32C)
		}
		return s, nil
	}
	var train []*Shard
	for _, info := range idx.Train {
		s, err := get(info)
		if err != nil {
			d.Close()
			return nil, err
		}
		train = append(train, s)
	}
	d.train = newStream(train)
	val := map[string][]*Shard{}
	for _, info := range idx.Val {
		s, err := get(info)
		if err != nil {
			d.Close()
			return nil, err
		}
		val[info.Source] = append(val[info.Source], s)
	}
	for src, shards := range val {
		d.val[src] = newStream(shards)
	}
	return d, nil
}

// Close releases the shards.
func (d *Dataset) Close() error {
	var first error
	for _, s := range d.shards {
		if err := s.Close(); err != nil && first == nil {
			first = err
		}
	}
	d.shards = nil
	return first
}

// Dir returns the dataset's folder ("" for a dataset built in memory).
func (d *Dataset) Dir() string { return d.dir }

// VocabSize returns the vocabulary size of the tokens.
func (d *Dataset) VocabSize() int { return d.Index.VocabSize }

// EOS returns the end-of-text id that follows every document.
func (d *Dataset) EOS() int { return d.Index.EOS }

// TrainTokens returns the number of training tokens.
func (d *Dataset) TrainTokens() int64 { return d.train.len() }

// ValSources returns the names of the sources that have validation tokens, in index order.
func (d *Dataset) ValSources() []string {
	var out []string
	for _, s := range d.Index.Sources {
		if v, ok := d.val[s.Name]; ok && v.len() > 0 {
			out = append(out, s.Name)
		}
	}
	return out
}

// ValTokens returns the number of validation tokens of a source (0 for an unknown source).
func (d *Dataset) ValTokens(source string) int64 {
	if v, ok := d.val[source]; ok {
		return v.len()
	}
	return 0
}

// TrainTokensAt copies training tokens off, off+1, ... into dst; it fails when the range is
// not inside the training split.
func (d *Dataset) TrainTokensAt(dst []int32, off int64) error {
	if off < 0 || off+int64(len(dst)) > d.train.len() {
		return fmt.Errorf("data: train tokens [%d,%d) outside [0,%d)", off, off+int64(len(dst)), d.train.len())
	}
	d.train.read(dst, off)
	return nil
}
