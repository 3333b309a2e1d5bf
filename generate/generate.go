// Package generate turns a prompt into text on any engine: prefill, decode
// steps, sampling, stop strings and an honest stop reason. It is written
// once for every job that generates: the generate command, the server and
// evaluation.
//
// A Sequence is the state of one generation and does not call the engine:
// whoever drives the engine (Run for one prompt, a server's batcher for
// many) feeds it the logits of each step and gets back the next token to
// feed and the text it completes. So continuous batching needs nothing
// more than one Sequence and one engine.Cache per request.
package generate

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/internal/enum"
	"github.com/twell-ai/twell/sample"
)

// StopReason says why a generation ended.
type StopReason int

// The stop reasons.
const (
	// NotDone: the generation goes on.
	NotDone StopReason = iota
	// MaxTokens: the requested number of tokens was generated.
	MaxTokens
	// ContextFull: the model's context (its positions) is full, before the
	// requested number of tokens.
	ContextFull
	// EndOfSequence: the model produced an end-of-sequence token.
	EndOfSequence
	// StopString: the text reached one of the stop strings (which is not
	// part of the text).
	StopString
)

// String returns the reason in words.
func (r StopReason) String() string {
	return enum.String(r, "StopReason", "not done", "max tokens", "context full", "end of sequence", "stop string")
}

// Decoder turns token ids back into text (a *tokenizer.Tokenizer is one).
type Decoder interface {
	Decode(ids []int, skipSpecial bool) (string, error)
}

// Options are the settings of one generation.
type Options struct {
	// MaxTokens is the most tokens to generate (at least 1).
	MaxTokens int
	// Context is the most positions the model takes (prompt and generated
	// tokens together): the model's max_position_embeddings, or less.
	Context int
	// Sample chooses each token from the logits.
	Sample sample.Options
	// Stop lists texts that end the generation when they appear; the text
	// returned stops before them. Empty strings are ignored.
	Stop []string
	// EOS lists the token ids that end the sequence (not part of the text).
	EOS []int
	// Vocab, when positive, is the number of ids that can be decoded (a
	// tokenizer smaller than the model's vocabulary): ids from Vocab on are
	// never sampled.
	Vocab int
}

// Validate reports the first bad setting, naming it.
func (o Options) Validate() error {
	if o.MaxTokens < 1 {
		return fmt.Errorf("max tokens %d: must be at least 1", o.MaxTokens)
	}
	if o.Context < 1 {
		return fmt.Errorf("context %d: must be at least 1", o.Context)
	}
	return o.Sample.Validate()
}

// Step is what one call of Sequence.Next produced.
type Step struct {
	// Token is the token chosen; feed it to the engine for the next step
	// unless Done. It is -1 when the step ended the sequence without a
	// token (end of sequence).
	Token int
	// Text is the text that became final with this step: the caller may
	// show it. Text that could still turn out to be the start of a stop
	// string, or an incomplete UTF-8 sequence, is held back until it is
	// known.
	Text string
	// Done reports that the generation ended; Reason says why.
	Done   bool
	Reason StopReason
}

// Sequence is the state of one generation.
type Sequence struct {
	o       Options
	dec     Decoder
	sampler *sample.Sampler
	eos     map[int]bool
	history []int // prompt and generated tokens (for the repetition penalty)
	gen     []int
	limit   int    // the most tokens this sequence may generate
	emitted string // text already returned in steps
	text    string // text so far, cut at a stop string once found
	// Incremental detokenising: gen[decOff:readOff] was decoded last step
	// as context for the tokens after it (a decoder treats a sequence's
	// first token specially, e.g. dropping its leading space), so each
	// step decodes a short window, not the whole generation.
	decOff, readOff int
	reason          StopReason
	maxStop         int
	promptN         int
	capacity        int
}

// NewSequence starts a generation after prompt (token ids, not empty). The
// prompt must leave room for at least one token in the context.
func NewSequence(dec Decoder, prompt []int, o Options) (*Sequence, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if len(prompt) == 0 {
		return nil, errors.New("the prompt has no tokens")
	}
	if len(prompt) >= o.Context {
		return nil, fmt.Errorf("the prompt has %d tokens; the context takes at most %d positions, and one must be left to generate into", len(prompt), o.Context)
	}
	sm, err := sample.New(o.Sample)
	if err != nil {
		return nil, err
	}
	s := &Sequence{o: o, dec: dec, sampler: sm, eos: map[int]bool{}, history: append([]int(nil), prompt...), promptN: len(prompt)}
	for _, id := range o.EOS {
		s.eos[id] = true
	}
	for _, st := range o.Stop {
		s.maxStop = max(s.maxStop, len(st))
	}
	s.limit = min(o.MaxTokens, o.Context-len(prompt))
	// The last generated token is never fed back, so the cache needs the
	// prompt and all but one generated token.
	s.capacity = len(prompt) + s.limit - 1
	return s, nil
}

// CacheCapacity returns the positions the sequence's KV cache must hold:
// the prompt and every generated token that is fed back.
func (s *Sequence) CacheCapacity() int { return max(s.capacity, s.promptN) }

// Prompt returns the prompt's token ids (shared: do not modify).
func (s *Sequence) Prompt() []int { return s.history[:s.promptN] }

// Tokens returns the generated tokens so far (shared: do not modify).
func (s *Sequence) Tokens() []int { return s.gen }

// Text returns the generated text so far, cut before a stop string.
func (s *Sequence) Text() string { return s.text }

// Reason returns why the sequence ended, or NotDone.
func (s *Sequence) Reason() StopReason { return s.reason }

// Next takes the logits that follow the last token fed (the prompt's last
// token at first) and chooses the next token.
func (s *Sequence) Next(logits []float32) (Step, error) {
	if s.reason != NotDone {
		return Step{}, fmt.Errorf("the sequence has ended (%v)", s.reason)
	}
	if s.o.Vocab > 0 && s.o.Vocab < len(logits) {
		logits = logits[:s.o.Vocab]
	}
	tok, err := s.sampler.Pick(logits, s.history, uint64(len(s.gen)))
	if err != nil {
		return Step{}, err
	}
	return s.Accept(tok)
}

// DeviceDraw returns the draw of the sequence's next token for an engine
// that picks on its device (engine.DeviceSampling), among the first
// Options.Vocab logits, and false when the sequence has a repetition
// penalty (it needs the history): feed the engine's pick to Accept. Its
// Index is the number of tokens generated so far, so that a generation's
// draws do not depend on the other sequences it shares steps with.
func (s *Sequence) DeviceDraw() (sample.Draw, bool) {
	return s.o.Sample.Draw(uint64(len(s.gen)))
}

// Accept is Next with the token chosen elsewhere: tok is the sequence's
// next token. A negative tok (an engine's greedy pick where no logit was
// above -Inf) is an error wrapping sample.ErrNoCandidate, as Next's is.
func (s *Sequence) Accept(tok int) (Step, error) {
	if s.reason != NotDone {
		return Step{}, fmt.Errorf("the sequence has ended (%v)", s.reason)
	}
	if tok < 0 {
		return Step{}, fmt.Errorf("sample: %w: no logit above -Inf", sample.ErrNoCandidate)
	}
	if s.eos[tok] {
		if err := s.decodeNew(true); err != nil {
			return Step{}, err
		}
		return s.finish(EndOfSequence, -1)
	}
	s.gen = append(s.gen, tok)
	s.history = append(s.history, tok)
	old := len(s.text)
	// At the last token the text is complete: an unfinished UTF-8
	// sequence then shows as U+FFFD, as a decode of the whole would.
	if err := s.decodeNew(len(s.gen) == s.limit); err != nil {
		return Step{}, err
	}
	if s.maxStop > 0 {
		// Earlier steps found no stop string: one must end in the new text.
		from := max(0, old-s.maxStop+1)
		if cut, ok := stopAt(s.text[from:], s.o.Stop); ok {
			s.text = s.text[:from] + cut
			return s.finish(StopString, tok)
		}
	}
	if len(s.gen) == s.limit {
		if s.limit == s.o.MaxTokens {
			return s.finish(MaxTokens, tok)
		}
		return s.finish(ContextFull, tok)
	}
	return Step{Token: tok, Text: s.release(false)}, nil
}

// decodeNew appends to s.text the text of the tokens generated since the
// last text appended: the decode of the window gen[decOff:] less that of
// its context gen[decOff:readOff]. Unless final, it waits while the new
// text is empty or ends in an unfinished UTF-8 sequence (U+FFFD), so that
// a character split over tokens comes whole.
func (s *Sequence) decodeNew(final bool) error {
	if s.readOff == len(s.gen) {
		return nil
	}
	ctx, err := s.dec.Decode(s.gen[s.decOff:s.readOff], true)
	if err != nil {
		return err
	}
	win, err := s.dec.Decode(s.gen[s.decOff:], true)
	if err != nil {
		return err
	}
	if len(win) <= len(ctx) || (!final && strings.HasSuffix(win, string(utf8.RuneError))) {
		return nil
	}
	if strings.HasPrefix(win, ctx) && !strings.ContainsRune(win, utf8.RuneError) {
		s.text += win[len(ctx):]
	} else {
		// Bytes that form no valid UTF-8: how they decode can depend on
		// tokens outside the window (a byte-fallback decoder replaces a
		// whole run of byte tokens), so decode everything.
		all, err := s.dec.Decode(s.gen, true)
		if err != nil {
			return err
		}
		s.text = all
	}
	s.decOff, s.readOff = s.readOff, len(s.gen)
	return nil
}

// finish ends the sequence for reason r after token tok.
func (s *Sequence) finish(r StopReason, tok int) (Step, error) {
	s.reason = r
	return Step{Token: tok, Text: s.release(true), Done: true, Reason: r}, nil
}

// release returns the text that is now final and not yet returned: all of
// it at the end, else all but a tail that may still become a stop string or
// an incomplete UTF-8 sequence.
func (s *Sequence) release(final bool) string {
	text := s.text
	if !strings.HasPrefix(text, s.emitted) {
		// Decoding more tokens changed earlier text (a tokenizer that
		// merges across tokens): what was shown stands; go on after it.
		s.emitted = commonPrefix(text, s.emitted)
	}
	end := len(text)
	if !final {
		end = len(text) - heldBack(text, s.o.Stop, s.maxStop)
		end = max(end, len(s.emitted))
	}
	out := text[len(s.emitted):end]
	s.emitted = text[:end]
	return out
}

// heldBack returns how many trailing bytes of text to hold back: an
// incomplete UTF-8 sequence (the decoder shows it as U+FFFD), or the
// longest tail that is a proper prefix of a stop string.
func heldBack(text string, stops []string, maxStop int) int {
	n := 0
	if strings.HasSuffix(text, string(utf8.RuneError)) {
		n = len(string(utf8.RuneError))
	}
	body := text[:len(text)-n]
	for k := min(maxStop-1, len(body)); k > 0; k-- {
		tail := body[len(body)-k:]
		for _, st := range stops {
			if st != "" && strings.HasPrefix(st, tail) {
				return n + k
			}
		}
	}
	return n
}

func commonPrefix(a, b string) string {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return a[:i]
}

// stopAt returns text cut before the first stop string it contains.
func stopAt(text string, stops []string) (string, bool) {
	best := -1
	for _, s := range stops {
		if s == "" {
			continue
		}
		if i := strings.Index(text, s); i >= 0 && (best < 0 || i < best) {
			best = i
		}
	}
	if best < 0 {
		return text, false
	}
	return text[:best], true
}

// Result is what Run generated and how fast.
type Result struct {
	// PromptTokens and Tokens are the prompt's and the generated token ids.
	PromptTokens, Tokens []int
	// Text is the generated text (before a stop string).
	Text   string
	Reason StopReason
	// Prefill and Decode are the wall times of the prompt pass and of the
	// decode steps.
	Prefill, Decode time.Duration
	// MeanActive is, per layer, the mean number of active MLP units per
	// token over the passes that measured it, or -1 where none did.
	MeanActive []float64
}

// Run generates from prompt on e: one prefill pass, then one decode step
// per token, calling emit (which may be nil) with each piece of final text
// as it comes. The cache it uses is freed before it returns.
func Run(e engine.Engine, dec Decoder, prompt []int, o Options, emit func(text string) error) (*Result, error) {
	s, err := NewSequence(dec, prompt, o)
	if err != nil {
		return nil, err
	}
	cache, err := e.NewCache(s.CacheCapacity())
	if err != nil {
		return nil, err
	}
	defer cache.Free()
	layers := e.Config().NumHiddenLayers
	act := newActiveSum(layers)
	res := &Result{PromptTokens: s.Prompt()}
	// On an engine that picks on its device, every token of a sequence
	// without a repetition penalty is picked there, the first one too.
	ds, _ := e.(engine.DeviceSampling)
	if _, ok := s.DeviceDraw(); !ok {
		ds = nil
	}
	t0 := time.Now()
	step, err := s.first(e, ds, cache, prompt, act)
	if err != nil {
		return nil, err
	}
	res.Prefill = time.Since(t0)
	t1 := time.Now()
	show := func(step Step) error {
		if emit != nil && step.Text != "" {
			return emit(step.Text)
		}
		return nil
	}
	if err := show(step); err != nil {
		return nil, err
	}
	if ds != nil && !step.Done {
		err = s.decodeOnDevice(ds, cache, step.Token, show)
	} else {
		for !step.Done {
			logits, st, err := e.Forward([]engine.Cache{cache}, [][]int{{step.Token}}, false)
			if err != nil {
				return nil, err
			}
			act.add(st)
			if step, err = s.Next(logits[0]); err != nil {
				return nil, err
			}
			if err := show(step); err != nil {
				return nil, err
			}
		}
	}
	if err != nil {
		return nil, err
	}
	res.Decode = time.Since(t1)
	res.Tokens, res.Text, res.Reason = s.Tokens(), s.Text(), s.Reason()
	res.MeanActive = act.mean()
	return res, nil
}

// first runs the prompt's pass and takes the first generated token:
// picked on ds when it is not nil, else from e's logits.
func (s *Sequence) first(e engine.Engine, ds engine.DeviceSampling, cache engine.Cache, prompt []int, act *activeSum) (Step, error) {
	if ds != nil {
		draw, _ := s.DeviceDraw()
		picks, st, err := ds.ForwardSample([]engine.Cache{cache}, [][]int{prompt}, s.pickVocab(e), []sample.Draw{draw})
		if err != nil {
			return Step{}, err
		}
		act.add(st)
		return s.Accept(picks[0])
	}
	logits, st, err := e.Forward([]engine.Cache{cache}, [][]int{prompt}, false)
	if err != nil {
		return Step{}, err
	}
	act.add(st)
	return s.Next(logits[0])
}

// pickVocab is the number of logits an engine's picks for the sequence
// choose among (engine.DeviceSampling): Options.Vocab where it limits e's
// vocabulary, else 0 (all).
func (s *Sequence) pickVocab(e engine.Engine) int {
	if s.o.Vocab > 0 && s.o.Vocab < e.Config().VocabSize {
		return s.o.Vocab
	}
	return 0
}

// decodeOnDevice runs the sequence's decode steps, from its first generated
// token tok on, through a Decoder of ds: the picks are made on the device
// and the step that feeds a pick is queued before the host has it, unless
// that pick is the last token (one step too many then runs at an end of
// sequence or stop string, its token never read). show gets each step.
func (s *Sequence) decodeOnDevice(ds engine.DeviceSampling, cache engine.Cache, tok int, show func(Step) error) (err error) {
	draw, _ := s.DeviceDraw()
	d, err := ds.NewDecoder([]engine.Cache{cache}, s.pickVocab(ds), []sample.Draw{draw})
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, d.Close()) }()
	if err := d.Queue([]int{tok}); err != nil {
		return err
	}
	// fed counts the generated tokens queued; the last one (limit) is
	// never fed.
	for fed := 1; ; {
		if fed < s.limit-1 {
			if err := d.Queue(nil); err != nil {
				return err
			}
			fed++
		}
		picks, err := d.Next()
		if err != nil {
			return err
		}
		step, err := s.Accept(picks[0])
		if err != nil {
			return err
		}
		if err := show(step); err != nil {
			return err
		}
		if step.Done {
			return nil
		}
	}
}

// activeSum adds up the active MLP units of forward passes, per layer.
type activeSum struct {
	units  []float64
	tokens []int
}

func newActiveSum(layers int) *activeSum {
	return &activeSum{units: make([]float64, layers), tokens: make([]int, layers)}
}

func (a *activeSum) add(st *engine.Stats) {
	if st == nil {
		return
	}
	for i, v := range st.MeanActive {
		if v >= 0 && i < len(a.units) {
			a.units[i] += v * float64(st.Tokens)
			a.tokens[i] += st.Tokens
		}
	}
}

func (a *activeSum) mean() []float64 {
	out := make([]float64, len(a.units))
	for i := range out {
		out[i] = -1
		if a.tokens[i] > 0 {
			out[i] = a.units[i] / float64(a.tokens[i])
		}
	}
	return out
}
