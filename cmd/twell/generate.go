package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unicode/utf8"

	cpullm "github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/gpu/llm"
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

func runGenerate(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("generate", stderr)
	dir := fs.String("model", "", "checkpoint folder: config.json, model.safetensors, tokenizer.json")
	prompt := fs.String("prompt", "", "prompt text")
	maxTokens := fs.Int("max-tokens", 128, "most tokens to generate")
	temp := fs.Float64("temperature", 0.8, "sampling temperature; 0 = greedy")
	topK := fs.Int("top-k", 0, "keep the k most likely tokens (0 = all)")
	topP := fs.Float64("top-p", 1, "nucleus sampling threshold in (0, 1]")
	rep := fs.Float64("repetition-penalty", 1, "penalty > 1 for tokens already seen")
	seed := fs.Uint64("seed", 0, "random seed (0: from the clock)")
	device := fs.String("device", "auto", "cpu, cuda or auto (auto: cuda when a GPU is found and takes the model, else cpu)")
	decodeBF16 := fs.Bool("decode-bf16", true, "CPU decode steps read bf16 weight copies (faster; float32 when false)")
	var stops stringList
	fs.Var(&stops, "stop", "stop when this text is generated (repeatable)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *dir == "" {
		return usagef("-model is required")
	}
	if *maxTokens < 1 {
		return usagef("-max-tokens %d: must be positive", *maxTokens)
	}
	if *seed == 0 {
		*seed = uint64(time.Now().UnixNano())
	}
	opts := sample.Options{Temperature: *temp, TopK: *topK, TopP: *topP, RepetitionPenalty: *rep, Seed: *seed}
	if err := opts.Validate(); err != nil {
		return usagef("%v", err)
	}
	switch *device {
	case "auto", "cpu", "cuda":
	default:
		return usagef("-device %q: want cpu, cuda or auto", *device)
	}
	sampler, _ := sample.New(opts)

	tok, err := tokenizer.Load(filepath.Join(*dir, "tokenizer.json"))
	if err != nil {
		return err
	}
	m, err := model.Load(*dir)
	if err != nil {
		return err
	}
	if *device == "auto" {
		*device = "cpu"
		if n, err := cuda.Count(); err == nil && n > 0 {
			if err := llm.Supported(m.Config); err != nil {
				fmt.Fprintf(stderr, "generate: running on the CPU: the GPU engine does not take this model: %v\n", err)
			} else {
				*device = "cuda"
			}
		}
	}
	if tok.VocabSize() > m.Config.VocabSize {
		return fmt.Errorf("tokenizer has %d tokens but the model's vocabulary is %d", tok.VocabSize(), m.Config.VocabSize)
	}
	ids, err := tok.Encode(*prompt, true)
	if err != nil {
		return err
	}
	if len(ids) == 0 {
		return usagef("-prompt: encodes to no tokens (the tokenizer adds no BOS); give some text")
	}
	limit := m.Config.MaxPositionEmbeddings
	if len(ids) >= limit {
		return fmt.Errorf("prompt has %d tokens; the model takes at most %d positions", len(ids), limit)
	}
	n := min(*maxTokens, limit-len(ids))
	eos, hasEOS := tok.EOS()
	eosSet := map[int]bool{}
	if hasEOS {
		eosSet[eos] = true
	}
	for _, id := range m.Config.EOSTokenIDs {
		eosSet[id] = true
	}

	active := make([]float64, m.Config.NumHiddenLayers)
	var mlpTokens int64
	// forward runs one step (the prompt, then one token at a time) and
	// adds up the MLP's active units.
	var forward func(toks []int) ([][]float32, error)
	if *device == "cuda" {
		gpuForward, closeGPU, err := cudaGenerator(m, len(ids)+n, active, &mlpTokens)
		if err != nil {
			return err
		}
		defer closeGPU()
		forward = gpuForward
	} else {
		e, err := cpullm.New(m, cpullm.Options{DecodeBF16: *decodeBF16})
		if err != nil {
			return err
		}
		cache, err := e.NewCache(len(ids) + n)
		if err != nil {
			return err
		}
		forward = func(toks []int) ([][]float32, error) {
			logits, st, err := e.Forward([]engine.Cache{cache}, [][]int{toks}, false)
			if err != nil {
				return nil, err
			}
			for i, a := range st.MeanActive {
				if a >= 0 {
					active[i] += a * float64(st.Tokens)
				}
			}
			mlpTokens += int64(st.Tokens)
			return logits, nil
		}
	}
	t0 := time.Now()
	logits, err := forward(ids)
	if err != nil {
		return err
	}
	prefill := time.Since(t0)

	history := append([]int(nil), ids...)
	var gen []int
	printed := ""
	t1 := time.Now()
	stopped := ""
	for len(gen) < n {
		next := sampler.Sample(logits[0], history)
		if eosSet[next] {
			stopped = "end of sequence"
			break
		}
		gen = append(gen, next)
		history = append(history, next)
		text, err := tok.Decode(gen, true)
		if err != nil {
			return err
		}
		if cut, ok := stopAt(text, stops); ok {
			fmt.Fprint(stdout, cut[len(printed):])
			printed = cut
			stopped = "stop string"
			break
		}
		// Hold back an incomplete UTF-8 sequence until its last byte arrives.
		if !strings.HasSuffix(text, string(utf8.RuneError)) && len(text) >= len(printed) && strings.HasPrefix(text, printed) {
			fmt.Fprint(stdout, text[len(printed):])
			printed = text
			if f, ok := stdout.(*os.File); ok {
				f.Sync()
			}
		}
		if len(gen) == n {
			stopped = "max tokens"
			break
		}
		if logits, err = forward([]int{next}); err != nil {
			return err
		}
	}
	if text, err := tok.Decode(gen, true); err == nil && stopped != "stop string" && len(text) > len(printed) && strings.HasPrefix(text, printed) {
		fmt.Fprint(stdout, text[len(printed):])
	}
	fmt.Fprintln(stdout)
	decode := time.Since(t1)
	fmt.Fprintf(stderr, "prefill: %d tokens in %.1f ms (%.1f tokens/s); decode: %d tokens in %.1f ms (%.1f tokens/s); stopped: %s\n",
		len(ids), ms(prefill), float64(len(ids))/prefill.Seconds(), len(gen), ms(decode), float64(len(gen))/max(decode.Seconds(), 1e-9), stopped)
	if act, _ := m.Config.GateActivation(); act != model.ActReLU {
		fmt.Fprintf(stderr, "MLP: dense %s gate, no activation sparsity\n", act)
		return nil
	}
	var b strings.Builder
	for i, a := range active {
		fmt.Fprintf(&b, " %d:%.1f%%", i, 100*a/float64(max(mlpTokens, 1))/float64(m.Config.IntermediateSize))
	}
	fmt.Fprintf(stderr, "MLP active units per token, per layer (percent of %d):%s\n", m.Config.IntermediateSize, b.String())
	return nil
}

// cudaGenerator returns the GPU forward step of generate for a sequence
// of up to capacity tokens, adding the MLPs' measured active units into
// active and the tokens into tokens, and a function that frees the GPU
// engine.
func cudaGenerator(m *model.Model, capacity int, active []float64, tokens *int64) (func([]int) ([][]float32, error), func(), error) {
	dev, err := cuda.Open(0)
	if err != nil {
		return nil, nil, fmt.Errorf("-device cuda: %w", err)
	}
	e, err := llm.NewEngine(dev, m)
	if err != nil {
		return nil, nil, fmt.Errorf("-device cuda: %w", err)
	}
	cache, err := e.NewCache(capacity)
	if err != nil {
		e.Close()
		return nil, nil, fmt.Errorf("-device cuda: %w", err)
	}
	step := func(toks []int) ([][]float32, error) {
		logits, st, err := e.Forward([]engine.Cache{cache}, [][]int{toks}, false)
		if err != nil {
			return nil, err
		}
		for i, a := range st.MeanActive {
			if a >= 0 { // measured on the step's last MLP call: a mean per token
				active[i] += a * float64(st.Tokens)
			}
		}
		*tokens += int64(st.Tokens)
		return logits, nil
	}
	return step, func() { cache.Free(); e.Close() }, nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// stopAt returns text cut before the first stop string it contains.
func stopAt(text string, stops []string) (string, bool) {
	best := -1
	for _, s := range stops {
		if s == "" {
			continue
		}
		if i := strings.Index(text, s); i >= 0 && (best < 0 || i < best) {
			best = i
		}
	}
	if best < 0 {
		return text, false
	}
	return text[:best], true
}
