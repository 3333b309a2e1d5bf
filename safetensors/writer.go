package safetensors

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"

	"github.com/twell-ai/twell/internal/atomicfile"
)

// Writer writes a safetensors file, or a sharded checkpoint, so that no reader ever sees a
// half-written file: tensor bytes are spooled to unlinked temporary files as they are added,
// and Close writes each output to a temporary file in the target directory, syncs it and
// renames it into place.
//
// Within a file, tensors are laid out by element size, largest first (then in the order
// they were added), and the header is padded to a multiple of 8 bytes, as the reference
// writer does: every tensor then starts at a multiple of its element size, which PyTorch
// needs to view the bytes in place.
//
// Unless SetMetadata("format", ...) says otherwise, files carry {"format": "pt"} metadata,
// which transformers requires of any safetensors file that has metadata.
type Writer struct {
	dir      string
	base     string // output file name (single-file mode)
	maxShard int64  // > 0: sharded mode with this many tensor bytes per shard at most
	meta     map[string]string
	names    map[string]bool
	spools   [4]*spool // by size class: element sizes 1, 2, 4, 8
	shards   []*shard
	scratch  []byte
	err      error // sticky I/O error
	done     bool
}

// spool collects the bytes of all tensors of one size class.
type spool struct {
	f    *os.File
	w    *bufio.Writer
	size int64
}

// shard is one output file: its tensors in the order added, and for each size class the
// contiguous range of that class's spool that holds their bytes.
type shard struct {
	entries []wentry
	size    int64
	from    [4]int64 // spool offsets where this shard's bytes begin
	bytes   [4]int64 // bytes per class
}

type wentry struct {
	entry       // begin and end are assigned when the file is laid out
	class int   // size class of the dtype
	n     int64 // bytes
}

// sizeClass maps an element size (1, 2, 4, 8) to 0..3.
func sizeClass(size int) int {
	switch size {
	case 1:
		return 0
	case 2:
		return 1
	case 4:
		return 2
	}
	return 3
}

// Create starts writing a single safetensors file at path. Nothing appears at path until
// Close succeeds; an existing file there is then replaced.
func Create(path string) (*Writer, error) {
	dir := filepath.Dir(path)
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return nil, &Error{Path: path, Msg: "directory " + dir + " does not exist"}
	}
	return &Writer{dir: dir, base: filepath.Base(path), meta: map[string]string{"format": "pt"}, names: map[string]bool{}}, nil
}

// CreateSharded starts writing a checkpoint into dir (created if needed) in the Hugging Face
// layout: shards of at most maxShardBytes tensor bytes (a larger tensor gets a shard of its
// own) named model-00001-of-0000N.safetensors plus model.safetensors.index.json, or a lone
// model.safetensors when everything fits in one shard. Close then removes model*.safetensors
// files and a stale index left in dir by an earlier save, as transformers' save_pretrained
// does, so the directory holds exactly one checkpoint.
func CreateSharded(dir string, maxShardBytes int64) (*Writer, error) {
	if maxShardBytes <= 0 {
		return nil, &Error{Path: dir, Msg: fmt.Sprintf("max shard size %d must be positive", maxShardBytes)}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, ioErr(dir, "create directory", err)
	}
	return &Writer{dir: dir, maxShard: maxShardBytes, meta: map[string]string{"format": "pt"}, names: map[string]bool{}}, nil
}

// SetMetadata sets a __metadata__ entry of the output file(s).
func (w *Writer) SetMetadata(key, value string) { w.meta[key] = value }

// Add appends a tensor given as raw little-endian bytes; len(data) must match the shape.
// A rejected tensor leaves the writer usable; an I/O failure makes every later call fail.
func (w *Writer) Add(name string, dtype DType, shape []int, data []byte) error {
	s, sp, err := w.begin(name, dtype, shape, int64(len(data)), -1)
	if err != nil {
		return err
	}
	if _, err := sp.w.Write(data); err != nil {
		return w.fail(name, err)
	}
	w.commit(s, sp, name, dtype, shape, int64(len(data)))
	return nil
}

// AddTensor appends a copy of t, e.g. one read from another file.
func (w *Writer) AddTensor(t Tensor) error { return w.Add(t.Name, t.DType, t.Shape, t.Data) }

// AddFloat32 appends a tensor given as float32 values, stored as dtype BF16 or F16 (rounded
// to nearest even), F32 or F64.
func (w *Writer) AddFloat32(name string, dtype DType, shape []int, values []float32) error {
	if !dtype.IsFloat() {
		return &Error{Path: w.target(), Tensor: name, Msg: fmt.Sprintf("cannot store float32 values as dtype %s", dtype)}
	}
	nbytes := int64(len(values)) * int64(dtype.Size())
	s, sp, err := w.begin(name, dtype, shape, nbytes, len(values))
	if err != nil {
		return err
	}
	const chunk = 1 << 16
	for i := 0; i < len(values); i += chunk {
		w.scratch, _ = encodeFloat32(w.scratch[:0], dtype, values[i:min(i+chunk, len(values))])
		if _, err := sp.w.Write(w.scratch); err != nil {
			return w.fail(name, err)
		}
	}
	w.commit(s, sp, name, dtype, shape, nbytes)
	return nil
}

// begin validates a tensor about to be added (nvalues < 0: unknown) and returns the shard
// that will hold it and the spool its bytes go to.
func (w *Writer) begin(name string, dtype DType, shape []int, nbytes int64, nvalues int) (*shard, *spool, error) {
	fail := func(format string, args ...any) (*shard, *spool, error) {
		return nil, nil, &Error{Path: w.target(), Tensor: name, Msg: fmt.Sprintf(format, args...)}
	}
	switch {
	case w.done:
		return fail("writer is closed")
	case w.err != nil:
		return nil, nil, w.err
	case name == "" || name == metadataKey:
		return fail("invalid tensor name")
	case w.names[name]:
		return fail("added twice")
	case !dtype.Valid():
		return fail("unknown dtype %q", dtype)
	}
	n := int64(1)
	for _, d := range shape {
		if d < 0 || (d > 0 && n > math.MaxInt64/int64(d)) {
			return fail("invalid shape %v", shape)
		}
		n *= int64(d)
	}
	if nvalues >= 0 && int64(nvalues) != n {
		return fail("shape %v has %d elements, got %d values", shape, n, nvalues)
	}
	if size := int64(dtype.Size()); n > math.MaxInt64/size || n*size != nbytes {
		return fail("shape %v of %s needs %s bytes, got %d", shape, dtype, mulString(n, size), nbytes)
	}
	c := sizeClass(dtype.Size())
	if w.spools[c] == nil {
		f, err := os.CreateTemp(w.dir, ".twell-spool-*")
		if err != nil {
			return nil, nil, w.fail(name, err)
		}
		// Unlinked at once (where the OS allows) so a crash leaves nothing behind.
		os.Remove(f.Name())
		w.spools[c] = &spool{f: f, w: bufio.NewWriterSize(f, 1<<20)}
	}
	var s *shard
	if len(w.shards) > 0 {
		s = w.shards[len(w.shards)-1]
	}
	if s == nil || (w.maxShard > 0 && s.size > 0 && s.size+nbytes > w.maxShard) {
		s = &shard{}
		for i, sp := range w.spools {
			if sp != nil {
				s.from[i] = sp.size
			}
		}
		w.shards = append(w.shards, s)
	}
	return s, w.spools[c], nil
}

func (w *Writer) commit(s *shard, sp *spool, name string, dtype DType, shape []int, nbytes int64) {
	c := sizeClass(dtype.Size())
	s.entries = append(s.entries, wentry{entry: entry{name: name, dtype: dtype, shape: slices.Clone(shape)}, class: c, n: nbytes})
	s.size += nbytes
	s.bytes[c] += nbytes
	sp.size += nbytes
	w.names[name] = true
}

func (w *Writer) fail(tensor string, err error) error {
	w.err = &Error{Path: w.target(), Tensor: tensor, Msg: "write", Err: err}
	return w.err
}

func (w *Writer) target() string {
	if w.maxShard > 0 {
		return w.dir
	}
	return filepath.Join(w.dir, w.base)
}

// Abort discards everything written so far; the target is left untouched.
func (w *Writer) Abort() {
	w.done = true
	w.release()
}

func (w *Writer) release() {
	for i, sp := range w.spools {
		if sp != nil {
			sp.f.Close()
			os.Remove(sp.f.Name()) // in case unlinking at creation was not possible
			w.spools[i] = nil
		}
	}
	w.shards = nil
}

// Close writes the output file(s) and renames them into place. On error nothing is renamed
// over an existing file, except that in sharded mode shards renamed before a failure stay.
func (w *Writer) Close() error {
	if w.done {
		return &Error{Path: w.target(), Msg: "writer is already closed"}
	}
	w.done = true
	defer w.release()
	if w.err != nil {
		return w.err
	}
	for _, sp := range w.spools {
		if sp != nil {
			if err := sp.w.Flush(); err != nil {
				return ioErr(w.target(), "write", err)
			}
		}
	}
	if len(w.shards) == 0 {
		w.shards = []*shard{{}} // an empty file is still a valid file
	}
	if w.maxShard == 0 {
		return w.writeOutputs([]string{w.base})
	}
	n := len(w.shards)
	names := []string{SingleFileName}
	if n > 1 {
		names = make([]string, n)
		for i := range names {
			names[i] = fmt.Sprintf("model-%05d-of-%05d.safetensors", i+1, n)
		}
	}
	if err := w.writeOutputs(names); err != nil {
		return err
	}
	if n > 1 {
		if err := w.writeIndex(names); err != nil {
			return err
		}
	}
	return w.removeStale(names, n > 1)
}

// writeOutputs writes shard i to dir/names[i] through temporary files, renaming only after
// all of them were written and synced.
func (w *Writer) writeOutputs(names []string) error {
	tmps := make([]string, len(names))
	defer func() {
		for _, t := range tmps {
			if t != "" {
				os.Remove(t)
			}
		}
	}()
	for i, s := range w.shards {
		final := filepath.Join(w.dir, names[i])
		tmp, err := w.writeShard(final, s)
		if err != nil {
			return err
		}
		tmps[i] = tmp
	}
	for i, t := range tmps {
		final := filepath.Join(w.dir, names[i])
		if err := os.Rename(t, final); err != nil {
			return ioErr(final, "rename into place", err)
		}
		tmps[i] = ""
	}
	syncDir(w.dir)
	return nil
}

// layout assigns data offsets: size classes from largest to smallest, each in add order.
func (s *shard) layout() []entry {
	var out []entry
	var pos int64
	for c := 3; c >= 0; c-- {
		for i := range s.entries {
			if e := &s.entries[i]; e.class == c {
				e.begin, e.end = pos, pos+e.n
				pos += e.n
				out = append(out, e.entry)
			}
		}
	}
	return out
}

func (w *Writer) writeShard(final string, s *shard) (string, error) {
	f, err := os.CreateTemp(w.dir, "."+filepath.Base(final)+".tmp-*")
	if err != nil {
		return "", ioErr(final, "create temporary file", err)
	}
	err = func() error {
		hdr := encodeHeader(w.meta, s.layout())
		bw := bufio.NewWriterSize(f, 1<<20)
		var prefix [8]byte
		binary.LittleEndian.PutUint64(prefix[:], uint64(len(hdr)))
		bw.Write(prefix[:])
		bw.Write(hdr)
		for c := 3; c >= 0; c-- {
			if s.bytes[c] == 0 {
				continue
			}
			src := io.NewSectionReader(w.spools[c].f, s.from[c], s.bytes[c])
			if n, err := io.Copy(bw, src); err != nil {
				return err
			} else if n != s.bytes[c] {
				return fmt.Errorf("spooled %d bytes, copied %d", s.bytes[c], n)
			}
		}
		if err := bw.Flush(); err != nil {
			return err
		}
		if err := f.Chmod(0o644); err != nil {
			return err
		}
		return f.Sync()
	}()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return "", ioErr(final, "write", err)
	}
	return f.Name(), nil
}

func (w *Writer) writeIndex(names []string) error {
	weightMap := map[string]string{}
	var total int64
	for i, s := range w.shards {
		for _, e := range s.entries {
			weightMap[e.name] = names[i]
			total += e.n
		}
	}
	idx := map[string]any{"metadata": map[string]any{"total_size": total}, "weight_map": weightMap}
	b, err := json.MarshalIndent(idx, "", "  ")
	if err != nil {
		return err
	}
	path := filepath.Join(w.dir, IndexFileName)
	if err := atomicfile.WriteFile(path, append(b, '\n')); err != nil {
		return ioErr(path, "write", err)
	}
	return nil
}

// removeStale deletes checkpoint files of an earlier save that the new one does not use.
func (w *Writer) removeStale(keep []string, sharded bool) error {
	old, _ := filepath.Glob(filepath.Join(w.dir, "model-*-of-*.safetensors"))
	old = append(old, filepath.Join(w.dir, SingleFileName))
	if !sharded {
		old = append(old, filepath.Join(w.dir, IndexFileName))
	}
	var errs []error
	for _, p := range old {
		if slices.Contains(keep, filepath.Base(p)) {
			continue
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, ioErr(p, "remove stale checkpoint file", err))
		}
	}
	return errors.Join(errs...)
}

// encodeHeader renders the JSON header (metadata first, tensors in data order), padded with
// spaces to a multiple of 8 bytes so that the data section starts 8-byte aligned.
func encodeHeader(meta map[string]string, entries []entry) []byte {
	var b bytes.Buffer
	b.WriteByte('{')
	if len(meta) > 0 {
		m, _ := json.Marshal(meta) // map[string]string always marshals; keys sorted
		b.WriteString(`"__metadata__":`)
		b.Write(m)
	}
	for i, e := range entries {
		if i > 0 || len(meta) > 0 {
			b.WriteByte(',')
		}
		name, _ := json.Marshal(e.name)
		shape := e.shape
		if shape == nil {
			shape = []int{}
		}
		sh, _ := json.Marshal(shape)
		fmt.Fprintf(&b, `%s:{"dtype":"%s","shape":%s,"data_offsets":[%d,%d]}`, name, e.dtype, sh, e.begin, e.end)
	}
	b.WriteByte('}')
	for b.Len()%8 != 0 {
		b.WriteByte(' ')
	}
	return b.Bytes()
}

// syncDir makes a rename in dir durable; failure is ignored (some systems cannot sync dirs).
func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
}
