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
)

// TestServeRunsAndStops: twell serve answers a completion on a tiny CPU
// model, then stops cleanly (exit 0) when asked to, as on SIGINT.
func TestServeRunsAndStops(t *testing.T) {
	dir := tinyCheckpoint(t)
	stop := make(chan struct{})
	serveStop = stop
	defer func() { serveStop = nil }()
	pr, pw := io.Pipe()
	code := make(chan int, 1)
	go func() {
		code <- run([]string{"serve", "-model", dir, "-device", "cpu", "-addr", "127.0.0.1:0", "-max-concurrent", "2",
			"-kv-memory", "64KiB", "-kv-page-size", "8", "-prefill-tokens", "3"}, io.Discard, pw)
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
	if want := "KV cache 32 pages of 8 positions (64 KiB)"; !strings.Contains(sc.Text(), want) {
		t.Errorf("listening line %q lacks %q", sc.Text(), want)
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
	if len(out.Choices) != 1 || out.Choices[0].FinishReason != "length" || out.Model == "" {
		t.Errorf("answer %+v", out)
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
		{[]string{"serve"}, 2, "-model is required"},
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
