package serve

import (
	"bufio"
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// FuzzRequests posts arbitrary bodies to the completion and chat routes:
// the server never panics or hangs (an answer within 20 s), answers 200 or
// an error status, and every answer is what its status promises: an
// OpenAI-style error object (with a message and a type) for an error, a
// JSON completion or chat response with at least one choice, or a stream
// of server-sent events of JSON objects that ends with [DONE].
func FuzzRequests(f *testing.F) {
	for _, s := range []struct {
		chat bool
		body string
	}{
		{false, `{"prompt": "once upon", "max_tokens": 2}`},
		{false, `{"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": true}`},
		{false, `{"prompt": "a", "max_tokens": 2, "stream": true, "stream_options": {"include_usage": true}}`},
		{false, `{"prompt": "a", "stop": ["b", "c"], "max_tokens": 3, "top_p": 0.5, "seed": 7}`},
		{false, `{"prompt": "x", "max_tokens": -1}`},
		{false, `{"prompt": "x", "temperature": 1e309}`},
		{false, `{"prompt": ["a", "b"]}`},
		{false, `{"prompt": [[1, 2]]}`},
		{false, `{"prompt": ""}`},
		{false, `{"prompt": "x",`},
		{false, `null`},
		{true, `{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}`},
		{true, `{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "max_tokens": 1, "stream": true}`},
		{true, `{"messages": [{"role": "tool", "content": null}]}`},
		{true, `{"messages": "hi"}`},
		{true, `{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 1}`},
	} {
		f.Add(s.chat, s.body)
	}
	o := DefaultOptions()
	o.MaxTokens = 16 // the completions default; keeps an accepted request short
	e, tok := tinyEngine(f)
	s, err := New(e, tok, o)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() {
		done := make(chan struct{})
		close(done)
		s.Shutdown(done)
	})
	h := s.Handler()
	f.Fuzz(func(t *testing.T, chat bool, body string) {
		path := "/v1/completions"
		if chat {
			path = "/v1/chat/completions"
		}
		req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		rec := httptest.NewRecorder()
		served := make(chan struct{})
		go func() {
			defer close(served)
			h.ServeHTTP(rec, req)
		}()
		select {
		case <-served:
		case <-time.After(20 * time.Second):
			t.Fatalf("body %q: no answer in 20 s", body)
		}
		out := rec.Body.Bytes()
		switch code := rec.Code; {
		case code == http.StatusOK && strings.HasPrefix(rec.Header().Get("Content-Type"), "text/event-stream"):
			checkStream(t, body, out)
		case code == http.StatusOK:
			var resp struct {
				Object  string            `json:"object"`
				Choices []json.RawMessage `json:"choices"`
			}
			if err := json.Unmarshal(out, &resp); err != nil || len(resp.Choices) == 0 || resp.Object == "" {
				t.Fatalf("body %q: 200 with %q (%v)", body, out, err)
			}
		case code == http.StatusBadRequest || code == http.StatusRequestEntityTooLarge || code == http.StatusTooManyRequests ||
			code == http.StatusServiceUnavailable:
			var resp struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
				} `json:"error"`
			}
			if err := json.Unmarshal(out, &resp); err != nil || resp.Error.Message == "" || resp.Error.Type == "" {
				t.Fatalf("body %q: %d with %q (%v)", body, code, out, err)
			}
		default:
			t.Fatalf("body %q: status %d, %q", body, code, out)
		}
	})
}

// checkStream checks a stream of server-sent events: data lines of JSON
// objects (a chunk, or an error) and a last data line [DONE].
func checkStream(t *testing.T, body string, out []byte) {
	t.Helper()
	var data []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			data = append(data, d)
		}
	}
	if len(data) == 0 || data[len(data)-1] != "[DONE]" {
		t.Fatalf("body %q: stream %q does not end with [DONE]", body, out)
	}
	for _, d := range data[:len(data)-1] {
		var v map[string]any
		if err := json.Unmarshal([]byte(d), &v); err != nil {
			t.Fatalf("body %q: stream event %q: %v", body, d, err)
		}
	}
}
