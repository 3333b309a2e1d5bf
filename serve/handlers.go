package serve

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"

	"github.com/twell-ai/twell/generate"
	"github.com/twell-ai/twell/sample"
)

// maxLogprobs bounds the logprobs field (alternatives per position).
const maxLogprobs = 20

// options turns the shared request fields into generation options;
// maxTokens is the request's max_tokens (already defaulted).
func (s *Server) options(sp *sampling, maxTokens int) (generate.Options, error) {
	var o generate.Options
	if sp.N != nil && *sp.N != 1 {
		return o, badRequest("n", "field \"n\": %d; this server makes one choice per prompt (n = 1)", *sp.N)
	}
	if sp.PresencePenalty != nil && *sp.PresencePenalty != 0 {
		return o, badRequest("presence_penalty", "field \"presence_penalty\" is not supported (only 0)")
	}
	if sp.FrequencyPenalty != nil && *sp.FrequencyPenalty != 0 {
		return o, badRequest("frequency_penalty", "field \"frequency_penalty\" is not supported (only 0)")
	}
	if maxTokens < 0 || maxTokens > s.o.MaxTokens {
		return o, badRequest("max_tokens", "field \"max_tokens\": %d; must be in 0..%d (the server's -max-tokens)", maxTokens, s.o.MaxTokens)
	}
	so := sample.Options{Temperature: 1, TopP: 1, RepetitionPenalty: 1, Seed: rand.Uint64()}
	if sp.Temperature != nil {
		so.Temperature = *sp.Temperature
	}
	if sp.TopP != nil {
		so.TopP = *sp.TopP
	}
	if sp.TopK != nil && *sp.TopK != -1 { // -1 is "off" for some clients
		so.TopK = *sp.TopK
	}
	if sp.Seed != nil {
		so.Seed = uint64(*sp.Seed)
	}
	if err := so.Validate(); err != nil {
		field := strings.ReplaceAll(strings.Fields(err.Error())[0], "-", "_")
		return o, badRequest(field, "field %q: %v", field, err)
	}
	stops, err := stopList(sp.Stop)
	if err != nil {
		return o, err
	}
	eos := s.eos
	if sp.IgnoreEOS {
		eos = nil
	}
	return generate.Options{MaxTokens: max(maxTokens, 1), Context: s.o.Context, Sample: so, Stop: stops,
		EOS: eos, Vocab: s.vocab}, nil
}

// checkPrompt checks a prompt's ids, its length against the context and,
// on an engine with a KV page budget, that the request (the prompt and
// maxTokens generated tokens, 0 for none) fits in the whole pool.
func (s *Server) checkPrompt(i int, ids []int, maxTokens int) error {
	generating := maxTokens > 0
	if len(ids) == 0 {
		return badRequest("prompt", "prompt %d encodes to no tokens", i)
	}
	vocab := s.e.Config().VocabSize
	for k, id := range ids {
		if id < 0 || id >= vocab {
			return badRequest("prompt", "prompt %d token %d: id %d outside the vocabulary [0, %d)", i, k, id, vocab)
		}
	}
	limit := s.o.Context
	if generating {
		limit-- // one position is left to generate into
	}
	if len(ids) > limit {
		return badRequest("prompt", "prompt %d has %d tokens; the context is %d positions (prompt and generated tokens together), so a prompt may have at most %d tokens",
			i, len(ids), s.o.Context, limit)
	}
	if s.pages != nil {
		positions := len(ids) // the last generated token is not fed back
		if generating {
			positions += min(maxTokens, s.o.Context-len(ids)) - 1
		}
		ps := s.pageStats()
		if need := ps.PagesFor(positions); need > ps.Total {
			return badRequest("max_tokens", "prompt %d: %d prompt tokens and max_tokens %d take up to %d positions of KV cache; the server's KV memory holds %d (%d pages of %d positions): lower max_tokens or shorten the prompt",
				i, len(ids), maxTokens, positions, ps.Total*ps.PageSize, ps.Total, ps.PageSize)
		}
	}
	return nil
}

func finishReason(r generate.StopReason) *string {
	s := "length"
	if r == generate.StopString || r == generate.EndOfSequence {
		s = "stop"
	}
	return &s
}

func (s *Server) completions(w http.ResponseWriter, r *http.Request) {
	if err := s.doCompletions(w, r); err != nil {
		writeError(w, err)
	}
}

func (s *Server) doCompletions(w http.ResponseWriter, r *http.Request) error {
	var req completionRequest
	if err := decodeBody(w, r, s.o.MaxBody, &req); err != nil {
		return err
	}
	if req.BestOf != nil && *req.BestOf != 1 {
		return badRequest("best_of", "field \"best_of\": %d; only 1 is supported", *req.BestOf)
	}
	if req.Suffix != nil && *req.Suffix != "" {
		return badRequest("suffix", "field \"suffix\" is not supported")
	}
	maxTokens := 16
	if req.MaxTokens != nil {
		maxTokens = *req.MaxTokens
	}
	o, err := s.options(&req.sampling, maxTokens)
	if err != nil {
		return err
	}
	topN := -1
	if req.Logprobs != nil {
		if *req.Logprobs < 0 || *req.Logprobs > maxLogprobs {
			return badRequest("logprobs", "field \"logprobs\": %d; must be in 0..%d", *req.Logprobs, maxLogprobs)
		}
		topN = *req.Logprobs
	}
	texts, ids, err := prompts(req.Prompt)
	if err != nil {
		return err
	}
	if req.Stream && len(texts) > 1 {
		return badRequest("prompt", "a streamed request takes one prompt, not %d", len(texts))
	}
	if req.Stream && req.Echo && topN >= 0 {
		return badRequest("echo", "echo with logprobs is not supported in a streamed request")
	}
	jobs := make([]*job, len(texts))
	for i := range texts {
		if ids[i] == nil {
			if ids[i], err = s.tok.Encode(texts[i], true); err != nil {
				return badRequest("prompt", "prompt %d: %v", i, err)
			}
		} else if texts[i], err = s.tok.Decode(ids[i], true); err != nil {
			return badRequest("prompt", "prompt %d: %v", i, err)
		}
		if err := s.checkPrompt(i, ids[i], maxTokens); err != nil {
			return err
		}
		jobs[i] = &job{ctx: r.Context(), prompt: ids[i], opts: o, topN: topN, done: make(chan struct{}),
			score: maxTokens == 0, echoLogp: req.Echo && topN >= 0}
		if req.Stream {
			jobs[i].out = make(chan piece, streamBuffer)
		}
	}
	var work []*job
	for _, j := range jobs {
		if j.score && !j.echoLogp {
			close(j.done) // nothing for the engine to do
			continue
		}
		work = append(work, j)
	}
	if err := s.enqueue(work); err != nil {
		return err
	}
	resp := completionResponse{ID: s.newID("cmpl"), Object: "text_completion", Created: s.created, Model: s.o.ModelName}
	if req.Stream {
		first := ""
		if req.Echo {
			first = texts[0]
		}
		return s.streamCompletion(w, r, jobs[0], resp, first, req.StreamOptions)
	}
	if err := wait(r, jobs); err != nil {
		return err
	}
	u := usage{}
	for i, j := range jobs {
		ch := completionChoice{Index: i, Text: j.text, FinishReason: finishReason(j.reason)}
		if req.Echo {
			ch.Text = texts[i] + ch.Text
		}
		if topN >= 0 {
			ch.Logprobs = s.logprobs(j, req.Echo, texts[i])
		}
		resp.Choices = append(resp.Choices, ch)
		u.PromptTokens += len(j.prompt)
		u.CompletionTokens += len(j.tokens)
	}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	resp.Usage = &u
	writeJSON(w, http.StatusOK, resp)
	return nil
}

// logprobs builds a choice's logprobs object: the prompt's tokens first
// when echoed (the first with a null log-probability), then the generated
// ones. Token strings are the text each token adds to the decoded
// sequence; text_offset counts characters from the start of the prompt.
func (s *Server) logprobs(j *job, echo bool, promptText string) *logprobsBody {
	var lps []tokenLogprob
	var ids []int
	base := 0
	if echo {
		lps = append(lps, j.promptLogp...)
		ids = append(ids, j.prompt...)
	} else {
		base = len([]rune(promptText))
	}
	lps = append(lps, j.genLogp...)
	ids = append(ids, j.tokens...)
	b := &logprobsBody{Tokens: []string{}, TokenLogprobs: []*float64{}, TopLogprobs: []map[string]float64{}, TextOffset: []int{}}
	prev := ""
	off := base
	for i, lp := range lps {
		text, _ := s.tok.Decode(ids[:i+1], true)
		tokStr := strings.TrimPrefix(text, prev)
		if !strings.HasPrefix(text, prev) {
			tokStr = s.tokenString(lp.id)
		}
		prev = text
		b.Tokens = append(b.Tokens, tokStr)
		b.TextOffset = append(b.TextOffset, off)
		off += len([]rune(tokStr))
		if echo && i == 0 {
			b.TokenLogprobs = append(b.TokenLogprobs, nil)
			b.TopLogprobs = append(b.TopLogprobs, nil)
			continue
		}
		v := lp.logprob
		b.TokenLogprobs = append(b.TokenLogprobs, &v)
		b.TopLogprobs = append(b.TopLogprobs, s.topMap(lp))
	}
	return b
}

// topMap returns the alternatives of one position keyed by token text (the
// more likely id wins where two decode to the same text).
func (s *Server) topMap(lp tokenLogprob) map[string]float64 {
	m := make(map[string]float64, len(lp.top))
	for _, t := range lp.top {
		k := s.tokenString(t.id)
		if _, ok := m[k]; !ok {
			m[k] = t.logprob
		}
	}
	return m
}

func (s *Server) tokenString(id int) string {
	t, err := s.tok.Decode([]int{id}, false)
	if err != nil {
		return fmt.Sprintf("<%d>", id)
	}
	return t
}

func (s *Server) models(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []map[string]any{{
		"id": s.o.ModelName, "object": "model", "created": s.created, "owned_by": "twell",
		"max_model_len": s.o.Context,
	}}})
}

func (s *Server) health(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	closing := s.closing
	s.mu.Unlock()
	if closing {
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "shutting down"})
		return
	}
	running, queued := s.Load()
	writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "running": running, "queued": queued})
}

func (s *Server) chat(w http.ResponseWriter, r *http.Request) {
	if err := s.doChat(w, r); err != nil {
		writeError(w, err)
	}
}

func (s *Server) doChat(w http.ResponseWriter, r *http.Request) error {
	var req chatRequest
	if err := decodeBody(w, r, s.o.MaxBody, &req); err != nil {
		return err
	}
	if req.Logprobs != nil && *req.Logprobs {
		return badRequest("logprobs", "field \"logprobs\" is not supported on /v1/chat/completions")
	}
	if len(req.Messages) == 0 {
		return badRequest("messages", "field \"messages\": at least one message is required")
	}
	roles := make([]string, len(req.Messages))
	contents := make([]string, len(req.Messages))
	for i, m := range req.Messages {
		if m.Role == "" {
			return badRequest("messages", "field \"messages\"[%d].role is required", i)
		}
		c, err := messageText(i, m.Content)
		if err != nil {
			return err
		}
		roles[i], contents[i] = m.Role, c
	}
	maxTokens := s.o.MaxTokens
	if req.MaxCompletionTokens != nil {
		maxTokens = *req.MaxCompletionTokens
	} else if req.MaxTokens != nil {
		maxTokens = *req.MaxTokens
	}
	if maxTokens < 1 {
		return badRequest("max_tokens", "field \"max_tokens\": %d; must be at least 1", maxTokens)
	}
	o, err := s.options(&req.sampling, maxTokens)
	if err != nil {
		return err
	}
	ids, err := s.tok.Encode(ChatPrompt(roles, contents), true)
	if err != nil {
		return badRequest("messages", "%v", err)
	}
	if err := s.checkPrompt(0, ids, maxTokens); err != nil {
		return err
	}
	j := &job{ctx: r.Context(), prompt: ids, opts: o, topN: -1, done: make(chan struct{})}
	if req.Stream {
		j.out = make(chan piece, streamBuffer)
	}
	if err := s.enqueue([]*job{j}); err != nil {
		return err
	}
	resp := chatResponse{ID: s.newID("chatcmpl"), Object: "chat.completion", Created: s.created, Model: s.o.ModelName}
	if req.Stream {
		return s.streamChat(w, r, j, resp, req.StreamOptions)
	}
	if err := wait(r, []*job{j}); err != nil {
		return err
	}
	resp.Choices = []chatChoice{{Message: &chatMessageFull{Role: "assistant", Content: j.text}, FinishReason: finishReason(j.reason)}}
	u := j.usage()
	resp.Usage = &u
	writeJSON(w, http.StatusOK, resp)
	return nil
}
