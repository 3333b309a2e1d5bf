package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/twell-ai/twell/backend"
	"github.com/twell-ai/twell/internal/memcheck"
	"github.com/twell-ai/twell/mlp"
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
	dir := fs.String("model", "", "checkpoint folder: config.json, model.safetensors, tokenizer.json")
	addr := fs.String("addr", "127.0.0.1:8080", "host:port to listen on")
	device := fs.String("device", "auto", backend.FlagUsage)
	name := fs.String("name", "", "model id the API shows (default: the folder's name)")
	maxConc := fs.Int("max-concurrent", d.MaxConcurrent, "most requests running in the batch, 1..4096")
	maxQueue := fs.Int("max-queue", d.MaxQueue, "most requests waiting for room, 0..1000000; past it: 429")
	maxTokens := fs.Int("max-tokens", d.MaxTokens, "most tokens one request may generate, 1..1000000 (also the chat default)")
	maxBody := fs.Int64("max-body", d.MaxBody, "largest request body in bytes, 1024..1073741824")
	ctxLen := fs.Int("context", 0, "most positions per request, prompt and generated (0: the model's max_position_embeddings)")
	grace := fs.Duration("shutdown-timeout", 30*time.Second, "on SIGINT/SIGTERM, how long running requests may finish before they are cancelled")
	decodeBF16 := fs.Bool("decode-bf16", false, "CPU passes of <= 16 tokens read bf16 weight copies (faster, but a greedy result may then depend on the batch)")
	path := mlp.Auto
	fs.Var(&path, "mlp", "MLP path: auto, sparse or dense (auto picks per pass by density, so a greedy result may depend on the batch)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *dir == "" {
		return usagef("-model is required")
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
	o := serve.Options{ModelName: *name, MaxConcurrent: *maxConc, MaxQueue: *maxQueue, MaxTokens: *maxTokens, MaxBody: *maxBody, Context: *ctxLen}
	if o.ModelName == "" {
		o.ModelName = filepath.Base(filepath.Clean(*dir))
	}
	if err := o.Validate(); err != nil {
		return usagef("%v", err)
	}
	m, tok, err := loadCheckpoint(*dir)
	if err != nil {
		return err
	}
	c := m.Config
	if o.Context == 0 || o.Context > c.MaxPositionEmbeddings {
		o.Context = c.MaxPositionEmbeddings
	}
	kind, note := backend.Resolve(kind, &c)
	if note != "" {
		fmt.Fprintln(stderr, "serve: "+note)
	}
	if kind == backend.CPU {
		kv := float64(o.MaxConcurrent) * float64(o.Context) * float64(c.NumHiddenLayers) * float64(c.NumKeyValueHeads*c.HeadDim) * 8
		if err := memcheck.Fits(fmt.Sprintf("the KV caches of %d full-context requests (%d positions)", o.MaxConcurrent, o.Context), kv, "lower -max-concurrent or -context"); err != nil {
			return err
		}
	}
	e, err := backend.Open(kind, m, backend.Options{MLPPath: path, DecodeBF16: *decodeBF16})
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
	fmt.Fprintf(stderr, "serve: listening on http://%s (model %q on %s, %d positions, %d concurrent, %d queued)\n",
		ln.Addr(), o.ModelName, kind, o.Context, o.MaxConcurrent, o.MaxQueue)

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

func closed() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}
