package data

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
)

// Defaults used when a BuildConfig field is zero, and the usual validation fraction.
const (
	// DefaultShardTokens is the most tokens a shard file holds (128 MiB of uint16 tokens).
	DefaultShardTokens = 64 << 20
	// DefaultValFrac is the usual fraction of each source's documents held out for
	// validation (the twell data command's default; BuildConfig's zero means none).
	DefaultValFrac = 0.01
)

// Encoder turns text into token ids. Build calls Encode from several goroutines at once, so
// it must be safe for concurrent use. A package tokenizer Tokenizer fits through a small
// adapter (see cmd/twell/data.go).
type Encoder interface {
	// Encode returns the ids of text, without special tokens of its own.
	Encode(text string) ([]int, error)
	// VocabSize returns the number of ids; every id is below it.
	VocabSize() int
	// EOS returns the end-of-text id that Build writes after every document.
	EOS() int
}

// BuildConfig describes a dataset to build.
type BuildConfig struct {
	Sources []Source
	Encoder Encoder
	// Tokenizer names the tokenizer in the index (a file path or name); informational.
	Tokenizer string
	// ValFrac is the fraction of each source's documents held out for validation: the last
	// ceil(ValFrac*n) of its n kept documents, at least one and at most n-1. A source with a
	// single document has that document cut at a paragraph break instead. 0 holds out nothing.
	ValFrac float64
	// ShardTokens is the most tokens per shard file (DefaultShardTokens when 0).
	ShardTokens int
	// Workers is the number of tokenizing goroutines (all cores when 0).
	Workers int
	// Overwrite lets Build replace an existing dataset folder (one with an index.json).
	Overwrite bool
	// Progress, when set, is called from one goroutine as the build advances.
	Progress func(Progress)
}

// Progress reports how far a build is.
type Progress struct {
	Phase string // "scan" (reading and deduplicating) or "tokenize"
	Done  int64  // bytes of text done in this phase
	Total int64  // bytes of text in this phase (0 when not known yet)
}

// plan is a checked BuildConfig with the files of every source listed.
type plan struct {
	cfg     BuildConfig
	sources []*srcPlan
	bytes   int64 // bytes of kept documents, known after scan
}

type srcPlan struct {
	src      Source
	files    []string
	fileName string      // the name used in val shard file names
	kept     []bool      // per document in eachDoc order: tokenized (not empty, not a duplicate)
	hashes   [][16]byte  // per document: hash of the normalized text (kept documents)
	nKept    int         // number of kept documents
	nVal     int         // the last nVal kept documents are validation documents
	splitOne bool        // the single kept document is cut into a train and a val part
	stats    SourceStats // filled as the build goes
}

// newPlan checks cfg for a build (the encoder, the shard size) and lists the input files.
// Everything that can be known about bad input before reading documents fails here.
func newPlan(cfg BuildConfig) (*plan, error) {
	if cfg.Encoder == nil {
		return nil, errors.New("data: no encoder (tokenizer) given")
	}
	v := cfg.Encoder.VocabSize()
	if v <= 0 || int64(v) >= 1<<32 {
		return nil, fmt.Errorf("data: encoder vocabulary size %d out of range [1, 2^32)", v)
	}
	if e := cfg.Encoder.EOS(); e < 0 || e >= v {
		return nil, fmt.Errorf("data: end-of-text id %d is outside the vocabulary [0,%d)", e, v)
	}
	if cfg.ShardTokens < 0 {
		return nil, fmt.Errorf("data: shard size %d tokens, want > 0", cfg.ShardTokens)
	}
	if cfg.ShardTokens == 0 {
		cfg.ShardTokens = DefaultShardTokens
	}
	if cfg.Workers <= 0 {
		cfg.Workers = runtime.GOMAXPROCS(0)
	}
	return newSplitPlan(cfg)
}

// newSplitPlan checks what decides the train/validation split (the sources and ValFrac) and
// lists the input files; Build and HeldOut share it.
func newSplitPlan(cfg BuildConfig) (*plan, error) {
	if math.IsNaN(cfg.ValFrac) || cfg.ValFrac < 0 || cfg.ValFrac >= 1 {
		return nil, fmt.Errorf("data: validation fraction %v out of range [0, 1)", cfg.ValFrac)
	}
	if len(cfg.Sources) == 0 {
		return nil, errors.New("data: empty corpus: no sources given")
	}
	p := &plan{cfg: cfg}
	names := map[string]bool{}
	fileNames := map[string]bool{}
	total := 0
	for i, s := range cfg.Sources {
		if s.Name == "" {
			return nil, fmt.Errorf("data: source %d has no name", i)
		}
		if names[s.Name] {
			return nil, fmt.Errorf("data: two sources are named %q", s.Name)
		}
		names[s.Name] = true
		files, err := inputFiles(s)
		if err != nil {
			return nil, err
		}
		if len(files) == 0 && len(s.Docs) == 0 {
			return nil, fmt.Errorf("data: source %s is empty: no paths and no documents", s.Name)
		}
		total += len(files) + len(s.Docs)
		fn := safeFileName(s.Name)
		if fileNames[fn] {
			fn = fmt.Sprintf("%s-%d", fn, i)
		}
		fileNames[fn] = true
		sp := &srcPlan{src: s, files: files, fileName: fn}
		sp.stats.Name = s.Name
		sp.stats.Inputs = s.Paths
		sp.stats.Files = len(files)
		p.sources = append(p.sources, sp)
	}
	if total == 0 {
		return nil, errors.New("data: empty corpus: the sources hold no files or documents")
	}
	return p, nil
}

// safeFileName keeps letters, digits, '.', '-' and '_' of name and replaces the rest by '_'.
func safeFileName(name string) string {
	b := []byte(name)
	for i, c := range b {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '-' || c == '_'
		if !ok {
			b[i] = '_'
		}
	}
	return strings.TrimLeft(string(b), ".")
}

func docHash(s string) [16]byte {
	h := sha256.Sum256([]byte(s))
	var k [16]byte
	copy(k[:], h[:])
	return k
}

// scan reads every document once: normalizes it, drops empty documents and exact duplicates
// (across all sources; the first copy is kept) and decides the validation split.
func (p *plan) scan() error {
	seen := map[[16]byte]bool{}
	var done int64
	kept := 0
	for _, sp := range p.sources {
		err := eachDoc(sp.src.Name, sp.files, sp.src.Docs, func(loc, text string) error {
			sp.stats.Documents++
			done += int64(len(text))
			n := Normalize(text)
			var h [16]byte
			ok := n != ""
			if !ok {
				sp.stats.Empty++
			} else if h = docHash(n); seen[h] {
				sp.stats.Duplicates++
				ok = false
			} else {
				seen[h] = true
				sp.nKept++
				p.bytes += int64(len(n))
			}
			sp.kept = append(sp.kept, ok)
			sp.hashes = append(sp.hashes, h)
			if p.cfg.Progress != nil {
				p.cfg.Progress(Progress{Phase: "scan", Done: done})
			}
			return nil
		})
		if err != nil {
			return err
		}
		kept += sp.nKept
		switch {
		case p.cfg.ValFrac == 0 || sp.nKept == 0:
		case sp.nKept == 1:
			sp.splitOne = true
		default:
			sp.nVal = min(max(int(math.Ceil(p.cfg.ValFrac*float64(sp.nKept))), 1), sp.nKept-1)
		}
	}
	if kept == 0 {
		docs, empty := 0, 0
		for _, sp := range p.sources {
			docs += sp.stats.Documents
			empty += sp.stats.Empty
		}
		return fmt.Errorf("data: empty corpus: all %d documents are empty (%d) or duplicates (%d)", docs, empty, docs-empty)
	}
	return nil
}

// splitDoc cuts a document into a train part and a validation part of about frac of its bytes,
// at the paragraph break (else line break, else space) nearest to that point. ok is false when
// the document has no such break.
func splitDoc(s string, frac float64) (train, val string, ok bool) {
	target := int(float64(len(s)) * (1 - frac))
	for _, sep := range []string{"\n\n", "\n", " "} {
		best := -1
		for i := 0; ; {
			j := strings.Index(s[i:], sep)
			if j < 0 {
				break
			}
			at := i + j
			if best < 0 || abs(at-target) < abs(best-target) {
				best = at
			}
			i = at + len(sep)
		}
		if best > 0 {
			train = strings.TrimRight(s[:best], " \n")
			val = strings.TrimLeft(s[best:], " \n")
			if train != "" && val != "" {
				return train, val, true
			}
		}
	}
	return s, "", false
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

// docPart is a kept document, or one part of a source's single document cut in two, as Build
// writes it.
type docPart struct {
	src  int    // index of the source in plan.sources
	loc  string // where the document is in the input (see eachDoc)
	text string // the normalized document, or the part of it
	val  bool   // it goes to the validation split
	cut  bool   // text is a part of a document that splitDoc cut in two
	size int    // bytes of the normalized document it accounts for (progress)
}

// eachPart reads the documents again after scan and calls fn with every kept document, in
// order, as it goes to the train or the validation split: this is the one place that applies
// the split that scan decided. It stops at the first error from fn.
func (p *plan) eachPart(fn func(docPart) error) error {
	for si, sp := range p.sources {
		di, ki := 0, 0
		err := eachDoc(sp.src.Name, sp.files, sp.src.Docs, func(loc, text string) error {
			d := di
			di++
			if d >= len(sp.kept) {
				return fmt.Errorf("data: %s: the input changed during the build (more documents than before)", loc)
			}
			if !sp.kept[d] {
				return nil
			}
			n := Normalize(text)
			if n == "" || docHash(n) != sp.hashes[d] {
				return fmt.Errorf("data: %s: the document changed during the build", loc)
			}
			k := ki
			ki++
			if sp.splitOne {
				if tr, va, ok := splitDoc(n, p.cfg.ValFrac); ok {
					if err := fn(docPart{src: si, loc: loc, text: tr, cut: true, size: len(n) - len(va)}); err != nil {
						return err
					}
					return fn(docPart{src: si, loc: loc, text: va, val: true, cut: true, size: len(va)})
				}
			}
			return fn(docPart{src: si, loc: loc, text: n, val: k >= sp.nKept-sp.nVal, size: len(n)})
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// sink receives finished shards.
type sink interface {
	create(name string, vocab int) (*ShardWriter, error)
	finish(name string, w *ShardWriter) error
}

// fileSink writes shard files into a folder.
type fileSink struct{ dir string }

func (s fileSink) create(name string, vocab int) (*ShardWriter, error) {
	return CreateShard(filepath.Join(s.dir, name), vocab)
}
func (s fileSink) finish(_ string, w *ShardWriter) error { return w.Close() }

// memSink keeps shards in memory.
type memSink struct{ shards map[string]*Shard }

func (s memSink) create(name string, vocab int) (*ShardWriter, error) {
	return NewMemShardWriter(name, vocab)
}
func (s memSink) finish(name string, w *ShardWriter) error {
	if err := w.Close(); err != nil {
		return err
	}
	sh, err := ReadShard(name, w.Bytes())
	if err != nil {
		return err
	}
	s.shards[name] = sh
	return nil
}

// rolling writes a stream of tokens as numbered shards of at most max tokens.
type rolling struct {
	sink   sink
	prefix string // file names are prefix-00000.twsh, ...
	source string // recorded in ShardInfo
	vocab  int
	max    int
	cur    *ShardWriter
	name   string
	infos  []ShardInfo
}

func (r *rolling) write(toks []int) error {
	for len(toks) > 0 {
		if r.cur == nil {
			r.name = fmt.Sprintf("%s-%05d%s", r.prefix, len(r.infos), ShardExt)
			w, err := r.sink.create(r.name, r.vocab)
			if err != nil {
				return err
			}
			r.cur = w
		}
		n := min(len(toks), r.max-r.cur.Len())
		if err := r.cur.Write(toks[:n]); err != nil {
			return err
		}
		toks = toks[n:]
		if r.cur.Len() == r.max {
			if err := r.flush(); err != nil {
				return err
			}
		}
	}
	return nil
}

// flush finishes the current shard, if any.
func (r *rolling) flush() error {
	if r.cur == nil {
		return nil
	}
	w := r.cur
	r.cur = nil
	if err := r.sink.finish(r.name, w); err != nil {
		return err
	}
	r.infos = append(r.infos, ShardInfo{File: r.name, Source: r.source, Tokens: int64(w.Len()), CRC32C: w.Checksum()})
	return nil
}

func (r *rolling) abort() {
	if r.cur != nil {
		r.cur.Abort()
		r.cur = nil
	}
}

type tokJob struct {
	seq  int
	src  int
	val  bool
	text string
	size int // bytes of the normalized document this job accounts for (progress)
}

type tokResult struct {
	tokJob
	toks []int
	err  error
}

// tokenize reads the documents again, tokenizes the kept ones on all workers and writes them,
// in document order, to the train shards or to their source's validation shards.
func (p *plan) tokenize(out sink) (*Index, error) {
	cfg := p.cfg
	enc := cfg.Encoder
	vocab, eos := enc.VocabSize(), enc.EOS()
	train := &rolling{sink: out, prefix: "train", vocab: vocab, max: cfg.ShardTokens}
	vals := make([]*rolling, len(p.sources))
	for i, sp := range p.sources {
		vals[i] = &rolling{sink: out, prefix: "val-" + sp.fileName, source: sp.src.Name, vocab: vocab, max: cfg.ShardTokens}
	}
	abortAll := func() {
		train.abort()
		for _, v := range vals {
			v.abort()
		}
	}

	workers := cfg.Workers
	jobs := make(chan tokJob, workers)
	results := make(chan tokResult, workers)
	slots := make(chan struct{}, 4*workers+4) // bounds the documents held in memory
	stop := make(chan struct{})
	var stopOnce sync.Once
	halt := func() { stopOnce.Do(func() { close(stop) }) }

	var prodErr error
	go func() { // producer
		defer close(jobs)
		seq := 0
		send := func(j tokJob) bool {
			j.seq = seq
			select {
			case slots <- struct{}{}:
			case <-stop:
				return false
			}
			select {
			case jobs <- j:
				seq++
				return true
			case <-stop:
				return false
			}
		}
		errStopped := errors.New("stopped")
		err := p.eachPart(func(d docPart) error {
			if !send(tokJob{src: d.src, val: d.val, text: d.text, size: d.size}) {
				return errStopped
			}
			return nil
		})
		if err != nil && err != errStopped {
			prodErr = err
			halt()
		}
	}()

	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for j := range jobs {
				toks, err := enc.Encode(j.text)
				if err == nil {
					toks = append(toks, eos)
				} else {
					err = fmt.Errorf("data: tokenizing a document of source %s: %w", p.sources[j.src].src.Name, err)
				}
				results <- tokResult{tokJob: j, toks: toks, err: err}
			}
		})
	}
	go func() {
		wg.Wait()
		close(results)
	}()

	var firstErr error
	pending := map[int]tokResult{}
	next := 0
	var done int64
	for r := range results {
		if firstErr != nil {
			continue // drain
		}
		if r.err != nil {
			firstErr = r.err
			halt()
			continue
		}
		pending[r.seq] = r
		for {
			r, ok := pending[next]
			if !ok {
				break
			}
			delete(pending, next)
			next++
			<-slots
			sp := p.sources[r.src]
			w := train
			if r.val {
				w = vals[r.src]
				sp.stats.ValDocuments++
				sp.stats.ValTokens += int64(len(r.toks))
				sp.stats.ValBytes += int64(len(r.text))
			} else {
				sp.stats.TrainDocuments++
				sp.stats.TrainTokens += int64(len(r.toks))
				sp.stats.TrainBytes += int64(len(r.text))
			}
			if err := w.write(r.toks); err != nil {
				firstErr = err
				halt()
				break
			}
			done += int64(r.size)
			if cfg.Progress != nil {
				cfg.Progress(Progress{Phase: "tokenize", Done: done, Total: p.bytes})
			}
		}
	}
	if firstErr == nil {
		firstErr = prodErr
	}
	if firstErr == nil {
		firstErr = train.flush()
	}
	for _, v := range vals {
		if firstErr == nil {
			firstErr = v.flush()
		}
	}
	if firstErr != nil {
		abortAll()
		return nil, firstErr
	}

	idx := &Index{
		Format:      IndexFormat,
		Version:     IndexVersion,
		Tokenizer:   cfg.Tokenizer,
		VocabSize:   vocab,
		EOS:         eos,
		Dtype:       DtypeFor(vocab).String(),
		ShardTokens: cfg.ShardTokens,
		ValFrac:     cfg.ValFrac,
		Train:       train.infos,
	}
	for i, sp := range p.sources {
		idx.Sources = append(idx.Sources, sp.stats)
		idx.Val = append(idx.Val, vals[i].infos...)
	}
	if idx.Train == nil {
		return nil, errors.New("data: no training documents (every kept document went to validation)")
	}
	return idx, nil
}

// Build tokenizes the sources of cfg into a dataset folder outDir: shard files and an
// index.json (see Index). outDir must not exist, be empty, or (with cfg.Overwrite) hold a
// dataset. The dataset is built in a temporary folder beside outDir and moved into place when
// it is complete, so outDir never holds a half-written dataset.
func Build(outDir string, cfg BuildConfig) (*Index, error) {
	if outDir == "" {
		return nil, errors.New("data: no output folder given")
	}
	outDir = filepath.Clean(outDir)
	exists, err := checkOutDir(outDir, cfg.Overwrite)
	if err != nil {
		return nil, err
	}
	p, err := newPlan(cfg)
	if err != nil {
		return nil, err
	}
	if err := p.scan(); err != nil {
		return nil, err
	}
	parent := filepath.Dir(outDir)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return nil, fmt.Errorf("data: %w", err)
	}
	tmp, err := os.MkdirTemp(parent, "."+filepath.Base(outDir)+".partial-")
	if err != nil {
		return nil, fmt.Errorf("data: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			os.RemoveAll(tmp)
		}
	}()
	idx, err := p.tokenize(fileSink{dir: tmp})
	if err != nil {
		return nil, err
	}
	if err := idx.write(filepath.Join(tmp, IndexFile)); err != nil {
		return nil, err
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		return nil, fmt.Errorf("data: %w", err)
	}
	if err := replaceDir(tmp, outDir, exists); err != nil {
		return nil, err
	}
	ok = true
	return idx, nil
}

// checkOutDir reports whether dir exists and fails when Build must not write there.
func checkOutDir(dir string, overwrite bool) (bool, error) {
	st, err := os.Stat(dir)
	if os.IsNotExist(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("data: %w", err)
	}
	if !st.IsDir() {
		return false, fmt.Errorf("data: output %s exists and is not a folder", dir)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return false, fmt.Errorf("data: %w", err)
	}
	if len(ents) == 0 {
		return true, nil
	}
	if !overwrite {
		return false, fmt.Errorf("data: output folder %s is not empty (choose a new folder, or overwrite the dataset there)", dir)
	}
	if _, err := os.Stat(filepath.Join(dir, IndexFile)); err != nil {
		return false, fmt.Errorf("data: refusing to replace %s: it has no %s, so it is not a dataset folder", dir, IndexFile)
	}
	return true, nil
}

// replaceDir moves the finished folder tmp to dir, replacing what is there.
func replaceDir(tmp, dir string, exists bool) error {
	if !exists {
		if err := os.Rename(tmp, dir); err != nil {
			return fmt.Errorf("data: %w", err)
		}
		return nil
	}
	old, err := os.MkdirTemp(filepath.Dir(dir), "."+filepath.Base(dir)+".old-")
	if err != nil {
		return fmt.Errorf("data: %w", err)
	}
	os.Remove(old) // only the unique name is wanted
	if err := os.Rename(dir, old); err != nil {
		return fmt.Errorf("data: %w", err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		os.Rename(old, dir) // put the old dataset back
		return fmt.Errorf("data: %w", err)
	}
	if err := os.RemoveAll(old); err != nil {
		return fmt.Errorf("data: the new dataset is in place but the old one is left in %s: %w", old, err)
	}
	return nil
}

// BuildMemory builds a dataset like Build but keeps the shards in memory, for small corpora
// such as the bundled sample.
func BuildMemory(cfg BuildConfig) (*Dataset, error) {
	p, err := newPlan(cfg)
	if err != nil {
		return nil, err
	}
	if err := p.scan(); err != nil {
		return nil, err
	}
	ms := memSink{shards: map[string]*Shard{}}
	idx, err := p.tokenize(ms)
	if err != nil {
		return nil, err
	}
	return newDataset(*idx, "", func(name string) (*Shard, error) {
		s, ok := ms.shards[name]
		if !ok {
			return nil, fmt.Errorf("data: shard %s missing", name)
		}
		return s, nil
	})
}
