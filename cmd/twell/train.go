package main

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/twell-ai/twell/data"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/tokenizer"
	"github.com/twell-ai/twell/tokenizer/bpetrain"
	"github.com/twell-ai/twell/train"
)

func init() {
	register(command{name: "train", summary: "train a sparse (ReLU + L1) Llama model", run: runTrain})
}

// sampleVocab is the vocabulary of the tokenizer trained on the bundled
// sample when no tokenizer is given.
const sampleVocab = 1024

func runTrain(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("train", stderr)
	cfgPath := fs.String("config", "", "training config JSON (see train.Config)")
	preset := fs.String("preset", "", "named config: "+strings.Join(train.PresetNames(), "; "))
	out := fs.String("out", "", "output folder: checkpoint/, metrics.jsonl, loss.png, l0.png, dead.png")
	steps := fs.Int("steps", 0, "override the number of steps")
	l1 := fs.Float64("l1", -1, "override lambda, the L1 weight on MLP activations (0 disables)")
	dataDir := fs.String("data", "", "token-shard folder from \"twell data\" (default: the bundled sample)")
	tokPath := fs.String("tokenizer", "", "tokenizer.json matching -data (default: trained on the bundled sample)")
	device := fs.String("device", "auto", "cpu, cuda or auto")
	resume := fs.Bool("resume", false, "continue the run in -out from its checkpoint")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	switch {
	case (*cfgPath == "") == (*preset == ""):
		return usagef("give exactly one of -config FILE or -preset NAME")
	case *out == "":
		return usagef("-out is required")
	case *steps < 0:
		return usagef("-steps %d: must be positive", *steps)
	case *l1 < -1 || (*l1 < 0 && *l1 != -1):
		return usagef("-l1 %g: must be >= 0", *l1)
	}
	switch *device {
	case "auto", "cpu":
	case "cuda":
		return errors.New("-device cuda: GPU training is not part of this build yet; use -device cpu")
	default:
		return usagef("-device %q: want cpu, cuda or auto", *device)
	}
	if _, err := os.Stat(filepath.Join(*out, "checkpoint")); err == nil && !*resume {
		return fmt.Errorf("%s already holds a checkpoint: pass -resume to continue it, or choose another -out", *out)
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}

	// Config file first: its data and tokenizer fields count unless flags override them.
	var cfg *train.Config
	var err error
	if *cfgPath != "" {
		if cfg, err = train.LoadConfig(*cfgPath); err != nil {
			return err
		}
		if *dataDir == "" {
			*dataDir = cfg.Data
		}
		if *tokPath == "" {
			*tokPath = cfg.Tokenizer
		}
	}
	if *dataDir != "" && *tokPath == "" {
		return usagef("-data needs -tokenizer (the tokenizer.json the shards were built with)")
	}

	// Tokenizer: given, or trained on the bundled sample (kept in -out for resume and for the checkpoint).
	if *tokPath == "" {
		*tokPath = filepath.Join(*out, "tokenizer.json")
		if _, err := os.Stat(*tokPath); err != nil {
			fmt.Fprintf(stderr, "training a %d-token BPE tokenizer on the bundled sample\n", sampleVocab)
			var texts []string
			for _, f := range data.SampleFiles() {
				texts = append(texts, f.Text)
			}
			bm, err := bpetrain.Train(texts, bpetrain.Config{VocabSize: sampleVocab})
			if err != nil {
				return err
			}
			if err := bm.Save(*tokPath); err != nil {
				return err
			}
		}
	}
	tok, err := tokenizer.Load(*tokPath)
	if err != nil {
		return err
	}
	eos, ok := tok.EOS()
	if !ok {
		return fmt.Errorf("%s: the tokenizer has no end-of-text token to separate documents", *tokPath)
	}

	if cfg == nil {
		if cfg, err = train.Preset(*preset, tok.VocabSize(), eos); err != nil {
			return usagef("-preset: %v", err)
		}
	}
	if *steps > 0 {
		cfg.Steps = *steps
	}
	if *l1 >= 0 {
		cfg.L1 = *l1
	}
	mc := cfg.ModelConfig()
	if tok.VocabSize() > mc.VocabSize {
		return fmt.Errorf("vocabulary mismatch: %s has %d tokens but the model's vocab_size is %d", *tokPath, tok.VocabSize(), mc.VocabSize)
	}

	// Data: shards, or the bundled sample tokenized in memory.
	var ds *data.Dataset
	if *dataDir != "" {
		if ds, err = data.Open(*dataDir); err != nil {
			return err
		}
		defer ds.Close()
		if ds.VocabSize() != tok.VocabSize() {
			return fmt.Errorf("vocabulary mismatch: the shards in %s were built with %d tokens, %s has %d", *dataDir, ds.VocabSize(), *tokPath, tok.VocabSize())
		}
	} else {
		ds, err = data.BuildMemory(data.BuildConfig{Sources: []data.Source{data.SampleSource()},
			Encoder: encoder{tok, eos}, Tokenizer: *tokPath, ValFrac: 0.05})
		if err != nil {
			return err
		}
	}
	if ds.TrainTokens() < int64(cfg.Seq+1) {
		return fmt.Errorf("the training split has %d tokens, fewer than one sequence of %d", ds.TrainTokens(), cfg.Seq+1)
	}
	val, err := valWindows(ds, cfg.Seq, cfg.EvalBatches*cfg.Batch)
	if err != nil {
		return err
	}

	run := train.NewRun(cfg, *out, model.RandomWeights(mc, rand.New(rand.NewPCG(cfg.Seed, 0x5eed))),
		&datasetSource{ds: ds, seed: cfg.Seed}, val)
	run.Extra = map[string]string{"tokenizer.json": *tokPath}
	run.Log = stderr
	if *resume {
		if err := run.Resume(); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "resuming %s at step %d\n", *out, run.Step())
	}
	fmt.Fprintf(stderr, "train: %.2fM parameters, %d train tokens, %d held-out windows, %d steps of %d x %d tokens, l1 %g\n",
		float64(mc.ParamCount())/1e6, ds.TrainTokens(), len(val), cfg.Steps, cfg.Batch*cfg.Accum, cfg.Seq, cfg.L1)
	t0 := time.Now()
	if err := run.Loop(); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "trained %d steps in %.1fs; checkpoint: %s\n", cfg.Steps, time.Since(t0).Seconds(), filepath.Join(*out, "checkpoint"))
	return nil
}

// encoder adapts a tokenizer to data.Encoder.
type encoder struct {
	t   *tokenizer.Tokenizer
	eos int
}

func (e encoder) Encode(text string) ([]int, error) { return e.t.AppendEncode(nil, text) }
func (e encoder) VocabSize() int                    { return e.t.VocabSize() }
func (e encoder) EOS() int                          { return e.eos }

// datasetSource draws training windows at seeded pseudo-random offsets of a
// dataset's training split: window i depends only on (seed, i).
type datasetSource struct {
	ds   *data.Dataset
	seed uint64
	buf  []int32
}

func (s *datasetSource) Window(dst []int, i int64) error {
	n := s.ds.TrainTokens() - int64(len(dst))
	if n < 0 {
		return fmt.Errorf("training split of %d tokens is shorter than a window of %d", s.ds.TrainTokens(), len(dst))
	}
	off := rand.New(rand.NewPCG(s.seed, uint64(i))).Int64N(n + 1)
	if cap(s.buf) < len(dst) {
		s.buf = make([]int32, len(dst))
	}
	buf := s.buf[:len(dst)]
	if err := s.ds.TrainTokensAt(buf, off); err != nil {
		return err
	}
	for k, v := range buf {
		dst[k] = int(v)
	}
	return nil
}

// valWindows collects up to limit held-out windows of seq+1 tokens, taking
// the sources in turn.
func valWindows(ds *data.Dataset, seq, limit int) ([][]int, error) {
	var out [][]int
	for _, src := range ds.ValSources() {
		it, err := ds.Val(src, 1, seq)
		if err != nil {
			return nil, err
		}
		var buf []int32
		for len(out) < limit {
			var rows int
			buf, rows, err = it.Next(buf)
			if errors.Is(err, io.EOF) || rows == 0 {
				break
			}
			if err != nil {
				return nil, err
			}
			w := make([]int, seq+1)
			for k, v := range buf[:seq+1] {
				w[k] = int(v)
			}
			out = append(out, w)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("the held-out split has no window of %d tokens: use more data or a shorter seq", seq+1)
	}
	return out, nil
}
