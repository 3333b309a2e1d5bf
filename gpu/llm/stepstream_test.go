package llm

import (
	_ "embed"
	"encoding/binary"
	"fmt"
	"math"
	"testing"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/gpu"
	"github.com/twell-ai/twell/internal/testutil"
)

// stepstream.cu measures how fast one persistent kernel streams a
// one-token decode step's weights through shared memory between grid
// barriers: the bound a whole-step decode kernel would work against.

//go:embed testdata/stepstream.cu
var stepStreamSrc []byte

// ssSlots are the ring sizes built.
var ssSlots = []int{4, 13}

// The bits of step_stream's mode (stepstream.cu).
const (
	ssSync    = 1  // a grid barrier after each phase
	ssStage   = 2  // x read again after each barrier
	ssDown    = 4  // the scattered reads of the down phase
	ssLayer   = 8  // one barrier a layer instead of five
	ssNoFence = 16 // the barriers without __threadfence
	ssReal    = ssSync | ssStage | ssDown
)

// ssBuilds are the (ring slots, mode) pairs timed.
var ssBuilds = []struct{ slots, mode int }{
	{13, 0}, {13, ssSync}, {13, ssSync | ssStage}, {13, ssDown}, {13, ssReal}, {4, ssReal},
	{13, ssReal | ssLayer}, {13, ssSync | ssNoFence}, {13, ssReal | ssNoFence}}

func ssName(slots int) string { return fmt.Sprintf("step_stream<%d>", slots) }

// ssStep is a one-token decode step of the SparseLM-1.5B shape in 4-row
// chunks per layer: q/k/v (6144 rows), keys and values of 512 cached
// tokens (4 MB), the output projection (2048 rows) and the gate (5632).
var ssStep = [4]int{6144 / 4, 4 << 20 / (4 * 2048 * 2), 2048 / 4, 5632 / 4}

const ssLayers = 28

type ssRig struct {
	dev                      *cuda.Device
	fns                      map[string]*cuda.Function
	fill                     *cuda.Function
	nl                       int
	nc                       [4]int
	weights                  [][4]*cuda.Buffer
	table, x, out, sink, cnt *cuda.Buffer
}

func newSSRig(tb testing.TB, nl int, nc [4]int) *ssRig {
	dev := cudatest.Device(tb)
	if dev.Properties().Major < 9 {
		tb.Skip("stepstream: needs sm_90 (bulk copies)")
	}
	var exprs []string
	for _, n := range ssSlots {
		exprs = append(exprs, ssName(n))
	}
	mod, err := dev.Compile("stepstream.cu", stepStreamSrc, append(gpu.Headers(), cuda.WithNameExpressions(exprs...))...)
	if err != nil {
		tb.Fatal(err)
	}
	r := &ssRig{dev: dev, fns: map[string]*cuda.Function{}, nl: nl, nc: nc}
	for _, e := range exprs {
		if r.fns[e], err = mod.Function(e); err != nil {
			tb.Fatal(err)
		}
	}
	if r.fill, err = mod.Function("ss_fill"); err != nil {
		tb.Fatal(err)
	}
	table := make([]byte, 0, nl*32)
	total := 0
	for l := 0; l < nl; l++ {
		var w [4]*cuda.Buffer
		for p, n := range nc {
			w[p] = cudatest.Alloc(tb, dev, max(n, 1)*4*2048*2)
			table = binary.LittleEndian.AppendUint64(table, uint64(w[p].Ptr()))
			total += n
		}
		r.weights = append(r.weights, w)
	}
	r.table = cudatest.Alloc(tb, dev, len(table))
	if err := dev.CopyHtoD(r.table, table); err != nil {
		tb.Fatal(err)
	}
	r.x = cudatest.Alloc(tb, dev, 2048*2)
	r.out = cudatest.Alloc(tb, dev, max(1, nl*total)*8*4)
	r.sink = cudatest.Alloc(tb, dev, dev.Properties().SMs*56*4)
	r.cnt = cudatest.Alloc(tb, dev, 8)
	if err := dev.Memset8(r.cnt, 0, nil); err != nil {
		tb.Fatal(err)
	}
	return r
}

// launch queues one step of build (slots, mode) on s.
func (r *ssRig) launch(slots, mode int, s *cuda.Stream) error {
	return r.fns[ssName(slots)].LaunchEx(cuda.LaunchConfig{
		Grid: cuda.Dim3{uint32(r.dev.Properties().SMs), 1, 1}, Block: cuda.Dim3{288, 1, 1},
		SharedBytes: slots*4*2048*2 + 2048*2, Stream: s, Cooperative: true},
		r.table, int32(r.nl), int32(r.nc[0]), int32(r.nc[1]), int32(r.nc[2]), int32(r.nc[3]),
		r.x, r.out, r.sink, r.cnt, int32(mode))
}

// TestCompileStepStream builds stepstream.cu offline (no GPU) and wants no
// spills.
func TestCompileStepStream(t *testing.T) {
	var exprs []string
	for _, n := range ssSlots {
		exprs = append(exprs, ssName(n))
	}
	cudatest.CleanSASS(t, "stepstream.cu", stepStreamSrc, append(gpu.Headers(), cuda.WithNameExpressions(exprs...))...)
}

// TestStepStream checks every build's dot products against float64 on
// random rows, with fewer chunks than blocks in some phases and more than
// the ring's slots in others.
func TestStepStream(t *testing.T) {
	rng, seed := testutil.Rand(t)
	nc := [4]int{300, 7, 133, 41}
	r := newSSRig(t, 3, nc)
	host := make([][4][]float32, r.nl)
	for l := range host {
		for p, n := range nc {
			v := make([]float32, n*4*2048)
			for i := range v {
				v[i] = bf16.Round(float32(rng.NormFloat64()))
			}
			host[l][p] = v
			upload(t, r.dev, r.weights[l][p], v)
		}
	}
	x := make([]float32, 2048)
	for i := range x {
		x[i] = bf16.Round(float32(rng.NormFloat64()))
	}
	upload(t, r.dev, r.x, x)
	total := nc[0] + nc[1] + nc[2] + nc[3]
	for _, b := range ssBuilds {
		if err := r.dev.Memset8(r.out, 0, nil); err != nil {
			t.Fatal(err)
		}
		for rep := 0; rep < 2; rep++ { // the barrier's counter carries over
			if err := r.launch(b.slots, b.mode, nil); err != nil {
				t.Fatal(err)
			}
		}
		got := make([]float32, r.nl*total*8)
		if err := r.dev.CopyDtoH(cuda.Bytes(got), r.out); err != nil {
			t.Fatalf("%s mode %d: %v", ssName(b.slots), b.mode, err)
		}
		for l := range host {
			off := 0
			for p, n := range nc {
				for c := 0; c < n; c++ {
					for w := 0; w < 8; w++ {
						row, half := w/2, w%2
						want := 0.0
						for k := 0; k < 1024; k++ {
							want += float64(host[l][p][(c*4+row)*2048+half*1024+k]) * float64(x[half*1024+k])
						}
						g := float64(got[((l*total)+off+c)*8+w])
						if math.Abs(g-want) > 1e-4*32*math.Sqrt(1024)+1e-5*math.Abs(want) {
							t.Fatalf("%s mode %d (seed %d): layer %d phase %d chunk %d warp %d: %g, want %g",
								ssName(b.slots), b.mode, seed, l, p, c, w, g, want)
						}
					}
				}
				off += n
			}
		}
	}
}

func upload(tb testing.TB, dev *cuda.Device, dst *cuda.Buffer, v []float32) {
	tb.Helper()
	b := make([]uint16, len(v))
	bf16.FromFloat32s(b, v)
	if err := dev.CopyHtoD(dst, cuda.Bytes(b)); err != nil {
		tb.Fatal(err)
	}
}

// BenchmarkStepStream times every build over a full step of the
// SparseLM-1.5B shape (28 layers, 1.70 GB streamed) and reports the
// step's time and the bytes streamed a second; the barriers alone (nothing
// streamed) are timed as slots=13/empty.
func BenchmarkStepStream(b *testing.B) {
	r := newSSRig(b, ssLayers, ssStep)
	for _, w := range r.weights {
		for _, buf := range w {
			if err := r.fill.Launch(cuda.Dim3{1024, 1, 1}, cuda.Dim3{256, 1, 1}, 0, nil, buf, uint64(buf.Len()/2),
				uint32(buf.Ptr())); err != nil {
				b.Fatal(err)
			}
		}
	}
	if err := r.fill.Launch(cuda.Dim3{8, 1, 1}, cuda.Dim3{256, 1, 1}, 0, nil, r.x, uint64(2048), uint32(7)); err != nil {
		b.Fatal(err)
	}
	bytes := float64(ssLayers * (ssStep[0] + ssStep[1] + ssStep[2] + ssStep[3]) * 4 * 2048 * 2)
	for _, bd := range ssBuilds {
		b.Run(fmt.Sprintf("slots=%d/mode=%d", bd.slots, bd.mode), func(b *testing.B) {
			ssTime(b, r, bd.slots, bd.mode, bytes)
		})
	}
	empty := newSSRig(b, ssLayers, [4]int{})
	for _, mode := range []int{ssSync, ssSync | ssStage, ssSync | ssNoFence} {
		b.Run(fmt.Sprintf("slots=13/empty/mode=%d", mode), func(b *testing.B) { ssTime(b, empty, 13, mode, 0) })
	}
}

// ssTime times b.N launches of r's build (slots, mode) in a row with
// events, after 3 untimed ones.
func ssTime(b *testing.B, r *ssRig, slots, mode int, bytes float64) {
	s, err := r.dev.NewStream()
	if err != nil {
		b.Fatal(err)
	}
	defer s.Destroy()
	start, err := r.dev.NewEvent()
	if err != nil {
		b.Fatal(err)
	}
	defer start.Destroy()
	end, err := r.dev.NewEvent()
	if err != nil {
		b.Fatal(err)
	}
	defer end.Destroy()
	for i := 0; i < 3; i++ {
		if err := r.launch(slots, mode, s); err != nil {
			b.Fatal(err)
		}
	}
	b.ResetTimer()
	if err := start.Record(s); err != nil {
		b.Fatal(err)
	}
	for i := 0; i < b.N; i++ {
		if err := r.launch(slots, mode, s); err != nil {
			b.Fatal(err)
		}
	}
	if err := end.Record(s); err != nil {
		b.Fatal(err)
	}
	if err := end.Synchronize(); err != nil {
		b.Fatal(err)
	}
	el, err := start.Elapsed(end)
	if err != nil {
		b.Fatal(err)
	}
	step := el.Seconds() / float64(b.N)
	b.ReportMetric(step*1e6, "us/step")
	if bytes > 0 {
		b.ReportMetric(bytes/step/1e12, "TB/s")
	}
}
