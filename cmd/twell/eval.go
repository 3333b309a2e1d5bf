package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/twell-ai/twell/backend"
	"github.com/twell-ai/twell/data"
	"github.com/twell-ai/twell/eval"
	"github.com/twell-ai/twell/internal/atomicfile"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/tokenizer"
)

func init() {
	register(command{name: "eval", summary: "measure a checkpoint: held-out perplexity, multiple-choice tasks, MLP sparsity", run: runEval})
}

// maxTextBytes bounds one -text file.
const maxTextBytes = 1 << 30

func runEval(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("eval", stderr)
	dir := fs.String("model", "", "checkpoint folder: config.json, model.safetensors, tokenizer.json")
	dataDir := fs.String("data", "", "dataset folder from `twell data`: the perplexity of its held-out split, per source")
	var texts, tasks stringList
	fs.Var(&texts, "text", "UTF-8 text file whose perplexity to measure, tokenized with the checkpoint's tokenizer (repeatable)")
	fs.Var(&tasks, "tasks", `multiple-choice JSONL file, one {"context", "choices", "gold"} object a line (repeatable)`)
	device := fs.String("device", "auto", backend.FlagUsage)
	maxTokens := fs.Int64("max-tokens", 0, "most tokens to score for perplexity, over all sources and files in order (0: all)")
	stride := fs.Int("stride", 0, "tokens between the starts of perplexity windows, 1 to context-1 (0: half the context)")
	batch := fs.Int("batch", 4, "windows or task items per forward pass, >= 1")
	jsonPath := fs.String("json", "", `also write the results as JSON (schema "`+eval.Schema+`") to this file`)
	itemsPath := fs.String("items", "", `also write JSON lines (schema "`+eval.ItemsSchema+`") to this file: per task item and per perplexity window the token ids scored and their log-likelihoods, for scripts/eval-crosscheck.py`)
	path := mlp.Auto
	fs.Var(&path, "mlp", "MLP path: auto, sparse or dense (default: dense on the CPU, float32 throughout, so the log-likelihoods are exact; auto on the GPU, bf16 either way); the sparse path (TwELL) holds the gate activations in bf16, auto picks per pass by density")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	switch {
	case *dir == "":
		return usagef("-model is required")
	case *dataDir == "" && len(texts) == 0 && len(tasks) == 0:
		return usagef("nothing to evaluate: give -data, -text or -tasks")
	case *maxTokens < 0:
		return usagef("-max-tokens %d: must be >= 0", *maxTokens)
	case *stride < 0:
		return usagef("-stride %d: must be >= 1 (or 0 for half the context)", *stride)
	case *batch < 1:
		return usagef("-batch %d: must be >= 1", *batch)
	}
	kind, err := backend.Parse(*device)
	if err != nil {
		return usagef("%v", err)
	}
	for _, p := range []string{*jsonPath, *itemsPath} {
		if p == "" {
			continue
		}
		if st, err := os.Stat(filepath.Dir(p)); err != nil || !st.IsDir() {
			return usagef("%s: its folder %s does not exist", p, filepath.Dir(p))
		}
	}
	for _, p := range append(append([]string{*dataDir}, texts...), tasks...) {
		if p == "" {
			continue
		}
		if _, err := os.Stat(p); err != nil {
			return err
		}
	}
	// Read the task files before the model, so that a bad line is found at once.
	taskItems := make([][]eval.Item, len(tasks))
	for i, p := range tasks {
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		taskItems[i], err = eval.ReadTasks(p, f)
		f.Close()
		if err != nil {
			return err
		}
	}

	m, tok, err := loadCheckpoint(*dir, true)
	if err != nil {
		return err
	}
	defer m.Close()
	c := m.Config
	ctx := c.MaxPositionEmbeddings
	if *stride >= ctx {
		return usagef("-stride %d: must be less than the model's context of %d", *stride, ctx)
	}
	seqs, err := evalSequences(tok, *dataDir, texts, *maxTokens)
	if err != nil {
		return err
	}
	var encoded [][]eval.Encoded
	prefix := -1
	if id, ok := tok.BOS(); ok {
		prefix = id
	} else if id, ok := tok.EOS(); ok {
		prefix = id
	}
	for i, items := range taskItems {
		enc, err := eval.Encode(items, func(s string) ([]int, error) { return tok.Encode(s, false) }, prefix, ctx)
		if err != nil {
			return fmt.Errorf("%s %w", tasks[i], err)
		}
		encoded = append(encoded, enc)
	}

	kind, note := backend.Resolve(kind, &c)
	if note != "" {
		fmt.Fprintln(stderr, "eval: "+note)
	}
	if err := memcheck.Fits(fmt.Sprintf("a batch of %d windows of %d tokens", *batch, ctx), evalBatchBytes(c, *batch, ctx, kind),
		fmt.Sprintf("try -batch %d", max(*batch/2, 1))); err != nil {
		return err
	}
	if kind == backend.CPU && !set["mlp"] {
		path = mlp.Dense // exact; the dense path measures the sparsity as well
	}
	e, err := backend.Open(kind, m, backend.Options{MLPPath: path, ReleaseWeights: true})
	if err != nil {
		return err
	}
	defer e.Close()
	start := time.Now()
	last := start
	ev, err := eval.New(e, eval.Options{Stride: *stride, Batch: *batch, Progress: func(what string, done, total int64) {
		if now := time.Now(); now.Sub(last) >= 3*time.Second && done < total {
			last = now
			fmt.Fprintf(stderr, "eval: %d/%d %s (%.0f%%), %.0f s\n", done, total, what, 100*float64(done)/float64(total), now.Sub(start).Seconds())
		}
	}})
	if err != nil {
		return usagef("%v", err)
	}
	defer ev.Close()
	o := ev.Options()
	rep := eval.Report{Schema: eval.Schema, Model: *dir, Device: string(kind), MLPPath: path.String(), Context: o.Context, Stride: o.Stride, Batch: o.Batch,
		Perplexity: []eval.PPL{}, Tasks: []eval.TaskResult{}, MLPWidth: c.IntermediateSize}
	var windowRows []eval.WindowRow
	var itemRows []eval.ItemRow
	if len(seqs) > 0 {
		res, wins, err := ev.PerplexityWindows(seqs)
		if err != nil {
			return err
		}
		rep.Perplexity = append(res, eval.Total("all", res))
		if *itemsPath != "" {
			if windowRows, err = eval.WindowRows(seqs, wins); err != nil {
				return err
			}
		}
	}
	for i, enc := range encoded {
		res, scores, err := ev.Score(tasks[i], enc)
		if err != nil {
			return err
		}
		if *itemsPath != "" {
			rows, err := eval.ItemRows(tasks[i], enc, scores)
			if err != nil {
				return err
			}
			itemRows = append(itemRows, rows...)
		}
		if res.Truncated > 0 {
			fmt.Fprintf(stderr, "eval: %s: %d items had their context cut from the left to fit %d positions\n", tasks[i], res.Truncated, o.Context)
		}
		rep.Tasks = append(rep.Tasks, res)
	}
	rep.Sparsity, rep.Tokens = ev.Sparsity()
	rep.Seconds = time.Since(start).Seconds()
	rep.TokensPerSec = float64(rep.Tokens) / max(rep.Seconds, 1e-9)
	if err := rep.WriteTable(stdout); err != nil {
		return err
	}
	if *jsonPath != "" {
		b, err := json.MarshalIndent(&rep, "", "  ")
		if err != nil {
			return err
		}
		if err := atomicfile.WriteFile(*jsonPath, append(b, '\n')); err != nil {
			return fmt.Errorf("writing -json %s: %w", *jsonPath, err)
		}
	}
	if *itemsPath != "" {
		act, _ := c.GateActivation()
		run := eval.RunRow{Model: *dir, Device: string(kind), MLPPath: path.String(), Context: o.Context, Stride: o.Stride, Batch: o.Batch,
			HiddenAct: act, MLPGated: c.MLPGated, VocabSize: c.VocabSize}
		err := atomicfile.Write(*itemsPath, 0o644, func(w io.Writer) error { return eval.WriteItems(w, run, windowRows, itemRows) })
		if err != nil {
			return fmt.Errorf("writing -items %s: %w", *itemsPath, err)
		}
	}
	return nil
}

// evalSequences returns the sequences whose perplexity to measure: the
// held-out split of each source of the dataset in dataDir, then each text
// file, cut so that at most maxTokens tokens are scored in all (0: no
// limit). Bytes is the UTF-8 length of the decoded scored tokens (all but
// the first), special tokens (the end-of-text between documents, a BOS)
// left out.
func evalSequences(tok *tokenizer.Tokenizer, dataDir string, texts []string, maxTokens int64) ([]eval.Sequence, error) {
	var seqs []eval.Sequence
	left := maxTokens
	add := func(name string, ids []int) error {
		if maxTokens > 0 {
			if left == 0 {
				return nil
			}
			if int64(len(ids))-1 > left {
				ids = ids[:left+1]
			}
		}
		if len(ids) < 2 {
			return fmt.Errorf("%s: %d tokens; perplexity needs at least 2", name, len(ids))
		}
		left -= int64(len(ids) - 1)
		text, err := tok.Decode(ids[1:], true)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		seqs = append(seqs, eval.Sequence{Name: name, Tokens: ids, Bytes: int64(len(text))})
		return nil
	}
	if dataDir != "" {
		d, err := data.Open(dataDir)
		if err != nil {
			return nil, err
		}
		defer d.Close()
		if d.VocabSize() != tok.VocabSize() {
			return nil, fmt.Errorf("-data %s: its tokens come from a vocabulary of %d, the checkpoint's tokenizer has %d (another tokenizer?)", dataDir, d.VocabSize(), tok.VocabSize())
		}
		srcs := d.ValSources()
		if len(srcs) == 0 {
			return nil, fmt.Errorf("-data %s: no held-out split (build it with -val-frac > 0)", dataDir)
		}
		for _, src := range srcs {
			n := d.ValTokens(src)
			if maxTokens > 0 {
				n = min(n, left+1)
			}
			if n < 2 {
				continue
			}
			it, err := d.Val(src, 1, int(n-1))
			if err != nil {
				return nil, err
			}
			ids := make([]int, n)
			if err := it.Window(ids, 0); err != nil {
				return nil, err
			}
			if err := add(filepath.Base(dataDir)+":"+src, ids); err != nil {
				return nil, err
			}
		}
	}
	for _, p := range texts {
		st, err := os.Stat(p)
		if err != nil {
			return nil, err
		}
		if st.IsDir() {
			return nil, fmt.Errorf("-text %s: is a folder, want a text file", p)
		}
		if st.Size() > maxTextBytes {
			return nil, fmt.Errorf("-text %s: %s, more than the %s one file may hold", p, memcheck.Format(float64(st.Size())), memcheck.Format(maxTextBytes))
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, err
		}
		ids, err := tok.Encode(string(b), true)
		if err != nil {
			return nil, fmt.Errorf("-text %s: %w", p, err)
		}
		if err := add(p, ids); err != nil {
			return nil, err
		}
	}
	return seqs, nil
}

// evalBatchBytes estimates the host memory one Forward call of batch
// windows of ctx tokens takes: the logits (float32, and the engine's
// GEMM output beside the returned rows), the activations of the widest
// layer and, on the CPU, the float32 KV caches.
func evalBatchBytes(c model.Config, batch, ctx int, k backend.Kind) float64 {
	t := float64(batch) * float64(ctx)
	hd := float64(c.HeadDim)
	need := t * float64(c.VocabSize) * 4 * 2
	need += t * 4 * (4*float64(c.HiddenSize) + float64(c.NumAttentionHeads+2*c.NumKeyValueHeads)*hd + 3*float64(c.IntermediateSize))
	if k == backend.CPU {
		need += t * float64(c.NumHiddenLayers) * 2 * float64(c.NumKeyValueHeads) * hd * 4
	}
	return need
}
