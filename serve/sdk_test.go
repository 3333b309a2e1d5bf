package serve

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
)

// TestOpenAISDK drives the server with the official Go SDK: a completion,
// a chat reply, both streamed, and an error.
func TestOpenAISDK(t *testing.T) {
	s, hs, e := newTestServer(t, DefaultOptions())
	ctx := context.Background()
	client := openai.NewClient(option.WithBaseURL(hs.URL+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))

	want := direct(t, s, "Once upon a time", 8)
	cp := openai.CompletionNewParams{Model: "twell", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
		MaxTokens: openai.Int(8), Temperature: openai.Float(0)}
	c, err := client.Completions.New(ctx, cp)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Choices) != 1 || c.Choices[0].Text != want.Text || c.Choices[0].FinishReason != "length" || c.Usage.CompletionTokens != 8 {
		t.Errorf("completion %+v; want %q", c, want.Text)
	}
	var text strings.Builder
	cs := client.Completions.NewStreaming(ctx, cp)
	for cs.Next() {
		for _, ch := range cs.Current().Choices {
			text.WriteString(ch.Text)
		}
	}
	if err := cs.Err(); err != nil || text.String() != want.Text {
		t.Errorf("streamed completion %q (%v); want %q", text.String(), err, want.Text)
	}

	wantChat := direct(t, s, "user: Hello\nassistant:", 6)
	chp := openai.ChatCompletionNewParams{Model: "twell", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Hello")},
		MaxTokens: openai.Int(6), Temperature: openai.Float(0)}
	ch, err := client.Chat.Completions.New(ctx, chp)
	if err != nil {
		t.Fatal(err)
	}
	if len(ch.Choices) != 1 || ch.Choices[0].Message.Content != wantChat.Text || ch.Usage.CompletionTokens != 6 {
		t.Errorf("chat %+v; want %q", ch, wantChat.Text)
	}
	text.Reset()
	st := client.Chat.Completions.NewStreaming(ctx, chp)
	var acc openai.ChatCompletionAccumulator
	for st.Next() {
		acc.AddChunk(st.Current())
		for _, c := range st.Current().Choices {
			text.WriteString(c.Delta.Content)
		}
	}
	if err := st.Err(); err != nil || text.String() != wantChat.Text {
		t.Errorf("streamed chat %q (%v); want %q", text.String(), err, wantChat.Text)
	}
	if len(acc.Choices) != 1 || acc.Choices[0].Message.Content != wantChat.Text || acc.Choices[0].FinishReason != "length" {
		t.Errorf("accumulated chat %+v", acc.Choices)
	}

	chp.N = openai.Int(2)
	_, err = client.Chat.Completions.New(ctx, chp)
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 400 || apiErr.Param != "n" || !strings.Contains(apiErr.Message, "n = 1") {
		t.Errorf("n = 2: %v; want a 400 naming n", err)
	}
	waitIdle(t, s, e)
}
