package serve

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
)

// instantEngine answers every Forward at once with fixed logits, so that a
// benchmark over it times what the server itself does per step: batching,
// sampling, detokenising and streaming.
type instantEngine struct {
	c    model.Config
	rows [][]float32 // a few logits rows, each peaked at another token
	out  [][]float32
}

type instantCache struct{ n, cap int }

func (c *instantCache) Len() int      { return c.n }
func (c *instantCache) Capacity() int { return c.cap }
func (c *instantCache) Truncate(n int) error {
	if n < 0 || n > c.n {
		return errors.New("truncate past the end")
	}
	c.n = n
	return nil
}
func (c *instantCache) Free() error { return nil }

func (e *instantEngine) Config() model.Config { return e.c }
func (e *instantEngine) NewCache(n int) (engine.Cache, error) {
	return &instantCache{cap: n}, nil
}
func (e *instantEngine) SetMLPPath(mlp.Path) error { return nil }
func (e *instantEngine) Close() error              { return nil }

func (e *instantEngine) Forward(cs []engine.Cache, toks [][]int, all bool) ([][]float32, *engine.Stats, error) {
	e.out = e.out[:0]
	n := 0
	for i, c := range cs {
		ic := c.(*instantCache)
		if ic.n+len(toks[i]) > ic.cap {
			return nil, nil, errors.New("past the capacity")
		}
		ic.n += len(toks[i])
		k := 1
		if all {
			k = len(toks[i])
		}
		for j := range k {
			e.out = append(e.out, e.rows[(ic.n+j)%len(e.rows)])
		}
		n += len(toks[i])
	}
	return e.out, engine.NewStats(n, e.c.NumHiddenLayers), nil
}

// BenchmarkServeStreams streams 64 completions of 64 tokens at once
// through the server over an engine that costs nothing, greedy and at
// temperature 0.8: output tokens/s is the server's own ceiling.
func BenchmarkServeStreams(b *testing.B) {
	for _, temp := range []float64{0, 0.8} {
		name := "greedy"
		if temp > 0 {
			name = "t0.8"
		}
		b.Run(name, func(b *testing.B) { serveStreams(b, temp) })
	}
}

func serveStreams(b *testing.B, temp float64) {
	m, tok := enginetest.TinyModel(b, 512)
	c := m.Config
	e := &instantEngine{c: c}
	for i := range 16 {
		row := make([]float32, c.VocabSize)
		for j := range row {
			row[j] = float32((j*7919+i*104729)%1000) / 1000
		}
		row[1000+37*i] = 5 // a word piece, not the end of text
		e.rows = append(e.rows, row)
	}
	o := DefaultOptions()
	o.MaxConcurrent, o.MaxQueue, o.Context = 64, 64, 512
	s, err := New(e, tok, o)
	if err != nil {
		b.Fatal(err)
	}
	hs := httptest.NewServer(s.Handler())
	defer func() {
		hs.Close()
		done := make(chan struct{})
		close(done)
		s.Shutdown(done)
	}()
	body, _ := json.Marshal(map[string]any{"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 64,
		"temperature": temp, "seed": 7, "stream": true, "ignore_eos": true})
	const clients = 64
	b.ResetTimer()
	for range b.N {
		var wg sync.WaitGroup
		errs := make(chan error, clients)
		for range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp, err := http.Post(hs.URL+"/v1/completions", "application/json", bytes.NewReader(body))
				if err != nil {
					errs <- err
					return
				}
				defer resp.Body.Close()
				sc := bufio.NewScanner(resp.Body)
				n := 0
				for sc.Scan() {
					if strings.HasPrefix(sc.Text(), "data: {") {
						n++
					}
				}
				if n < 64 {
					errs <- fmt.Errorf("%d events, want at least 64", n)
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*clients*64)/b.Elapsed().Seconds(), "tokens/s")
}
