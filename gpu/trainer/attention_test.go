package trainer

import (
	"bytes"
	"fmt"
	"math"
	"math/rand"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/cuda/cudatest"
)

// TestAttentionCompile builds attention.cu for every supported head size to
// sm_90a machine code (NVRTC and ptxas, no GPU needed) and fails on spilled
// registers or a missing kernel.
func TestAttentionCompile(t *testing.T) {
	cudatest.Compiler(t)
	for _, hd := range attentionHeadDims {
		t.Run(fmt.Sprint("hd", hd), func(t *testing.T) {
			fwd, dkdv, dq := attentionExprs(hd)
			exprs := cuda.WithNameExpressions(fwd, dkdv, dq)
			cudatest.CleanSASS(t, "attention.cu", attentionCU, append(attentionHeaders(), exprs)...)
			prog, err := cuda.CompileProgram("attention.cu", attentionCU,
				append(attentionHeaders(), exprs, cuda.WithArch("compute_90"))...)
			if err != nil {
				t.Fatal(err)
			}
			if n := strings.Count(string(prog.Image), ".entry "); n != 4 {
				t.Errorf("%d kernels in the PTX, want 4", n)
			}
		})
	}
	t.Run("wgmma", func(t *testing.T) {
		cudatest.CleanSASS(t, "attention_wgmma.cu", attentionWGMMACU, attentionHeaders()...)
		prog, err := cuda.CompileProgram("attention_wgmma.cu", attentionWGMMACU,
			append(attentionHeaders(), cuda.WithArch("compute_90a"))...)
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"attn_fwd_wg", "attn_bwd_dkdv_wg", "attn_bwd_dq_wg"} {
			if !strings.Contains(string(prog.Image), ".entry "+k+"(") {
				t.Errorf("kernel %s missing from the PTX", k)
			}
		}
	})
}

// TestAttentionShapeErrors checks that newAttention names a bad shape
// before it touches the device.
func TestAttentionShapeErrors(t *testing.T) {
	for _, c := range []struct {
		batch, seq, nq, nkv, hd int
		want                    string
	}{
		{0, 16, 4, 4, 64, "positive"},
		{1, 16, 6, 4, 64, "multiple of nkv"},
		{1, 16, 4, 4, 48, "head size 48"},
		{1, 16, 4, 4, 96, "head size 96"},
		{1, 16, 4, 4, 256, "head size 256"},
		{70000, 16, 4, 4, 64, "65535"},
	} {
		_, err := newAttention(nil, nil, c.batch, c.seq, c.nq, c.nkv, c.hd)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("newAttention(batch %d, seq %d, nq %d, nkv %d, hd %d) = %v, want an error with %q",
				c.batch, c.seq, c.nq, c.nkv, c.hd, err, c.want)
		}
	}
}

// attnShape is one attention test shape.
type attnShape struct{ batch, seq, nq, nkv, hd int }

func (c attnShape) String() string {
	return fmt.Sprintf("b%d_s%d_q%d_kv%d_hd%d", c.batch, c.seq, c.nq, c.nkv, c.hd)
}

// attnShapes are the GPU test shapes: MHA and GQA (groups 2, 4, 8), every
// head size, sequences shorter than, equal to and not a multiple of the
// 64-row tiles, batch 1 to 3.
var attnShapes = []attnShape{
	{2, 100, 4, 4, 64},
	{1, 64, 2, 2, 32},
	{3, 77, 2, 2, 128},
	{1, 1, 2, 1, 32},
	{2, 130, 8, 2, 64},
	{1, 257, 8, 1, 128},
	{2, 200, 6, 3, 32},
	{1, 150, 4, 1, 32},
	{1, 2048, 2, 1, 64},
}

// attnRef is the float64 reference of causal attention: out and lse of the
// forward pass, and dqkv of the backward pass for dout.
type attnRef struct {
	out, lse, dqkv []float64
}

// attentionReference computes attnRef from bf16 qkv and dout (as float64).
func attentionReference(c attnShape, qkv, dout []float64) attnRef {
	W, OW, G := (c.nq+2*c.nkv)*c.hd, c.nq*c.hd, c.nq/c.nkv
	scale := 1 / math.Sqrt(float64(c.hd))
	r := attnRef{out: make([]float64, c.batch*c.seq*OW), lse: make([]float64, c.batch*c.nq*c.seq),
		dqkv: make([]float64, c.batch*c.seq*W)}
	p := make([]float64, c.seq)
	dp := make([]float64, c.seq)
	for b := 0; b < c.batch; b++ {
		row := func(pos int) int { return (b*c.seq + pos) * W }
		for h := 0; h < c.nq; h++ {
			kh := h / G
			qo, ko, vo := h*c.hd, (c.nq+kh)*c.hd, (c.nq+c.nkv+kh)*c.hd
			for i := 0; i < c.seq; i++ {
				q := qkv[row(i)+qo : row(i)+qo+c.hd]
				m := math.Inf(-1)
				for j := 0; j <= i; j++ {
					k := qkv[row(j)+ko : row(j)+ko+c.hd]
					s := 0.0
					for d := range q {
						s += q[d] * k[d]
					}
					p[j] = s * scale
					m = math.Max(m, p[j])
				}
				l := 0.0
				for j := 0; j <= i; j++ {
					l += math.Exp(p[j] - m)
				}
				lse := m + math.Log(l)
				r.lse[(b*c.nq+h)*c.seq+i] = lse
				o := r.out[(b*c.seq+i)*OW+qo : (b*c.seq+i)*OW+qo+c.hd]
				do := dout[(b*c.seq+i)*OW+qo : (b*c.seq+i)*OW+qo+c.hd]
				for j := 0; j <= i; j++ {
					p[j] = math.Exp(p[j] - lse)
					v := qkv[row(j)+vo : row(j)+vo+c.hd]
					s := 0.0
					for d := range o {
						o[d] += p[j] * v[d]
						s += do[d] * v[d]
					}
					dp[j] = s
				}
				D := 0.0
				for d := range o {
					D += do[d] * o[d]
				}
				dq := r.dqkv[row(i)+qo : row(i)+qo+c.hd]
				for j := 0; j <= i; j++ {
					ds := p[j] * (dp[j] - D) * scale
					k := qkv[row(j)+ko : row(j)+ko+c.hd]
					dk := r.dqkv[row(j)+ko : row(j)+ko+c.hd]
					dv := r.dqkv[row(j)+vo : row(j)+vo+c.hd]
					for d := range dq {
						dq[d] += ds * k[d]
						dk[d] += ds * q[d]
						dv[d] += p[j] * do[d]
					}
				}
			}
		}
	}
	return r
}

// relErr returns ||a - b|| / ||b|| over the elements where pick is true
// (all when pick is nil).
func relErr(a, b []float64, pick func(i int) bool) float64 {
	var num, den float64
	for i := range b {
		if pick != nil && !pick(i) {
			continue
		}
		num += (a[i] - b[i]) * (a[i] - b[i])
		den += b[i] * b[i]
	}
	if den == 0 {
		return math.Sqrt(num)
	}
	return math.Sqrt(num / den)
}

// randBF16 returns n bf16 values drawn from N(0, 1) and their float64 values.
func randBF16(rng *rand.Rand, n int) ([]uint16, []float64) {
	h, f := make([]uint16, n), make([]float64, n)
	for i := range h {
		h[i] = bf16.FromFloat32(float32(rng.NormFloat64()))
		f[i] = float64(bf16.ToFloat32(h[i]))
	}
	return h, f
}

// attnRun holds the device buffers of one attention test.
type attnRun struct {
	a                         *attention
	qkv, out, lse, dout, dqkv *cuda.Buffer
	qkvH, doutH               []uint16
	qkvF, doutF               []float64
	W, OW, tokens             int
}

// newAttnRun allocates and fills the buffers of shape c with random qkv
// and dout from rng; out, lse and dqkv start as NaN so that an element a
// kernel fails to write shows.
func newAttnRun(t testing.TB, dev *cuda.Device, c attnShape, rng *rand.Rand) *attnRun {
	t.Helper()
	a, err := newAttention(dev, (*cublas.Handle)(nil), c.batch, c.seq, c.nq, c.nkv, c.hd)
	if err != nil {
		t.Fatal(err)
	}
	r := &attnRun{a: a, W: (c.nq + 2*c.nkv) * c.hd, OW: c.nq * c.hd, tokens: c.batch * c.seq}
	r.qkvH, r.qkvF = randBF16(rng, r.tokens*r.W)
	r.doutH, r.doutF = randBF16(rng, r.tokens*r.OW)
	alloc := func(n int) *cuda.Buffer {
		b, err := dev.Alloc(n)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Free() })
		if err := dev.Memset8(b, 0xff, nil); err != nil {
			t.Fatal(err)
		}
		return b
	}
	r.qkv, r.dout = alloc(2*r.tokens*r.W), alloc(2*r.tokens*r.OW)
	r.out, r.lse, r.dqkv = alloc(2*r.tokens*r.OW), alloc(4*c.batch*c.nq*c.seq), alloc(4*r.tokens*r.W)
	if err := dev.CopyHtoD(r.qkv, cuda.Bytes(r.qkvH)); err != nil {
		t.Fatal(err)
	}
	if err := dev.CopyHtoD(r.dout, cuda.Bytes(r.doutH)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.close() })
	return r
}

// run queues forward and backward and returns out, lse and dqkv.
func (r *attnRun) run(t *testing.T) (out []uint16, lse, dqkv []float32) {
	t.Helper()
	dev := r.a.dev
	if err := r.a.forward(nil, r.out, r.qkv, r.lse); err != nil {
		t.Fatal(err)
	}
	if err := r.a.backward(nil, attnGrad{f32: r.dqkv}, r.dout, r.qkv, r.out, r.lse); err != nil {
		t.Fatal(err)
	}
	if err := dev.Synchronize(); err != nil {
		t.Fatal(err)
	}
	out = make([]uint16, r.tokens*r.OW)
	lse = make([]float32, r.a.batch*r.a.nq*r.a.seq)
	dqkv = make([]float32, r.tokens*r.W)
	for _, c := range []struct {
		dst []byte
		src *cuda.Buffer
	}{{cuda.Bytes(out), r.out}, {cuda.Bytes(lse), r.lse}, {cuda.Bytes(dqkv), r.dqkv}} {
		if err := dev.CopyDtoH(c.dst, c.src); err != nil {
			t.Fatal(err)
		}
	}
	return out, lse, dqkv
}

// TestAttentionMatchesReference runs forward and backward on random inputs
// for every shape of attnShapes and compares out, lse and the q, k and v
// parts of dqkv with the float64 reference (relative error below 1e-2).
func TestAttentionMatchesReference(t *testing.T) {
	eachAttnKernels(t, func(t *testing.T, c attnShape, r *attnRun, _ *rand.Rand, seed int64) {
		attnMatchesReference(t, c, r, seed)
	})
}

// eachAttnKernels runs check for every shape of attnShapes, once on the
// mma.sync kernels and once on the wgmma ones where they run, each time on
// a fresh attnRun of random inputs from rng (seeded with seed).
func eachAttnKernels(t *testing.T, check func(t *testing.T, c attnShape, r *attnRun, rng *rand.Rand, seed int64)) {
	dev := cudatest.Device(t)
	seed := time.Now().UnixNano()
	for i, c := range attnShapes {
		for _, wg := range []bool{false, true} {
			name := c.String()
			if wg {
				name += "_wgmma"
			}
			t.Run(name, func(t *testing.T) {
				seed := seed + int64(i)
				rng := rand.New(rand.NewSource(seed))
				r := newAttnRun(t, dev, c, rng)
				if wg && r.a.dkdvWG == nil {
					t.Skipf("no wgmma kernels for head size %d on %v", c.hd, dev)
				}
				if !wg {
					r.a.fwdWG, r.a.dkdvWG, r.a.dqWG = nil, nil, nil
				}
				check(t, c, r, rng, seed)
			})
		}
	}
}

// attnMatchesReference runs r's forward and backward and compares out, lse
// and the q, k and v parts of dqkv with the float64 reference.
func attnMatchesReference(t *testing.T, c attnShape, r *attnRun, seed int64) {
	t.Helper()
	out, lse, dqkv := r.run(t)
	ref := attentionReference(c, r.qkvF, r.doutF)
	f64 := func(n int, at func(i int) float64) []float64 {
		v := make([]float64, n)
		for i := range v {
			v[i] = at(i)
		}
		return v
	}
	got := f64(len(out), func(i int) float64 { return float64(bf16.ToFloat32(out[i])) })
	e := relErr(got, ref.out, nil)
	if !(e < 1e-2) {
		t.Errorf("seed %d: out relative error %.3g", seed, e)
	}
	errs := fmt.Sprintf("out %.2g", e)
	got = f64(len(lse), func(i int) float64 { return float64(lse[i]) })
	if e = relErr(got, ref.lse, nil); !(e < 1e-3) {
		t.Errorf("seed %d: lse relative error %.3g", seed, e)
	}
	errs += fmt.Sprintf(", lse %.2g", e)
	got = f64(len(dqkv), func(i int) float64 { return float64(dqkv[i]) })
	qw, kw := c.nq*c.hd, c.nkv*c.hd
	for _, part := range []struct {
		name   string
		lo, hi int
	}{{"dq", 0, qw}, {"dk", qw, qw + kw}, {"dv", qw + kw, qw + 2*kw}} {
		pick := func(i int) bool { col := i % r.W; return col >= part.lo && col < part.hi }
		if e = relErr(got, ref.dqkv, pick); !(e < 1e-2) {
			t.Errorf("seed %d: %s relative error %.3g", seed, part.name, e)
		}
		errs += fmt.Sprintf(", %s %.2g", part.name, e)
	}
	t.Logf("seed %d: relative errors %s", seed, errs)
}

// TestAttentionRopedGradient runs the backward of every shape of attnShapes
// (mma.sync and wgmma kernels) both ways, fp32 and bf16 with RoPE's
// rotation turned back (random angles), and checks that the bf16 one is
// the fp32 one turned back on the host, in float64, and rounded: within
// half a bf16 step of each value, plus a little for the order of the
// products. The v part is not rotated.
func TestAttentionRopedGradient(t *testing.T) {
	eachAttnKernels(t, func(t *testing.T, c attnShape, r *attnRun, rng *rand.Rand, seed int64) {
		dev := r.a.dev
		_, _, dqkv := r.run(t)
		half := c.hd / 2
		cos, sin := make([]float32, c.seq*half), make([]float32, c.seq*half)
		for k := range cos {
			a := rng.Float64() * 2 * math.Pi
			cos[k], sin[k] = float32(math.Cos(a)), float32(math.Sin(a))
		}
		cosB, sinB, dqkvb := cudatest.Alloc(t, dev, 4*len(cos)), cudatest.Alloc(t, dev, 4*len(sin)), cudatest.Alloc(t, dev, 2*r.tokens*r.W)
		for _, u := range []struct {
			dst *cuda.Buffer
			src []float32
		}{{cosB, cos}, {sinB, sin}} {
			if err := dev.CopyHtoD(u.dst, cuda.Bytes(u.src)); err != nil {
				t.Fatal(err)
			}
		}
		if err := r.a.backward(nil, attnGrad{bf16: dqkvb, cos: cosB, sin: sinB}, r.dout, r.qkv, r.out, r.lse); err != nil {
			t.Fatal(err)
		}
		got := make([]uint16, r.tokens*r.W)
		if err := dev.CopyDtoH(cuda.Bytes(got), dqkvb); err != nil {
			t.Fatal(err)
		}
		maxAbs := 0.0
		for _, v := range dqkv {
			maxAbs = max(maxAbs, math.Abs(float64(v)))
		}
		rotHeads := c.nq + c.nkv
		for tok := range r.tokens {
			pos := tok % c.seq
			for col := range r.W {
				head, i := col/c.hd, col%c.hd
				want := float64(dqkv[tok*r.W+col])
				if head < rotHeads {
					j := i % half
					cs, sn := float64(cos[pos*half+j]), float64(sin[pos*half+j])
					a, b := float64(dqkv[tok*r.W+head*c.hd+j]), float64(dqkv[tok*r.W+head*c.hd+j+half])
					if i < half {
						want = a*cs + b*sn
					} else {
						want = b*cs - a*sn
					}
				}
				g := float64(bf16.ToFloat32(got[tok*r.W+col]))
				if d := math.Abs(g - want); d > math.Abs(want)/256+1e-6*maxAbs {
					t.Fatalf("seed %d: token %d column %d (head %d): bf16 %g, want %g", seed, tok, col, head, g, want)
				}
			}
		}
	})
}

// TestAttentionDeterministic runs forward and backward twice on the same
// inputs and checks that out, lse and dqkv are bitwise equal (the kernels
// use no atomics and a fixed order of summation).
func TestAttentionDeterministic(t *testing.T) {
	dev := cudatest.Device(t)
	seed := time.Now().UnixNano()
	c := attnShape{2, 300, 8, 2, 64}
	r := newAttnRun(t, dev, c, rand.New(rand.NewSource(seed)))
	out1, lse1, dqkv1 := r.run(t)
	out2, lse2, dqkv2 := r.run(t)
	if !bytes.Equal(cuda.Bytes(out1), cuda.Bytes(out2)) || !bytes.Equal(cuda.Bytes(lse1), cuda.Bytes(lse2)) ||
		!bytes.Equal(cuda.Bytes(dqkv1), cuda.Bytes(dqkv2)) {
		t.Errorf("seed %d, %v: two runs on the same inputs differ", seed, c)
	}
}

// TestAttentionChunks runs the backward in chunks of one sequence (a small
// scratch cap) and checks that dqkv is bitwise the one-launch result.
func TestAttentionChunks(t *testing.T) {
	dev := cudatest.Device(t)
	seed := time.Now().UnixNano()
	c := attnShape{3, 130, 4, 2, 64}
	r := newAttnRun(t, dev, c, rand.New(rand.NewSource(seed)))
	if r.a.chunk != c.batch {
		t.Fatalf("chunk %d with the default cap, want %d", r.a.chunk, c.batch)
	}
	_, _, whole := r.run(t)
	defer func(v int64) { attnScratchCap = v }(attnScratchCap)
	attnScratchCap = attnSeqScratch(c.seq, c.nq) + 1
	rc := newAttnRun(t, dev, c, rand.New(rand.NewSource(seed)))
	if rc.a.chunk != 1 {
		t.Fatalf("chunk %d with a cap of one sequence, want 1", rc.a.chunk)
	}
	_, _, chunked := rc.run(t)
	if !bytes.Equal(cuda.Bytes(whole), cuda.Bytes(chunked)) {
		t.Errorf("seed %d, %v: dqkv in chunks of one sequence differs from one launch", seed, c)
	}
}

// TestAttentionWorkBytes checks the chunking arithmetic: a chunk is at
// least one sequence, at most the batch, and within the cap unless one
// sequence alone exceeds it.
func TestAttentionWorkBytes(t *testing.T) {
	seed := time.Now().UnixNano()
	rng := rand.New(rand.NewSource(seed))
	for range 1000 {
		batch, seq, nq := 1+rng.Intn(64), 1+rng.Intn(16384), 1+rng.Intn(64)
		n, one := attnChunk(batch, seq, nq), attnSeqScratch(seq, nq)
		nt := int64((seq + 63) / 64)
		if one != nt*(nt+1)/2*8192*int64(nq) {
			t.Fatalf("seed %d: one sequence of %d tokens, %d heads: %d bytes of tiles", seed, seq, nq, one)
		}
		if n < 1 || n > batch || (n > 1 && int64(n)*one > attnScratchCap) ||
			(n < batch && int64(n+1)*one <= attnScratchCap) {
			t.Fatalf("seed %d: batch %d, seq %d, %d heads: chunk %d (one sequence %d bytes, cap %d)",
				seed, batch, seq, nq, n, one, attnScratchCap)
		}
		if w := attnWorkBytes(batch, seq, nq); w != 4*int64(batch*seq*nq)+int64(n)*one {
			t.Fatalf("seed %d: work bytes %d", seed, w)
		}
	}
	if n := attnChunk(8, 2048, 32); n != 8 {
		t.Errorf("the 1.5B shape's backward in chunks of %d sequences, want all 8", n)
	}
}

// BenchmarkAttention times the forward and the backward pass at training
// shapes (the first the 1.5B model's) on a stream with CUDA events, one
// pass an iteration, and reports the median pass time and its tensor
// throughput (causal FLOPs over half the score matrix: 2 products forward,
// 5 backward, 1 for the backward's dQ kernel alone). Run it on a GPU with
// go test -run XXX -bench Attention ./gpu/trainer.
func BenchmarkAttention(b *testing.B) {
	dev := cudatest.Device(b)
	s, err := dev.NewStream()
	if err != nil {
		b.Fatal(err)
	}
	defer s.Destroy()
	for _, c := range []attnShape{{8, 2048, 32, 32, 64}, {8, 2048, 16, 4, 64}, {4, 2048, 16, 8, 128}, {16, 1024, 8, 2, 64}} {
		r := newAttnRun(b, dev, c, rand.New(rand.NewSource(1)))
		if err := r.a.forward(s, r.out, r.qkv, r.lse); err != nil { // the backward reads its out and lse
			b.Fatal(err)
		}
		flop := float64(c.batch*c.nq) * float64(c.seq) * float64(c.seq) * float64(c.hd) // one causal product: 2 seq^2 hd / 2 a head
		for _, pass := range []struct {
			name     string
			products float64
			run      func() error
		}{
			{"forward", 2, func() error { return r.a.forward(s, r.out, r.qkv, r.lse) }},
			{"backward", 5, func() error { return r.a.backward(s, attnGrad{f32: r.dqkv}, r.dout, r.qkv, r.out, r.lse) }},
			// The dQ kernel alone, from the dS^T tiles the backward
			// left (its last chunk's; all of them at these shapes).
			{"backward_dQ", 1, func() error {
				return r.a.launchDQ(s, []any{r.dqkv, cuda.DevicePtr(0), cuda.DevicePtr(0), cuda.DevicePtr(0)}, r.qkv, 0, uint32(r.a.chunk))
			}},
		} {
			b.Run(c.String()+"/"+pass.name, func(b *testing.B) {
				if err := pass.run(); err != nil { // loads the kernels
					b.Fatal(err)
				}
				start, end := newEvent(b, dev), newEvent(b, dev)
				times := make([]float64, 0, b.N)
				for b.Loop() {
					for _, step := range []func() error{func() error { return start.Record(s) }, pass.run,
						func() error { return end.Record(s) }, end.Synchronize} {
						if err := step(); err != nil {
							b.Fatal(err)
						}
					}
					d, err := start.Elapsed(end)
					if err != nil {
						b.Fatal(err)
					}
					times = append(times, d.Seconds())
				}
				slices.Sort(times)
				med := times[len(times)/2]
				b.ReportMetric(med*1e6, "us/pass")
				b.ReportMetric(pass.products*flop/med/1e12, "TFLOP/s")
			})
		}
	}
}

// newEvent returns a CUDA event destroyed at the test's end.
func newEvent(t testing.TB, dev *cuda.Device) *cuda.Event {
	t.Helper()
	e, err := dev.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Destroy() })
	return e
}
