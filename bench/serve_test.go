package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twell-ai/twell/internal/testutil"
)

// TestPercentile checks Percentile against its definition on random data:
// the ends are the minimum and maximum, a rank that falls on an element is
// that element, and it rises with p.
func TestPercentile(t *testing.T) {
	r, seed := testutil.Rand(t)
	for range 50 {
		xs := make([]float64, 1+r.IntN(30))
		for i := range xs {
			xs[i] = r.NormFloat64() * 100
		}
		slices.Sort(xs)
		n := len(xs)
		if Percentile(xs, 0) != xs[0] || Percentile(xs, 100) != xs[n-1] {
			t.Fatalf("seed %d: ends of %v: %g, %g", seed, xs, Percentile(xs, 0), Percentile(xs, 100))
		}
		k := r.IntN(n)
		if n > 1 {
			if got := Percentile(xs, 100*float64(k)/float64(n-1)); math.Abs(got-xs[k]) > 1e-9*(1+math.Abs(xs[k])) {
				t.Fatalf("seed %d: rank %d of %d: %g, want %g", seed, k, n, got, xs[k])
			}
		}
		prev := math.Inf(-1)
		for p := 0.0; p <= 100; p += 2.5 {
			v := Percentile(xs, p)
			if v < prev-1e-9 || v < xs[0] || v > xs[n-1] {
				t.Fatalf("seed %d: percentile %g = %g after %g, outside [%g, %g]", seed, p, v, prev, xs[0], xs[n-1])
			}
			prev = v
		}
	}
	if Percentile(nil, 50) != 0 || newDist(nil) != (Dist{}) {
		t.Error("an empty set does not give zeros")
	}
}

// fakeServer streams chunks completions: per request, `chunks` pieces of
// text then a usage chunk; requests whose prompt starts with "fail" get a
// 429. It records the most requests in flight and the bodies it got.
type fakeServer struct {
	chunks         int
	inFlight, peak atomic.Int64
	mu             sync.Mutex
	bodies         []map[string]any
}

func (f *fakeServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/metrics" {
		fmt.Fprintln(w, "# TYPE twell_preemptions_total counter\ntwell_preemptions_total 7")
		return
	}
	n := f.inFlight.Add(1)
	defer f.inFlight.Add(-1)
	for p := f.peak.Load(); n > p && !f.peak.CompareAndSwap(p, n); p = f.peak.Load() {
	}
	var body map[string]any
	json.NewDecoder(r.Body).Decode(&body)
	f.mu.Lock()
	f.bodies = append(f.bodies, body)
	f.mu.Unlock()
	if strings.HasPrefix(body["prompt"].(string), "fail") {
		w.WriteHeader(429)
		fmt.Fprint(w, `{"error": {"message": "busy", "type": "rate_limit_error"}}`)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	rc := http.NewResponseController(w)
	for i := range f.chunks {
		fmt.Fprintf(w, "data: {\"choices\": [{\"text\": \"t%d \"}]}\n\n", i)
		rc.Flush()
	}
	fmt.Fprint(w, "data: {\"choices\": [{\"text\": \"\", \"finish_reason\": \"length\"}]}\n\n")
	fmt.Fprintf(w, "data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 5, \"completion_tokens\": %d}}\n\ndata: [DONE]\n\n", f.chunks)
}

// TestServeCountsAndLimits: against a fake server, every request is sent
// with the options asked, the concurrency limit holds, tokens, chunks and
// failures are counted, and the summaries are ordered (median <= p90 <=
// p99 <= max).
func TestServeCountsAndLimits(t *testing.T) {
	r, seed := testutil.Rand(t)
	f := &fakeServer{chunks: 2 + r.IntN(6)}
	hs := httptest.NewServer(f)
	defer hs.Close()
	n, conc, fails := 10+r.IntN(20), 1+r.IntN(4), r.IntN(3)
	prompts := []string{"alpha beta", "gamma"}
	for range fails {
		prompts = append(prompts, "fail now")
	}
	o := ServeOptions{URL: hs.URL, Model: "m", Prompts: prompts, Requests: n, Concurrency: conc, MaxTokens: 9,
		IgnoreEOS: true, Seed: r.Uint64()}
	if r.IntN(2) == 0 {
		o.Rate = 1000 // fast, so that the test takes no time to speak of
	}
	var calls atomic.Int64
	res, err := Serve(context.Background(), o, func(done, total int) { calls.Add(1) })
	if err != nil {
		t.Fatal(err)
	}
	wantFail := 0
	for i := range n {
		if strings.HasPrefix(prompts[i%len(prompts)], "fail") {
			wantFail++
		}
	}
	ok := n - wantFail
	switch {
	case res.Completed != ok || res.Failed != wantFail || len(res.PerRequest) != n || calls.Load() != int64(n):
		t.Errorf("seed %d: %d completed, %d failed, %d rows, %d progress calls; want %d, %d, %d, %d", seed, res.Completed, res.Failed, len(res.PerRequest), calls.Load(), ok, wantFail, n, n)
	case wantFail > 0 && (len(res.Errors) != 1 || !strings.Contains(res.Errors[0], "HTTP 429: busy")):
		t.Errorf("seed %d: errors %q", seed, res.Errors)
	case res.OutputTokens != ok*f.chunks || res.InputTokens != 5*ok:
		t.Errorf("seed %d: %d output and %d input tokens; want %d and %d", seed, res.OutputTokens, res.InputTokens, ok*f.chunks, 5*ok)
	case res.TTFT.N != ok || res.TPOT.N != ok || res.E2E.N != ok || res.ITL.N != ok*(f.chunks-1) || len(res.ITLSamples()) != res.ITL.N:
		t.Errorf("seed %d: samples TTFT %d, TPOT %d, E2E %d, ITL %d; want %d, %d, %d, %d", seed, res.TTFT.N, res.TPOT.N, res.E2E.N, res.ITL.N, ok, ok, ok, ok*(f.chunks-1))
	case f.peak.Load() > int64(conc):
		t.Errorf("seed %d: %d requests in flight at once; the limit is %d", seed, f.peak.Load(), conc)
	case res.Preemptions != 7:
		t.Errorf("preemptions %d; the server's /metrics says 7", res.Preemptions)
	}
	if ok > 0 && !(res.DurationS > 0 && res.RequestsPerS > 0 && res.OutputTokPerS > 0 && res.TotalTokPerS > res.OutputTokPerS) {
		t.Errorf("seed %d: duration %g s, throughputs %g req/s, %g tok/s, %g total tok/s", seed, res.DurationS, res.RequestsPerS, res.OutputTokPerS, res.TotalTokPerS)
	}
	for name, d := range map[string]Dist{"ttft": res.TTFT, "tpot": res.TPOT, "itl": res.ITL, "e2e": res.E2E} {
		if d.N > 0 && !(d.Median <= d.P90 && d.P90 <= d.P99 && d.P99 <= d.Max && d.Mean <= d.Max && d.Mean > 0) {
			t.Errorf("seed %d: %s %+v out of order", seed, name, d)
		}
	}
	for _, q := range res.PerRequest {
		if q.Error == "" && !(q.TTFTMS <= q.E2EMS && q.TPOTMS > 0 && q.OutputTokens == f.chunks) {
			t.Errorf("seed %d: request %+v", seed, q)
		}
	}
	for _, b := range f.bodies {
		so, _ := b["stream_options"].(map[string]any)
		if b["model"] != "m" || b["max_tokens"] != 9.0 || b["stream"] != true || b["ignore_eos"] != true || so["include_usage"] != true || b["temperature"] != 0.0 {
			t.Errorf("request body %v", b)
		}
	}
}

func TestServeOptionsChecked(t *testing.T) {
	good := ServeOptions{URL: "http://127.0.0.1:1", Prompts: []string{"x"}, Requests: 1, MaxTokens: 1}
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		set  func(*ServeOptions)
		want string
	}{
		{func(o *ServeOptions) { o.URL = "localhost:8080" }, "-url"},
		{func(o *ServeOptions) { o.Requests = 0 }, "-requests 0"},
		{func(o *ServeOptions) { o.Rate = math.NaN() }, "-rate"},
		{func(o *ServeOptions) { o.Rate = math.Inf(1) }, "-rate"},
		{func(o *ServeOptions) { o.Rate = 1e-9 }, "-rate"},
		{func(o *ServeOptions) { o.Concurrency = -2 }, "-concurrency -2"},
		{func(o *ServeOptions) { o.MaxTokens = 0 }, "-max-tokens 0"},
		{func(o *ServeOptions) { o.Temperature = -1 }, "-temperature"},
		{func(o *ServeOptions) { o.Prompts = nil }, "no prompts"},
		{func(o *ServeOptions) { o.Prompts = []string{" "} }, "empty"},
		{func(o *ServeOptions) { o.Warmup = -1 }, "-warmup -1"},
	} {
		o := good
		c.set(&o)
		if err := o.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v; want an error mentioning %q", o, err, c.want)
		}
	}
}

// TestPrompts: prompts start at a paragraph's first word and hold the
// words asked, with white space folded.
func TestPrompts(t *testing.T) {
	r, seed := testutil.Rand(t)
	var texts []string
	var firsts []string
	for range 1 + r.IntN(3) {
		var paras []string
		for range 1 + r.IntN(5) {
			var words []string
			for range 1 + r.IntN(12) {
				w := fmt.Sprintf("w%d", r.IntN(1000))
				words = append(words, w)
			}
			firsts = append(firsts, words[0])
			paras = append(paras, strings.Join(words, []string{" ", "\n", "  \t"}[r.IntN(3)]))
		}
		texts = append(texts, strings.Join(paras, "\n\n"))
	}
	words := 1 + r.IntN(8)
	ps, err := Prompts(texts, 20, words, r.Uint64())
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for _, tx := range texts {
		total += len(strings.Fields(tx))
	}
	for _, p := range ps {
		f := strings.Fields(p)
		if p != strings.Join(f, " ") || len(f) != min(words, total) || !slices.Contains(firsts, f[0]) {
			t.Fatalf("seed %d: prompt %q: want %d words from a paragraph's start, single spaces", seed, p, min(words, total))
		}
	}
	if _, err := Prompts([]string{" \n\n "}, 1, 3, 1); err == nil {
		t.Error("a text of no words gave prompts")
	}
}

// TestPlotServeEdgeCases: the serving figure is drawn for a plain result,
// an empty one, one whose requests all failed, and one with values a log
// axis cannot show.
func TestPlotServeEdgeCases(t *testing.T) {
	r, _ := testutil.Rand(t)
	plain := &ServeResult{Row: testRow, Server: "in-process, tiny model", Requests: 20, Rate: 4, MaxTokens: 16}
	for i := range 20 {
		q := ServeRequest{StartS: float64(i) * 0.25, TTFTMS: 5 + 20*r.Float64(), OutputTokens: 16}
		q.E2EMS = q.TTFTMS + 100*r.Float64()
		q.TPOTMS = (q.E2EMS - q.TTFTMS) / 15
		for range 15 {
			plain.itl = append(plain.itl, 0.5+10*r.ExpFloat64())
		}
		plain.PerRequest = append(plain.PerRequest, q)
	}
	failed := &ServeResult{Row: testRow, Requests: 2, PerRequest: []ServeRequest{{Error: "HTTP 429"}, {Error: "refused"}}}
	odd := &ServeResult{Row: testRow, Requests: 3, PerRequest: []ServeRequest{
		{StartS: 0, TTFTMS: 0, E2EMS: math.NaN(), OutputTokens: 2, TPOTMS: math.Inf(1)},
		{StartS: 1, TTFTMS: 3, E2EMS: 4, OutputTokens: 1},
		{StartS: math.NaN(), TTFTMS: 1, E2EMS: 2, OutputTokens: 3, TPOTMS: 0.5}},
		itl: []float64{0, -1, math.NaN(), 2}}
	for name, res := range map[string]*ServeResult{"plain": plain, "empty": {Row: testRow}, "failed": failed, "odd": odd} {
		path := figurePath(t, "serve-"+name+".png")
		if err := PlotServe(res, path); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		checkPNG(t, path)
	}
	if err := PlotServe(nil, figurePath(t, "nil.png")); err == nil {
		t.Error("a nil result was drawn")
	}
}

// TestServeDisconnectAndDuration: with Disconnect 1 every client hangs up
// mid-stream (counted apart from failures), and Duration stops the arrivals.
func TestServeDisconnectAndDuration(t *testing.T) {
	r, seed := testutil.Rand(t)
	f := &fakeServer{chunks: 4 + r.IntN(8)}
	hs := httptest.NewServer(f)
	defer hs.Close()
	n := 5 + r.IntN(10)
	o := ServeOptions{URL: hs.URL, Model: "m", Prompts: []string{"a b"}, Requests: n, Concurrency: 2, MaxTokens: 2 * f.chunks,
		Seed: r.Uint64(), Disconnect: 1}
	res, err := Serve(context.Background(), o, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.Disconnected != n || res.Completed != 0 || res.Failed != 0 || res.E2E.N != 0 {
		t.Errorf("seed %d: %d hung up, %d completed, %d failed, %d latencies; want %d, 0, 0, 0", seed, res.Disconnected, res.Completed, res.Failed, res.E2E.N, n)
	}
	o.Disconnect, o.Requests, o.Rate, o.Duration = 0, 1000, 100, 150*time.Millisecond
	res, err = Serve(context.Background(), o, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.Requests < 1 || res.Requests >= 1000 || len(res.PerRequest) != res.Requests || res.Completed != res.Requests {
		t.Errorf("seed %d: with a 150 ms duration at 100/s: %d requests, %d rows, %d completed", seed, res.Requests, len(res.PerRequest), res.Completed)
	}
}
