package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/twell-ai/twell/backend"
	"github.com/twell-ai/twell/dist"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/data"
	"github.com/twell-ai/twell/gpu/trainer"
	"github.com/twell-ai/twell/internal/atomicfile"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/mlp"
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

// trainFlags are the flags of twell train.
type trainFlags struct {
	cfgPath, preset, out, dataDir, tokPath, device string
	steps, gpus                                    int
	l1, denseAbove                                 float64
	recompute                                      bool
	mlp                                            mlp.Path
	resume, overwrite                              bool
	set                                            map[string]bool // the flags given

	// A rank of a data-parallel run (started by -gpus, or by torchrun's
	// variables): where it stands; ranked false for a single process.
	env    dist.Env
	ranked bool
}

// writer reports whether this process writes the run folder and reports
// progress: a single process, or rank 0 of a data-parallel run.
func (f *trainFlags) writer() bool { return !f.ranked || f.env.Rank == 0 }

func parseTrainFlags(args []string, stderr io.Writer) (*trainFlags, error) {
	f := &trainFlags{set: map[string]bool{}}
	fs := newFlagSet("train", stderr)
	fs.StringVar(&f.cfgPath, "config", "", "training config JSON (see train.Config)")
	fs.StringVar(&f.preset, "preset", "", "named config: "+strings.Join(train.PresetNames(), "; "))
	fs.StringVar(&f.out, "out", "", "run folder: checkpoint/, metrics.jsonl, loss.png, l0.png, dead.png; required")
	fs.IntVar(&f.steps, "steps", 0, "optimizer steps, >= 1 (default: the config's; with -resume it may extend the run)")
	fs.Float64Var(&f.l1, "l1", 0, "lambda, the L1 weight on MLP activations: finite, >= 0, 0 disables (default: the config's)")
	fs.StringVar(&f.dataDir, "data", "", "token-shard folder from \"twell data\" (default: the bundled sample)")
	fs.StringVar(&f.tokPath, "tokenizer", "", "tokenizer.json matching -data (default: trained on the bundled sample)")
	fs.StringVar(&f.device, "device", "auto", backend.FlagUsage)
	fs.BoolVar(&f.resume, "resume", false, "continue the run in -out from its newest checkpoint (its config is read from there)")
	fs.BoolVar(&f.overwrite, "overwrite", false, "start over in an -out that holds an earlier run, deleting its checkpoints, metrics and plots")
	fs.Var(&f.mlp, "mlp", "GPU MLP path: auto (per layer: sparse while its density is at most -dense-above), sparse or dense")
	fs.Float64Var(&f.denseAbove, "dense-above", trainer.DefaultDenseAbove, "with -mlp auto, the density above which a layer's MLP runs dense on the GPU")
	fs.BoolVar(&f.recompute, "recompute", false, "GPU: keep only each layer's input and run its forward again before its backward (one more forward pass a step, far less activation memory; the same results)")
	fs.IntVar(&f.gpus, "gpus", 1, "GPUs of this host to train on, data-parallel, one process each; the global batch stays the config's")
	if err := parseFlags(fs, args); err != nil {
		return nil, err
	}
	if !(f.denseAbove > 0 && f.denseAbove <= 1) {
		return nil, usagef("-dense-above %v: must be a density in (0, 1]", f.denseAbove)
	}
	fs.Visit(func(fl *flag.Flag) { f.set[fl.Name] = true })
	switch {
	case f.out == "":
		return nil, usagef("-out is required")
	case f.cfgPath != "" && f.preset != "":
		return nil, usagef("give one of -config FILE or -preset NAME, not both")
	case !f.resume && f.cfgPath == "" && f.preset == "":
		return nil, usagef("give exactly one of -config FILE or -preset NAME (or -resume)")
	case f.resume && f.overwrite:
		return nil, usagef("-resume continues the run in -out and -overwrite deletes it: give one")
	case f.set["steps"] && f.steps < 1:
		return nil, usagef("-steps %d: must be >= 1", f.steps)
	case f.set["l1"] && !(f.l1 >= 0 && !math.IsInf(f.l1, 0)):
		return nil, usagef("-l1 %v: must be a finite number >= 0", f.l1)
	case !f.resume && f.dataDir != "" && f.tokPath == "":
		return nil, usagef("-data needs -tokenizer (the tokenizer.json the shards were built with)")
	}
	if f.preset != "" {
		if err := train.CheckPreset(f.preset); err != nil {
			return nil, usagef("-preset: %v", err)
		}
	}
	if _, err := backend.Parse(f.device); err != nil {
		return nil, usagef("%v", err)
	}
	return f, nil
}

// trainSetup is everything a run needs, gathered and checked before
// anything is written.
type trainSetup struct {
	cfg       *train.Config
	saved     *train.Saved // the checkpoint resumed from; nil for a fresh run
	tok       *tokenizer.Tokenizer
	tokJSON   []byte
	tokPath   string // where the tokenizer came from ("" when trained here)
	writeTok  bool   // save tokJSON as -out/tokenizer.json
	ds        *data.Dataset
	val       [][]int
	eos       int
	clearRun  bool
	startStep int
}

func runTrain(args []string, stdout, stderr io.Writer) error {
	f, err := parseTrainFlags(args, stderr)
	if err != nil {
		return err
	}
	if f.gpus > 1 && f.device == "cpu" {
		return usagef("-gpus %d with -device cpu: data-parallel training runs on GPUs", f.gpus)
	}
	if launched, err := launchTrain(f, args, stdout, stderr); launched {
		return err
	}
	if f.env, f.ranked, err = dist.FromEnv(os.Getenv); err == nil && f.ranked {
		err = f.env.Validate()
	}
	if err != nil {
		return usagef("%v", err)
	}
	if f.ranked && f.device == "cpu" {
		return usagef("-device cpu: data-parallel training (WORLD_SIZE=%d) runs on GPUs", f.env.WorldSize)
	}
	if !f.writer() { // only rank 0 speaks; the others' errors still show
		stdout = io.Discard
	}
	s, err := prepareTrain(f, stderr)
	if err != nil {
		return err
	}
	defer s.ds.Close()
	cfg := s.cfg
	mc := cfg.ModelConfig()

	// Ctrl-C (or SIGTERM) ends the run after the step under way, saved; a
	// second one at once. A rank can get one signal from its launcher and
	// the same one from a supervisor that signals every process: for it
	// only a signal well after the first means "now".
	gap := time.Duration(0)
	if f.ranked {
		gap = 2 * time.Second
	}
	ctx, stopSignals := onInterrupt(func() {
		os.Exit(130) // a second Ctrl-C: stop now; the last complete checkpoint stays on disk
	}, gap)
	defer stopSignals()

	// The backend before anything else: a missing GPU, or one too small for
	// the model and batch, is refused while -out still holds what it held.
	w := model.RandomWeights(mc, rand.New(rand.NewPCG(cfg.Seed, 0x5eed)))
	if s.saved != nil {
		w = s.saved.Weights
	}
	tb, gpuBackend, err := newTrainBackend(ctx, f, cfg, w, stderr)
	if err != nil {
		return err
	}
	defer tb.Close()

	// Everything is checked: from here on the run writes into -out.
	if s.clearRun && f.writer() {
		extra := []string{}
		if s.writeTok {
			extra = append(extra, "tokenizer.json")
		}
		if err := train.ClearRun(f.out, extra...); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(f.out, 0o755); err != nil {
		return err
	}
	if s.writeTok && f.writer() {
		if err := atomicfile.WriteFile(filepath.Join(f.out, "tokenizer.json"), s.tokJSON); err != nil {
			return err
		}
	}
	log := stderr
	if !f.writer() {
		log = io.Discard
	}
	run := train.NewRun(cfg, f.out, tb, &datasetSource{ds: s.ds, seed: cfg.Seed}, s.val)
	run.Files = map[string][]byte{"tokenizer.json": s.tokJSON, "tokenizer_config.json": tokenizerConfig(s.tok, mc, s.eos)}
	if f.writer() {
		run.Log = stderr
	}
	if s.saved != nil {
		from := s.saved.Dir
		if err := run.ResumeFrom(s.saved); err != nil {
			return err
		}
		fmt.Fprintf(log, "resuming %s at step %d of %d (from %s)\n", f.out, run.Step(), cfg.Steps, from)
	}
	fmt.Fprintf(log, "train: %.2fM parameters, %d train tokens, %d held-out windows, %d steps of %d x %d tokens, l1 %g\n",
		float64(mc.ParamCount())/1e6, s.ds.TrainTokens(), len(s.val), cfg.Steps, cfg.Batch*cfg.Accum, cfg.Seq, cfg.L1)

	t0 := time.Now()
	err = run.Loop(ctx)
	var intr *train.Interrupted
	if errors.As(err, &intr) {
		if intr.Checkpoint == "" {
			fmt.Fprintf(log, "twell train: interrupted before the first step finished: nothing to resume; start again with -overwrite\n")
		} else {
			fmt.Fprintf(log, "twell train: interrupted at step %d of %d: saved checkpoint %s, metrics.jsonl and plots in %s; resume with: twell train -out %s -resume\n",
				intr.Step, cfg.Steps, intr.Checkpoint, f.out, f.out)
		}
		return exitCode{code: 130} // as a shell reports death by SIGINT
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "trained %d steps (%d to %d) in %.1fs; checkpoint: %s\n", run.Step()-s.startStep, s.startStep, run.Step(),
		time.Since(t0).Seconds(), filepath.Join(f.out, "checkpoint"))
	if gpuBackend != nil {
		fmt.Fprintf(stdout, "peak device memory in use: %s\n", memcheck.Format(float64(gpuBackend.PeakMemory())))
	}
	return nil
}

// newTrainBackend returns the backend of -device: cpu, cuda (GPU 0), or
// auto (cuda when a GPU is found and can train this model, else cpu); for
// a rank of a data-parallel run, the GPU of its local rank joined to the
// other ranks' (see rankBackend). The GPU backend is also returned as
// such, for its memory report.
func newTrainBackend(ctx context.Context, f *trainFlags, cfg *train.Config, w *model.Weights, stderr io.Writer) (train.Backend, *trainer.Backend, error) {
	if f.ranked {
		return rankBackend(ctx, f, cfg, w, stderr)
	}
	device := f.device
	mc := cfg.ModelConfig()
	cpuNote := func() {
		if f.set["mlp"] || f.set["dense-above"] {
			fmt.Fprintf(stderr, "note: -mlp and -dense-above choose the GPU trainer's MLP kernels; the CPU trainer runs its MLPs dense\n")
		}
		if f.recompute {
			fmt.Fprintf(stderr, "note: -recompute is the GPU trainer's; the CPU trainer keeps every layer's activations\n")
		}
	}
	if device == "cpu" {
		cpuNote()
		b, err := train.NewCPU(mc, w)
		return b, nil, err
	}
	dev, err := cuda.Open(0)
	if err == nil {
		var b *trainer.Backend
		if b, err = trainer.New(dev, mc, w, trainer.Options{Batch: cfg.Batch, Seq: cfg.Seq, MLP: f.mlp, DenseAbove: f.denseAbove,
			Recompute: f.recompute}); err == nil {
			fmt.Fprintf(stderr, "training on %v\n", dev)
			return b, b, nil
		}
	}
	if device == "cuda" {
		return nil, nil, fmt.Errorf("-device cuda: %w", err)
	}
	fmt.Fprintf(stderr, "training on the CPU (no usable GPU: %v)\n", err)
	cpuNote()
	b, err := train.NewCPU(mc, w)
	return b, nil, err
}

// prepareTrain reads and checks the config, the run folder, the tokenizer
// and the data, writing nothing.
func prepareTrain(f *trainFlags, stderr io.Writer) (*trainSetup, error) {
	s := &trainSetup{}
	if st, err := os.Stat(f.out); err == nil && !st.IsDir() {
		return nil, fmt.Errorf("-out %s is a file, not a folder", f.out)
	}
	var given *train.Config // from -config (a preset needs the tokenizer first)
	if f.cfgPath != "" {
		c, err := train.LoadConfig(f.cfgPath)
		if err != nil {
			return nil, err
		}
		given = c
	}
	dataDir, tokPath := f.dataDir, f.tokPath
	if f.resume {
		saved, err := train.LoadCheckpoint(f.out)
		if err != nil {
			return nil, err
		}
		s.saved, s.cfg, s.startStep = saved, saved.Config.Clone(), saved.Step
		if dataDir == "" {
			dataDir = s.cfg.Data
		}
		if tokPath == "" {
			tokPath = filepath.Join(saved.Dir, "tokenizer.json")
			if _, err := os.Stat(tokPath); err != nil && s.cfg.Tokenizer != "" {
				tokPath = s.cfg.Tokenizer
			}
		}
	} else {
		if given != nil {
			if dataDir == "" {
				dataDir = given.Data
			}
			if tokPath == "" {
				tokPath = given.Tokenizer
			}
			if dataDir != "" && tokPath == "" {
				return nil, fmt.Errorf("%s: data %q needs a tokenizer (the tokenizer.json the shards were built with)", f.cfgPath, dataDir)
			}
		}
		// Only the process that writes the folder looks at what is there
		// (rank 0 may be clearing it while the others start).
		var earlier []string
		if f.writer() {
			var err error
			if earlier, err = train.EarlierRun(f.out); err != nil {
				return nil, err
			}
		}
		s.writeTok = tokPath == ""
		if s.writeTok && f.writer() {
			if _, err := os.Stat(filepath.Join(f.out, "tokenizer.json")); err == nil {
				earlier = append(earlier, "tokenizer.json")
			}
		}
		if len(earlier) > 0 && !f.overwrite {
			return nil, fmt.Errorf("%s holds an earlier run (%s): pass -resume to continue it, -overwrite to replace it, or choose another -out",
				f.out, strings.Join(earlier, ", "))
		}
		s.clearRun = len(earlier) > 0
	}

	// Tokenizer: given, the checkpoint's, or trained here on the bundled sample.
	var err error
	if tokPath != "" {
		if s.tokJSON, err = os.ReadFile(tokPath); err != nil {
			return nil, err
		}
		if s.tok, err = tokenizer.Parse(s.tokJSON); err != nil {
			return nil, fmt.Errorf("%s: %w", tokPath, err)
		}
		s.tokPath = tokPath
	} else {
		fmt.Fprintf(stderr, "training a %d-token BPE tokenizer on the bundled sample\n", sampleVocab)
		var texts []string
		for _, f := range data.SampleFiles() {
			texts = append(texts, f.Text)
		}
		bm, err := bpetrain.Train(texts, bpetrain.Config{VocabSize: sampleVocab})
		if err != nil {
			return nil, err
		}
		if s.tokJSON, err = bm.JSON(); err != nil {
			return nil, err
		}
		if s.tok, err = tokenizer.Parse(s.tokJSON); err != nil {
			return nil, err
		}
	}
	eos, ok := s.tok.EOS()
	if !ok {
		return nil, fmt.Errorf("%s: the tokenizer has no end-of-text token to separate documents", tokPath)
	}
	s.eos = eos

	// The config: the checkpoint's (resume), -config's, or the preset's for this vocabulary.
	if given == nil && f.preset != "" {
		if given, err = train.Preset(f.preset, s.tok.VocabSize(), eos); err != nil {
			return nil, usagef("-preset: %v", err)
		}
	}
	for _, c := range []*train.Config{s.cfg, given} {
		if c == nil {
			continue
		}
		if f.set["steps"] {
			c.Steps = f.steps
		}
		if f.set["l1"] {
			c.L1 = f.l1
		}
	}
	if s.cfg == nil {
		s.cfg = given
		if dataDir != "" {
			s.cfg.Data = absPath(dataDir)
		}
		if tokPath != "" {
			s.cfg.Tokenizer = absPath(tokPath)
		}
	} else if given != nil {
		what := "-preset " + f.preset
		if f.cfgPath != "" {
			what = "-config " + f.cfgPath
		}
		if d := given.Diff(s.cfg, "data", "tokenizer"); d != "" {
			return nil, fmt.Errorf("%s does not describe the run being resumed: %s; resume with -out and -resume alone (the checkpoint holds the config)",
				what, strings.Replace(d, "(other:", "(checkpoint:", 1))
		}
	}
	cfg := s.cfg
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if s.saved != nil && s.saved.Step > cfg.Steps {
		return nil, fmt.Errorf("-steps %d: the checkpoint in %s is already at step %d", cfg.Steps, s.saved.Dir, s.saved.Step)
	}
	mc := cfg.ModelConfig()
	if s.tok.VocabSize() > mc.VocabSize {
		return nil, fmt.Errorf("vocabulary mismatch: %s has %d tokens but the model's vocab_size is %d", tokName(tokPath), s.tok.VocabSize(), mc.VocabSize)
	}

	// Data: shards, or the bundled sample tokenized in memory.
	if dataDir != "" {
		if s.ds, err = data.Open(dataDir); err != nil {
			return nil, err
		}
		if s.ds.VocabSize() != s.tok.VocabSize() {
			s.ds.Close()
			return nil, fmt.Errorf("vocabulary mismatch: the shards in %s were built with %d tokens, %s has %d", dataDir, s.ds.VocabSize(), tokName(tokPath), s.tok.VocabSize())
		}
	} else {
		s.ds, err = data.BuildMemory(data.BuildConfig{Sources: []data.Source{data.SampleSource()},
			Encoder: tokenizerEncoder{s.tok, eos}, Tokenizer: tokName(tokPath), ValFrac: 0.05})
		if err != nil {
			return nil, err
		}
	}
	if s.ds.TrainTokens() < int64(cfg.Seq+1) {
		s.ds.Close()
		return nil, fmt.Errorf("the training split has %d tokens, fewer than one sequence of %d", s.ds.TrainTokens(), cfg.Seq+1)
	}
	if s.val, err = valWindows(s.ds, cfg.Seq, cfg.EvalBatches*cfg.Batch); err != nil {
		s.ds.Close()
		return nil, err
	}
	// Training on the CPU must fit in host memory; the GPU backend checks
	// device memory itself.
	if f.device == "cpu" || (f.device == "auto" && !backend.GPUPresent()) {
		need := train.CPUMemory(cfg.ModelConfig(), cfg.Batch, cfg.Seq)
		if err := memcheck.Fits(fmt.Sprintf("training %s on the CPU", countString(cfg.ModelConfig().ParamCount())+" parameters"), need, "a smaller model, batch or seq, or -device cuda"); err != nil {
			s.ds.Close()
			return nil, err
		}
	}
	return s, nil
}

func tokName(path string) string {
	if path == "" {
		return "the sample tokenizer"
	}
	return path
}

func absPath(p string) string {
	if a, err := filepath.Abs(p); err == nil {
		return a
	}
	return p
}

// tokenizerConfig returns the checkpoint's tokenizer_config.json: the
// model's BOS token (the end-of-text token when the model has none) and its
// end-of-text token, by name.
func tokenizerConfig(tok *tokenizer.Tokenizer, mc model.Config, eos int) []byte {
	eosName, _ := tok.IDToken(eos)
	bosName := eosName
	if mc.BOSTokenID != nil {
		if n, ok := tok.IDToken(*mc.BOSTokenID); ok {
			bosName = n
		}
	}
	return train.TokenizerConfig(bosName, eosName, mc.MaxPositionEmbeddings)
}

// datasetSource draws training windows at seeded pseudo-random offsets of a
// dataset's training split: window i depends only on (seed, i).
type datasetSource struct {
	ds   *data.Dataset
	seed uint64
	buf  []int32
}

// Window fills dst with training window i.
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
