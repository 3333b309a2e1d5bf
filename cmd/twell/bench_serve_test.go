package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/twell-ai/twell/bench"
)

// TestBenchServeInProcess runs bench serve on the tiny random model in
// this process with a few requests, and checks the report: every request
// done, the tokens asked, throughputs and latency summaries that are
// positive and ordered, the JSON and the PNG written.
func TestBenchServeInProcess(t *testing.T) {
	dir := t.TempDir()
	jsonPath, plotPath := filepath.Join(dir, "serve.json"), filepath.Join(dir, "serve.png")
	const n, maxTokens = 5, 6
	var out, errb bytes.Buffer
	code := run([]string{"bench", "serve", "-device", "cpu", "-requests", "5", "-max-tokens", "6", "-ignore-eos", "-concurrency", "3",
		"-prompt-words", "12", "-max-concurrent", "2", "-prefill-tokens", "16", "-kv-memory", "256KiB", "-warmup", "4", "-json", jsonPath, "-plot", plotPath,
		"-temperature", "0.7", "-top-p", "0.9", "-top-k", "20"},
		&out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	for _, want := range []string{"request throughput:", "output throughput:", "time to first token", "inter-token latency", "time per output token",
		"warm-up:             4 requests before, not counted", "max_tokens 6, temperature 0.7, top_p 0.9, top_k 20)"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, out.String())
		}
	}
	r := readServeResult(t, jsonPath)
	switch {
	case r.Schema != bench.ServeSchema || r.Device != "cpu" || !strings.Contains(r.Server, "tiny-random") || !strings.Contains(r.Server, "KV cache"):
		t.Errorf("header %+v", r.Row)
	case r.Temperature != 0.7 || r.TopP != 0.9 || r.TopK != 20:
		t.Errorf("sampling recorded as temperature %g, top_p %g, top_k %d", r.Temperature, r.TopP, r.TopK)
	case r.Requests != n || r.Completed != n || r.Failed != 0 || len(r.PerRequest) != n || r.Concurrency != 3 || r.Warmup != 4:
		t.Errorf("%d requests, %d done, %d failed, %d rows, %d warm-up", r.Requests, r.Completed, r.Failed, len(r.PerRequest), r.Warmup)
	case r.OutputTokens != n*maxTokens || r.InputTokens < n*12:
		t.Errorf("%d output tokens (want %d), %d input tokens (want at least a token a word)", r.OutputTokens, n*maxTokens, r.InputTokens)
	case !(r.DurationS > 0 && r.RequestsPerS > 0 && r.OutputTokPerS > 0 && r.TotalTokPerS > r.OutputTokPerS):
		t.Errorf("duration %g s, %g requests/s, %g tokens/s, %g total tokens/s", r.DurationS, r.RequestsPerS, r.OutputTokPerS, r.TotalTokPerS)
	case r.TTFT.N != n || r.TPOT.N != n || r.E2E.N != n || r.ITL.N < 1 || r.Preemptions < 0:
		t.Errorf("samples: TTFT %d, TPOT %d, E2E %d, ITL %d; preemptions %d", r.TTFT.N, r.TPOT.N, r.E2E.N, r.ITL.N, r.Preemptions)
	}
	for name, d := range map[string]bench.Dist{"ttft": r.TTFT, "tpot": r.TPOT, "itl": r.ITL, "e2e": r.E2E} {
		if !(d.Mean > 0 && d.Median > 0 && d.Median <= d.P90 && d.P90 <= d.P99 && d.P99 <= d.Max) {
			t.Errorf("%s: %+v", name, d)
		}
	}
	if r.TTFT.Max > r.E2E.Max || r.TTFT.Median > r.E2E.Median {
		t.Errorf("time to first token %+v past end-to-end %+v", r.TTFT, r.E2E)
	}
	for i, q := range r.PerRequest {
		if q.Error != "" || q.OutputTokens != maxTokens || q.TTFTMS > q.E2EMS || q.StartS < 0 {
			t.Errorf("request %d: %+v", i, q)
		}
	}
	if st, err := os.Stat(plotPath); err != nil || st.Size() < 1000 {
		t.Errorf("plot: %v", err)
	}
}

func TestBenchServeBadFlags(t *testing.T) {
	txt := filepath.Join(t.TempDir(), "empty")
	if err := os.Mkdir(txt, 0o755); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"-requests", "0"}, 2, "-requests 0"},
		{[]string{"-rate", "-1"}, 2, "-rate -1"},
		{[]string{"-concurrency", "-1"}, 2, "-concurrency -1"},
		{[]string{"-max-tokens", "0"}, 2, "-max-tokens 0"},
		{[]string{"-prompt-words", "0"}, 2, "-prompt-words 0"},
		{[]string{"-url", "localhost"}, 2, "-url"},
		{[]string{"-url", "http://127.0.0.1:1", "-model", "x"}, 2, "-model sets up the in-process server"},
		{[]string{"-prompts", "/nonexistent"}, 1, "nonexistent"},
		{[]string{"-prompts", txt}, 1, "no .txt file"},
		{[]string{"-max-concurrent", "0"}, 2, "-max-concurrent 0"},
		{[]string{"-prefill-tokens", "0"}, 2, "-prefill-tokens 0"},
		{[]string{"-kv-memory", "much"}, 2, "-kv-memory"},
		{[]string{"-device", "tpu"}, 2, "tpu"},
		{[]string{"-model", "/nonexistent"}, 1, "nonexistent"},
		{[]string{"-preset", "gpt-5"}, 2, "-preset \"gpt-5\""},
		{[]string{"-preset", "sparselm-1.5b", "-model", "x"}, 2, "not both"},
		{[]string{"-layers", "2"}, 2, "-layers 2"},
		{[]string{"-preset", "sparselm-1.5b", "-layers", "-1"}, 2, "-layers -1"},
		{[]string{"-url", "http://127.0.0.1:1", "-preset", "sparselm-1.5b"}, 2, "-preset sets up the in-process server"},
		{[]string{"-json", "/nonexistent/x.json"}, 1, "does not exist"},
		{[]string{"-url", "http://127.0.0.1:1", "-requests", "2"}, 1, "all 2 requests failed"},
	}
	for _, c := range cases {
		var out, errb bytes.Buffer
		code := run(append([]string{"bench", "serve"}, c.args...), &out, &errb)
		if code != c.code || !strings.Contains(errb.String(), c.want) || strings.Count(strings.TrimSpace(lastLine(errb.String())), "\n") != 0 {
			t.Errorf("%v: exit %d, stderr %q; want exit %d mentioning %q", c.args, code, errb.String(), c.code, c.want)
		}
	}
}

// lastLine returns the last line of s.
func lastLine(s string) string {
	s = strings.TrimRight(s, "\n")
	return s[strings.LastIndexByte(s, '\n')+1:]
}

// TestBenchServeLeakCheck: clients that hang up mid-stream leave the
// in-process server with nothing running, no KV pages held and no extra
// goroutines.
func TestBenchServeLeakCheck(t *testing.T) {
	jsonPath := filepath.Join(t.TempDir(), "soak.json")
	var out, errb bytes.Buffer
	code := run([]string{"bench", "serve", "-device", "cpu", "-requests", "24", "-max-tokens", "8", "-ignore-eos", "-concurrency", "6",
		"-prompt-words", "10", "-disconnect", "0.5", "-kv-memory", "256KiB", "-json", jsonPath}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	r := readServeResult(t, jsonPath)
	l := r.Leaks
	switch {
	case l == nil:
		t.Fatalf("no leak check in %s", jsonPath)
	case r.Completed+r.Disconnected != 24 || r.Failed != 0:
		t.Errorf("%d completed + %d hung up (want 24 together), %d failed", r.Completed, r.Disconnected, r.Failed)
	case l.RunningAfter != 0 || l.QueuedAfter != 0 || l.KVPagesAfter != l.KVPagesBefore || l.GoroutinesAfter > l.GoroutinesBefore:
		t.Errorf("leak check %+v", *l)
	}
	if !strings.Contains(out.String(), "leak check:") {
		t.Errorf("report lacks the leak check:\n%s", out.String())
	}
}

// readServeResult reads the JSON that bench serve -json wrote.
func readServeResult(t *testing.T, path string) bench.ServeResult {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var r bench.ServeResult
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	return r
}
