package serve

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/generate"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/sample"
)

// pickingEngine is a countingEngine that also makes its picks "on its
// device" (engine.DeviceSampling), as the GPU engine does: its Forward,
// then each sequence's draw by package sample at the draw's index. Its
// passes run each sequence alone, so that a sequence's logits, and with
// them its draws, do not depend on the batch even in the last bit (the
// CPU engine's may, in a few logits of a step). It counts its passes and
// those that picked.
type pickingEngine struct {
	*countingEngine
	passes, picked atomic.Int64
}

func (e *pickingEngine) Forward(cs []engine.Cache, toks [][]int, all bool) ([][]float32, *engine.Stats, error) {
	e.passes.Add(1)
	var logits [][]float32
	var st *engine.Stats
	for i := range cs {
		l, s, err := e.countingEngine.Forward(cs[i:i+1], toks[i:i+1], all)
		if err != nil {
			return nil, nil, err
		}
		logits, st = append(logits, l...), s
	}
	return logits, st, nil
}

func (e *pickingEngine) ForwardSample(cs []engine.Cache, toks [][]int, vocab int, draws []sample.Draw) ([]int, *engine.Stats, error) {
	e.picked.Add(1)
	logits, st, err := e.Forward(cs, toks, false)
	if err != nil {
		return nil, nil, err
	}
	picks, err := enginetest.Picks(logits, vocab, draws)
	if err != nil {
		return nil, nil, err
	}
	return picks, st, nil
}

func (e *pickingEngine) NewDecoder([]engine.Cache, int, []sample.Draw) (engine.Decoder, error) {
	return nil, errors.New("the server does not use decoders")
}

// TestStepsPickOnEngine runs greedy and sampled requests (temperature,
// top-k, top-p, a seed each) together, with one that wants
// log-probabilities joining, on an engine that can pick itself: each
// request's text is the one it gets alone, whether its tokens were drawn on
// the engine or, in the steps beside the one with log-probabilities, on
// the host; the steps where no request wants log-probabilities pick on the
// engine (ForwardSample), the others copy logits back; with PicksOnHost
// none picks on the engine.
func TestStepsPickOnEngine(t *testing.T) {
	for _, onHost := range []bool{false, true} {
		t.Run(fmt.Sprintf("picks on host %v", onHost), func(t *testing.T) {
			ce, tok := tinyEngine(t)
			e := &pickingEngine{countingEngine: ce}
			o := DefaultOptions()
			o.PicksOnHost = onHost
			srv, hs := serveOn(t, e, tok, o)
			bodies := []map[string]any{
				{"prompt": "Once upon a time", "temperature": 0},
				{"prompt": "The", "temperature": 0.8, "seed": 3},
				{"prompt": "A long time ago in a galaxy far, far away", "temperature": 1.2, "top_p": 0.9, "seed": 4},
				{"prompt": "1 2 3 4 5 6", "temperature": 0.7, "top_k": 5, "top_p": 0.95, "seed": 5},
				{"prompt": "Once upon a time", "temperature": 1, "seed": 6},
			}
			text := func(body map[string]any) string {
				b := map[string]any{"max_tokens": 24}
				for k, v := range body {
					b[k] = v
				}
				code, out := post(t, hs.URL+"/v1/completions", b)
				if code != 200 {
					t.Errorf("%v: status %d: %v", body, code, out)
					return ""
				}
				return choice(t, out)["text"].(string)
			}
			alone := make([]string, len(bodies))
			for i, b := range bodies {
				alone[i] = text(b)
			}
			before := e.picked.Load()
			got := make([]string, len(bodies))
			var wg sync.WaitGroup
			for i, b := range bodies {
				wg.Go(func() { got[i] = text(b) })
			}
			// A request with log-probabilities joins while the others run.
			wg.Go(func() {
				time.Sleep(10 * time.Millisecond)
				text(map[string]any{"prompt": "Hello", "temperature": 0, "logprobs": 2})
			})
			wg.Wait()
			for i := range bodies {
				if got[i] != alone[i] {
					t.Errorf("%v: %q in the batch, %q alone", bodies[i], got[i], alone[i])
				}
			}
			picked, calls := e.picked.Load(), e.passes.Load()
			switch {
			case onHost && picked != 0:
				t.Errorf("with PicksOnHost %d of %d passes picked on the engine", picked, calls)
			case !onHost && (before == 0 || picked == calls):
				t.Errorf("%d of %d passes picked on the engine (%d alone): want some, not all", picked, calls, before)
			}
			waitIdle(t, srv, ce)
		})
	}
}

// TestSampleAllMatchesSerial samples a step of jobs at temperatures, with
// top-p, log-probabilities and greedy picks among them, through sampleAll
// (on several goroutines) and, on twins of the same jobs, one after
// another: every job's steps and log-probabilities are the same.
func TestSampleAllMatchesSerial(t *testing.T) {
	r, seed := testutil.Rand(t)
	const vocab, jobs, steps = 3000, 24, 5
	s := &Server{vocab: vocab}
	twins := func() []*job {
		rr := rand.New(rand.NewPCG(seed, 1))
		js := make([]*job, jobs)
		for i := range js {
			o := generate.Options{MaxTokens: 64, Context: 256, Sample: sample.Greedy(), Vocab: vocab}
			if i%4 != 0 {
				o.Sample.Temperature, o.Sample.TopP, o.Sample.Seed = 0.5+rr.Float64(), 0.9, rr.Uint64()
			}
			sq, err := generate.NewSequence(enginetest.IDText{}, []int{1, 2, 3}, o)
			if err != nil {
				t.Fatal(err)
			}
			js[i] = &job{seq: sq, topN: i%3 - 1}
		}
		return js
	}
	par, ser := twins(), twins()
	for step := range steps {
		rows := make([][]float32, jobs)
		for i := range rows {
			rows[i] = make([]float32, vocab)
			for k := range rows[i] {
				rows[i][k] = float32(r.NormFloat64() * 2)
			}
		}
		dp, ds := make([]draw, jobs), make([]draw, jobs)
		for i := range dp {
			dp[i] = draw{j: par[i], last: rows[i], pick: -1}
			ds[i] = draw{j: ser[i], last: rows[i], pick: -1}
		}
		if !s.sampleAll(dp) && runtime.GOMAXPROCS(0) > 1 {
			t.Fatalf("seed %d: sampleAll left %d draws at temperatures to the caller", seed, jobs)
		}
		for i := range ds {
			s.sampleOne(&ds[i])
		}
		for i := range dp {
			if fmt.Sprint(dp[i].stp, dp[i].err, dp[i].lp) != fmt.Sprint(ds[i].stp, ds[i].err, ds[i].lp) {
				t.Fatalf("seed %d: step %d job %d: %v %v %v on goroutines, %v %v %v one after another", seed, step, i,
					dp[i].stp, dp[i].err, dp[i].lp, ds[i].stp, ds[i].err, ds[i].lp)
			}
		}
	}
}
