package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/twell-ai/twell/backend"
	"github.com/twell-ai/twell/engine"
	gpullm "github.com/twell-ai/twell/gpu/llm"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/models"
	"github.com/twell-ai/twell/serve"
)

func init() {
	register(command{name: "serve", summary: "serve a checkpoint over an OpenAI-compatible HTTP API (completions, chat, streaming)", run: runServe})
}

// serveStop, when not nil, ends a serve command like SIGINT (for tests).
var serveStop <-chan struct{}

func runServe(args []string, stdout, stderr io.Writer) error {
	d := serve.DefaultOptions()
	fs := newFlagSet("serve", stderr)
	dir := fs.String("model", "", "checkpoint folder: config.json, model.safetensors, tokenizer.json (default: the embedded default model)")
	addr := fs.String("addr", "127.0.0.1:8080", "host:port to listen on")
	device := fs.String("device", "auto", backend.FlagUsage)
	name := fs.String("name", "", "model id the API shows (default: the folder's name)")
	maxConc := fs.Int("max-concurrent", d.MaxConcurrent, "most requests running in the batch, 1..4096")
	maxQueue := fs.Int("max-queue", d.MaxQueue, "most requests waiting for room, 0..1000000; past it: 429")
	maxTokens := fs.Int("max-tokens", d.MaxTokens, "most tokens one request may generate, 1..1000000 (also the chat default)")
	maxBody := fs.Int64("max-body", d.MaxBody, "largest request body in bytes, 1024..1073741824")
	ctxLen := fs.Int("context", 0, "most positions per request, prompt and generated (0: the model's max_position_embeddings)")
	grace := fs.Duration("shutdown-timeout", 30*time.Second, "on SIGINT/SIGTERM, how long running requests may finish before they are cancelled")
	prefill := fs.Int("prefill-tokens", d.PrefillTokens, "most prompt tokens fed per batcher step beside the running requests' tokens, 1..1048576; longer prompts go in chunks")
	picksOnHost := fs.Bool("picks-on-host", false, "copy every step's logits back and sample on the host, also for steps whose picks the GPU could make on the device")
	kvMem := fs.String("kv-memory", "", "KV cache budget, e.g. 2GiB or 512MB (default: what -max-concurrent full-context requests take); requests are admitted by the pages free")
	kvPage := fs.Int("kv-page-size", 0, "positions per KV cache page (0: on the CPU 16, or more where a page would not fill the OS's memory pages; on the GPU 64, and a multiple of 64 if set)")
	decodeBF16 := fs.Bool("decode-bf16", false, "CPU passes of <= 16 tokens read bf16 copies of weights that bf16 cannot hold exactly (faster, but a greedy result may then depend on the batch; bf16 checkpoints are held in bf16 either way, with float32 results)")
	path := mlp.Auto
	fs.Var(&path, "mlp", "MLP path: auto, sparse or dense (auto picks per pass by density, so a greedy result may depend on the batch)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	kind, err := backend.Parse(*device)
	if err != nil {
		return usagef("%v", err)
	}
	if *ctxLen < 0 {
		return usagef("-context %d: must be >= 0", *ctxLen)
	}
	if *grace < 0 {
		return usagef("-shutdown-timeout %v: must be >= 0", *grace)
	}
	budget, err := parseBytes(*kvMem)
	if err != nil {
		return usagef("-kv-memory: %v", err)
	}
	if *kvPage < 0 || *kvPage > 1<<16 {
		return usagef("-kv-page-size %d: must be in 0..65536", *kvPage)
	}
	o := serve.Options{ModelName: *name, MaxConcurrent: *maxConc, MaxQueue: *maxQueue, MaxTokens: *maxTokens, MaxBody: *maxBody, Context: *ctxLen, PrefillTokens: *prefill, PicksOnHost: *picksOnHost}
	if o.ModelName == "" {
		o.ModelName = filepath.Base(filepath.Clean(*dir))
		if *dir == "" {
			o.ModelName = models.DefaultName
		}
	}
	if err := o.Validate(); err != nil {
		return usagef("%v", err)
	}
	m, tok, err := loadCheckpointOrDefault("serve", *dir, stderr)
	if err != nil {
		return err
	}
	defer m.Close()
	c := m.Config
	if o.Context == 0 || o.Context > c.MaxPositionEmbeddings {
		o.Context = c.MaxPositionEmbeddings
	}
	kind, note := backend.Resolve(kind, &c)
	if note != "" {
		fmt.Fprintln(stderr, "serve: "+note)
	}
	e, err := openServing(kind, m, backend.Options{MLPPath: path, DecodeBF16: *decodeBF16, ReleaseWeights: true}, o, *kvPage, budget, stderr)
	if err != nil {
		return err
	}
	srv, err := serve.New(e, tok, o)
	if err != nil {
		e.Close()
		return err
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		srv.Shutdown(closed())
		return fmt.Errorf("-addr %s: %w", *addr, err)
	}
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()
	fmt.Fprintf(stderr, "serve: listening on http://%s (model %q on %s, %d positions, %d concurrent, %d queued, %d prefill tokens per step%s)\n",
		ln.Addr(), o.ModelName, kind, o.Context, o.MaxConcurrent, o.MaxQueue, o.PrefillTokens, kvNote(e))

	sig, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stopSignals()
	var serveErr error
	select {
	case <-sig.Done():
	case <-serveStop:
	case serveErr = <-served:
	}
	fmt.Fprintf(stderr, "serve: shutting down: running requests have %v to finish\n", *grace)
	ctx, cancel := context.WithTimeout(context.Background(), *grace)
	defer cancel()
	stopped := make(chan error, 1)
	go func() { stopped <- srv.Shutdown(ctx.Done()) }()
	if err := hs.Shutdown(ctx); err != nil {
		// Past the timeout: the server cancels what is left; give the
		// handlers a moment to answer, then close the connections.
		after, cancel2 := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel2()
		if hs.Shutdown(after) != nil {
			hs.Close()
		}
	}
	if err := <-stopped; err != nil {
		return err
	}
	if serveErr != nil && !errors.Is(serveErr, http.ErrServerClosed) {
		return serveErr
	}
	fmt.Fprintln(stderr, "serve: stopped")
	return nil
}

// openServing opens the engine of a server with options o: its KV cache
// pages of kvPage positions (0: the engine's default) under budget bytes
// (0: what o.MaxConcurrent full-context requests take), checked against the
// memory of the machine (CPU) or the device memory left beside the weights
// (GPU).
func openServing(kind backend.Kind, m *model.Model, bo backend.Options, o serve.Options, kvPage int, budget int64, stderr io.Writer) (engine.Engine, error) {
	var err error
	if kind == backend.CPU {
		if bo.KVPageSize, bo.KVMemory, err = kvBudget(m.Config, o, kvPage, budget, stderr); err != nil {
			return nil, err
		}
	} else if kvPage%gpullm.PageMultiple != 0 {
		return nil, usagef("-kv-page-size %d: the GPU engine takes multiples of %d", kvPage, gpullm.PageMultiple)
	}
	e, err := backend.Open(kind, m, bo)
	if err != nil {
		return nil, err
	}
	if g, ok := e.(*gpullm.Engine); ok {
		if err := gpuKVBudget(g, o, kvPage, budget, stderr); err != nil {
			e.Close()
			return nil, err
		}
	}
	if err := warmUp(e, o.Context); err != nil {
		e.Close()
		return nil, fmt.Errorf("warm-up pass: %w", err)
	}
	return e, nil
}

// warmUp runs a short prompt and two decode steps through e and frees
// their cache, so that what an engine does once (compiling GPU kernels,
// packing CPU weights) happens before the server listens rather than in
// its first request.
func warmUp(e engine.Engine, context int) error {
	n := min(64, context-2)
	if n < 1 {
		return nil
	}
	c, err := e.NewCache(n + 2)
	if err != nil {
		return err
	}
	defer c.Free()
	vocab := e.Config().VocabSize
	prompt := make([]int, n)
	for i := range prompt {
		prompt[i] = (i * 7919) % vocab
	}
	for _, toks := range [][]int{prompt, {1 % vocab}, {2 % vocab}} {
		if _, _, err := e.Forward([]engine.Cache{c}, [][]int{toks}, false); err != nil {
			return err
		}
	}
	return nil
}

// kvBudget returns the CPU engine's KV page size and budget in bytes for
// the server's options: the budget given (-kv-memory), or by default what
// MaxConcurrent full-context requests take, checked against the memory
// available. A budget smaller than one full-context request is allowed
// (longer requests are refused) and noted.
func kvBudget(c model.Config, o serve.Options, pageSize int, budget int64, stderr io.Writer) (int, int64, error) {
	pageSize, pageBytes := backend.KVPage(c, pageSize)
	budget, err := pageBudget(o, pageSize, pageBytes, budget, memcheck.Fits, stderr)
	return pageSize, budget, err
}

// gpuKVBudget gives the GPU engine g its KV page size (0: the engine's
// default) and budget by kvBudget's rules, the budget checked against the
// device memory free once the weights are loaded.
func gpuKVBudget(g *gpullm.Engine, o serve.Options, pageSize int, budget int64, stderr io.Writer) error {
	if pageSize == 0 {
		pageSize = gpullm.DefaultPageSize
	}
	fits := func(what string, need float64, hint string) error {
		free, err := g.Device().Available()
		if err != nil {
			return err
		}
		if need > float64(free) {
			return fmt.Errorf("%s needs %s of device memory, but %s is free on %v beside the weights; %s",
				what, memcheck.Format(need), memcheck.Format(float64(free)), g.Device(), hint)
		}
		return nil
	}
	budget, err := pageBudget(o, pageSize, gpullm.PageBytes(g.Config(), pageSize), budget, fits, stderr)
	if err != nil {
		return err
	}
	return g.SetKVPages(pageSize, budget)
}

// pageBudget returns the KV budget in bytes for pages of pageSize positions
// of pageBytes each: budget, or by default what MaxConcurrent full-context
// requests take, checked by fits (what, bytes, hint).
func pageBudget(o serve.Options, pageSize int, pageBytes, budget int64, fits func(string, float64, string) error, stderr io.Writer) (int64, error) {
	perRequest := int64((o.Context+pageSize-1)/pageSize) * pageBytes
	what := fmt.Sprintf("the KV cache budget (-kv-memory %s)", memcheck.Format(float64(budget)))
	hint := "set a smaller -kv-memory"
	if budget == 0 {
		if float64(o.MaxConcurrent)*float64(perRequest) > math.MaxInt64/2 {
			return 0, fmt.Errorf("the KV caches of %d full-context requests (%d positions) would take %s: set -kv-memory",
				o.MaxConcurrent, o.Context, memcheck.Format(float64(o.MaxConcurrent)*float64(perRequest)))
		}
		budget = int64(o.MaxConcurrent) * perRequest
		what = fmt.Sprintf("the KV caches of %d full-context requests (%d positions)", o.MaxConcurrent, o.Context)
		hint = "lower -max-concurrent or -context, or set a smaller -kv-memory (requests are then admitted by the pages free)"
	}
	if budget < pageBytes {
		return 0, usagef("-kv-memory %s: less than one page of %d positions (%s)", memcheck.Format(float64(budget)), pageSize, memcheck.Format(float64(pageBytes)))
	}
	if err := fits(what, float64(budget), hint); err != nil {
		return 0, err
	}
	if budget < perRequest {
		fmt.Fprintf(stderr, "serve: the KV budget holds %d positions, fewer than the context (%d): requests that could reach more are refused\n",
			budget/pageBytes*int64(pageSize), o.Context)
	}
	return budget, nil
}

// kvNote describes e's KV page pool for the log line, if it has one.
func kvNote(e engine.Engine) string {
	p, ok := e.(engine.Paged)
	if !ok {
		return ""
	}
	ps := p.KVPages()
	if ps.Total == 0 {
		return ""
	}
	return fmt.Sprintf(", KV cache %d pages of %d positions (%s)", ps.Total, ps.PageSize, memcheck.Format(float64(ps.Total)*float64(ps.PageBytes)))
}

// parseBytes reads a size: a number of bytes, or a number with a unit,
// KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024).
// The empty string is 0.
func parseBytes(s string) (int64, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, nil
	}
	units := []struct {
		suffix string
		mult   float64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"B", 1}}
	mult := 1.0
	num := s
	for _, u := range units {
		if n, ok := strings.CutSuffix(s, u.suffix); ok {
			num, mult = strings.TrimSpace(n), u.mult
			break
		}
	}
	v, err := strconv.ParseFloat(num, 64)
	if err != nil || math.IsNaN(v) || v < 0 || v*mult >= 1<<62 {
		return 0, fmt.Errorf("%q: want a size such as 512MiB, 2GiB or 1500000000", s)
	}
	return int64(v * mult), nil
}

func closed() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}
