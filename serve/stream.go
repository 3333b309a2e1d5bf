package serve

import (
	"encoding/json"
	"errors"
	"net/http"
	"time"
)

// writeTimeout bounds one write to a streaming client: a client that
// stops reading is dropped.
const writeTimeout = 30 * time.Second

// sse writes server-sent events: "data: <json>\n\n", flushed each time.
type sse struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

func newSSE(w http.ResponseWriter) *sse {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.Header().Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	return &sse{w: w, rc: http.NewResponseController(w)}
}

func (e *sse) send(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return e.raw(b)
}

func (e *sse) raw(b []byte) error {
	e.rc.SetWriteDeadline(time.Now().Add(writeTimeout))
	if _, err := e.w.Write(append(append([]byte("data: "), b...), '\n', '\n')); err != nil {
		return err
	}
	if err := e.rc.Flush(); err != nil {
		return errors.Join(errNoFlush, err)
	}
	return nil
}

// fail ends a stream with an error event (the status line is already
// sent).
func (e *sse) fail(err error) {
	var ae *apiError
	if !errors.As(err, &ae) {
		ae = &apiError{status: http.StatusInternalServerError, typ: "server_error", msg: err.Error()}
	}
	d := errorDetail{Message: ae.msg, Type: ae.typ}
	if ae.param != "" {
		d.Param = &ae.param
	}
	e.send(errorBody{Error: d})
}

// follow calls emit with each piece of j until j is done, then returns j's
// error; it returns early when the client goes away or a write fails.
func follow(r *http.Request, j *job, emit func(piece) error) error {
	for {
		select {
		case p := <-j.out:
			if err := emit(p); err != nil {
				return err
			}
		case <-j.done:
			for {
				select {
				case p := <-j.out:
					if err := emit(p); err != nil {
						return err
					}
				default:
					return j.err
				}
			}
		case <-r.Context().Done():
			return r.Context().Err()
		}
	}
}

// streamCompletion streams one completion as text_completion chunks.
func (s *Server) streamCompletion(w http.ResponseWriter, r *http.Request, j *job, resp completionResponse, echo string, so *streamOptions) error {
	ev := newSSE(w)
	chunk := func(text string, lb *logprobsBody, reason *string) error {
		c := resp
		c.Choices = []completionChoice{{Text: text, Logprobs: lb, FinishReason: reason}}
		return ev.send(c)
	}
	if echo != "" {
		if err := chunk(echo, nil, nil); err != nil {
			return nil
		}
	}
	err := follow(r, j, func(p piece) error {
		var lb *logprobsBody
		if j.topN >= 0 {
			lb = &logprobsBody{}
			for _, lp := range p.logprobs {
				v := lp.logprob
				lb.Tokens = append(lb.Tokens, s.tokenString(lp.id))
				lb.TokenLogprobs = append(lb.TokenLogprobs, &v)
				lb.TopLogprobs = append(lb.TopLogprobs, s.topMap(lp))
			}
		}
		return chunk(p.text, lb, nil)
	})
	endStream(ev, r, j, err, so, func() error { return chunk("", nil, finishReason(j.reason)) }, func(u *usage) {
		c := resp
		c.Choices = []completionChoice{}
		c.Usage = u
		ev.send(c)
	})
	return nil
}

// streamChat streams one chat reply as chat.completion.chunk objects.
func (s *Server) streamChat(w http.ResponseWriter, r *http.Request, j *job, resp chatResponse, so *streamOptions) error {
	ev := newSSE(w)
	resp.Object = "chat.completion.chunk"
	chunk := func(d chatMessageOut, reason *string) error {
		c := resp
		c.Choices = []chatChoice{{Delta: &d, FinishReason: reason}}
		return ev.send(c)
	}
	if chunk(chatMessageOut{Role: "assistant"}, nil) != nil {
		return nil
	}
	err := follow(r, j, func(p piece) error {
		if p.text == "" {
			return nil
		}
		return chunk(chatMessageOut{Content: p.text}, nil)
	})
	endStream(ev, r, j, err, so, func() error { return chunk(chatMessageOut{}, finishReason(j.reason)) }, func(u *usage) {
		c := resp
		c.Choices = []chatChoice{}
		c.Usage = u
		ev.send(c)
	})
	return nil
}

// endStream ends a stream after its pieces: the error event if following
// the job failed (unless the client left), else the finishing chunk, the
// usage chunk when the client asked for it, and [DONE].
func endStream(ev *sse, r *http.Request, j *job, err error, so *streamOptions, finish func() error, sendUsage func(*usage)) {
	if err != nil {
		if r.Context().Err() == nil {
			ev.fail(err)
		}
		return
	}
	if finish() != nil {
		return
	}
	if so != nil && so.IncludeUsage {
		u := j.usage()
		sendUsage(&u)
	}
	ev.raw([]byte("[DONE]"))
}
