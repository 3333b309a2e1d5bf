package safetensors

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Standard file names of a Hugging Face checkpoint directory.
const (
	SingleFileName = "model.safetensors"
	IndexFileName  = "model.safetensors.index.json"
)

// Checkpoint is a merged, read-only view over the safetensors files of one checkpoint: a
// single file, or the shards listed by an index. Tensor names are unique across it.
type Checkpoint struct {
	path  string // what was opened: a file, an index or a directory
	files []*File
	where map[string]*File
	names []string
	meta  map[string]string
}

// OpenCheckpoint opens path as a checkpoint: a directory (see OpenDir), an index JSON file
// (see OpenIndex), or a single safetensors file.
func OpenCheckpoint(path string) (*Checkpoint, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, ioErr(path, "open", err)
	}
	switch {
	case st.IsDir():
		return OpenDir(path)
	case strings.HasSuffix(path, ".json"):
		return OpenIndex(path)
	}
	f, err := Open(path)
	if err != nil {
		return nil, err
	}
	return single(path, f), nil
}

// OpenDir opens the checkpoint in dir. Like transformers, it prefers model.safetensors and
// otherwise reads model.safetensors.index.json.
func OpenDir(dir string) (*Checkpoint, error) {
	p := filepath.Join(dir, SingleFileName)
	if _, err := os.Stat(p); err == nil {
		f, err := Open(p)
		if err != nil {
			return nil, err
		}
		return single(dir, f), nil
	}
	idx := filepath.Join(dir, IndexFileName)
	if _, err := os.Stat(idx); err == nil {
		return OpenIndex(idx)
	}
	return nil, &Error{Path: dir, Msg: "no " + SingleFileName + " or " + IndexFileName + " in this directory", Kind: ErrNotFound}
}

func single(path string, f *File) *Checkpoint {
	c := &Checkpoint{path: path, files: []*File{f}, where: make(map[string]*File, len(f.names)), names: f.names, meta: f.meta}
	for _, n := range f.names {
		c.where[n] = f
	}
	return c
}

// indexJSON is the layout of model.safetensors.index.json.
type indexJSON struct {
	Metadata  map[string]json.RawMessage `json:"metadata"`
	WeightMap map[string]string          `json:"weight_map"`
}

// OpenIndex opens a sharded checkpoint through its index file, whose weight_map maps each
// tensor name to a shard file in the index's directory. Every shard must exist, hold every
// tensor the index assigns to it, and hold no tensor the index does not list.
func OpenIndex(path string) (*Checkpoint, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, ioErr(path, "read", err)
	}
	var idx indexJSON
	if err := json.Unmarshal(raw, &idx); err != nil {
		return nil, &Error{Path: path, Msg: "index is not valid JSON of the form {\"weight_map\": {name: file}}", Kind: ErrFormat, Err: err}
	}
	if len(idx.WeightMap) == 0 {
		return nil, formatErr(path, "", "index has no weight_map entries")
	}
	// Open each shard once, in sorted order so errors are deterministic.
	var shards []string
	for name, shard := range idx.WeightMap {
		if !filepath.IsLocal(shard) || shard == "" {
			return nil, formatErr(path, name, "shard file %q is not a relative path inside the checkpoint directory", shard)
		}
		shards = append(shards, shard)
	}
	slices.Sort(shards)
	shards = slices.Compact(shards)

	c := &Checkpoint{path: path, where: make(map[string]*File, len(idx.WeightMap))}
	byShard := map[string]*File{}
	dir := filepath.Dir(path)
	for _, s := range shards {
		f, err := Open(filepath.Join(dir, s))
		if err != nil {
			c.Close()
			if errors.Is(err, fs.ErrNotExist) {
				return nil, &Error{Path: path, Msg: fmt.Sprintf("shard file %q is missing", s), Kind: ErrNotFound, Err: err}
			}
			return nil, err
		}
		c.files = append(c.files, f)
		byShard[s] = f
	}
	for name, s := range idx.WeightMap {
		f := byShard[s]
		if !f.Has(name) {
			c.Close()
			return nil, &Error{Path: path, Tensor: name, Msg: fmt.Sprintf("listed in the index for shard %q, which does not contain it", s), Kind: ErrNotFound}
		}
		c.where[name] = f
		c.names = append(c.names, name)
	}
	for _, f := range c.files {
		for _, n := range f.names {
			if c.where[n] != f {
				c.Close()
				return nil, formatErr(path, n, "present in shard %q but not mapped to it by the index", f.path)
			}
		}
	}
	slices.Sort(c.names)
	if len(idx.Metadata) > 0 {
		c.meta = map[string]string{}
		for k, v := range idx.Metadata {
			var s string
			if json.Unmarshal(v, &s) != nil {
				s = string(v) // numbers such as total_size keep their JSON text
			}
			c.meta[k] = s
		}
	}
	return c, nil
}

// Path returns what the checkpoint was opened from.
func (c *Checkpoint) Path() string { return c.path }

// Files returns the opened files: one, or the shards in name order.
func (c *Checkpoint) Files() []*File { return c.files }

// Names returns all tensor names, sorted. The slice must not be modified.
func (c *Checkpoint) Names() []string { return c.names }

// Metadata returns the single file's __metadata__, or the index's "metadata" object with
// non-string values as JSON text. It must not be modified.
func (c *Checkpoint) Metadata() map[string]string { return c.meta }

// Has reports whether the checkpoint holds a tensor called name.
func (c *Checkpoint) Has(name string) bool {
	_, ok := c.where[name]
	return ok
}

// Tensor returns the named tensor from whichever shard holds it.
func (c *Checkpoint) Tensor(name string) (Tensor, error) {
	f, ok := c.where[name]
	if !ok {
		return Tensor{}, &Error{Path: c.path, Tensor: name, Msg: "not found", Kind: ErrNotFound}
	}
	return f.Tensor(name)
}

// Expect returns the named tensor after checking its dtype (empty: any) and shape; see
// File.Expect.
func (c *Checkpoint) Expect(name string, dtype DType, shape ...int) (Tensor, error) {
	f, ok := c.where[name]
	if !ok {
		return Tensor{}, &Error{Path: c.path, Tensor: name, Msg: "not found", Kind: ErrNotFound}
	}
	return f.Expect(name, dtype, shape...)
}

// Unused returns, sorted, the tensor names not in consumed.
func (c *Checkpoint) Unused(consumed map[string]bool) []string { return unused(c.names, consumed) }

// Close closes every file. Tensor data obtained earlier must not be used afterwards.
func (c *Checkpoint) Close() error {
	var errs []error
	for _, f := range c.files {
		errs = append(errs, f.Close())
	}
	return errors.Join(errs...)
}
