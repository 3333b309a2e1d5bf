package serve

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	cpullm "github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/generate"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/sample"
	"github.com/twell-ai/twell/tokenizer"
)

// countingEngine counts the live caches of the engine it wraps and records
// the tokens of each sequence of each Forward call; ref is a second engine
// over the same model and options, for reference results.
type countingEngine struct {
	engine.Engine
	live atomic.Int64
	ref  engine.Engine

	mu    sync.Mutex
	calls [][]int // per Forward call, the number of tokens of each sequence
}

// KVPages passes the wrapped engine's page pool on.
func (e *countingEngine) KVPages() engine.PageStats { return e.Engine.(engine.Paged).KVPages() }

// forwardCalls returns the calls recorded so far.
func (e *countingEngine) forwardCalls() [][]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([][]int(nil), e.calls...)
}

type countedCache struct {
	engine.Cache
	e *countingEngine
}

func (e *countingEngine) NewCache(n int) (engine.Cache, error) {
	c, err := e.Engine.NewCache(n)
	if err != nil {
		return nil, err
	}
	e.live.Add(1)
	return &countedCache{c, e}, nil
}

func (c *countedCache) Free() error {
	c.e.live.Add(-1)
	return c.Cache.Free()
}

func (e *countingEngine) Forward(cs []engine.Cache, toks [][]int, all bool) ([][]float32, *engine.Stats, error) {
	inner := make([]engine.Cache, len(cs))
	lens := make([]int, len(cs))
	for i, c := range cs {
		inner[i] = c.(*countedCache).Cache
		lens[i] = len(toks[i])
	}
	e.mu.Lock()
	e.calls = append(e.calls, lens)
	e.mu.Unlock()
	return e.Engine.Forward(inner, toks, all)
}

// tinyEngine returns the CPU engine of a small random sparse model (128
// positions) with the Llama-2 tokenizer. The MLP path is fixed and the
// weights are float32 in every pass, so a row's numbers depend on the
// batch by rounding only (docs/serve.md, "Not there yet").
func tinyEngine(t testing.TB) (*countingEngine, *tokenizer.Tokenizer) {
	return tinyPagedEngine(t, 0, 0)
}

// tinyPagedEngine is tinyEngine with KV pages of pageSize positions (0:
// the default) and a budget of pages pages (0: none).
func tinyPagedEngine(t testing.TB, pageSize, pages int) (*countingEngine, *tokenizer.Tokenizer) {
	t.Helper()
	m, tok := enginetest.TinyModel(t, 128)
	o := cpullm.Options{MLPPath: mlp.Sparse, KVPageSize: pageSize}
	if pages > 0 {
		ps := pageSize
		if ps == 0 {
			ps = cpullm.DefaultPageSize(m.Config)
		}
		o.KVMemory = int64(pages) * cpullm.PageBytes(m.Config, ps)
	}
	e, err := cpullm.New(m, o)
	if err != nil {
		t.Fatal(err)
	}
	ref, err := cpullm.New(m, cpullm.Options{MLPPath: mlp.Sparse})
	if err != nil {
		t.Fatal(err)
	}
	return &countingEngine{Engine: e, ref: ref}, tok
}

// newTestServer starts a server over a tiny engine behind httptest.
func newTestServer(t *testing.T, o Options) (*Server, *httptest.Server, *countingEngine) {
	t.Helper()
	return newPagedTestServer(t, o, 0, 0)
}

// newPagedTestServer is newTestServer over tinyPagedEngine.
func newPagedTestServer(t *testing.T, o Options, pageSize, pages int) (*Server, *httptest.Server, *countingEngine) {
	t.Helper()
	e, tok := tinyPagedEngine(t, pageSize, pages)
	s, hs := serveOn(t, e, tok, o)
	return s, hs, e
}

// serveOn starts a server over e behind httptest, shut down at the end of
// the test.
func serveOn(t *testing.T, e engine.Engine, tok *tokenizer.Tokenizer, o Options) (*Server, *httptest.Server) {
	t.Helper()
	s, err := New(e, tok, o)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(s.Handler())
	t.Cleanup(func() {
		hs.Close()
		done := make(chan struct{})
		close(done)
		s.Shutdown(done)
	})
	return s, hs
}

// post sends body as JSON and returns the status and the decoded answer.
func post(t *testing.T, url string, body any) (int, map[string]any) {
	t.Helper()
	var b []byte
	if s, ok := body.(string); ok {
		b = []byte(s)
	} else {
		b, _ = json.Marshal(body)
	}
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	raw, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("answer %q: %v", raw, err)
	}
	return resp.StatusCode, out
}

// events reads a server-sent event stream into its JSON objects; done
// reports the final [DONE].
func events(t *testing.T, url string, body any) (objs []map[string]any, done bool) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		raw, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d %s: %s", resp.StatusCode, resp.Header.Get("Content-Type"), raw)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("line %q is not an event", line)
		}
		if data == "[DONE]" {
			done = true
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(data), &m); err != nil {
			t.Fatalf("event %q: %v", data, err)
		}
		objs = append(objs, m)
	}
	return objs, done
}

// direct generates greedily from text on a fresh engine call sequence.
func direct(t *testing.T, s *Server, text string, maxTokens int) *generate.Result {
	t.Helper()
	ids, err := s.tok.Encode(text, true)
	if err != nil {
		t.Fatal(err)
	}
	o := generate.Options{MaxTokens: maxTokens, Context: s.o.Context, Sample: sample.Greedy(), EOS: s.eos, Vocab: s.vocab}
	var res *generate.Result
	s.onEngine(t, func(e engine.Engine) {
		res, err = generate.Run(e, s.tok, ids, o, nil)
	})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// onEngine runs f with the reference engine: the same model and options as
// the server's engine, driven by the test goroutine alone.
func (s *Server) onEngine(t *testing.T, f func(engine.Engine)) {
	t.Helper()
	switch e := s.e.(type) {
	case *countingEngine:
		f(e.ref)
	case *pickingEngine:
		f(e.ref)
	default:
		t.Fatalf("no reference engine beside a %T", s.e)
	}
}

func choice(t *testing.T, m map[string]any) map[string]any {
	t.Helper()
	cs, ok := m["choices"].([]any)
	if !ok || len(cs) == 0 {
		t.Fatalf("no choices in %v", m)
	}
	return cs[0].(map[string]any)
}

func TestCompletion(t *testing.T) {
	s, hs, e := newTestServer(t, DefaultOptions())
	want := direct(t, s, "Once upon a time", 10)
	code, out := post(t, hs.URL+"/v1/completions", map[string]any{"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0})
	if code != 200 {
		t.Fatalf("status %d: %v", code, out)
	}
	c := choice(t, out)
	if c["text"] != want.Text || c["finish_reason"] != "length" {
		t.Errorf("text %q finish %v; want %q length", c["text"], c["finish_reason"], want.Text)
	}
	u := out["usage"].(map[string]any)
	if int(u["prompt_tokens"].(float64)) != len(want.PromptTokens) || u["completion_tokens"].(float64) != 10 || u["total_tokens"].(float64) != float64(10+len(want.PromptTokens)) {
		t.Errorf("usage %v", u)
	}
	if out["object"] != "text_completion" || c["logprobs"] != nil {
		t.Errorf("object %v logprobs %v", out["object"], c["logprobs"])
	}
	waitIdle(t, s, e)
}

func TestCompletionStream(t *testing.T) {
	s, hs, e := newTestServer(t, DefaultOptions())
	want := direct(t, s, "The cat", 12)
	objs, done := events(t, hs.URL+"/v1/completions", map[string]any{"prompt": "The cat", "max_tokens": 12, "temperature": 0,
		"stream": true, "stream_options": map[string]any{"include_usage": true}})
	if !done || len(objs) < 3 {
		t.Fatalf("%d events, done %v", len(objs), done)
	}
	var text strings.Builder
	for _, o := range objs[:len(objs)-2] {
		text.WriteString(choice(t, o)["text"].(string))
	}
	if text.String() != want.Text {
		t.Errorf("streamed %q, want %q", text.String(), want.Text)
	}
	if fr := choice(t, objs[len(objs)-2])["finish_reason"]; fr != "length" {
		t.Errorf("finish reason %v", fr)
	}
	if u := objs[len(objs)-1]["usage"].(map[string]any); u["completion_tokens"].(float64) != 12 {
		t.Errorf("usage %v", u)
	}
	waitIdle(t, s, e)
}

func TestChat(t *testing.T) {
	s, hs, e := newTestServer(t, DefaultOptions())
	msgs := []map[string]any{{"role": "system", "content": "Be brief."}, {"role": "user", "content": []map[string]any{{"type": "text", "text": "Hello"}}}}
	want := direct(t, s, "system: Be brief.\nuser: Hello\nassistant:", 9)
	code, out := post(t, hs.URL+"/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": 9, "temperature": 0})
	if code != 200 {
		t.Fatalf("status %d: %v", code, out)
	}
	m := choice(t, out)["message"].(map[string]any)
	if m["role"] != "assistant" || m["content"] != want.Text || out["object"] != "chat.completion" {
		t.Errorf("got %v, want content %q", out, want.Text)
	}
	objs, done := events(t, hs.URL+"/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": 9, "temperature": 0, "stream": true})
	if !done || len(objs) < 2 {
		t.Fatalf("%d events, done %v", len(objs), done)
	}
	var text strings.Builder
	for i, o := range objs {
		d := choice(t, o)["delta"].(map[string]any)
		if i == 0 && d["role"] != "assistant" {
			t.Errorf("first delta %v", d)
		}
		if c, ok := d["content"].(string); ok {
			text.WriteString(c)
		}
		if o["object"] != "chat.completion.chunk" {
			t.Errorf("object %v", o["object"])
		}
	}
	if text.String() != want.Text || choice(t, objs[len(objs)-1])["finish_reason"] != "length" {
		t.Errorf("streamed %q (last %v), want %q", text.String(), objs[len(objs)-1], want.Text)
	}
	waitIdle(t, s, e)
}

// TestEchoLogprobs: echo with logprobs and max_tokens 0 (the requests of
// lm-evaluation-harness's local-completions model) returns each prompt
// token's log-probability, equal to a float64 log-softmax of one direct
// all-logits pass.
// With a prefill budget of 3 tokens the prompts are fed in chunks over
// several steps, in caches of 4-position pages, with the same answers.
func TestEchoLogprobs(t *testing.T) {
	t.Run("whole", func(t *testing.T) { testEchoLogprobs(t, DefaultOptions(), 0) })
	o := DefaultOptions()
	o.PrefillTokens = 3
	t.Run("chunked", func(t *testing.T) { testEchoLogprobs(t, o, 4) })
}

func testEchoLogprobs(t *testing.T, o Options, pageSize int) {
	pages := 0
	if pageSize > 0 {
		pages = 64
	}
	s, hs, e := newPagedTestServer(t, o, pageSize, pages)
	prompts := [][]int{{1, 450, 4996, 17354, 1701, 29916, 432, 17204}, {1, 9038, 2501, 263, 931}}
	for _, maxTokens := range []int{0, 1} {
		code, out := post(t, hs.URL+"/v1/completions", map[string]any{"prompt": prompts, "echo": true, "logprobs": 1,
			"max_tokens": maxTokens, "temperature": 0, "seed": 1234})
		if code != 200 {
			t.Fatalf("status %d: %v", code, out)
		}
		cs := out["choices"].([]any)
		if len(cs) != len(prompts) {
			t.Fatalf("%d choices for %d prompts", len(cs), len(prompts))
		}
		for i, p := range prompts {
			var logits [][]float32
			s.onEngine(t, func(e engine.Engine) {
				c, _ := e.NewCache(len(p))
				defer c.Free()
				l, _, err := e.Forward([]engine.Cache{c}, [][]int{p}, true)
				if err != nil {
					t.Fatal(err)
				}
				for _, row := range l {
					logits = append(logits, append([]float32(nil), row...))
				}
			})
			c := cs[i].(map[string]any)
			if int(c["index"].(float64)) != i {
				t.Errorf("choice %d has index %v", i, c["index"])
			}
			lp := c["logprobs"].(map[string]any)
			tl := lp["token_logprobs"].([]any)
			top := lp["top_logprobs"].([]any)
			if len(tl) != len(p)+maxTokens || len(lp["tokens"].([]any)) != len(tl) || len(lp["text_offset"].([]any)) != len(tl) || len(top) != len(tl) {
				t.Fatalf("prompt %d: %d logprobs for %d+%d tokens: %v", i, len(tl), len(p), maxTokens, lp)
			}
			if tl[0] != nil || top[0] != nil {
				t.Errorf("first token: logprob %v top %v; want null", tl[0], top[0])
			}
			for k := 1; k < len(p); k++ {
				want := logSoftmax(logits[k-1], p[k])
				if got := tl[k].(float64); math.Abs(got-want) > 1e-4 {
					t.Errorf("prompt %d token %d: logprob %g, want %g", i, k, got, want)
				}
				best := logSoftmax(logits[k-1], argmax(logits[k-1]))
				m := top[k].(map[string]any)
				if len(m) != 1 {
					t.Errorf("top_logprobs %v: want 1 entry", m)
				}
				for _, v := range m {
					if math.Abs(v.(float64)-best) > 1e-4 {
						t.Errorf("prompt %d token %d: top logprob %v, want %g", i, k, v, best)
					}
				}
			}
			if maxTokens == 1 {
				want := logSoftmax(logits[len(p)-1], argmax(logits[len(p)-1]))
				if got := tl[len(p)].(float64); math.Abs(got-want) > 1e-4 {
					t.Errorf("generated token: logprob %g, want %g", got, want)
				}
			}
		}
	}
	waitIdle(t, s, e)
}

func logSoftmax(row []float32, id int) float64 {
	m := math.Inf(-1)
	for _, v := range row {
		m = max(m, float64(v))
	}
	sum := 0.0
	for _, v := range row {
		sum += math.Exp(float64(v) - m)
	}
	return float64(row[id]) - m - math.Log(sum)
}

func argmax(row []float32) int {
	best := 0
	for i, v := range row {
		if v > row[best] {
			best = i
		}
	}
	return best
}

// TestGreedyIndependentOfBatch: a greedy request gives the same text alone
// and beside other requests of different lengths in the running batch.
func TestGreedyIndependentOfBatch(t *testing.T) {
	s, hs, e := newTestServer(t, DefaultOptions())
	prompts := []string{"Once upon a time", "The", "A long time ago in a galaxy far, far away", "Hello world", "1 2 3 4 5 6"}
	alone := make([]string, len(prompts))
	for i, p := range prompts {
		alone[i] = direct(t, s, p, 20).Text
	}
	// Steps are slowed so that the requests overlap in the batch.
	var maxRunning atomic.Int64
	s.stepHook = func() {
		maxRunning.Store(max(maxRunning.Load(), s.metrics.running.Load()))
		time.Sleep(time.Millisecond)
	}
	got := make([]string, len(prompts))
	var wg sync.WaitGroup
	for i, p := range prompts {
		wg.Go(func() {
			time.Sleep(time.Duration(i) * 3 * time.Millisecond)
			code, out := post(t, hs.URL+"/v1/completions", map[string]any{"prompt": p, "max_tokens": 20, "temperature": 0})
			if code != 200 {
				t.Errorf("status %d: %v", code, out)
				return
			}
			got[i] = choice(t, out)["text"].(string)
		})
	}
	wg.Wait()
	for i := range prompts {
		if got[i] != alone[i] {
			t.Errorf("prompt %q: %q in a batch, %q alone", prompts[i], got[i], alone[i])
		}
	}
	if maxRunning.Load() < 2 {
		t.Errorf("at most %d requests ran together; the test wants a batch", maxRunning.Load())
	}
	waitIdle(t, s, e)
}

// waitIdle waits until no request runs or waits and every cache is freed.
func waitIdle(t *testing.T, s *Server, e *countingEngine) {
	t.Helper()
	for range 500 {
		if r, q := s.Load(); r == 0 && q == 0 && e.live.Load() == 0 {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	r, q := s.Load()
	t.Fatalf("not idle: %d running, %d queued, %d live caches", r, q, e.live.Load())
}

func TestErrors(t *testing.T) {
	s, hs, e := newTestServer(t, DefaultOptions())
	long := strings.Repeat("a b ", 80)
	cases := []struct {
		path  string
		body  any
		code  int
		param string
		want  string
	}{
		{"/v1/completions", `{"prompt": "x",`, 400, "", "malformed JSON"},
		{"/v1/completions", `[1, 2]`, 400, "", "JSON object"},
		{"/v1/completions", `{"prompt": "x", "max_tokens": "ten"}`, 400, "max_tokens", "max_tokens"},
		{"/v1/completions", `{"prompt": "x", "temperature": "hot"}`, 400, "temperature", "temperature"},
		{"/v1/completions", `{"prompt": 7}`, 400, "prompt", "prompt"},
		{"/v1/completions", `{"prompt": "x", "stop": 3}`, 400, "stop", "stop"},
		{"/v1/completions", `{"prompt": "x", "n": 2}`, 400, "n", "n = 1"},
		{"/v1/completions", `{"prompt": "x", "temperature": -1}`, 400, "temperature", "temperature"},
		{"/v1/completions", `{"prompt": "x", "max_tokens": 5000}`, 400, "max_tokens", "-max-tokens"},
		{"/v1/completions", `{"prompt": [1, 99999999]}`, 400, "prompt", "vocabulary"},
		{"/v1/completions", `{"prompt": "` + long + `"}`, 400, "prompt", "at most 127 tokens"},
		{"/v1/completions", `{"prompt": "x", "logprobs": 99}`, 400, "logprobs", "logprobs"},
		{"/v1/chat/completions", `{"messages": []}`, 400, "messages", "messages"},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": 5}]}`, 400, "messages", "content"},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "hi"}], "n": 3}`, 400, "n", "n = 1"},
		{"/v1/nothing", `{}`, 404, "", "no route"},
	}
	for _, c := range cases {
		code, out := post(t, hs.URL+c.path, c.body)
		eo, _ := out["error"].(map[string]any)
		msg, _ := eo["message"].(string)
		param, _ := eo["param"].(string)
		if code != c.code || param != c.param || !strings.Contains(msg, c.want) {
			t.Errorf("%s %v: %d %v; want %d param %q mentioning %q", c.path, c.body, code, out, c.code, c.param, c.want)
		}
	}
	waitIdle(t, s, e)
}

// TestQueueFull: with one running request and a full queue, the next
// request is answered 429 with an OpenAI-style error.
func TestQueueFull(t *testing.T) {
	o := DefaultOptions()
	o.MaxConcurrent, o.MaxQueue = 1, 1
	s, hs, e := newTestServer(t, o)
	release := make(chan struct{})
	unblock := sync.OnceFunc(func() { close(release) })
	defer unblock()
	s.stepHook = func() { <-release }
	body := map[string]any{"prompt": "x", "max_tokens": 3, "temperature": 0}
	codes := make(chan int, 2)
	// The first request must be running before the second is sent: while
	// it still waits in the queue (of one), the second would be refused.
	for _, want := range [][2]int{{1, 0}, {1, 1}} {
		go func() { c, _ := post(t, hs.URL+"/v1/completions", body); codes <- c }()
		if r, q, ok := waitLoad(s, func(r, q int) bool { return r == want[0] && q == want[1] }); !ok {
			t.Fatalf("%d running, %d queued after 30 s; want %d and %d", r, q, want[0], want[1])
		}
	}
	code, out := post(t, hs.URL+"/v1/completions", body)
	eo, _ := out["error"].(map[string]any)
	if code != 429 || eo["type"] != "rate_limit_error" || !strings.Contains(eo["message"].(string), "-max-queue") {
		t.Errorf("got %d %v; want 429", code, out)
	}
	unblock()
	for range 2 {
		if c := <-codes; c != 200 {
			t.Errorf("a waiting request got %d", c)
		}
	}
	waitIdle(t, s, e)
}

// TestDisconnectFreesCache: a client that goes away mid-stream leaves the
// batch and its cache is freed.
func TestDisconnectFreesCache(t *testing.T) {
	s, hs, e := newTestServer(t, DefaultOptions())
	s.stepHook = func() { time.Sleep(2 * time.Millisecond) }
	ctx, cancel := context.WithCancel(context.Background())
	b, _ := json.Marshal(map[string]any{"prompt": "x", "max_tokens": 100, "temperature": 0, "stream": true})
	req, _ := http.NewRequestWithContext(ctx, "POST", hs.URL+"/v1/completions", bytes.NewReader(b))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first line %q: %v", line, err)
	}
	if n := e.live.Load(); n != 1 {
		t.Errorf("%d live caches during the stream; want 1", n)
	}
	cancel()
	resp.Body.Close()
	waitIdle(t, s, e)
}

// TestSlowClientCancelled: a stream whose reader does not keep up is
// cancelled by the batcher instead of stalling it, and its cache freed.
func TestSlowClientCancelled(t *testing.T) {
	s, _, e := newTestServer(t, DefaultOptions())
	ids, _ := s.tok.Encode("x", true)
	o := generate.Options{MaxTokens: 50, Context: s.o.Context, Sample: sample.Greedy(), Vocab: s.vocab}
	j := &job{ctx: context.Background(), prompt: ids, opts: o, topN: -1, out: make(chan piece), done: make(chan struct{})}
	if err := s.enqueue([]*job{j}); err != nil {
		t.Fatal(err)
	}
	<-j.done
	if j.err != errTooSlow {
		t.Errorf("error %v; want %v", j.err, errTooSlow)
	}
	waitIdle(t, s, e)
}

func TestModelsHealthMetrics(t *testing.T) {
	s, hs, e := newPagedTestServer(t, DefaultOptions(), 16, 20)
	post(t, hs.URL+"/v1/completions", map[string]any{"prompt": "hi", "max_tokens": 2, "temperature": 0})
	post(t, hs.URL+"/v1/completions", map[string]any{"prompt": "hi", "n": 2})
	get := func(path string) string {
		resp, err := http.Get(hs.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 {
			t.Errorf("%s: %d %s", path, resp.StatusCode, b)
		}
		return string(b)
	}
	if m := get("/v1/models"); !strings.Contains(m, `"id":"twell"`) {
		t.Errorf("models: %s", m)
	}
	if h := get("/health"); !strings.Contains(h, `"ok"`) {
		t.Errorf("health: %s", h)
	}
	// A response may reach the client a moment before the batcher drops its
	// job from the running batch; the gauges are read once it has.
	waitIdle(t, s, e)
	m := get("/metrics")
	for _, want := range []string{
		`twell_requests_total{endpoint="/v1/completions",status="200"} 1`,
		`twell_requests_total{endpoint="/v1/completions",status="400"} 1`,
		"twell_requests_running 0", "twell_requests_queued 0", "twell_generated_tokens_total 2",
		`twell_mlp_active_units{layer="1"} `,
		"twell_kv_pages_used 0", "twell_kv_pages_idle 1", "twell_kv_pages_total 20", "twell_kv_page_positions 16", "twell_preemptions_total 0",
		// one request of two tokens: one first token, one gap between tokens
		"# TYPE twell_time_to_first_token_seconds histogram", `twell_time_to_first_token_seconds_bucket{le="+Inf"} 1`,
		"twell_time_to_first_token_seconds_count 1",
		"# TYPE twell_inter_token_latency_seconds histogram", `twell_inter_token_latency_seconds_bucket{le="+Inf"} 1`,
		"twell_inter_token_latency_seconds_count 1",
		"# TYPE twell_e2e_request_latency_seconds histogram", `twell_e2e_request_latency_seconds_bucket{le="+Inf"} 1`,
		"twell_e2e_request_latency_seconds_count 1",
	} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %q:\n%s", want, m)
		}
	}
	checkHistograms(t, m)
	if strings.Contains(m, `layer="0"} NaN`) {
		t.Errorf("layer 0 not measured:\n%s", m)
	}
}

// TestShutdown: running requests finish before the batcher stops; after
// the timeout the rest are cancelled.
func TestShutdown(t *testing.T) {
	for _, wait := range []bool{true, false} {
		t.Run(fmt.Sprint("wait=", wait), func(t *testing.T) {
			e, tok := tinyEngine(t)
			s, err := New(e, tok, DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			hs := httptest.NewServer(s.Handler())
			defer hs.Close()
			started := make(chan struct{})
			var once sync.Once
			s.stepHook = func() { once.Do(func() { close(started) }); time.Sleep(time.Millisecond) }
			type res struct {
				code int
				out  map[string]any
			}
			got := make(chan res, 1)
			go func() {
				c, o := post(t, hs.URL+"/v1/completions", map[string]any{"prompt": "x", "max_tokens": 40, "temperature": 0})
				got <- res{c, o}
			}()
			<-started
			done := make(chan struct{})
			if !wait {
				close(done)
			}
			if err := s.Shutdown(done); err != nil {
				t.Fatal(err)
			}
			r := <-got
			if wait && (r.code != 200 || choice(t, r.out)["finish_reason"] != "length") {
				t.Errorf("drained request: %d %v", r.code, r.out)
			}
			if !wait && r.code != 503 {
				t.Errorf("cancelled request: %d %v; want 503", r.code, r.out)
			}
			if e.live.Load() != 0 {
				t.Errorf("%d live caches after shutdown", e.live.Load())
			}
			if c, _ := post(t, hs.URL+"/v1/completions", map[string]any{"prompt": "x"}); c != 503 {
				t.Errorf("a request after shutdown got %d; want 503", c)
			}
		})
	}
}

// checkHistograms checks every histogram in a /metrics page: bucket bounds
// rising to +Inf, cumulative counts that never fall, the +Inf count equal
// to _count, and a non-negative _sum that is positive when _count is.
func checkHistograms(t *testing.T, page string) {
	t.Helper()
	type hist struct {
		les    []float64
		counts []int64
		sum    float64
		count  int64
		seen   int
	}
	hs := map[string]*hist{}
	get := func(name string) *hist {
		if hs[name] == nil {
			hs[name] = &hist{}
		}
		return hs[name]
	}
	for _, line := range strings.Split(page, "\n") {
		if !strings.HasPrefix(line, "# TYPE ") || !strings.HasSuffix(line, " histogram") {
			continue
		}
		get(strings.Fields(line)[2])
	}
	if len(hs) != 3 {
		t.Errorf("%d histograms, want 3 (time to first token, inter-token, end-to-end)", len(hs))
	}
	for _, line := range strings.Split(page, "\n") {
		f := strings.Fields(line)
		if len(f) != 2 || strings.HasPrefix(line, "#") {
			continue
		}
		for name, h := range hs {
			switch {
			case strings.HasPrefix(f[0], name+"_bucket{le=\""):
				le, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimPrefix(f[0], name+"_bucket{le=\""), "\"}"), 64)
				n, err2 := strconv.ParseInt(f[1], 10, 64)
				if err != nil || err2 != nil {
					t.Errorf("line %q: %v %v", line, err, err2)
				}
				h.les, h.counts = append(h.les, le), append(h.counts, n)
			case f[0] == name+"_sum":
				h.sum, _ = strconv.ParseFloat(f[1], 64)
				h.seen++
			case f[0] == name+"_count":
				h.count, _ = strconv.ParseInt(f[1], 10, 64)
				h.seen++
			}
		}
	}
	for name, h := range hs {
		if len(h.les) < 2 || h.seen != 2 || !math.IsInf(h.les[len(h.les)-1], 1) {
			t.Errorf("%s: %d buckets, last le %v, sum and count lines %d", name, len(h.les), h.les, h.seen)
			continue
		}
		for i := 1; i < len(h.les); i++ {
			if h.les[i] <= h.les[i-1] || h.counts[i] < h.counts[i-1] {
				t.Errorf("%s: bucket %d: le %g count %d after le %g count %d", name, i, h.les[i], h.counts[i], h.les[i-1], h.counts[i-1])
			}
		}
		if h.counts[len(h.counts)-1] != h.count || h.sum < 0 || h.count > 0 && h.sum <= 0 {
			t.Errorf("%s: +Inf bucket %d, count %d, sum %g", name, h.counts[len(h.counts)-1], h.count, h.sum)
		}
	}
}
