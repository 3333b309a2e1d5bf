package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/twell-ai/twell/backend"
	"github.com/twell-ai/twell/generate"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/sample"
	"github.com/twell-ai/twell/tokenizer"
)

func init() {
	register(command{name: "generate", summary: "generate text from a checkpoint (streams to stdout)", run: runGenerate})
}

// stringList is a repeatable string flag.
type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

// stdin is where generate reads a piped prompt (a variable for tests).
var stdin io.Reader = os.Stdin

func runGenerate(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("generate", stderr)
	dir := fs.String("model", "", "checkpoint folder: config.json, model.safetensors, tokenizer.json (default: the embedded default model)")
	prompt := fs.String("prompt", "", `prompt text; "-" or none with a piped stdin reads it from stdin`)
	maxTokens := fs.Int("max-tokens", 128, "most tokens to generate, >= 1")
	temp := fs.Float64("temperature", 0.8, "sampling temperature, >= 0; 0 = greedy")
	topK := fs.Int("top-k", 0, "keep the k most likely tokens, >= 0 (0 = all)")
	topP := fs.Float64("top-p", 1, "nucleus sampling threshold in (0, 1] (1 = all)")
	rep := fs.Float64("repetition-penalty", 1, "penalty > 0 for tokens already seen (1 = off, > 1 discourages repeats)")
	seed := fs.Uint64("seed", 0, "random seed (0: from the clock)")
	device := fs.String("device", "auto", backend.FlagUsage)
	decodeBF16 := fs.Bool("decode-bf16", true, "CPU decode steps read bf16 copies of weights that bf16 cannot hold exactly (faster; float32 when false; bf16 checkpoints are held in bf16 either way, with float32 results)")
	var stops stringList
	fs.Var(&stops, "stop", "stop when this text is generated (repeatable)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *maxTokens < 1 {
		return usagef("-max-tokens %d: must be >= 1", *maxTokens)
	}
	kind, err := backend.Parse(*device)
	if err != nil {
		return usagef("%v", err)
	}
	if *seed == 0 {
		*seed = uint64(time.Now().UnixNano())
	}
	so := sample.Options{Temperature: *temp, TopK: *topK, TopP: *topP, RepetitionPenalty: *rep, Seed: *seed}
	if err := so.Validate(); err != nil {
		return usagef("%v", err)
	}
	text, err := promptText(fs, *prompt)
	if err != nil {
		return err
	}

	m, tok, err := loadCheckpointOrDefault("generate", *dir, stderr)
	if err != nil {
		return err
	}
	defer m.Close()
	c := m.Config
	if tok.VocabSize() < c.VocabSize {
		fmt.Fprintf(stderr, "generate: the model's vocabulary has %d entries, the tokenizer %d; ids past the tokenizer's are never sampled\n", c.VocabSize, tok.VocabSize())
	}
	ids, err := tok.Encode(text, true)
	if err != nil {
		return err
	}
	if len(ids) == 0 {
		return usagef("-prompt: encodes to no tokens (the tokenizer adds no BOS); give some text")
	}
	o := generate.Options{MaxTokens: *maxTokens, Context: c.MaxPositionEmbeddings, Sample: so, Stop: stops,
		EOS: c.EOSTokenIDs, Vocab: tok.VocabSize()}
	if eos, ok := tok.EOS(); ok {
		o.EOS = append(o.EOS, eos)
	}
	if len(ids) >= o.Context {
		return fmt.Errorf("the prompt has %d tokens; the model takes at most %d positions, and one must be left to generate into", len(ids), o.Context)
	}
	kind, note := backend.Resolve(kind, &c)
	if note != "" {
		fmt.Fprintln(stderr, "generate: "+note)
	}
	e, err := backend.Open(kind, m, backend.Options{DecodeBF16: *decodeBF16, ReleaseWeights: true})
	if err != nil {
		return err
	}
	defer e.Close()
	if p, ok := e.(interface{ Pack() error }); ok { // before the timed prefill
		if err := p.Pack(); err != nil {
			return err
		}
	}
	res, err := generate.Run(e, tok, ids, o, func(s string) error {
		_, err := io.WriteString(stdout, s)
		if f, ok := stdout.(*os.File); ok {
			f.Sync()
		}
		return err
	})
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout)
	reason := res.Reason.String()
	if res.Reason == generate.ContextFull {
		reason += fmt.Sprintf(" (%d tokens: %d of the prompt, %d generated)", len(ids)+len(res.Tokens), len(ids), len(res.Tokens))
	}
	fmt.Fprintf(stderr, "prefill: %d tokens in %.1f ms (%.1f tokens/s); decode: %d tokens in %.1f ms (%.1f tokens/s); stopped: %s\n",
		len(ids), ms(res.Prefill), float64(len(ids))/res.Prefill.Seconds(), len(res.Tokens), ms(res.Decode),
		float64(len(res.Tokens))/max(res.Decode.Seconds(), 1e-9), reason)
	if act, _ := c.GateActivation(); act != model.ActReLU {
		fmt.Fprintf(stderr, "MLP: dense %s gate, no activation sparsity\n", act)
		return nil
	}
	var b strings.Builder
	for i, a := range res.MeanActive {
		if a < 0 {
			fmt.Fprintf(&b, " %d:-", i)
			continue
		}
		fmt.Fprintf(&b, " %d:%.1f%%", i, 100*a/float64(c.IntermediateSize))
	}
	fmt.Fprintf(stderr, "MLP active units per token, per layer (percent of %d):%s\n", c.IntermediateSize, b.String())
	return nil
}

// loadCheckpoint loads the model and tokenizer of a checkpoint folder and
// checks that the model's vocabulary covers the tokenizer's. For a job that
// only runs the model (runOnly) the layers stay in the checkpoint until the
// engine reads them (model.LoadDeferred); close the model when done.
func loadCheckpoint(dir string, runOnly bool) (*model.Model, *tokenizer.Tokenizer, error) {
	if fi, err := os.Stat(dir); err != nil {
		return nil, nil, fmt.Errorf("model %s: %w", dir, err)
	} else if !fi.IsDir() {
		return nil, nil, fmt.Errorf("model %s: not a folder (a checkpoint is a folder holding config.json, the weights and tokenizer.json)", dir)
	}
	tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, fmt.Errorf("model %s: no tokenizer.json in the folder", dir)
	} else if err != nil {
		return nil, nil, err
	}
	load := model.Load
	if runOnly {
		load = model.LoadDeferred
	}
	m, err := load(dir)
	if err != nil {
		return nil, nil, err
	}
	if tok.VocabSize() > m.Config.VocabSize {
		m.Close()
		return nil, nil, fmt.Errorf("tokenizer has %d tokens but the model's vocabulary is %d", tok.VocabSize(), m.Config.VocabSize)
	}
	return m, tok, nil
}

// maxPromptBytes bounds a prompt read from stdin.
const maxPromptBytes = 16 << 20

// promptText returns the prompt: the -prompt flag, or stdin when the flag
// is "-", or not given while stdin is not a terminal (one trailing newline
// of a piped prompt is dropped).
func promptText(fs *flag.FlagSet, value string) (string, error) {
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == "prompt" })
	if given && value != "-" {
		return value, nil
	}
	if !given {
		if f, ok := stdin.(*os.File); ok {
			if st, err := f.Stat(); err != nil || st.Mode()&os.ModeCharDevice != 0 {
				return "", usagef("-prompt is required (or pipe the prompt into stdin)")
			}
		}
	}
	b, err := io.ReadAll(io.LimitReader(stdin, maxPromptBytes+1))
	if err != nil {
		return "", fmt.Errorf("reading the prompt from stdin: %w", err)
	}
	if len(b) > maxPromptBytes {
		return "", usagef("the prompt on stdin is longer than %d MiB", maxPromptBytes>>20)
	}
	text := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	if text == "" {
		return "", usagef("no prompt: -prompt is empty and stdin gave no text")
	}
	return text, nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
