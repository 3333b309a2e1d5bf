package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode"

	"github.com/twell-ai/twell/data"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/synth/sparsify"
	"github.com/twell-ai/twell/tokenizer"
	"github.com/twell-ai/twell/tokenizer/bpetrain"
)

// ServeSchema names the layout of a ServeResult in JSON, and its version.
const ServeSchema = "twell.bench.serve/1"

// ServeOptions configure a serving load test: Requests streamed
// completions sent to an OpenAI-compatible server, as vLLM's "bench serve"
// sends them.
type ServeOptions struct {
	// URL is the server's base URL, e.g. http://127.0.0.1:8080; requests go
	// to URL/v1/completions.
	URL string
	// Model is the requests' "model" field.
	Model string
	// Prompts are the requests' prompts, used in turn.
	Prompts []string
	// Requests is the number of requests to send.
	Requests int
	// Rate is the mean number of requests sent per second, at exponential
	// intervals (Poisson arrivals); 0 sends them all at once.
	Rate float64
	// Concurrency is the most requests in flight; an arrival waits for a
	// request to end when as many are. 0: no limit.
	Concurrency int
	// MaxTokens is each request's max_tokens.
	MaxTokens int
	// Temperature is each request's temperature (0: greedy).
	Temperature float64
	// TopP and TopK are each request's top_p (in (0, 1]; 0 is read as 1)
	// and top_k (0: off).
	TopP float64
	TopK int
	// IgnoreEOS asks the server to generate past the end of sequence
	// (vLLM's ignore_eos, which twell serve takes), so that every request
	// generates MaxTokens tokens.
	IgnoreEOS bool
	// Seed draws the arrival times and the requests' seeds.
	Seed uint64
	// Timeout bounds one request (0: none).
	Timeout time.Duration
	// Duration stops sending new requests once it has passed since the
	// start (0: send all Requests); requests in flight then finish.
	Duration time.Duration
	// Disconnect is the probability, in [0, 1], that a request's client
	// hangs up mid-stream, after a number of streamed chunks drawn
	// uniformly from 1..max(1, MaxTokens/2): the abuse a server must
	// survive without leaking. Such requests count as Disconnected.
	Disconnect float64
	// Warmup is a number of requests sent before the timed ones, all at
	// once at Concurrency, with the same prompts and MaxTokens, and not
	// counted: the first requests to a server pay for what it does once
	// (a GPU server compiles its kernels, records a decode step's graph
	// for each batch size and times its MLP paths).
	Warmup int
}

// Validate reports the first bad option, naming its flag.
func (o ServeOptions) Validate() error {
	u, err := url.Parse(o.URL)
	switch {
	case err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "":
		return fmt.Errorf("-url %q: want http://host:port", o.URL)
	case o.Requests < 1 || o.Requests > 1000000:
		return fmt.Errorf("-requests %d: must be in 1..1000000", o.Requests)
	case !(o.Rate == 0 || o.Rate >= 0.001) || math.IsInf(o.Rate, 0):
		return fmt.Errorf("-rate %g: must be 0 (all at once) or a finite number of requests per second >= 0.001", o.Rate)
	case o.Concurrency < 0:
		return fmt.Errorf("-concurrency %d: must be >= 0 (0: no limit)", o.Concurrency)
	case o.MaxTokens < 1 || o.MaxTokens > 1000000:
		return fmt.Errorf("-max-tokens %d: must be in 1..1000000", o.MaxTokens)
	case !(o.Temperature >= 0) || math.IsInf(o.Temperature, 0):
		return fmt.Errorf("-temperature %g: must be a finite number >= 0", o.Temperature)
	case !(o.TopP >= 0 && o.TopP <= 1):
		return fmt.Errorf("-top-p %g: must be in (0, 1] (1 keeps all tokens)", o.TopP)
	case o.TopK < 0:
		return fmt.Errorf("-top-k %d: must be >= 0 (0 keeps all tokens)", o.TopK)
	case len(o.Prompts) == 0:
		return errors.New("no prompts")
	case o.Timeout < 0:
		return fmt.Errorf("timeout %v: must be >= 0", o.Timeout)
	case o.Duration < 0:
		return fmt.Errorf("-duration %v: must be >= 0", o.Duration)
	case !(o.Disconnect >= 0 && o.Disconnect <= 1):
		return fmt.Errorf("-disconnect %g: must be a probability in [0, 1]", o.Disconnect)
	case o.Warmup < 0 || o.Warmup > 1000000:
		return fmt.Errorf("-warmup %d: must be in 0..1000000", o.Warmup)
	}
	for i, p := range o.Prompts {
		if strings.TrimSpace(p) == "" {
			return fmt.Errorf("prompt %d is empty", i)
		}
	}
	return nil
}

// Dist summarises a set of latencies in milliseconds: the number of
// samples, their mean, median, 90th and 99th percentiles and maximum.
type Dist struct {
	N      int     `json:"n"`
	Mean   float64 `json:"mean_ms"`
	Median float64 `json:"median_ms"`
	P90    float64 `json:"p90_ms"`
	P99    float64 `json:"p99_ms"`
	Max    float64 `json:"max_ms"`
}

// newDist summarises xs (which it sorts); an empty set gives zeros.
func newDist(xs []float64) Dist {
	if len(xs) == 0 {
		return Dist{}
	}
	slices.Sort(xs)
	sum := 0.0
	for _, x := range xs {
		sum += x
	}
	return Dist{N: len(xs), Mean: sum / float64(len(xs)), Median: Percentile(xs, 50), P90: Percentile(xs, 90),
		P99: Percentile(xs, 99), Max: xs[len(xs)-1]}
}

// Percentile returns the p-th percentile (0..100) of sorted, by linear
// interpolation between the two nearest ranks (numpy's default); 0 for an
// empty slice.
func Percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	rank := p / 100 * float64(len(sorted)-1)
	lo := int(math.Floor(rank))
	hi := min(lo+1, len(sorted)-1)
	return sorted[lo] + (rank-float64(lo))*(sorted[hi]-sorted[lo])
}

// ServeRequest is one request of a serving load test. Times are from the
// start of the test (StartS) or of the request (the others), in
// milliseconds but StartS.
type ServeRequest struct {
	StartS       float64 `json:"start_s"`
	TTFTMS       float64 `json:"ttft_ms"`
	E2EMS        float64 `json:"e2e_ms"`
	TPOTMS       float64 `json:"tpot_ms"` // 0 with fewer than two output tokens
	PromptTokens int     `json:"prompt_tokens"`
	OutputTokens int     `json:"output_tokens"`
	Error        string  `json:"error,omitempty"`
	// Disconnected says the client hung up on purpose (ServeOptions.Disconnect).
	Disconnected bool `json:"disconnected,omitempty"`
	// itl are the gaps between the request's streamed chunks of text.
	itl []float64
}

// ServeResult is what a serving load test measured.
type ServeResult struct {
	Row                          // Schema ServeSchema; Device: "cpu", "cuda" or "remote"
	Server        string         `json:"server"` // what served: the URL, or the in-process server's model and settings
	Model         string         `json:"model"`
	Requests      int            `json:"requests"`
	Rate          float64        `json:"rate"` // requests/s asked; 0: all at once
	Concurrency   int            `json:"concurrency"`
	MaxTokens     int            `json:"max_tokens"`
	Temperature   float64        `json:"temperature"`
	TopP          float64        `json:"top_p,omitempty"` // 0: not sent (1)
	TopK          int            `json:"top_k,omitempty"`
	Completed     int            `json:"completed"`
	Failed        int            `json:"failed"`
	Disconnected  int            `json:"disconnected"` // clients that hung up on purpose
	Leaks         *LeakCheck     `json:"leak_check,omitempty"`
	Errors        []string       `json:"errors,omitempty"` // the first distinct errors
	DurationS     float64        `json:"duration_s"`
	InputTokens   int            `json:"input_tokens"`
	OutputTokens  int            `json:"output_tokens"`
	RequestsPerS  float64        `json:"request_throughput"`
	OutputTokPerS float64        `json:"output_throughput"`
	TotalTokPerS  float64        `json:"total_token_throughput"`
	TTFT          Dist           `json:"ttft"`
	TPOT          Dist           `json:"tpot"`
	ITL           Dist           `json:"itl"`
	E2E           Dist           `json:"e2e_latency"`
	Preemptions   int64          `json:"preemptions"`      // from the server's /metrics (warm-up included); -1 where it has none
	Warmup        int            `json:"warmup,omitempty"` // requests sent before and not counted (ServeOptions.Warmup)
	PerRequest    []ServeRequest `json:"per_request"`
	itl           []float64
}

// Serve runs a serving load test against o.URL. progress, when not nil,
// is told of each request that ends, one call at a time, in order of the
// count. Requests that fail are counted and their first errors kept; Serve
// itself fails only on bad options or a cancelled ctx.
func Serve(ctx context.Context, o ServeOptions, progress func(done, total int)) (*ServeResult, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if o.Warmup > 0 {
		w := o
		w.Requests, w.Warmup, w.Rate, w.Duration, w.Disconnect = o.Warmup, 0, 0, 0, 0
		w.Seed = o.Seed ^ 0x3a4e
		wr, err := Serve(ctx, w, nil)
		if err != nil {
			return nil, fmt.Errorf("warm-up: %w", err)
		}
		if wr.Failed > 0 {
			return nil, fmt.Errorf("warm-up: %d of %d requests failed: %s", wr.Failed, wr.Requests, strings.Join(wr.Errors, "; "))
		}
	}
	base := strings.TrimRight(o.URL, "/")
	r := rand.New(rand.NewPCG(o.Seed, 0x5e7e))
	starts := make([]float64, o.Requests) // seconds after the start
	t := 0.0
	for i := range starts {
		starts[i] = t
		if o.Rate > 0 {
			t += r.ExpFloat64() / o.Rate
		}
	}
	seeds := make([]int64, o.Requests)
	cuts := make([]int, o.Requests) // chunks after which the client hangs up; 0: never
	for i := range seeds {
		seeds[i] = int64(r.Uint64() >> 1)
		if o.Disconnect > 0 && r.Float64() < o.Disconnect {
			cuts[i] = 1 + r.IntN(max(1, o.MaxTokens/2))
		}
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: max(o.Concurrency, min(o.Requests, 1024)), DisableCompression: true}}
	defer client.CloseIdleConnections()
	// The goroutines write into all, which is never reassigned; reqs is the
	// part of it that was sent, cut once they are done.
	all := make([]ServeRequest, o.Requests)
	sent := len(all)
	var sem chan struct{}
	if o.Concurrency > 0 {
		sem = make(chan struct{}, o.Concurrency)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	done := 0
	t0 := time.Now()
	var cancelled error
	for i := range all {
		if d := time.Until(t0.Add(time.Duration(starts[i] * float64(time.Second)))); d > 0 {
			select {
			case <-time.After(d):
			case <-ctx.Done():
			}
		}
		if sem != nil {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
			}
		}
		if cancelled = ctx.Err(); cancelled != nil {
			break
		}
		if o.Duration > 0 && time.Since(t0) >= o.Duration {
			if sem != nil {
				<-sem
			}
			sent = i
			break
		}
		wg.Go(func() {
			if sem != nil {
				defer func() { <-sem }()
			}
			all[i] = sendOne(ctx, client, base, o, o.Prompts[i%len(o.Prompts)], seeds[i], cuts[i], t0)
			// progress runs under mu: one call at a time, counts in order.
			mu.Lock()
			defer mu.Unlock()
			done++
			if progress != nil {
				progress(done, o.Requests)
			}
		})
	}
	wg.Wait()
	if cancelled != nil {
		return nil, cancelled
	}
	reqs := all[:sent]
	res := &ServeResult{Row: newRow(ServeSchema, "remote", CPUName()), Server: base, Model: o.Model, Requests: len(reqs),
		Rate: o.Rate, Concurrency: o.Concurrency, MaxTokens: o.MaxTokens, Temperature: o.Temperature, TopP: o.TopP, TopK: o.TopK, PerRequest: reqs, Preemptions: scrapePreemptions(client, base),
		Warmup: o.Warmup}
	var ttft, tpot, e2e []float64
	end := 0.0
	for _, q := range reqs {
		end = max(end, q.StartS+q.E2EMS/1000)
		if q.Disconnected {
			res.Disconnected++
			continue
		}
		if q.Error != "" {
			res.Failed++
			if len(res.Errors) < 5 && !slices.Contains(res.Errors, q.Error) {
				res.Errors = append(res.Errors, q.Error)
			}
			continue
		}
		res.Completed++
		res.InputTokens += q.PromptTokens
		res.OutputTokens += q.OutputTokens
		e2e = append(e2e, q.E2EMS)
		if q.OutputTokens > 0 {
			ttft = append(ttft, q.TTFTMS)
		}
		if q.OutputTokens > 1 {
			tpot = append(tpot, q.TPOTMS)
		}
		res.itl = append(res.itl, q.itl...)
	}
	res.DurationS = end
	if end > 0 {
		res.RequestsPerS = float64(res.Completed) / end
		res.OutputTokPerS = float64(res.OutputTokens) / end
		res.TotalTokPerS = float64(res.InputTokens+res.OutputTokens) / end
	}
	res.TTFT, res.TPOT, res.E2E = newDist(ttft), newDist(tpot), newDist(e2e)
	res.ITL = newDist(slices.Clone(res.itl))
	return res, nil
}

// ITLSamples returns every inter-token latency measured (milliseconds, the
// gaps between streamed chunks of text), for plots.
func (r *ServeResult) ITLSamples() []float64 { return r.itl }

// sendOne sends one streamed completion and times its chunks.
// With cut > 0 the client hangs up after cut chunks of text.
func sendOne(ctx context.Context, client *http.Client, base string, o ServeOptions, prompt string, seed int64, cut int, t0 time.Time) ServeRequest {
	fields := map[string]any{
		"model": o.Model, "prompt": prompt, "max_tokens": o.MaxTokens, "temperature": o.Temperature, "seed": seed,
		"ignore_eos": o.IgnoreEOS, "stream": true, "stream_options": map[string]any{"include_usage": true},
	}
	if o.TopP > 0 {
		fields["top_p"] = o.TopP
	}
	if o.TopK > 0 {
		fields["top_k"] = o.TopK
	}
	body, _ := json.Marshal(fields)
	if o.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.Timeout)
		defer cancel()
	}
	ctx, hangUp := context.WithCancel(ctx)
	defer hangUp()
	start := time.Now()
	q := ServeRequest{StartS: start.Sub(t0).Seconds()}
	fail := func(format string, a ...any) ServeRequest {
		q.Error = fmt.Sprintf(format, a...)
		q.E2EMS = ms(time.Since(start))
		return q
	}
	req, err := http.NewRequestWithContext(ctx, "POST", base+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return fail("%v", err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return fail("%v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fail("HTTP %d: %s", resp.StatusCode, errorMessage(b))
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	var last time.Time
	chunks, finished := 0, false
	for sc.Scan() {
		line := sc.Text()
		payload, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			continue
		}
		if payload == "[DONE]" {
			finished = true
			break
		}
		now := time.Now()
		var ev struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens     int `json:"prompt_tokens"`
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(payload), &ev); err != nil {
			return fail("a stream event is not JSON: %v", err)
		}
		if ev.Error != nil {
			return fail("error event: %s", ev.Error.Message)
		}
		if ev.Usage != nil {
			q.PromptTokens, q.OutputTokens = ev.Usage.PromptTokens, ev.Usage.CompletionTokens
		}
		if len(ev.Choices) > 0 && ev.Choices[0].Text != "" {
			if chunks == 0 {
				q.TTFTMS = ms(now.Sub(start))
			} else {
				q.itl = append(q.itl, ms(now.Sub(last)))
			}
			last = now
			chunks++
			if chunks == cut {
				hangUp()
				q.Disconnected = true
				q.E2EMS = ms(time.Since(start))
				return q
			}
		}
	}
	if err := sc.Err(); err != nil {
		return fail("reading the stream: %v", err)
	}
	if !finished {
		return fail("the stream ended without [DONE]")
	}
	q.E2EMS = ms(time.Since(start))
	if q.OutputTokens == 0 {
		q.OutputTokens = chunks // a server without usage in streams: chunks stand for tokens
	}
	if q.OutputTokens > 0 && chunks == 0 { // tokens that decoded to no text: the first arrived at the end
		q.TTFTMS = q.E2EMS
	}
	if q.OutputTokens > 1 {
		q.TPOTMS = (q.E2EMS - q.TTFTMS) / float64(q.OutputTokens-1)
	}
	return q
}

func ms(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }

// errorMessage returns the message of an OpenAI-style error body, or the
// body itself, on one line.
func errorMessage(b []byte) string {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(b, &e) == nil && e.Error.Message != "" {
		return e.Error.Message
	}
	return strings.Join(strings.Fields(string(b)), " ")
}

// scrapePreemptions reads twell_preemptions_total from the server's
// /metrics, or returns -1.
func scrapePreemptions(client *http.Client, base string) int64 {
	resp, err := client.Get(base + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		var n int64
		if _, err := fmt.Sscanf(sc.Text(), "twell_preemptions_total %d", &n); err == nil {
			return n
		}
	}
	return -1
}

// Prompts returns n prompts cut from texts: each starts at the beginning
// of a paragraph (after a blank line) drawn at random and runs for words
// words (into the following paragraphs where one is shorter), white space
// folded to single spaces. A text shorter than words words gives itself.
func Prompts(texts []string, n, words int, seed uint64) ([]string, error) {
	if n < 1 || words < 1 {
		return nil, fmt.Errorf("%d prompts of %d words: both must be positive", n, words)
	}
	var all []string
	var starts []int // indices in all where a paragraph begins
	for _, t := range texts {
		for _, para := range strings.Split(strings.ReplaceAll(t, "\r\n", "\n"), "\n\n") {
			f := strings.FieldsFunc(para, unicode.IsSpace)
			if len(f) == 0 {
				continue
			}
			starts = append(starts, len(all))
			all = append(all, f...)
		}
	}
	if len(all) == 0 {
		return nil, errors.New("the prompt text has no words")
	}
	// Paragraphs with words words after them; the first one at least.
	var ok []int
	for _, s := range starts {
		if s+words <= len(all) {
			ok = append(ok, s)
		}
	}
	if len(ok) == 0 {
		ok = starts[:1]
	}
	r := rand.New(rand.NewPCG(seed, 0x9a9e))
	out := make([]string, n)
	for i := range out {
		s := ok[r.IntN(len(ok))]
		out[i] = strings.Join(all[s:min(len(all), s+words)], " ")
	}
	return out, nil
}

// SampleText returns the bundled text sample (the trainer's default
// corpus, package data) as one text per file.
func SampleText() []string {
	var out []string
	for _, f := range data.SampleFiles() {
		out = append(out, f.Text)
	}
	return out
}

// TinyServeModelName names the model TinyServeModel builds.
const TinyServeModelName = "tiny-random (hidden 128, 4 layers, MLP 512, 1024-token BPE of the bundled sample)"

// TinyServeModel returns a small random model to serve when no checkpoint
// is given, and its tokenizer, with no download: a 1024-token BPE
// tokenizer trained on the bundled text sample, and a Llama model of
// hidden size 128, 4 layers, 4 heads (2 KV heads), a ReLU-gated MLP of 512
// units whose gates are calibrated to 2% skewed density, and 2048
// positions. The end-of-text token's embedding is zero, so that its tied
// logit is 0 and greedy generations do not end early by chance.
func TinyServeModel(seed uint64) (*model.Model, *tokenizer.Tokenizer, error) {
	tok, err := SampleTokenizer()
	if err != nil {
		return nil, nil, err
	}
	eos, ok := tok.EOS()
	if !ok {
		return nil, nil, errors.New("bench: the sample tokenizer has no end-of-text token")
	}
	c := model.Config{
		ModelType: "llama", Architectures: []string{"LlamaForCausalLM"},
		HiddenSize: 128, IntermediateSize: 512, NumHiddenLayers: 4, NumAttentionHeads: 4, NumKeyValueHeads: 2, HeadDim: 32,
		VocabSize: tok.VocabSize(), MaxPositionEmbeddings: 2048, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: model.ActReLU, TieWordEmbeddings: true, MLPGated: true, BOSTokenID: &eos, EOSTokenIDs: []int{eos},
	}
	r := rand.New(rand.NewPCG(seed, 0x7e57))
	m, err := model.New(c, model.RandomWeights(c, r))
	if err != nil {
		return nil, nil, err
	}
	if err := sparsify.Gates(m, 0.02, synth.Skewed, r); err != nil {
		return nil, nil, err
	}
	clear(m.Weights.Embed[eos*c.HiddenSize : (eos+1)*c.HiddenSize])
	return m, tok, nil
}

// SampleTokenizer returns a 1024-token byte-level BPE trained on the
// bundled text sample (deterministic; no download).
func SampleTokenizer() (*tokenizer.Tokenizer, error) {
	bm, err := bpetrain.Train(SampleText(), bpetrain.Config{VocabSize: 1024})
	if err != nil {
		return nil, err
	}
	raw, err := bm.JSON()
	if err != nil {
		return nil, err
	}
	return tokenizer.Parse(raw)
}

// LeakCheck compares an in-process server before a load test and after it
// has gone idle: what a server that frees everything keeps equal.
type LeakCheck struct {
	GoroutinesBefore int     `json:"goroutines_before"`
	GoroutinesAfter  int     `json:"goroutines_after"`
	HeapMiBBefore    float64 `json:"heap_mib_before"` // Go heap in use after a collection
	HeapMiBAfter     float64 `json:"heap_mib_after"`
	KVPagesBefore    int64   `json:"kv_pages_used_before"` // -1 where the engine has no page pool
	KVPagesAfter     int64   `json:"kv_pages_used_after"`
	RunningAfter     int     `json:"running_after"` // the server's requests once idle
	QueuedAfter      int     `json:"queued_after"`
}
