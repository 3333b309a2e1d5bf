package main

import (
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/twell-ai/twell/internal/atomicfile"

	"github.com/twell-ai/twell/data"
	"github.com/twell-ai/twell/tokenizer"
	"github.com/twell-ai/twell/tokenizer/bpetrain"
)

func init() {
	register(command{
		name:    "tokenizer train",
		summary: "train a byte-level BPE tokenizer (GPT-2 style) on text and write its tokenizer.json",
		run:     runTokenizerTrain,
	})
}

func runTokenizerTrain(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("tokenizer train", stderr)
	out := fs.String("out", "", "tokenizer.json file to write; required")
	vocab := fs.Int("vocab", bpetrain.DefaultVocabSize, "vocabulary size, including the 256 byte tokens and the special tokens")
	minFreq := fs.Int("min-frequency", bpetrain.DefaultMinFrequency, "fewest occurrences of a pair for it to be merged")
	special := fs.String("special", bpetrain.EndOfText, "comma-separated special tokens, given the last ids in this order")
	workers := fs.Int("workers", 0, "word-counting goroutines (0: all cores)")
	var ins dataPathList
	fs.Var(&ins, "in", "input file or folder; repeat it or give a comma-separated list (inputs may also follow the flags)")
	sample := fs.Bool("sample", false, "train on the bundled public-domain sample as well")
	expect := fs.String("expect", "", "also write texts and their ids (by package tokenizer) to this JSON file, for scripts/check-tokenizer-hf.py")
	seed := fs.Uint64("seed", 1, "seed for picking the -expect texts")
	force := fs.Bool("force", false, "overwrite -out (and -expect) if they exist")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "Usage: twell tokenizer train -out tokenizer.json [flags] INPUT...")
		fmt.Fprintln(fs.Output(), "\nINPUT is a text file, a folder (searched for .txt, .md, .jsonl), a .jsonl file (field \"text\"),")
		fmt.Fprintln(fs.Output(), "or a folder with a MANIFEST from scripts/fetch-corpus. Documents are normalized as by twell data.")
		fs.PrintDefaults()
	}
	pos, err := parseFlagsAndArgs(fs, args)
	if err != nil {
		return err
	}
	inputs := append([]string(ins), pos...)
	var specials []string
	for _, s := range strings.Split(*special, ",") {
		if s = strings.TrimSpace(s); s != "" {
			specials = append(specials, s)
		}
	}
	if specials == nil {
		specials = []string{}
	}
	switch {
	case *out == "":
		return usagef("-out FILE is required")
	case len(inputs) == 0 && !*sample:
		return usagef("no inputs: give files or folders (or -sample)")
	case *vocab < 256+len(specials):
		return usagef("-vocab %d: want at least %d (256 byte tokens + %d special tokens)", *vocab, 256+len(specials), len(specials))
	case *minFreq < 1:
		return usagef("-min-frequency %d: want >= 1", *minFreq)
	case *workers < 0:
		return usagef("-workers %d: want >= 0", *workers)
	}
	for _, p := range []string{*out, *expect} {
		if p == "" || *force {
			continue
		}
		if _, err := os.Stat(p); err == nil {
			return fmt.Errorf("%s exists (use -force to overwrite it)", p)
		}
	}
	sources, err := data.SourcesFromPaths(inputs)
	if err != nil {
		return err
	}
	if *sample {
		sources = append(sources, data.SampleSource())
	}
	tr, err := bpetrain.NewTrainer(bpetrain.Config{VocabSize: *vocab, MinFrequency: *minFreq, SpecialTokens: specials, Workers: *workers})
	if err != nil {
		return err
	}

	// Stream the normalized, deduplicated documents to the word counters, keeping a few for
	// the -expect texts.
	start := time.Now()
	texts := make(chan string, 64)
	counted := make(chan struct{})
	go func() {
		tr.AddStream(texts)
		close(counted)
	}()
	rng := rand.New(rand.NewPCG(*seed, 0x746f6b))
	var keep []string
	seen := map[[32]byte]bool{}
	docs, dups := 0, 0
	var readErr error
	for _, src := range sources {
		readErr = src.Documents(func(loc, text string) error {
			n := data.Normalize(text)
			if n == "" {
				return nil
			}
			h := sha256.Sum256([]byte(n))
			if seen[h] {
				dups++
				return nil
			}
			seen[h] = true
			docs++
			if len(keep) < 64 {
				keep = append(keep, n)
			} else if j := rng.IntN(docs); j < 64 {
				keep[j] = n
			}
			texts <- n
			return nil
		})
		if readErr != nil {
			break
		}
	}
	close(texts)
	<-counted
	if readErr != nil {
		return readErr
	}
	words, textBytes := tr.Words()
	if docs == 0 {
		return fmt.Errorf("empty corpus: no non-empty documents in the inputs")
	}
	fmt.Fprintf(stderr, "counted %d distinct words in %d documents (%.1f MB, %d duplicates dropped) in %s\n",
		words, docs, float64(textBytes)/1e6, dups, time.Since(start).Round(time.Millisecond))

	t0 := time.Now()
	var progress func(int, int)
	if isTerminal(stderr) {
		progress = func(v, target int) { fmt.Fprintf(stderr, "\rmerging: vocabulary %d / %d ", v, target) }
	}
	m, err := tr.Train(progress)
	if progress != nil {
		fmt.Fprintln(stderr)
	}
	if err != nil {
		return err
	}
	if err := m.Save(*out); err != nil {
		return err
	}
	// Load what was written with package tokenizer and check it on the kept documents.
	tk, err := tokenizer.Load(*out)
	if err != nil {
		return fmt.Errorf("the written tokenizer does not load: %w", err)
	}
	var nBytes, nTok int
	for _, d := range keep {
		ids, err := tk.Encode(d, false)
		if err != nil {
			return fmt.Errorf("checking %s: %w", *out, err)
		}
		if back, err := tk.Decode(ids, false); err != nil || back != d {
			return fmt.Errorf("checking %s: a training document does not round-trip through encode and decode", *out)
		}
		nBytes += len(d)
		nTok += len(ids)
	}
	note := ""
	if len(m.Tokens) < *vocab {
		note = fmt.Sprintf(" (stopped early: no pair occurs %d times any more)", *minFreq)
	}
	fmt.Fprintf(stdout, "%s: vocabulary %d%s, %d merges, %d special tokens; %.2f bytes per token on %d training documents; trained in %s\n",
		*out, len(m.Tokens), note, len(m.Merges), m.Special, float64(nBytes)/float64(max(nTok, 1)), len(keep),
		time.Since(t0).Round(time.Millisecond))

	if *expect != "" {
		if err := writeTokenizerExpect(*expect, *out, tk, keep, m.SpecialTokens(), rng); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "%s: expected ids for scripts/check-tokenizer-hf.py %s %s\n", *expect, *out, *expect)
	}
	return nil
}

// tokenizerExpect is the JSON file that scripts/check-tokenizer-hf.py reads.
type tokenizerExpect struct {
	Schema    string               `json:"schema"` // "twell.tokenizer.expect/1"
	Tokenizer string               `json:"tokenizer"`
	VocabSize int                  `json:"vocab_size"`
	Special   map[string]int       `json:"special"`
	Cases     []tokenizerExpectRow `json:"cases"`
}

type tokenizerExpectRow struct {
	Text string `json:"text"`
	IDs  []int  `json:"ids"`
}

// writeTokenizerExpect writes fixed tricky texts and random pieces of the kept documents with
// their ids from package tokenizer.
func writeTokenizerExpect(path, tokPath string, tk *tokenizer.Tokenizer, docs, specials []string, rng *rand.Rand) error {
	texts := []string{
		"", " ", "Hello world", "Hello  world", " leading space", "trailing space ", "a\n\nb", "x   y\n",
		"I'm here, aren't you? We'll see; they'd've DONE it.", "3.14159 is pi; 1,000,000!",
		"Über naïve café, 東京, ½, e\u0301, 🙂\u00a0end", "tab\tand\r\nCRLF", "  \n\t ",
		"<|endoftext|>", "text<|endoftext|>more text", "\"Quoted,\" said Alice -- 'twas brillig.",
	}
	for _, d := range docs {
		for range 4 {
			i := rng.IntN(len(d))
			j := min(len(d), i+1+rng.IntN(400))
			for i > 0 && !utf8.RuneStart(d[i]) {
				i--
			}
			for j < len(d) && !utf8.RuneStart(d[j]) {
				j++
			}
			texts = append(texts, d[i:j])
		}
	}
	e := tokenizerExpect{Schema: "twell.tokenizer.expect/1", Tokenizer: tokPath, VocabSize: tk.VocabSize(), Special: map[string]int{}}
	for _, s := range specials {
		id, _ := tk.TokenID(s)
		e.Special[s] = id
	}
	for _, t := range texts {
		ids, err := tk.Encode(t, true)
		if err != nil {
			return fmt.Errorf("encoding an -expect text: %w", err)
		}
		if ids == nil {
			ids = []int{}
		}
		e.Cases = append(e.Cases, tokenizerExpectRow{Text: t, IDs: ids})
	}
	b, err := json.MarshalIndent(e, "", " ")
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(path, append(b, '\n'))
}
