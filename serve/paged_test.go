package serve

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// gateFirstStep holds the batcher's first step until n requests are
// running or waiting, so that they all meet in the batch (for at most 30
// s: a request that never comes then fails the test's checks, not its
// time limit).
func gateFirstStep(s *Server, n int) {
	var once sync.Once
	s.stepHook = func() { once.Do(func() { waitLoad(s, atLeast(n)) }) }
}

// waitLoad waits until ok holds for the server's running and waiting
// requests, for at most 30 s, and returns the last counts and whether ok
// held.
func waitLoad(s *Server, ok func(running, queued int) bool) (int, int, bool) {
	deadline := time.Now().Add(30 * time.Second)
	for {
		r, q := s.Load()
		if ok(r, q) {
			return r, q, true
		}
		if time.Now().After(deadline) {
			return r, q, false
		}
		time.Sleep(time.Millisecond)
	}
}

// atLeast holds when at least n requests are running or waiting.
func atLeast(n int) func(int, int) bool { return func(r, q int) bool { return r+q >= n } }

// TestPreemptionKeepsGreedyOutputs: with too few KV pages for the requests
// running together, the newest are preempted and fed again later; every
// request still gets the greedy text it gets alone, prompts fed in chunks
// of 8 tokens both ways, and all pages come back.
func TestPreemptionKeepsGreedyOutputs(t *testing.T) {
	o := DefaultOptions()
	o.PrefillTokens = 8
	// 30 pages of 4 positions: each request fits alone (prompt + 39
	// generated positions), five together do not.
	s, hs, e := newPagedTestServer(t, o, 4, 30)
	prompts := []string{
		"Once upon a time there was a little girl who lived in a village near the forest.",
		"The",
		"A long time ago in a galaxy far, far away",
		"Hello world",
		"1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
	}
	const maxTokens = 40
	ask := func(p string) string {
		code, out := post(t, hs.URL+"/v1/completions", map[string]any{"prompt": p, "max_tokens": maxTokens, "temperature": 0})
		if code != 200 {
			t.Errorf("prompt %q: status %d: %v", p, code, out)
			return ""
		}
		c := choice(t, out)
		if c["finish_reason"] != "length" {
			t.Errorf("prompt %q: finish reason %v", p, c["finish_reason"])
		}
		return c["text"].(string)
	}
	alone := make([]string, len(prompts))
	for i, p := range prompts {
		alone[i] = ask(p)
	}
	if n := s.metrics.preemptions.Load(); n != 0 {
		t.Fatalf("%d preemptions with one request at a time", n)
	}
	gateFirstStep(s, len(prompts))
	got := make([]string, len(prompts))
	var wg sync.WaitGroup
	for i, p := range prompts {
		wg.Go(func() { got[i] = ask(p) })
	}
	wg.Wait()
	for i := range prompts {
		if got[i] != alone[i] {
			t.Errorf("prompt %q: %q beside the others, %q alone", prompts[i], got[i], alone[i])
		}
	}
	if s.metrics.preemptions.Load() == 0 {
		t.Error("no request was preempted; the test wants the pages to run out")
	}
	waitIdle(t, s, e)
	if ps := s.pageStats(); ps.InUse != 0 || ps.InUse+ps.Idle > ps.Total {
		t.Errorf("once idle: %d pages in use, %d idle, budget %d", ps.InUse, ps.Idle, ps.Total)
	}
}

// TestPrefillChunksInterleave: a long prompt is fed in chunks of at most
// -prefill-tokens tokens, and each step that feeds one also carries the
// next token of the stream already running.
func TestPrefillChunksInterleave(t *testing.T) {
	o := DefaultOptions()
	o.PrefillTokens = 8
	s, hs, e := newTestServer(t, o)
	// After its first step the running stream waits for the long prompt to
	// arrive: on a busy machine it could otherwise finish its 100 tokens
	// before that prompt's chunks go in.
	var steps atomic.Int32
	var arrived atomic.Bool
	s.stepHook = func() {
		if steps.Add(1) == 1 || arrived.Load() {
			return
		}
		waitLoad(s, atLeast(2))
		arrived.Store(true)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, _ := json.Marshal(map[string]any{"prompt": "x", "max_tokens": 100, "temperature": 0, "stream": true})
	req, _ := http.NewRequestWithContext(ctx, "POST", hs.URL+"/v1/completions", bytes.NewReader(b))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first line %q: %v", line, err)
	}
	long := strings.Repeat("the quick brown fox jumps over the lazy dog ", 6)
	ids, _ := s.tok.Encode(long, true)
	if len(ids) < 3*o.PrefillTokens || len(ids) > 100 {
		t.Fatalf("the long prompt has %d tokens", len(ids))
	}
	before := len(e.forwardCalls())
	if code, out := post(t, hs.URL+"/v1/completions", map[string]any{"prompt": long, "max_tokens": 1, "temperature": 0}); code != 200 {
		t.Fatalf("status %d: %v", code, out)
	}
	chunks, fed := 0, 0
	for _, call := range e.forwardCalls()[before:] {
		var prefill, decode int
		for _, n := range call {
			if n > 1 {
				prefill++
				fed += n
			} else {
				decode++
			}
			if n > o.PrefillTokens {
				t.Errorf("a step fed %d tokens of one prompt; the budget is %d", n, o.PrefillTokens)
			}
		}
		if prefill > 0 {
			chunks++
			if decode == 0 {
				t.Errorf("step %v fed a chunk of prompt without the running stream's token", call)
			}
		}
	}
	if chunks < 3 || fed < len(ids)-1 {
		t.Errorf("the %d-token prompt went in %d chunks (%d tokens); want it cut by %d", len(ids), chunks, fed, o.PrefillTokens)
	}
	cancel()
	waitIdle(t, s, e)
}

// TestRequestLargerThanPool: a request whose prompt and max_tokens would
// take more KV pages than the whole budget is refused up front (400), and
// one that fits is served.
func TestRequestLargerThanPool(t *testing.T) {
	s, hs, e := newPagedTestServer(t, DefaultOptions(), 4, 10) // 40 positions
	code, out := post(t, hs.URL+"/v1/completions", map[string]any{"prompt": "Hello world", "max_tokens": 60})
	eo, _ := out["error"].(map[string]any)
	if code != 400 || eo["param"] != "max_tokens" || !strings.Contains(eo["message"].(string), "KV memory holds 40") {
		t.Errorf("got %d %v; want 400 naming the KV memory", code, out)
	}
	if code, out := post(t, hs.URL+"/v1/completions", map[string]any{"prompt": "Hello world", "max_tokens": 20, "temperature": 0}); code != 200 {
		t.Errorf("a request that fits: %d %v", code, out)
	}
	waitIdle(t, s, e)
}

// TestPrefillTokensChecked: the prefill budget's range is enforced.
func TestPrefillTokensChecked(t *testing.T) {
	for _, n := range []int{0, -1, 1<<20 + 1} {
		o := DefaultOptions()
		o.PrefillTokens = n
		if err := o.Validate(); err == nil || !strings.Contains(err.Error(), "-prefill-tokens") {
			t.Errorf("PrefillTokens %d: %v", n, err)
		}
	}
}
