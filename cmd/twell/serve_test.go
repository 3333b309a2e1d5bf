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
		code <- run([]string{"serve", "-model", dir, "-device", "cpu", "-addr", "127.0.0.1:0", "-max-concurrent", "2"}, io.Discard, pw)
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
	}
	for _, c := range cases {
		var out, errb bytes.Buffer
		code := run(c.args, &out, &errb)
		if code != c.code || !strings.Contains(errb.String(), c.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit %d mentioning %q", c.args, code, errb.String(), c.code, c.want)
		}
	}
}
