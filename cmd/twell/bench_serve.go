package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/twell-ai/twell/backend"
	"github.com/twell-ai/twell/bench"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/serve"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/tokenizer"
)

func init() {
	register(command{name: "bench serve", summary: "serving load test: streamed completions at a request rate or concurrency; throughput, TTFT, TPOT, ITL", run: runBenchServe})
}

// tinyServeSeed draws the weights of the tiny random model, the same in
// every run.
const tinyServeSeed = 1

func runBenchServe(args []string, stdout, stderr io.Writer) error {
	d := serve.DefaultOptions()
	fs := newFlagSet("bench serve", stderr)
	url := fs.String("url", "", "a running server's base URL, e.g. http://127.0.0.1:8080 (default: start one in this process, over loopback)")
	dir := fs.String("model", "", "in-process server: checkpoint folder (default: a tiny random model with a tokenizer trained on the bundled sample, no download)")
	preset := fs.String("preset", "", "in-process server: random weights at a known shape instead of -model: sparselm-1.5b (gates calibrated to 0.5% skewed; prompts through the sample tokenizer)")
	layers := fs.Int("layers", 0, "with -preset: keep only the first N layers (0: all)")
	requests := fs.Int("requests", 64, "requests to send, 1..1000000")
	rate := fs.Float64("rate", 0, "mean requests per second, Poisson arrivals (0: all at once)")
	concurrency := fs.Int("concurrency", 0, "most requests in flight (0: no limit)")
	warmup := fs.Int("warmup", 0, "requests sent all at once (at -concurrency) before the timed ones and not counted, 0..1000000: a server's first requests pay for compiling kernels and recording graphs")
	maxTokens := fs.Int("max-tokens", 64, "max_tokens of each request")
	promptsPath := fs.String("prompts", "", "text file or folder (its .txt files) to cut prompts from (default: the bundled text sample)")
	words := fs.Int("prompt-words", 64, "words per prompt, from the start of a paragraph drawn at random")
	temp := fs.Float64("temperature", 0, "temperature of each request (0: greedy)")
	topP := fs.Float64("top-p", 1, "top_p of each request, in (0, 1] (1: off)")
	topK := fs.Int("top-k", 0, "top_k of each request (0: off)")
	ignoreEOS := fs.Bool("ignore-eos", false, "ask the server to generate max-tokens tokens past any end of sequence")
	seed := fs.Uint64("seed", 0, "random seed of the prompts, arrivals and sampling (0: fresh, printed)")
	timeout := fs.Duration("timeout", 0, "bound on one request (0: none)")
	duration := fs.Duration("duration", 0, "stop sending new requests after this long, e.g. 10m (0: send all -requests); a soak test")
	disconnect := fs.Float64("disconnect", 0, "probability in [0, 1] that a client hangs up mid-stream (the in-process server is then checked for leaks)")
	jsonPath := fs.String("json", "", "write the result (summary and every request) as JSON to this file")
	plotPath := fs.String("plot", "", "write a PNG of latencies per request and their distributions to this file")
	device := fs.String("device", "auto", "in-process server: "+backend.FlagUsage)
	path := mlp.Auto
	fs.Var(&path, "mlp", "in-process server: MLP path, auto, sparse or dense")
	maxConc := fs.Int("max-concurrent", d.MaxConcurrent, "in-process server: requests running in the batch at once")
	prefill := fs.Int("prefill-tokens", d.PrefillTokens, "in-process server: prompt tokens fed per step")
	picksOnHost := fs.Bool("picks-on-host", false, "in-process server: sample every step on the host, also steps the GPU could pick on the device")
	kvMem := fs.String("kv-memory", "", "in-process server: KV cache budget, e.g. 256MiB (default: what -max-concurrent full-context requests take)")
	kvPage := fs.Int("kv-page-size", 0, "in-process server: positions per KV page (0: the engine's default)")
	ctxLen := fs.Int("context", 0, "in-process server: positions per request (0: the model's)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	set := setFlags(fs)
	if *url != "" {
		for _, f := range []string{"model", "preset", "layers", "device", "mlp", "max-concurrent", "prefill-tokens", "kv-memory", "kv-page-size", "context"} {
			if set[f] {
				return usagef("-%s sets up the in-process server; it does not apply with -url", f)
			}
		}
	}
	switch {
	case *words < 1:
		return usagef("-prompt-words %d: must be >= 1", *words)
	case *preset != "" && *preset != "sparselm-1.5b":
		return usagef("-preset %q: the known preset is sparselm-1.5b", *preset)
	case *preset != "" && *dir != "":
		return usagef("give -model DIR or -preset NAME, not both")
	case *layers < 0 || (*layers > 0 && *preset == ""):
		return usagef("-layers %d: a number of layers >= 0, with -preset", *layers)
	}
	if *seed == 0 {
		*seed = rand.Uint64()
	}
	o := bench.ServeOptions{URL: "http://127.0.0.1:1", Prompts: []string{"x"}, Requests: *requests, Rate: *rate, Concurrency: *concurrency,
		MaxTokens: *maxTokens, Temperature: *temp, TopP: *topP, TopK: *topK, IgnoreEOS: *ignoreEOS, Seed: *seed, Timeout: *timeout,
		Duration: *duration, Disconnect: *disconnect, Warmup: *warmup}
	if *url != "" {
		o.URL = *url
	}
	if err := o.Validate(); err != nil {
		return usageError{err.Error()}
	}
	if err := checkWritable(*jsonPath, *plotPath); err != nil {
		return err
	}
	texts, source, err := promptTexts(*promptsPath)
	if err != nil {
		return err
	}
	if o.Prompts, err = bench.Prompts(texts, *requests, *words, *seed); err != nil {
		return fmt.Errorf("-prompts %s: %w", source, err)
	}

	deviceName, server := "remote", *url
	var is *inProcess
	if *url == "" {
		st := serverSetup{dir: *dir, preset: *preset, layers: *layers, device: *device, path: path, maxConc: *maxConc, prefill: *prefill, picksOnHost: *picksOnHost, kvMem: *kvMem, kvPage: *kvPage,
			context: *ctxLen, queue: *requests}
		if is, err = startInProcess(st, stderr); err != nil {
			return err
		}
		defer is.stop()
		o.URL, o.Model, deviceName, server = is.url, is.name, is.device, is.desc
	}
	fmt.Fprintf(stderr, "bench serve: %d requests to %s, seed %d; prompts of %d words from %s\n", *requests, o.URL, *seed, *words, source)
	ctx, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stopSignals()
	var before *bench.LeakCheck
	if *url == "" {
		before = is.snapshot()
	}
	step := max(1, *requests/10)
	res, err := bench.Serve(ctx, o, func(done, total int) {
		if done%step == 0 || done == total {
			fmt.Fprintf(stderr, "  %d/%d requests done\n", done, total)
		}
	})
	if err != nil {
		return err
	}
	res.Device, res.Server = deviceName, server
	if before != nil {
		res.Leaks = is.leakCheck(before)
	}
	printServeReport(stdout, res)
	if err := writeResults(*jsonPath, res, *plotPath, func() error { return bench.PlotServe(res, *plotPath) }); err != nil {
		return err
	}
	if res.Completed == 0 && res.Failed > 0 {
		return fmt.Errorf("all %d requests failed; the first error: %s", res.Failed, res.Errors[0])
	}
	if res.Failed > 0 {
		fmt.Fprintf(stderr, "bench serve: %d of %d requests failed: %s\n", res.Failed, res.Requests, strings.Join(res.Errors, "; "))
	}
	return nil
}

// promptTexts reads the text prompts are cut from: a file, every .txt file
// under a folder (in name order), or the bundled sample when path is
// empty. It returns the texts and a name for them.
func promptTexts(path string) ([]string, string, error) {
	if path == "" {
		return bench.SampleText(), "the bundled sample", nil
	}
	st, err := os.Stat(path)
	if err != nil {
		return nil, "", fmt.Errorf("-prompts: %w", err)
	}
	var files []string
	if st.IsDir() {
		err := filepath.WalkDir(path, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.Type().IsRegular() && strings.EqualFold(filepath.Ext(p), ".txt") {
				files = append(files, p)
			}
			return nil
		})
		if err != nil {
			return nil, "", fmt.Errorf("-prompts: %w", err)
		}
		if len(files) == 0 {
			return nil, "", fmt.Errorf("-prompts %s: no .txt file in the folder", path)
		}
		sort.Strings(files)
	} else {
		files = []string{path}
	}
	var texts []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, "", fmt.Errorf("-prompts: %w", err)
		}
		texts = append(texts, string(b))
	}
	return texts, path, nil
}

// serverSetup is the in-process server's settings (the serve flags).
type serverSetup struct {
	dir, preset, device, kvMem string
	path                       mlp.Path
	maxConc, prefill, layers   int
	kvPage, context, queue     int
	picksOnHost                bool
}

// inProcess is a server run in this process for the load test.
type inProcess struct {
	url, name, device, desc string
	stop                    func()
	srv                     *serve.Server
	e                       engine.Engine
}

// snapshot measures what a leak would grow: goroutines, the Go heap after
// a collection, the KV pages in use.
func (is *inProcess) snapshot() *bench.LeakCheck {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	lc := &bench.LeakCheck{GoroutinesBefore: runtime.NumGoroutine(), HeapMiBBefore: float64(ms.HeapInuse) / (1 << 20), KVPagesBefore: -1}
	if p, ok := is.e.(engine.Paged); ok {
		lc.KVPagesBefore = int64(p.KVPages().InUse)
	}
	return lc
}

// leakCheck waits (up to 30 s) for the server to go idle and the clients'
// connections to close, then measures again and returns both sides.
func (is *inProcess) leakCheck(before *bench.LeakCheck) *bench.LeakCheck {
	lc := *before
	deadline := time.Now().Add(30 * time.Second)
	for {
		after := is.snapshot()
		lc.RunningAfter, lc.QueuedAfter = is.srv.Load()
		lc.GoroutinesAfter, lc.HeapMiBAfter, lc.KVPagesAfter = after.GoroutinesBefore, after.HeapMiBBefore, after.KVPagesBefore
		idle := lc.RunningAfter == 0 && lc.QueuedAfter == 0 && lc.KVPagesAfter <= lc.KVPagesBefore && lc.GoroutinesAfter <= lc.GoroutinesBefore
		if idle || time.Now().After(deadline) {
			return &lc
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// startInProcess loads the model (or builds the tiny one) and serves it on
// a free loopback port, as twell serve would with the same flags.
func startInProcess(st serverSetup, stderr io.Writer) (*inProcess, error) {
	kind, err := backend.Parse(st.device)
	if err != nil {
		return nil, usagef("%v", err)
	}
	budget, err := parseBytes(st.kvMem)
	if err != nil {
		return nil, usagef("-kv-memory: %v", err)
	}
	if st.kvPage < 0 || st.kvPage > 1<<16 {
		return nil, usagef("-kv-page-size %d: must be in 0..65536", st.kvPage)
	}
	if st.context < 0 {
		return nil, usagef("-context %d: must be >= 0", st.context)
	}
	o := serve.Options{ModelName: "twell", MaxConcurrent: st.maxConc, MaxQueue: max(st.queue, serve.DefaultOptions().MaxQueue),
		MaxTokens: 1000000, MaxBody: serve.DefaultOptions().MaxBody, Context: st.context, PrefillTokens: st.prefill, PicksOnHost: st.picksOnHost}
	if err := o.Validate(); err != nil {
		return nil, usagef("%v", err)
	}
	var m *model.Model
	var tok *tokenizer.Tokenizer
	modelDesc := bench.TinyServeModelName
	switch {
	case st.dir != "":
		if m, tok, err = loadCheckpoint(st.dir, false); err != nil {
			return nil, err
		}
		o.ModelName = filepath.Base(filepath.Clean(st.dir))
		modelDesc = o.ModelName
	case st.preset != "":
		say := func(s string) { fmt.Fprintln(stderr, "bench serve: "+s) }
		if m, modelDesc, err = bench.PresetModel(st.layers, 0.005, synth.Skewed, rand.New(rand.NewPCG(tinyServeSeed, 0x15b)), say); err != nil {
			return nil, err
		}
		if tok, err = bench.SampleTokenizer(); err != nil {
			return nil, err
		}
		o.ModelName = st.preset
	default:
		fmt.Fprintln(stderr, "bench serve: no -model: building a tiny random model (tokenizer trained on the bundled sample)")
		if m, tok, err = bench.TinyServeModel(tinyServeSeed); err != nil {
			return nil, err
		}
		o.ModelName = "tiny-random"
	}
	c := m.Config
	if o.Context == 0 || o.Context > c.MaxPositionEmbeddings {
		o.Context = c.MaxPositionEmbeddings
	}
	kind, note := backend.Resolve(kind, &c)
	if note != "" {
		fmt.Fprintln(stderr, "bench serve: "+note)
	}
	e, err := openServing(kind, m, backend.Options{MLPPath: st.path}, o, st.kvPage, budget, stderr)
	if err != nil {
		return nil, err
	}
	srv, err := serve.New(e, tok, o)
	if err != nil {
		e.Close()
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		srv.Shutdown(closed())
		return nil, err
	}
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()
	picks := ""
	if o.PicksOnHost {
		picks = ", picks on the host"
	}
	desc := fmt.Sprintf("in-process twell serve: %s on %s, %d positions, max-concurrent %d, prefill-tokens %d, mlp %s%s%s",
		modelDesc, kind, o.Context, o.MaxConcurrent, o.PrefillTokens, st.path, picks, kvNote(e))
	stop := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		hs.Shutdown(ctx)
		srv.Shutdown(closed())
		if err := <-served; err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintf(stderr, "bench serve: the in-process server: %v\n", err)
		}
	}
	return &inProcess{url: "http://" + ln.Addr().String(), name: o.ModelName, device: string(kind), desc: desc, stop: stop, srv: srv, e: e}, nil
}

// printServeReport prints the summary and a table of the latencies.
func printServeReport(w io.Writer, r *bench.ServeResult) {
	rate := "all at once"
	if r.Rate > 0 {
		rate = fmt.Sprintf("%g/s (Poisson)", r.Rate)
	}
	conc := "no limit"
	if r.Concurrency > 0 {
		conc = fmt.Sprint(r.Concurrency)
	}
	fmt.Fprintf(w, "server:              %s\n", r.Server)
	fmt.Fprintf(w, "requests:            %d (rate %s, concurrency %s, max_tokens %d, %s): %d done, %d failed, %d hung up by the client\n", r.Requests, rate, conc, r.MaxTokens, samplingDesc(r), r.Completed, r.Failed, r.Disconnected)
	if r.Warmup > 0 {
		fmt.Fprintf(w, "warm-up:             %d requests before, not counted\n", r.Warmup)
	}
	if l := r.Leaks; l != nil {
		fmt.Fprintf(w, "leak check:          goroutines %d -> %d, Go heap %.1f -> %.1f MiB, KV pages in use %d -> %d, running %d, queued %d\n",
			l.GoroutinesBefore, l.GoroutinesAfter, l.HeapMiBBefore, l.HeapMiBAfter, l.KVPagesBefore, l.KVPagesAfter, l.RunningAfter, l.QueuedAfter)
	}
	fmt.Fprintf(w, "duration:            %.3f s\n", r.DurationS)
	fmt.Fprintf(w, "tokens:              %d in, %d out\n", r.InputTokens, r.OutputTokens)
	fmt.Fprintf(w, "request throughput:  %.3f requests/s\n", r.RequestsPerS)
	fmt.Fprintf(w, "output throughput:   %.1f tokens/s (%.1f tokens/s with the prompts)\n", r.OutputTokPerS, r.TotalTokPerS)
	if r.Preemptions >= 0 {
		fmt.Fprintf(w, "preemptions:         %d (the server's count since it started)\n", r.Preemptions)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "latency (ms)\tsamples\tmean\tmedian\tp90\tp99\tmax\t")
	for _, row := range []struct {
		name string
		d    bench.Dist
	}{{"time to first token", r.TTFT}, {"time per output token", r.TPOT}, {"inter-token latency", r.ITL}, {"end-to-end", r.E2E}} {
		fmt.Fprintf(tw, "%s\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t\n", row.name, row.d.N, row.d.Mean, row.d.Median, row.d.P90, row.d.P99, row.d.Max)
	}
	tw.Flush()
	fmt.Fprintf(w, "machine: %s, %s\n", r.Machine, r.Date)
}

// samplingDesc says how the requests of r sampled: "greedy", or their
// temperature with top_p and top_k where sent.
func samplingDesc(r *bench.ServeResult) string {
	if r.Temperature == 0 {
		return "greedy"
	}
	d := fmt.Sprintf("temperature %g", r.Temperature)
	if r.TopP > 0 && r.TopP < 1 {
		d += fmt.Sprintf(", top_p %g", r.TopP)
	}
	if r.TopK > 0 {
		d += fmt.Sprintf(", top_k %d", r.TopK)
	}
	return d
}
