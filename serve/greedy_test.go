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

// greedyEngine is a countingEngine that also makes greedy picks "on its
// device" (engine.GreedyDecoding), by its Forward and package sample's
// greedy pick, counting the passes that did.
type greedyEngine struct {
	*countingEngine
	picked atomic.Int64
}

func (e *greedyEngine) ForwardGreedy(cs []engine.Cache, toks [][]int, vocab int) ([]int, *engine.Stats, error) {
	e.picked.Add(1)
	logits, st, err := e.countingEngine.Forward(cs, toks, false)
	if err != nil {
		return nil, nil, err
	}
	sm, err := sample.New(sample.Greedy())
	if err != nil {
		return nil, nil, err
	}
	picks := make([]int, len(logits))
	for i, l := range logits {
		if vocab > 0 {
			l = l[:vocab]
		}
		if picks[i], err = sm.Pick(l, nil); errors.Is(err, sample.ErrNoCandidate) {
			picks[i] = -1
		} else if err != nil {
			return nil, nil, err
		}
	}
	return picks, st, nil
}

func (e *greedyEngine) NewDecoder([]engine.Cache, int) (engine.Decoder, error) {
	return nil, errors.New("the server does not use decoders")
}

// TestGreedyStepsPickOnEngine runs greedy requests beside a sampled one and
// one that wants log-probabilities on an engine that can pick greedily
// itself: the greedy requests' texts are those of a greedy generation
// alone; the steps where every request is greedy without log-probabilities
// pick on the engine (ForwardGreedy), the others copy logits back; with
// PicksOnHost none picks on the engine.
func TestGreedyStepsPickOnEngine(t *testing.T) {
	for _, onHost := range []bool{false, true} {
		t.Run(fmt.Sprintf("picks on host %v", onHost), func(t *testing.T) {
			ce, tok := tinyEngine(t)
			e := &greedyEngine{countingEngine: ce}
			o := DefaultOptions()
			o.PicksOnHost = onHost
			s, hs := serveOn(t, e, tok, o)
			prompts := []string{"Once upon a time", "The", "A long time ago in a galaxy far, far away", "1 2 3 4 5 6"}
			alone := make([]string, len(prompts))
			for i, p := range prompts {
				alone[i] = direct(t, s, p, 24).Text
			}
			s.stepHook = func() { time.Sleep(time.Millisecond) }
			got := make([]string, len(prompts))
			var wg sync.WaitGroup
			for i, p := range prompts {
				wg.Go(func() {
					code, out := post(t, hs.URL+"/v1/completions", map[string]any{"prompt": p, "max_tokens": 24, "temperature": 0})
					if code != 200 {
						t.Errorf("status %d: %v", code, out)
						return
					}
					got[i] = choice(t, out)["text"].(string)
				})
			}
			// A sampled request and one with log-probabilities join while
			// the greedy ones run.
			for _, body := range []map[string]any{
				{"prompt": "Hello", "max_tokens": 8, "temperature": 0.8, "seed": 3},
				{"prompt": "Hello", "max_tokens": 8, "temperature": 0, "logprobs": 2},
			} {
				wg.Go(func() {
					time.Sleep(10 * time.Millisecond)
					if code, out := post(t, hs.URL+"/v1/completions", body); code != 200 {
						t.Errorf("%v: status %d: %v", body, code, out)
					}
				})
			}
			wg.Wait()
			for i := range prompts {
				if got[i] != alone[i] {
					t.Errorf("prompt %q: %q in the batch, %q alone", prompts[i], got[i], alone[i])
				}
			}
			picked, calls := e.picked.Load(), int64(len(e.forwardCalls()))
			switch {
			case onHost && picked != 0:
				t.Errorf("with PicksOnHost %d of %d passes picked on the engine", picked, calls)
			case !onHost && (picked == 0 || picked == calls):
				t.Errorf("%d of %d passes picked on the engine: want some, not all", picked, calls)
			}
			waitIdle(t, s, ce)
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
