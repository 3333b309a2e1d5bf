package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/twell-ai/twell/data"
	"github.com/twell-ai/twell/tokenizer"
)

func init() {
	register(command{
		name:    "data",
		summary: "tokenize text files, folders and JSONL into training shards with a held-out split",
		run:     runData,
	})
}

func runData(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("data", stderr)
	tokPath := fs.String("tokenizer", "", "Hugging Face tokenizer.json to tokenize with; required")
	out := fs.String("out", "", "dataset folder to write (must not exist or be empty); required")
	var ins dataPathList
	fs.Var(&ins, "in", "input file or folder; repeat it or give a comma-separated list (taken before the INPUT arguments)")
	sample := fs.Bool("sample", false, "add the bundled public-domain sample as a source named sample (after the inputs)")
	valFrac := fs.Float64("val-frac", data.DefaultValFrac, "fraction of each source's documents held out for validation, in [0,1)")
	shardTokens := fs.Int("shard-tokens", data.DefaultShardTokens, "most tokens per shard file")
	workers := fs.Int("workers", 0, "tokenizing goroutines (0: all cores)")
	eosName := fs.String("eos", "", "end-of-text token written after each document (default: the tokenizer's, e.g. <|endoftext|> or </s>)")
	force := fs.Bool("force", false, "replace the dataset already in -out")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "Usage: twell data -tokenizer FILE -out DIR [flags] INPUT...")
		fmt.Fprintln(fs.Output(), "\nINPUT is a text file, a folder (searched for .txt, .md, .jsonl), a .jsonl file (field \"text\"),")
		fmt.Fprintln(fs.Output(), "NAME=PATH to name its source, or a folder with a MANIFEST from scripts/fetch-corpus (one source per folder).")
		fs.PrintDefaults()
	}
	pos, err := parseFlagsAndArgs(fs, args)
	if err != nil {
		return err
	}
	inputs := append([]string(ins), pos...)
	switch {
	case *tokPath == "":
		return usagef("-tokenizer FILE is required")
	case *out == "":
		return usagef("-out DIR is required")
	case len(inputs) == 0 && !*sample:
		return usagef("no inputs: give files or folders (or -sample)")
	case *valFrac < 0 || *valFrac >= 1:
		return usagef("-val-frac %v: want a fraction in [0,1)", *valFrac)
	case *shardTokens <= 0:
		return usagef("-shard-tokens %d: want > 0", *shardTokens)
	case *workers < 0:
		return usagef("-workers %d: want >= 0", *workers)
	}
	sources, err := data.SourcesFromPaths(inputs)
	if err != nil {
		return err
	}
	if *sample {
		sources = append(sources, data.SampleSource())
	}
	tk, err := tokenizer.Load(*tokPath)
	if err != nil {
		return err
	}
	enc, err := newTokenizerEncoder(tk, *eosName)
	if err != nil {
		return fmt.Errorf("%s: %w", *tokPath, err)
	}
	cfg := data.BuildConfig{
		Sources: sources, Encoder: enc, Tokenizer: *tokPath, ValFrac: *valFrac,
		ShardTokens: *shardTokens, Workers: *workers, Overwrite: *force,
	}
	var bar *progressLine
	if isTerminal(stderr) {
		bar = &progressLine{w: stderr}
		cfg.Progress = bar.update
	}
	start := time.Now()
	idx, err := data.Build(*out, cfg)
	if bar != nil {
		bar.finish()
	}
	if err != nil {
		return err
	}
	printDataSummary(stdout, *out, idx, time.Since(start))
	return nil
}

// tokenizerEncoder adapts a package tokenizer Tokenizer to data.Encoder (for twell data and
// twell train): plain encoding (no template tokens), and an end-of-text id written after each
// document.
type tokenizerEncoder struct {
	tk  *tokenizer.Tokenizer
	eos int
}

// newTokenizerEncoder picks the end-of-text id: the named token, or the tokenizer's own.
func newTokenizerEncoder(tk *tokenizer.Tokenizer, eosName string) (tokenizerEncoder, error) {
	if eosName != "" {
		id, ok := tk.TokenID(eosName)
		if !ok {
			return tokenizerEncoder{}, fmt.Errorf("-eos %q is not a token of this tokenizer", eosName)
		}
		return tokenizerEncoder{tk, id}, nil
	}
	id, ok := tk.EOS()
	if !ok {
		return tokenizerEncoder{}, errors.New("the tokenizer has no end-of-text token; name one with -eos")
	}
	return tokenizerEncoder{tk, id}, nil
}

func (e tokenizerEncoder) Encode(text string) ([]int, error) { return e.tk.AppendEncode(nil, text) }
func (e tokenizerEncoder) VocabSize() int                    { return e.tk.VocabSize() }
func (e tokenizerEncoder) EOS() int                          { return e.eos }

func printDataSummary(w io.Writer, out string, idx *data.Index, took time.Duration) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "source\tfiles\tdocs\tempty\tdups\ttrain docs\tval docs\ttrain tokens\tval tokens\tbytes/token\t")
	var docs, trainTok, valTok, bytes int64
	for _, s := range idx.Sources {
		bpt := 0.0
		if n := s.TrainTokens + s.ValTokens; n > 0 {
			bpt = float64(s.TrainBytes+s.ValBytes) / float64(n)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%.2f\t\n", s.Name, s.Files, s.Documents, s.Empty, s.Duplicates,
			s.TrainDocuments, s.ValDocuments, s.TrainTokens, s.ValTokens, bpt)
		docs += int64(s.Documents)
		trainTok += s.TrainTokens
		valTok += s.ValTokens
		bytes += s.TrainBytes + s.ValBytes
	}
	tw.Flush()
	fmt.Fprintf(w, "%s: %d train tokens in %d shards, %d validation tokens in %d shards (%s, vocabulary %d); %.1f MB of text in %s\n",
		out, trainTok, len(idx.Train), valTok, len(idx.Val), idx.Dtype, idx.VocabSize, float64(bytes)/1e6, took.Round(time.Millisecond))
}

// dataPathList is a flag that collects paths from repeated uses and comma-separated lists.
type dataPathList []string

func (l *dataPathList) String() string { return strings.Join(*l, ",") }
func (l *dataPathList) Set(v string) error {
	for _, p := range strings.Split(v, ",") {
		if p = strings.TrimSpace(p); p != "" {
			*l = append(*l, p)
		}
	}
	return nil
}

// parseFlagsAndArgs is parseFlags for commands that take positional arguments: flags and
// arguments may come in any order ("--" ends the flags), and a flag error is one usage line.
func parseFlagsAndArgs(fs *flag.FlagSet, args []string) ([]string, error) {
	out := fs.Output()
	fs.SetOutput(io.Discard) // the error is printed once, by run
	defer fs.SetOutput(out)
	var pos []string
	for {
		err := fs.Parse(args)
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(out)
			fs.Usage()
			return nil, flag.ErrHelp
		}
		if err != nil {
			return nil, usageError{err.Error()}
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		// fs.Parse stops at the first argument, or after "--" (then all the rest are arguments).
		if len(args) > len(rest) && args[len(args)-len(rest)-1] == "--" {
			return append(pos, rest...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// isTerminal reports whether w is a terminal (so a progress line can be redrawn in place).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// progressLine draws a build's progress on one terminal line, at most ten times a second.
type progressLine struct {
	w          io.Writer
	phase      string
	last       time.Time
	drawn      bool
	done, tot  int64
	phaseStart time.Time
}

func (p *progressLine) update(pr data.Progress) {
	now := time.Now()
	if pr.Phase != p.phase {
		if p.drawn {
			p.draw(now)
			fmt.Fprintln(p.w)
		}
		p.phase, p.phaseStart, p.last = pr.Phase, now, time.Time{}
	}
	p.done, p.tot = pr.Done, pr.Total
	if now.Sub(p.last) < 100*time.Millisecond && !(pr.Total > 0 && pr.Done == pr.Total) {
		return
	}
	p.last = now
	p.draw(now)
}

func (p *progressLine) draw(now time.Time) {
	rate := float64(p.done) / 1e6 / max(now.Sub(p.phaseStart).Seconds(), 1e-3)
	if p.tot <= 0 {
		fmt.Fprintf(p.w, "\r%-9s %8.1f MB  %6.1f MB/s ", p.phase, float64(p.done)/1e6, rate)
	} else {
		const width = 30
		frac := min(float64(p.done)/float64(p.tot), 1)
		n := int(frac * width)
		fmt.Fprintf(p.w, "\r%-9s [%s%s] %5.1f%%  %.1f/%.1f MB  %6.1f MB/s ", p.phase,
			strings.Repeat("#", n), strings.Repeat("-", width-n), 100*frac, float64(p.done)/1e6, float64(p.tot)/1e6, rate)
	}
	p.drawn = true
}

func (p *progressLine) finish() {
	if p.drawn {
		p.draw(time.Now())
		fmt.Fprintln(p.w)
	}
}
