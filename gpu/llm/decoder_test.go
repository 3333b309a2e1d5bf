package llm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/generate"
	"github.com/twell-ai/twell/sample"
)

// hostPick is package sample's pick of draw d among the first vocab logits.
func hostPick(t *testing.T, logits []float32, vocab int, d sample.Draw) int {
	t.Helper()
	id, err := enginetest.PickOf(logits, vocab, d)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// randomDraws returns S draws at random settings (about a quarter greedy),
// at random indices.
func randomDraws(r *rand.Rand, S int) []sample.Draw {
	draws := make([]sample.Draw, S)
	for i := range draws {
		d := sample.Draw{Temperature: []float64{0, 0.3, 0.8, 1, 1.7}[r.IntN(5)], TopP: 1, Seed: r.Uint64(), Index: uint64(r.IntN(1000))}
		if r.IntN(2) == 0 {
			d.TopK = []int{1, 2, 5, 50, 1000}[r.IntN(5)]
		}
		if r.IntN(2) == 0 {
			d.TopP = []float64{0.1, 0.5, 0.9, 0.95, 0.999}[r.IntN(5)]
		}
		draws[i] = d
	}
	return draws
}

// TestDecoderMatchesForward decodes a batch of prompts twice on one engine,
// greedily or drawing at random settings: step by step through Forward with
// the picks made on the host (package sample), and through a Decoder with
// two steps queued ahead. The tokens must be the same, on both MLP paths,
// for one and several sequences, with the picks limited to part of the
// vocabulary, and with a Forward that grows the workspace between two
// queued steps.
func TestDecoderMatchesForward(t *testing.T) {
	c := testConfig(64, 4, 2, true)
	e, r, seed := gpuEngine(t, c, "")
	const steps = 12
	for _, path := range []string{"sparse", "dense"} {
		if err := e.SetMLPPath(pathOf(t, path)); err != nil {
			t.Fatal(err)
		}
		for _, S := range []int{1, 3, 8} {
			vocab := c.VocabSize - r.IntN(2)*(1+r.IntN(c.VocabSize/2))
			prompts := make([][]int, S)
			for i := range prompts {
				prompts[i] = enginetest.Tokens(r, 1+r.IntN(40), c.VocabSize)
			}
			capacity := 40 + steps + 1
			var draws []sample.Draw // nil: greedy
			if r.IntN(3) > 0 {
				draws = randomDraws(r, S)
			}
			draw := func(s, n int) sample.Draw {
				if draws == nil {
					return sample.Draw{TopP: 1}
				}
				d := draws[s]
				d.Index += uint64(n)
				return d
			}
			// The reference: Forward and host picks.
			caches := enginetest.Caches(t, e, S, capacity)
			logits, _ := enginetest.Forward(t, e, caches, prompts, false)
			first := make([]int, S)
			for i, l := range logits {
				first[i] = hostPick(t, l, vocab, draw(i, 0))
			}
			want := make([][]int, steps)
			cur := first
			for i := range want {
				step := make([][]int, S)
				for s, id := range cur {
					step[s] = []int{id}
				}
				logits, _ = enginetest.Forward(t, e, caches, step, false)
				want[i] = make([]int, S)
				for s, l := range logits {
					want[i][s] = hostPick(t, l, vocab, draw(s, 1+i))
				}
				cur = want[i]
			}
			// The decoder.
			caches = enginetest.Caches(t, e, S, capacity)
			enginetest.Forward(t, e, caches, prompts, false)
			var next []sample.Draw
			for i := range draws {
				next = append(next, draw(i, 1))
			}
			d, err := e.NewDecoder(caches, vocab, next)
			if err != nil {
				t.Fatalf("seed %d: %v", seed, err)
			}
			if err := d.Queue(first); err != nil {
				t.Fatalf("seed %d: %v", seed, err)
			}
			grow := enginetest.Tokens(r, 300, c.VocabSize)
			for i := range steps {
				if i+1 < steps {
					if err := d.Queue(nil); err != nil {
						t.Fatalf("seed %d: %s S=%d: queue step %d: %v", seed, path, S, i+1, err)
					}
				}
				if i == steps/2 { // a Forward, and a workspace that grows, between queued steps
					enginetest.Forward(t, e, enginetest.Caches(t, e, 1, len(grow)), [][]int{grow}, false)
				}
				got, err := d.Next()
				if err != nil {
					t.Fatalf("seed %d: %s S=%d: step %d: %v", seed, path, S, i, err)
				}
				if !slices.Equal(got, want[i]) {
					t.Fatalf("seed %d: %s S=%d vocab %d draws %+v: step %d picked %v, Forward and host picks %v", seed, path, S, vocab, draws, i, got, want[i])
				}
			}
			if err := d.Close(); err != nil {
				t.Fatal(err)
			}
			for i, c := range caches {
				if want := len(prompts[i]) + steps; c.Len() != want {
					t.Errorf("seed %d: cache %d holds %d positions after the decoder, want %d", seed, i, c.Len(), want)
				}
				c.Free()
			}
		}
	}
	if e.GraphReplays() == 0 || e.GraphError() != nil {
		t.Errorf("seed %d: %d graph replays (error %v)", seed, e.GraphReplays(), e.GraphError())
	}
}

// TestDecoderErrors checks the decoder's misuse errors, and that a failed
// Queue changes no cache.
func TestDecoderErrors(t *testing.T) {
	c := testConfig(64, 4, 2, true)
	e, r, seed := gpuEngine(t, c, "sparse")
	caches := enginetest.Caches(t, e, 2, 8)
	enginetest.Forward(t, e, caches, [][]int{enginetest.Tokens(r, 3, c.VocabSize), enginetest.Tokens(r, 5, c.VocabSize)}, false)
	if _, err := e.NewDecoder(nil, 0, nil); err == nil {
		t.Error("a decoder of no sequences was made")
	}
	if _, err := e.NewDecoder([]engine.Cache{caches[0], caches[0]}, 0, nil); err == nil {
		t.Error("a decoder of one cache twice was made")
	}
	if _, err := e.NewDecoder(caches, c.VocabSize+1, nil); err == nil {
		t.Error("a decoder picking past the vocabulary was made")
	}
	if _, err := e.NewDecoder(caches, 0, randomDraws(r, 1)); err == nil {
		t.Error("a decoder with one draw for two sequences was made")
	}
	bad := randomDraws(r, 2)
	bad[1].TopP = 0
	if _, err := e.NewDecoder(caches, 0, bad); err == nil {
		t.Error("a decoder with top-p 0 was made")
	}
	d, err := e.NewDecoder(caches, 0, nil)
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	if _, err := d.Next(); err == nil {
		t.Error("Next with no step queued gave no error")
	}
	if err := d.Queue(nil); err == nil {
		t.Error("Queue(nil) with no step before gave no error")
	}
	if err := d.Queue([]int{1}); err == nil {
		t.Error("one token for two sequences gave no error")
	}
	if err := d.Queue([]int{1, c.VocabSize}); err == nil {
		t.Error("a token outside the vocabulary gave no error")
	}
	if caches[0].Len() != 3 || caches[1].Len() != 5 {
		t.Errorf("failed Queues changed the caches: %d and %d positions", caches[0].Len(), caches[1].Len())
	}
	if err := d.Queue([]int{1, 2}); err != nil {
		t.Fatal(err)
	}
	if err := d.Queue(nil); err != nil {
		t.Fatal(err)
	}
	if err := d.Queue(nil); err == nil {
		t.Error("a third step queued before Next gave no error")
	}
	for range 2 {
		if _, err := d.Next(); err != nil {
			t.Fatal(err)
		}
	}
	// The caches hold 8 positions: one more step fills the second.
	if err := d.Queue(nil); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Next(); err != nil {
		t.Fatal(err)
	}
	if err := d.Queue(nil); err == nil {
		t.Error("a step past a cache's capacity gave no error")
	}
	if caches[0].Len() != 6 || caches[1].Len() != 8 {
		t.Errorf("the failed Queue changed the caches: %d and %d positions, want 6 and 8", caches[0].Len(), caches[1].Len())
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Queue([]int{1, 2}); err == nil {
		t.Error("Queue after Close gave no error")
	}
	if err := d.Close(); err != nil {
		t.Errorf("a second Close: %v", err)
	}
}

// TestPickRows runs pick_rows on rows of random logits with NaN, +Inf,
// -Inf and ties, rows with nothing to sample, rows whose length is not a
// multiple of 4 and picks limited to part of a row, each row greedy or a
// draw at random settings (temperature, top-k, top-p, seed, index, the
// launch's step): each pick and no-candidate flag must be what package
// sample gives, bit for bit.
func TestPickRows(t *testing.T) {
	c := testConfig(64, 4, 2, true)
	e, r, seed := gpuEngine(t, c, "")
	dev := e.Device()
	for _, shape := range []struct{ ld, vocab int }{{384, 384}, {384, 101}, {389, 389}, {4099, 4001}, {49152, 49152}} {
		const rows = 48
		x := make([]float32, rows*shape.ld)
		scale := []float64{0.3, 1, 3, 10}[r.IntN(4)]
		for i := range x {
			x[i] = float32(r.NormFloat64() * scale)
		}
		nan, inf := float32(math.NaN()), float32(math.Inf(1))
		for row := range rows {
			v := x[row*shape.ld : row*shape.ld+shape.vocab]
			switch row % 10 {
			case 1: // ties at the maximum
				m := slices.Max(v)
				for range 3 {
					v[r.IntN(len(v))] = m
				}
			case 2: // NaNs
				for range 1 + len(v)/10 {
					v[r.IntN(len(v))] = nan
				}
			case 3: // two +Inf
				v[r.IntN(len(v))], v[r.IntN(len(v))] = inf, inf
			case 4: // all -Inf, some NaN
				fill(v, -inf)
				v[r.IntN(len(v))] = nan
				v[0] = nan
			case 5: // all NaN
				fill(v, nan)
			case 6: // the maximum past the vocabulary, -Inf inside
				v[r.IntN(len(v))] = -inf
				if shape.vocab < shape.ld {
					x[row*shape.ld+shape.vocab] = 100
				}
			case 7: // the last value the largest
				v[len(v)-1] = 50
			case 8: // few distinct values: many ties at every cut
				for i := range v {
					v[i] = float32(r.IntN(4))
				}
			}
		}
		for _, draws := range [][]sample.Draw{nil, randomDraws(r, rows)} {
			step := uint64(r.IntN(3))
			got := pickRows(t, dev, e, x, rows, shape.ld, shape.vocab, draws, step)
			for row := range rows {
				v := x[row*shape.ld : row*shape.ld+shape.vocab]
				d := sample.Draw{TopP: 1}
				if draws != nil {
					d = draws[row]
					d.Index += step
				}
				o := sample.Greedy()
				o.Temperature, o.TopK, o.TopP, o.Seed = d.Temperature, d.TopK, d.TopP, d.Seed
				sm, err := sample.New(o)
				if err != nil {
					t.Fatal(err)
				}
				want := sm.Sample(v, nil, d.Index)
				_, perr := sm.Pick(v, nil, d.Index)
				none := errors.Is(perr, sample.ErrNoCandidate)
				if int(got[row]) != want || (got[rows+row] != 0) != none {
					t.Errorf("seed %d: ld %d vocab %d row %d (case %d) draw %+v: pick %d, no candidate %d; want %d, %v",
						seed, shape.ld, shape.vocab, row, row%10, d, got[row], got[rows+row], want, none)
				}
			}
		}
	}
}

func fill(v []float32, x float32) {
	for i := range v {
		v[i] = x
	}
}

// pickRows runs pick_rows on rows of ld logits with draws (nil: greedy) at
// step and returns the picks, then the no-candidate flags.
func pickRows(t *testing.T, dev *cuda.Device, e *Engine, x []float32, rows, ld, vocab int, draws []sample.Draw, step uint64) []int32 {
	t.Helper()
	in, err := dev.Alloc(4 * len(x))
	if err != nil {
		t.Fatal(err)
	}
	defer in.Free()
	out, err := dev.Alloc(8 * rows)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Free()
	if err := dev.CopyHtoD(in, cuda.Bytes(x)); err != nil {
		t.Fatal(err)
	}
	words, err := drawWords(draws, rows)
	if err != nil {
		t.Fatal(err)
	}
	var params any = cuda.DevicePtr(0)
	if words != nil {
		p, err := dev.Alloc(len(words))
		if err != nil {
			t.Fatal(err)
		}
		defer p.Free()
		if err := dev.CopyHtoD(p, words); err != nil {
			t.Fatal(err)
		}
		params = p
	}
	err = e.k.pick.Launch(cuda.Dim3{uint32(rows), 1, 1}, cuda.Dim3{pickThreads, 1, 1}, 0, e.stream,
		in, int32(ld), int32(vocab), params, step, view(out, 0, 4*rows), view(out, 4*rows, 4*rows))
	if err != nil {
		t.Fatal(err)
	}
	if err := e.stream.Synchronize(); err != nil {
		t.Fatal(err)
	}
	got := make([]int32, 2*rows)
	if err := dev.CopyDtoH(cuda.Bytes(got), out); err != nil {
		t.Fatal(err)
	}
	return got
}

// hostOnly hides an engine's DeviceSampling, so that generate.Run picks on
// the host.
type hostOnly struct{ engine.Engine }

// TestGenerateOnDeviceMatchesHost runs generations through generate.Run on
// the GPU engine, which decodes through a Decoder, and on the same engine
// with the picks made on the host: the same tokens, text and stop reason,
// greedy ending at the token limit, at an end-of-sequence token, at a stop
// string, and with the picks limited to part of the vocabulary, and drawn
// at a temperature, with top-k and top-p.
func TestGenerateOnDeviceMatchesHost(t *testing.T) {
	c := testConfig(64, 4, 2, true)
	e, r, seed := gpuEngine(t, c, "sparse")
	prompt := enginetest.Tokens(r, 1+r.IntN(30), c.VocabSize)
	base := generate.Options{MaxTokens: 24, Context: c.MaxPositionEmbeddings, Sample: sample.Greedy()}
	run := func(eng engine.Engine, o generate.Options) *generate.Result {
		t.Helper()
		res, err := generate.Run(eng, enginetest.IDText{}, prompt, o, nil)
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		return res
	}
	first := run(hostOnly{e}, base)
	cases := map[string]generate.Options{"limit": base}
	if n := len(first.Tokens); n > 2 {
		o := base
		o.EOS = []int{first.Tokens[n/2]}
		cases["eos"] = o
		o = base
		o.Stop = []string{fmt.Sprintf("%d><", first.Tokens[n/3])}
		cases["stop"] = o
	}
	o := base
	o.Vocab = c.VocabSize / 3
	cases["vocab"] = o
	o = base
	o.MaxTokens = 1
	cases["one token"] = o
	for _, sm := range []sample.Options{
		{Temperature: 0.8, TopP: 1, RepetitionPenalty: 1, Seed: r.Uint64()},
		{Temperature: 1.3, TopK: 40, TopP: 0.9, RepetitionPenalty: 1, Seed: r.Uint64()},
	} {
		o = base
		o.Sample = sm
		cases[fmt.Sprintf("draws %+v", sm)] = o
	}
	for name, o := range cases {
		want, got := run(hostOnly{e}, o), run(e, o)
		if !slices.Equal(got.Tokens, want.Tokens) || got.Text != want.Text || got.Reason != want.Reason {
			t.Errorf("seed %d: %s: on the device %v %q (%v), on the host %v %q (%v)", seed, name,
				got.Tokens, got.Text, got.Reason, want.Tokens, want.Text, want.Reason)
		}
	}
}

// TestForwardSampleMatchesForward runs passes of prompts and decode tokens
// of several sequences, some still on their prompt beside others decoding,
// through ForwardSample (greedy, or drawing at random settings) and, on
// copies of the caches, Forward with the picks made on the host: the same
// picks, the same cache lengths, on both MLP paths, with the picks limited
// to part of the vocabulary.
func TestForwardSampleMatchesForward(t *testing.T) {
	c := testConfig(64, 4, 2, true)
	e, r, seed := gpuEngine(t, c, "")
	for _, path := range []string{"sparse", "dense"} {
		if err := e.SetMLPPath(pathOf(t, path)); err != nil {
			t.Fatal(err)
		}
		S := 1 + r.IntN(9)
		vocab := c.VocabSize - r.IntN(2)*(1+r.IntN(c.VocabSize/2))
		ref, dev := enginetest.Caches(t, e, S, 200), enginetest.Caches(t, e, S, 200)
		for pass := range 8 {
			toks := make([][]int, S)
			for i := range toks {
				toks[i] = enginetest.Tokens(r, 1+r.IntN(3)*r.IntN(20), c.VocabSize)
			}
			var draws []sample.Draw
			if pass%2 == 1 {
				draws = randomDraws(r, S)
			}
			logits, _ := enginetest.Forward(t, e, ref, toks, false)
			got, _, err := e.ForwardSample(dev, toks, vocab, draws)
			if err != nil {
				t.Fatalf("seed %d: %s pass %d: %v", seed, path, pass, err)
			}
			for i, l := range logits {
				d := sample.Draw{TopP: 1}
				if draws != nil {
					d = draws[i]
				}
				if want := hostPick(t, l, vocab, d); got[i] != want || dev[i].Len() != ref[i].Len() {
					t.Fatalf("seed %d: %s pass %d sequence %d draw %+v: pick %d with %d positions, want %d with %d",
						seed, path, pass, i, d, got[i], dev[i].Len(), want, ref[i].Len())
				}
			}
		}
	}
	if _, _, err := e.ForwardSample(enginetest.Caches(t, e, 1, 4), [][]int{{1}}, -1, nil); err == nil {
		t.Error("a negative vocab gave no error")
	}
	if _, _, err := e.ForwardSample(enginetest.Caches(t, e, 1, 4), [][]int{{1}}, 0, randomDraws(r, 2)); err == nil {
		t.Error("two draws for one sequence gave no error")
	}
}

// TestDrawWords checks the draws' layout as pick.cu's DrawParams reads
// them (temperature and top-p as float32, top-k as int32, seed and index as
// uint64), that all-greedy draws need none, and the errors.
func TestDrawWords(t *testing.T) {
	draws := []sample.Draw{
		{Temperature: 0.8, TopK: 40, TopP: 0.95, Seed: 0x0123456789abcdef, Index: 7},
		{Temperature: 0, TopP: 1},
		{Temperature: 1e300, TopK: math.MaxInt, TopP: 0.5, Seed: 1, Index: 1 << 40},
	}
	w, err := drawWords(draws, 3)
	if err != nil {
		t.Fatal(err)
	}
	if len(w) != 3*drawParamsSize {
		t.Fatalf("%d bytes for 3 draws, want %d", len(w), 3*drawParamsSize)
	}
	f32 := func(b []byte) float32 { return math.Float32frombits(binary.LittleEndian.Uint32(b)) }
	for i, want := range []struct {
		temp, topP float32
		topK       int32
		seed, at   uint64
	}{{0.8, 0.95, 40, 0x0123456789abcdef, 7}, {0, 1, 0, 0, 0}, {1e30, 0.5, math.MaxInt32, 1, 1 << 40}} {
		p := w[i*drawParamsSize:]
		got := struct {
			temp, topP float32
			topK       int32
			seed, at   uint64
		}{f32(p[0:]), f32(p[4:]), int32(binary.LittleEndian.Uint32(p[8:])), binary.LittleEndian.Uint64(p[16:]), binary.LittleEndian.Uint64(p[24:])}
		if got != want {
			t.Errorf("draw %d: %+v, want %+v", i, got, want)
		}
	}
	if w, err := drawWords([]sample.Draw{{TopP: 1}, {TopP: 1}}, 2); w != nil || err != nil {
		t.Errorf("greedy draws: %d bytes, error %v; want none", len(w), err)
	}
	if w, err := drawWords(nil, 4); w != nil || err != nil {
		t.Errorf("no draws: %d bytes, error %v; want none", len(w), err)
	}
	for _, bad := range [][]sample.Draw{{{TopP: 1}}, {{TopP: 0}, {TopP: 1}}, {{Temperature: -1, TopP: 1}, {TopP: 1}}} {
		if _, err := drawWords(bad, 2); err == nil {
			t.Errorf("draws %+v for 2 sequences: no error", bad)
		}
	}
}
