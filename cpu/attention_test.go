package cpu

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// refAttention is causal softmax attention in float64 for one sequence.
func refAttention(sq *AttentionSeq, sh AttentionShape, scale float64) [][]float64 {
	hd, group := sh.HeadDim, sh.Heads/sh.KVHeads
	out := make([][]float64, sq.N*sh.Heads)
	for i := 0; i < sq.N; i++ {
		for h := 0; h < sh.Heads; h++ {
			g := h / group
			q := sq.Q[i*sq.QStride+h*hd:][:hd]
			n := sq.Pos0 + i + 1
			s := make([]float64, n)
			mx := math.Inf(-1)
			for p := range s {
				k := sq.K[p*sq.KVStride+g*hd:][:hd]
				for d := range q {
					s[p] += float64(q[d]) * float64(k[d])
				}
				s[p] *= scale
				mx = max(mx, s[p])
			}
			sum := 0.0
			for p := range s {
				s[p] = math.Exp(s[p] - mx)
				sum += s[p]
			}
			o := make([]float64, hd)
			for p, e := range s {
				v := sq.V[p*sq.KVStride+g*hd:][:hd]
				for d := range o {
					o[d] += e / sum * float64(v[d])
				}
			}
			out[i*sh.Heads+h] = o
		}
	}
	return out
}

func normals(r *rand.Rand, n int, sd float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64() * sd)
	}
	return x
}

// TestAttentionMatchesFloat64 runs batches of sequences with fresh random
// shapes (GQA groups, head sizes that are and are not multiples of the
// micro-kernel's 12 rows, cached prefixes, padded strides) through both the
// panel and the decode path (caches of several key chunks included), and
// checks every output against float64; the padding between rows of Out must
// stay untouched.
func TestAttentionMatchesFloat64(t *testing.T) {
	forEachKernel(t, func(t *testing.T) {
		r, seed := testutil.Rand(t)
		for trial := 0; trial < 8; trial++ {
			kvh := 1 + r.IntN(3)
			sh := AttentionShape{KVHeads: kvh, Heads: kvh * []int{1, 2, 4, 8}[r.IntN(4)], HeadDim: []int{64, 128, 1 + r.IntN(100)}[r.IntN(3)]}
			hd := sh.HeadDim
			scale := float32(r.Float64()*2+0.1) / float32(math.Sqrt(float64(hd)))
			seqs := make([]AttentionSeq, 1+r.IntN(3))
			const sentinel = 12345
			for s := range seqs {
				n := []int{1, 2, 1 + r.IntN(40), 100 + r.IntN(300)}[r.IntN(4)]
				pos0 := []int{0, r.IntN(50), r.IntN(400), 256 + r.IntN(600)}[r.IntN(4)]
				qs, os, kvs := sh.Heads*hd+r.IntN(9), sh.Heads*hd+r.IntN(9), kvh*hd+r.IntN(9)
				sd := 0.5 + 2*r.Float64() // up to sharply peaked softmaxes
				sq := AttentionSeq{
					Q: normals(r, n*qs, sd), QStride: qs,
					Out: make([]float32, n*os), OutStride: os,
					K: normals(r, (pos0+n)*kvs, sd), V: normals(r, (pos0+n)*kvs, 1), KVStride: kvs,
					Pos0: pos0, N: n,
				}
				for i := range sq.Out {
					sq.Out[i] = sentinel
				}
				seqs[s] = sq
			}
			if err := Attention(seqs, sh, scale); err != nil {
				t.Fatalf("seed %d: %v", seed, err)
			}
			for s := range seqs {
				sq := &seqs[s]
				want := refAttention(sq, sh, float64(scale))
				var num, den float64
				for i := 0; i < sq.N; i++ {
					row := sq.Out[i*sq.OutStride:][:sq.OutStride]
					for c := sh.Heads * hd; c < len(row); c++ {
						if row[c] != sentinel {
							t.Fatalf("seed %d: sequence %d row %d: padding column %d overwritten", seed, s, i, c)
						}
					}
					for h := 0; h < sh.Heads; h++ {
						for d, w := range want[i*sh.Heads+h] {
							e := float64(row[h*hd+d]) - w
							num += e * e
							den += w * w
						}
					}
				}
				if e := math.Sqrt(num / den); !(e < 1e-5) {
					t.Fatalf("seed %d: %+v, sequence %d (%d queries from position %d): rel err %g", seed, sh, s, sq.N, sq.Pos0, e)
				}
			}
		}
	})
}

func TestAttentionRejectsBadShapes(t *testing.T) {
	sh := AttentionShape{Heads: 4, KVHeads: 2, HeadDim: 8}
	good := func() AttentionSeq {
		return AttentionSeq{Q: make([]float32, 3*32), QStride: 32, Out: make([]float32, 3*32), OutStride: 32,
			K: make([]float32, 5*16), V: make([]float32, 5*16), KVStride: 16, Pos0: 2, N: 3}
	}
	if err := Attention([]AttentionSeq{good()}, sh, 1); err != nil {
		t.Fatalf("good call: %v", err)
	}
	bad := map[string]func(*AttentionSeq, *AttentionShape){
		"heads not a multiple of KV heads": func(_ *AttentionSeq, s *AttentionShape) { s.Heads = 3 },
		"zero head size":                   func(_ *AttentionSeq, s *AttentionShape) { s.HeadDim = 0 },
		"no queries":                       func(q *AttentionSeq, _ *AttentionShape) { q.N = 0 },
		"negative position":                func(q *AttentionSeq, _ *AttentionShape) { q.Pos0 = -1 },
		"short Q stride":                   func(q *AttentionSeq, _ *AttentionShape) { q.QStride = 31 },
		"short Out":                        func(q *AttentionSeq, _ *AttentionShape) { q.Out = q.Out[:len(q.Out)-1] },
		"short K":                          func(q *AttentionSeq, _ *AttentionShape) { q.K = q.K[:len(q.K)-1] },
		"short V":                          func(q *AttentionSeq, _ *AttentionShape) { q.V = q.V[:4*16] },
	}
	for name, f := range bad {
		sq, s := good(), sh
		f(&sq, &s)
		if err := Attention([]AttentionSeq{sq}, s, 1); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestExp2 checks the tile kernels' 2^x against math.Exp2 on fresh random
// tiles: relative error under 4e-7 for normal results, exactly 0 at and
// below -150 (masked scores are -inf), NaN kept, and the column sums.
func TestExp2(t *testing.T) {
	forEachKernel(t, func(t *testing.T) {
		r, seed := testutil.Rand(t)
		rows := 1 + r.IntN(50)
		s := make([]float32, rows*32)
		for i := range s {
			s[i] = -float32(r.ExpFloat64() * 20)
		}
		s[0], s[1], s[2], s[3] = float32(math.Inf(-1)), -150, -149.5, float32(math.NaN())
		m, sum := make([]float32, 32), make([]float32, 32)
		for j := range m {
			m[j] = float32(r.NormFloat64())
			sum[j] = float32(j)
		}
		in := append([]float32(nil), s...)
		exp2TileKernel(s, rows, m, sum)
		wantSum := make([]float64, 32)
		for j := range wantSum {
			wantSum[j] = float64(j)
		}
		for i, x := range in {
			j := i % 32
			want := math.Exp2(float64(x - m[j]))
			got := float64(s[i])
			switch {
			case math.IsNaN(float64(x)):
				if !math.IsNaN(got) {
					t.Fatalf("seed %d: 2^NaN = %g", seed, got)
				}
				continue
			case x-m[j] <= -150:
				if got != 0 {
					t.Fatalf("seed %d: 2^%g = %g, want 0", seed, x-m[j], got)
				}
			case x-m[j] >= -126:
				if math.Abs(got-want) > 4e-7*want {
					t.Fatalf("seed %d: 2^%g = %g, want %g", seed, x-m[j], got, want)
				}
			default: // subnormal results
				if math.Abs(got-want) > 0x1p-149+4e-7*want {
					t.Fatalf("seed %d: 2^%g = %g, want %g", seed, x-m[j], got, want)
				}
			}
			wantSum[j] += got
		}
		for j := 1; j < 32; j++ { // column 3 holds the NaN
			if j != 3 && math.Abs(float64(sum[j])-wantSum[j]) > 1e-5*wantSum[j] {
				t.Fatalf("seed %d: column %d sums to %g, want %g", seed, j, sum[j], wantSum[j])
			}
		}
	})
}

// BenchmarkAttention times one prefill of 1024 tokens, 16 heads of 64.
func BenchmarkAttention(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 2))
	sh := AttentionShape{Heads: 16, KVHeads: 16, HeadDim: 64}
	n, w := 1024, 16*64
	sq := AttentionSeq{Q: normals(r, n*w, 1), QStride: w, Out: make([]float32, n*w), OutStride: w,
		K: normals(r, n*w, 1), V: normals(r, n*w, 1), KVStride: w, N: n}
	b.SetBytes(0)
	for b.Loop() {
		if err := Attention([]AttentionSeq{sq}, sh, 0.125); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(n)*float64(n)/2*float64(w)*4*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
}

// BenchmarkAttentionDecode times one decode step (one new query per
// sequence) of 32 heads of 64 over a 2048-token cache: the decode path.
func BenchmarkAttentionDecode(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 3))
	sh := AttentionShape{Heads: 32, KVHeads: 32, HeadDim: 64}
	n, w := 2048, 32*64
	sq := AttentionSeq{Q: normals(r, w, 1), QStride: w, Out: make([]float32, w), OutStride: w,
		K: normals(r, n*w, 1), V: normals(r, n*w, 1), KVStride: w, Pos0: n - 1, N: 1}
	for b.Loop() {
		if err := Attention([]AttentionSeq{sq}, sh, 0.125); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(2*n*w*4)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
}
