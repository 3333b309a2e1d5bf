package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/twell-ai/twell/backend"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/models"
	"github.com/twell-ai/twell/serve"
)

// TestServeRunsAndStops: twell serve answers a completion on a tiny CPU
// model, then stops cleanly (exit 0) when asked to, as on SIGINT.
func TestServeRunsAndStops(t *testing.T) {
	serveOnce(t, []string{"-model", tinyCheckpoint(t)}, "KV cache 512 pages of 8 positions (1 MiB)", "")
}

// TestServeDefaultModel: with no -model, twell serve serves the embedded
// default model under its name.
func TestServeDefaultModel(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	serveOnce(t, nil, "KV cache", models.DefaultName)
}

// serveOnce starts twell serve with args and small limits, checks its
// listening line for wantKV, asks for one completion (answered by model
// wantModel, when given) and stops the server.
func serveOnce(t *testing.T, args []string, wantKV, wantModel string) {
	t.Helper()
	stop := make(chan struct{})
	serveStop = stop
	defer func() { serveStop = nil }()
	pr, pw := io.Pipe()
	code := make(chan int, 1)
	go func() {
		code <- run(append([]string{"serve", "-device", "cpu", "-addr", "127.0.0.1:0", "-max-concurrent", "2",
			"-kv-memory", "1MiB", "-kv-page-size", "8", "-prefill-tokens", "3"}, args...), io.Discard, pw)
		pw.Close()
	}()
	sc := bufio.NewScanner(pr)
	var url string
	for sc.Scan() {
		if _, rest, ok := strings.Cut(sc.Text(), "listening on "); ok {
			url = strings.Fields(rest)[0]
			break
		}
		t.Logf("stderr: %s", sc.Text())
	}
	if url == "" {
		t.Fatalf("no listening line; exit %d", <-code)
	}
	if !strings.Contains(sc.Text(), wantKV) {
		t.Errorf("listening line %q lacks %q", sc.Text(), wantKV)
	}
	var logs strings.Builder
	logsDone := make(chan struct{})
	go func() {
		defer close(logsDone)
		for sc.Scan() {
			logs.WriteString(sc.Text() + "\n")
		}
	}()
	body, _ := json.Marshal(map[string]any{"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0})
	resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	var out struct {
		Model   string `json:"model"`
		Choices []struct {
			Text         string `json:"text"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != 200 {
		t.Fatalf("status %d: %v", resp.StatusCode, err)
	}
	resp.Body.Close()
	if len(out.Choices) != 1 || out.Choices[0].FinishReason != "length" || out.Model == "" || (wantModel != "" && out.Model != wantModel) {
		t.Errorf("answer %+v (model wanted: %q)", out, wantModel)
	}
	close(stop)
	select {
	case c := <-code:
		<-logsDone
		if c != 0 {
			t.Errorf("exit %d: %s", c, logs.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop")
	}
}

func TestServeBadFlags(t *testing.T) {
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"serve", "-model", ".", "-max-concurrent", "0"}, 2, "-max-concurrent 0"},
		{[]string{"serve", "-model", ".", "-max-queue", "-1"}, 2, "-max-queue -1"},
		{[]string{"serve", "-model", ".", "-max-body", "10"}, 2, "-max-body 10"},
		{[]string{"serve", "-model", ".", "-device", "tpu"}, 2, "tpu"},
		{[]string{"serve", "-model", ".", "-mlp", "fast"}, 2, "fast"},
		{[]string{"serve", "-model", "/nonexistent"}, 1, "nonexistent"},
		{[]string{"serve", "-model", ".", "-prefill-tokens", "0"}, 2, "-prefill-tokens 0"},
		{[]string{"serve", "-model", ".", "-kv-memory", "lots"}, 2, "-kv-memory: \"lots\""},
		{[]string{"serve", "-model", ".", "-kv-memory", "-3GiB"}, 2, "-kv-memory"},
		{[]string{"serve", "-model", ".", "-kv-page-size", "-1"}, 2, "-kv-page-size -1"},
		{[]string{"serve", "-model", tinyCheckpoint(t), "-device", "cpu", "-kv-memory", "100B"}, 2, "less than one page"},
		{[]string{"serve", "-model", tinyCheckpoint(t), "-device", "cpu", "-kv-memory", "1TB"}, 1, "-kv-memory"},
	}
	for _, c := range cases {
		var out, errb bytes.Buffer
		code := run(c.args, &out, &errb)
		if code != c.code || !strings.Contains(errb.String(), c.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit %d mentioning %q", c.args, code, errb.String(), c.code, c.want)
		}
	}
}

func TestParseBytes(t *testing.T) {
	for in, want := range map[string]int64{"": 0, "0": 0, "1500": 1500, "2KiB": 2048, "1.5 MiB": 3 << 19, "2GB": 2e9, "3TiB": 3 << 40, "7B": 7} {
		if got, err := parseBytes(in); err != nil || got != want {
			t.Errorf("parseBytes(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"x", "-1", "1QB", "NaN", "1e30", "GiB"} {
		if got, err := parseBytes(in); err == nil {
			t.Errorf("parseBytes(%q) = %d; want an error", in, got)
		}
	}
}

// TestWarmUpLeavesNoPages: the warm-up pass runs on the engine a server
// opens and gives back every KV page it took.
func TestWarmUpLeavesNoPages(t *testing.T) {
	m, _, err := loadCheckpoint(tinyCheckpoint(t), false)
	if err != nil {
		t.Fatal(err)
	}
	o := serve.DefaultOptions()
	o.Context = m.Config.MaxPositionEmbeddings
	e, err := openServing(backend.CPU, m, backend.Options{}, o, 8, 0, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	p, ok := e.(engine.Paged)
	if !ok {
		t.Fatal("the CPU engine is not paged")
	}
	if st := p.KVPages(); st.InUse != 0 || st.Total == 0 {
		t.Fatalf("after the warm-up: %+v, want no page in use under a budget", st)
	}
	for _, context := range []int{0, 1, 2, 3} { // too short to warm up, or just long enough
		if err := warmUp(e, context); err != nil {
			t.Fatalf("warmUp(context %d): %v", context, err)
		}
	}
}
