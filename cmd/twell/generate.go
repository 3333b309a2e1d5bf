package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unicode/utf8"

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
	device := fs.String("device", "auto", "cpu, cuda or auto")
	decodeBF16 := fs.Bool("decode-bf16", true, "decode steps read bf16 weight copies (faster; float32 when false)")
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
	case "auto", "cpu":
	case "cuda":
		return errors.New("-device cuda: the GPU model forward is not part of this build yet; use -device cpu")
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
	if *decodeBF16 {
		m.UseBF16ForDecode()
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
	cache := m.NewCache(len(ids) + n)
	eos, hasEOS := tok.EOS()
	eosSet := map[int]bool{}
	if hasEOS {
		eosSet[eos] = true
	}
	for _, id := range m.Config.EOSTokenIDs {
		eosSet[id] = true
	}

	active := make([]int64, m.Config.NumHiddenLayers)
	var mlpTokens int64
	addStats := func(st *model.Stats) {
		for i, a := range st.ActiveUnits {
			active[i] += a
		}
		mlpTokens += int64(st.Tokens)
	}
	t0 := time.Now()
	logits, st, err := m.Forward([]*model.Cache{cache}, [][]int{ids}, false)
	if err != nil {
		return err
	}
	addStats(st)
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
		if logits, st, err = m.Forward([]*model.Cache{cache}, [][]int{{next}}, false); err != nil {
			return err
		}
		addStats(st)
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
		fmt.Fprintf(&b, " %d:%.1f%%", i, 100*float64(a)/float64(max(mlpTokens, 1))/float64(m.Config.IntermediateSize))
	}
	fmt.Fprintf(stderr, "MLP active units per token, per layer (percent of %d):%s\n", m.Config.IntermediateSize, b.String())
	return nil
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
