package trainer

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
)

// TestRMSNormMatchesFloat64 runs the RMSNorm forward and backward kernels
// on random rows against a float64 reference: y and rstd, dx added into a
// random residual gradient, and the gain gradient added into a random dw.
// Row counts cover one row per part, parts of an odd number of rows, a
// last part shorter than the others and the full 256 parts; widths cover
// each backward kernel (rmsnorm_bwd1: a mostly idle block; rmsnorm_bwd2:
// the 1.5B model's; rmsnorm_bwd4 with 256 threads and with 384). The
// kernels run twice and must repeat bit for bit.
func TestRMSNormMatchesFloat64(t *testing.T) {
	dev, l := testLauncher(t)
	s := l.s
	for _, c := range []struct{ rows, h int }{{3, 64}, {300, 2048}, {1001, 192}, {999, 2048}, {16384, 2048}, {700, 4096}, {517, 6144}} {
		t.Run(fmt.Sprintf("rows%d_h%d", c.rows, c.h), func(t *testing.T) {
			seed := rand.Uint64()
			r := rand.New(rand.NewPCG(seed, 11))
			rows, h := c.rows, c.h
			const eps = 1e-5
			rnd := func(n int, scale float64) []float32 {
				v := make([]float32, n)
				for i := range v {
					v[i] = float32(r.NormFloat64() * scale)
				}
				return v
			}
			x, w, dy, dx0, dw0 := rnd(rows*h, 1.5), rnd(h, 1), rnd(rows*h, 0.1), rnd(rows*h, 0.1), rnd(h, 0.1)
			up := func(v []float32) *cuda.Buffer {
				b := cudatest.Alloc(t, dev, 4*len(v))
				if err := dev.CopyHtoD(b, cuda.Bytes(v)); err != nil {
					t.Fatal(err)
				}
				return b
			}
			xB, wB, dyB := up(x), up(w), up(dy)
			yB, rstdB := cudatest.Alloc(t, dev, 2*rows*h), cudatest.Alloc(t, dev, 4*rows)
			part := cudatest.Alloc(t, dev, 4*normParts*h)
			dxbB := cudatest.Alloc(t, dev, 2*rows*h)
			// run queues both kernels on fresh copies of dx and dw and
			// downloads y, rstd, dx, its bf16 copy and dw.
			run := func() (y, dxb []uint16, rstd, dx, dw []float32) {
				dxB, dwB := up(dx0), up(dw0)
				if err := l.rmsNormFwd(yB, rstdB, xB, wB, rows, h, eps); err != nil {
					t.Fatal(err)
				}
				if err := l.rmsNormBwd(dxB, dxbB, dwB, dyB, xB, wB, rstdB, part, rows, h); err != nil {
					t.Fatal(err)
				}
				if err := s.Synchronize(); err != nil {
					t.Fatal(err)
				}
				y, rstd, dx, dw = make([]uint16, rows*h), make([]float32, rows), make([]float32, rows*h), make([]float32, h)
				dxb = make([]uint16, rows*h)
				for _, c := range []struct {
					dst []byte
					src *cuda.Buffer
				}{{cuda.Bytes(y), yB}, {cuda.Bytes(rstd), rstdB}, {cuda.Bytes(dx), dxB}, {cuda.Bytes(dxb), dxbB}, {cuda.Bytes(dw), dwB}} {
					if err := dev.CopyDtoH(c.dst, c.src); err != nil {
						t.Fatal(err)
					}
				}
				return y, dxb, rstd, dx, dw
			}
			y, dxb, rstd, dx, dw := run()
			y2, _, rstd2, dx2, dw2 := run()
			if !slices.Equal(y, y2) || !slices.Equal(rstd, rstd2) || !slices.Equal(dx, dx2) || !slices.Equal(dw, dw2) {
				t.Errorf("seed %d: two runs differ", seed)
			}
			for i, v := range dx {
				if want := bf16.FromFloat32(v); dxb[i] != want {
					t.Fatalf("seed %d: bf16 dx[%d] = %#04x, want %#04x (bf16 of %g)", seed, i, dxb[i], want, v)
				}
			}
			wantDW := make([]float64, h)
			for i := range wantDW {
				wantDW[i] = float64(dw0[i])
			}
			var yErr, rErr, dxErr, dwErr, yMax, dxMax, dwMax float64
			for row := range rows {
				xr, dyr := x[row*h:][:h], dy[row*h:][:h]
				ss, dot := 0.0, 0.0
				for i := range h {
					ss += float64(xr[i]) * float64(xr[i])
				}
				iv := 1 / math.Sqrt(ss/float64(h)+eps)
				for i := range h {
					dot += float64(dyr[i]) * float64(w[i]) * float64(xr[i])
				}
				cc := dot * iv * iv * iv / float64(h)
				rErr = max(rErr, math.Abs(float64(rstd[row])-iv)/iv)
				for i := range h {
					wy := float64(xr[i]) * iv * float64(w[i])
					yErr, yMax = max(yErr, math.Abs(float64(math.Float32frombits(uint32(y[row*h+i])<<16))-wy)), max(yMax, math.Abs(wy))
					wdx := float64(dx0[row*h+i]) + float64(dyr[i])*float64(w[i])*iv - float64(xr[i])*cc
					dxErr, dxMax = max(dxErr, math.Abs(float64(dx[row*h+i])-wdx)), max(dxMax, math.Abs(wdx))
					wantDW[i] += float64(dyr[i]) * float64(xr[i]) * iv
				}
			}
			for i := range h {
				dwErr, dwMax = max(dwErr, math.Abs(float64(dw[i])-wantDW[i])), max(dwMax, math.Abs(wantDW[i]))
			}
			// y is bf16 (relative step 2^-8); the rest fp32 sums of up to
			// thousands of terms.
			for _, e := range []struct {
				name     string
				err, tol float64
			}{{"y", yErr / yMax, 8e-3}, {"rstd", rErr, 1e-5}, {"dx", dxErr / dxMax, 1e-4}, {"dw", dwErr / dwMax, 1e-4}} {
				if !(e.err <= e.tol) {
					t.Errorf("seed %d: %s: error %.3g of the largest value, want at most %g", seed, e.name, e.err, e.tol)
				}
			}
		})
	}
}

// TestNormGeometry checks the RMSNorm launch shapes for every width the
// kernels take: whole warps, at most NORM_THREADS (512) threads, each
// keeping at most as many float4 columns as its backward kernel holds
// (rmsnorm_bwd1 and rmsnorm_bwd2 only in blocks of 256), and that
// normWidth refuses the others.
func TestNormGeometry(t *testing.T) {
	vec := map[string]int{"rmsnorm_bwd1": 1, "rmsnorm_bwd2": 2, "rmsnorm_bwd4": 4}
	for h := 4; h <= maxNormWidth; h += 4 {
		if err := normWidth(h); err != nil {
			t.Fatal(err)
		}
		n, k := normThreads(h), normBwdKernel(h)
		per := ceil(h/4, n)
		if n%32 != 0 || n < 256 || n > 512 || per > vec[k] || (vec[k] < 4 && n != 256) {
			t.Fatalf("h %d: %d threads of %d float4 columns, kernel %s", h, n, per, k)
		}
	}
	for _, h := range []int{0, -4, 6, 2050, maxNormWidth + 4} {
		if normWidth(h) == nil {
			t.Errorf("normWidth(%d) takes it", h)
		}
	}
}

// TestCrossEntropyMatchesFloat64 runs ce_chunk on random logit rows
// against a float64 reference: each row's loss (scaled) and the bf16
// gradient grad_scale (softmax - onehot), with the 16-byte path (V % 4 ==
// 0) and the scalar one, logits spread wide enough that the running maximum
// moves often; two runs must give the same bits.
func TestCrossEntropyMatchesFloat64(t *testing.T) {
	dev, l := testLauncher(t)
	s := l.s
	for _, c := range []struct{ rows, V int }{{5, 64}, {37, 1001}, {300, 49152}} {
		t.Run(fmt.Sprintf("rows%d_V%d", c.rows, c.V), func(t *testing.T) {
			seed := rand.Uint64()
			r := rand.New(rand.NewPCG(seed, 13))
			rows, V := c.rows, c.V
			const gradScale, lossScale = float32(0.25), 0.5
			logits, targets := make([]float32, rows*V), make([]int32, rows)
			for i := range logits {
				logits[i] = float32(r.NormFloat64() * 8)
			}
			for i := range targets {
				targets[i] = int32(r.IntN(V))
			}
			lB, tB := cudatest.Alloc(t, dev, 4*rows*V), cudatest.Alloc(t, dev, 4*rows)
			dB, lossB := cudatest.Alloc(t, dev, 2*rows*V), cudatest.Alloc(t, dev, 8*rows)
			if err := dev.CopyHtoD(lB, cuda.Bytes(logits)); err != nil {
				t.Fatal(err)
			}
			if err := dev.CopyHtoD(tB, cuda.Bytes(targets)); err != nil {
				t.Fatal(err)
			}
			run := func() ([]float64, []uint16) {
				if err := l.crossEntropy(lB, tB, dB, lossB, rows, V, gradScale, lossScale); err != nil {
					t.Fatal(err)
				}
				if err := s.Synchronize(); err != nil {
					t.Fatal(err)
				}
				loss, d := make([]float64, rows), make([]uint16, rows*V)
				if err := dev.CopyDtoH(cuda.Bytes(loss), lossB); err != nil {
					t.Fatal(err)
				}
				if err := dev.CopyDtoH(cuda.Bytes(d), dB); err != nil {
					t.Fatal(err)
				}
				return loss, d
			}
			loss, d := run()
			loss2, d2 := run()
			if !slices.Equal(loss, loss2) || !slices.Equal(d, d2) {
				t.Errorf("seed %d: two runs differ", seed)
			}
			for row := range rows {
				x := logits[row*V:][:V]
				mx := float64(slices.Max(x))
				sum := 0.0
				for _, v := range x {
					sum += math.Exp(float64(v) - mx)
				}
				tg := int(targets[row])
				want := (math.Log(sum) - (float64(x[tg]) - mx)) * lossScale
				if math.Abs(loss[row]-want) > 1e-5*math.Max(1, math.Abs(want)) {
					t.Fatalf("seed %d: row %d: loss %.9g, want %.9g", seed, row, loss[row], want)
				}
				for i, v := range x {
					p := math.Exp(float64(v)-mx) / sum
					if i == tg {
						p--
					}
					want := p * float64(gradScale)
					got := float64(math.Float32frombits(uint32(d[row*V+i]) << 16))
					if math.Abs(got-want) > 4e-3*math.Abs(want)+2e-7 { // bf16 rounding, and fp32 cancellation at the target
						t.Fatalf("seed %d: row %d column %d: gradient %.6g, want %.6g", seed, row, i, got, want)
					}
				}
			}
		})
	}
}

// testLauncher returns device 0 and a launcher of the package's kernels on
// a stream of its own, destroyed when the test ends (skipping the test
// without a GPU).
func testLauncher(t *testing.T) (*cuda.Device, launcher) {
	t.Helper()
	dev := cudatest.Device(t)
	k, err := kernelsFor(dev)
	if err != nil {
		t.Fatal(err)
	}
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Destroy() })
	return dev, newLauncher(k, s, dev)
}
