package serve

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// apiError is an error answered with an HTTP status and an OpenAI-style
// body: {"error": {"message", "type", "param", "code"}}.
type apiError struct {
	status int
	typ    string
	param  string
	msg    string
}

func (e *apiError) Error() string { return e.msg }

// badRequest returns a 400 naming param (the request field at fault).
func badRequest(param, format string, a ...any) *apiError {
	return &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", param: param, msg: fmt.Sprintf(format, a...)}
}

type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

// writeError answers err: an *apiError as itself, anything else as a 500.
func writeError(w http.ResponseWriter, err error) {
	var ae *apiError
	if !errors.As(err, &ae) {
		ae = &apiError{status: http.StatusInternalServerError, typ: "server_error", msg: err.Error()}
	}
	d := errorDetail{Message: ae.msg, Type: ae.typ}
	if ae.param != "" {
		d.Param = &ae.param
	}
	writeJSON(w, ae.status, errorBody{Error: d})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

// decodeBody reads a JSON request body of at most maxBody bytes into v,
// turning a syntax or type error into a 400 that names the field.
func decodeBody(w http.ResponseWriter, r *http.Request, maxBody int64, v any) error {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		var mb *http.MaxBytesError
		if errors.As(err, &mb) {
			return &apiError{status: http.StatusRequestEntityTooLarge, typ: "invalid_request_error",
				msg: fmt.Sprintf("the request body is larger than %d bytes (-max-body)", maxBody)}
		}
		return badRequest("", "reading the request body: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(v); err != nil {
		return jsonError(err)
	}
	if dec.More() {
		return badRequest("", "malformed JSON: more than one value in the body")
	}
	return nil
}

// jsonError turns a decoding error into a 400 naming the field.
func jsonError(err error) error {
	var te *json.UnmarshalTypeError
	var se *json.SyntaxError
	switch {
	case errors.As(err, &te):
		field := strings.TrimPrefix(te.Field, "sampling.") // the embedded shared fields
		if field == "" {
			return badRequest("", "the request body must be a JSON object, not %s", te.Value)
		}
		return badRequest(field, "field %q: got a JSON %s, want %s", field, te.Value, jsonType(te.Type.String()))
	case errors.As(err, &se):
		return badRequest("", "malformed JSON at byte %d: %v", se.Offset, err)
	case errors.Is(err, io.EOF):
		return badRequest("", "malformed JSON: the request body is empty")
	case errors.Is(err, io.ErrUnexpectedEOF):
		return badRequest("", "malformed JSON: the body ends early")
	}
	return badRequest("", "malformed JSON: %v", err)
}

// jsonType names a Go type the way a client thinks of it.
func jsonType(goType string) string {
	switch {
	case strings.HasPrefix(goType, "*"):
		return jsonType(goType[1:])
	case strings.HasPrefix(goType, "int"), strings.HasPrefix(goType, "uint"):
		return "an integer"
	case strings.HasPrefix(goType, "float"):
		return "a number"
	case goType == "string":
		return "a string"
	case goType == "bool":
		return "true or false"
	case strings.HasPrefix(goType, "[]"):
		return "an array"
	}
	return "an object"
}

// streamOptions are the stream_options of a request.
type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// sampling holds the request fields both endpoints share.
type sampling struct {
	Model         string          `json:"model"`
	MaxTokens     *int            `json:"max_tokens"`
	Temperature   *float64        `json:"temperature"`
	TopP          *float64        `json:"top_p"`
	TopK          *int            `json:"top_k"`
	Seed          *int64          `json:"seed"`
	Stop          json.RawMessage `json:"stop"`
	N             *int            `json:"n"`
	Stream        bool            `json:"stream"`
	StreamOptions *streamOptions  `json:"stream_options"`
	// IgnoreEOS (a vLLM extension, for benchmarks) generates past the end
	// of sequence token, up to max_tokens.
	IgnoreEOS bool `json:"ignore_eos"`
	// Accepted only at their neutral values.
	PresencePenalty  *float64 `json:"presence_penalty"`
	FrequencyPenalty *float64 `json:"frequency_penalty"`
}

// completionRequest is the body of POST /v1/completions.
type completionRequest struct {
	sampling
	Prompt   json.RawMessage `json:"prompt"`
	Echo     bool            `json:"echo"`
	Logprobs *int            `json:"logprobs"`
	BestOf   *int            `json:"best_of"`
	Suffix   *string         `json:"suffix"`
}

// chatRequest is the body of POST /v1/chat/completions.
type chatRequest struct {
	sampling
	Messages            []chatMessage `json:"messages"`
	MaxCompletionTokens *int          `json:"max_completion_tokens"`
	Logprobs            *bool         `json:"logprobs"`
}

// chatMessage is one message; content is a string or an array of
// {"type": "text", "text": ...} parts.
type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// stopList reads stop: null, a string or an array of strings.
func stopList(raw json.RawMessage) ([]string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var one string
	if err := json.Unmarshal(raw, &one); err == nil {
		return []string{one}, nil
	}
	var many []string
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, badRequest("stop", "field \"stop\": want a string or an array of strings")
	}
	if len(many) > 16 {
		return nil, badRequest("stop", "field \"stop\": %d strings; at most 16", len(many))
	}
	return many, nil
}

// prompts reads prompt: a string, an array of token ids, an array of
// strings or an array of arrays of token ids. Each is one prompt; strings
// come back in texts (ids nil), token arrays in ids.
func prompts(raw json.RawMessage) (texts []string, ids [][]int, err error) {
	bad := badRequest("prompt", "field \"prompt\": want a string, an array of token ids, an array of strings or an array of arrays of token ids")
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil, badRequest("prompt", "field \"prompt\" is required")
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return []string{s}, [][]int{nil}, nil
	}
	var list []json.RawMessage
	if json.Unmarshal(raw, &list) != nil {
		return nil, nil, bad
	}
	if len(list) == 0 {
		return nil, nil, badRequest("prompt", "field \"prompt\": an empty array")
	}
	var one []int
	if json.Unmarshal(raw, &one) == nil {
		return []string{""}, [][]int{one}, nil
	}
	for i, item := range list {
		var s string
		var toks []int
		switch {
		case json.Unmarshal(item, &s) == nil:
			texts, ids = append(texts, s), append(ids, nil)
		case json.Unmarshal(item, &toks) == nil:
			if len(toks) == 0 {
				return nil, nil, badRequest("prompt", "field \"prompt\"[%d]: an empty array of token ids", i)
			}
			texts, ids = append(texts, ""), append(ids, toks)
		default:
			return nil, nil, bad
		}
	}
	return texts, ids, nil
}

// messageText reads a message's content: a string or text parts.
func messageText(i int, raw json.RawMessage) (string, error) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if json.Unmarshal(raw, &parts) != nil {
		return "", badRequest("messages", "field \"messages\"[%d].content: want a string or an array of text parts", i)
	}
	var b strings.Builder
	for j, p := range parts {
		if p.Type != "text" {
			return "", badRequest("messages", "field \"messages\"[%d].content[%d]: type %q is not supported (only \"text\")", i, j, p.Type)
		}
		b.WriteString(p.Text)
	}
	return b.String(), nil
}

// ChatPrompt is the plain chat format the server applies to messages: one
// line "<role>: <content>" per message, then "assistant:" for the reply.
// A chat_template in tokenizer_config.json is not read.
func ChatPrompt(roles, contents []string) string {
	var b strings.Builder
	for i := range roles {
		fmt.Fprintf(&b, "%s: %s\n", roles[i], contents[i])
	}
	b.WriteString("assistant:")
	return b.String()
}

// usage is the token counts of a response.
type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// logprobsBody is the logprobs object of a completion choice.
type logprobsBody struct {
	Tokens        []string             `json:"tokens"`
	TokenLogprobs []*float64           `json:"token_logprobs"`
	TopLogprobs   []map[string]float64 `json:"top_logprobs"`
	TextOffset    []int                `json:"text_offset"`
}

type completionChoice struct {
	Text         string        `json:"text"`
	Index        int           `json:"index"`
	Logprobs     *logprobsBody `json:"logprobs"`
	FinishReason *string       `json:"finish_reason"`
}

type completionResponse struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"`
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []completionChoice `json:"choices"`
	Usage   *usage             `json:"usage,omitempty"`
}

type chatMessageOut struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content,omitempty"`
}

// chatMessageFull is a whole reply: content is present even when empty.
type chatMessageFull struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type chatChoice struct {
	Index        int              `json:"index"`
	Message      *chatMessageFull `json:"message,omitempty"`
	Delta        *chatMessageOut  `json:"delta,omitempty"`
	Logprobs     *struct{}        `json:"logprobs"`
	FinishReason *string          `json:"finish_reason"`
}

type chatResponse struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []chatChoice `json:"choices"`
	Usage   *usage       `json:"usage,omitempty"`
}
