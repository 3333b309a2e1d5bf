package trainer

import (
	"errors"
	"fmt"
	"slices"

	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/train"
)

// MLPBlock is one MLP block's training forward and backward on a GPU,
// outside a model, with the L1 penalty on its hidden activations: what
// `twell bench train` times and the tests compare path against path. It
// runs exactly the code a training step runs for one layer.
type MLPBlock struct {
	gpuCtx
	shape mlpShape
	l1    float64

	x, dy, wgu, wd       *cuda.Buffer // bf16
	base, out, dx        *cuda.Buffer // fp32 (base zero)
	gGU, gDown           *cuda.Buffer // fp32
	stat, active, region *cuda.Buffer
	sc                   mlpScratch
	owned                []*cuda.Buffer
}

// MLPBlockBytes is the device memory an MLPBlock of m tokens, hidden size
// h and f units takes.
func MLPBlockBytes(m, h, f int, gated bool) int64 {
	s := mlpShape{m: m, h: h, f: f, gated: gated}
	n := int64(0)
	for _, b := range s.blockBuffers() {
		n += int64(b)
	}
	return n
}

// blockBuffers lists an MLPBlock's buffer sizes in allocation order.
func (s mlpShape) blockBuffers() []int {
	out := []int{2 * s.m * s.h, 2 * s.m * s.h, 2 * s.guW() * s.h, 2 * s.h * s.f, // x, dy, wgu, wd (transposed)
		4 * s.m * s.h, 4 * s.m * s.h, 4 * s.m * s.h, // base, out, dx
		4 * s.guW() * s.h, 4 * s.h * s.f, 16, 4 * s.f, s.saveBytes(mlp.Sparse), // gGU, gDown, stat, active, region
		4 * s.m * s.f, 2 * s.m * s.guW(), s.statPartBytes()} // dh, dgu, part
	return append(out, s.sparseScratchBytes()...)
}

// NewMLPBlock allocates a block of m tokens, hidden size h and f units
// (gated: relu(x·Wgᵀ)·(x·Wuᵀ); else relu(x·Wuᵀ)) with L1 coefficient l1
// on the mean over tokens of Σ|h|, checking free device memory first.
func NewMLPBlock(dev *cuda.Device, m, h, f int, gated bool, l1 float64) (*MLPBlock, error) {
	if m < 1 || h < 1 || f < 1 {
		return nil, fmt.Errorf("trainer: an MLP block of %d tokens, hidden size %d, %d units", m, h, f)
	}
	if err := sparseOK(m, h, f, sharedPerBlock(dev)); err != nil {
		return nil, err
	}
	s := mlpShape{m: m, h: h, f: f, gated: gated}
	free, err := dev.Available()
	if err != nil {
		return nil, err
	}
	if need := MLPBlockBytes(m, h, f, gated); need+(64<<20) > free {
		return nil, fmt.Errorf("trainer: an MLP block of %d x %d x %d needs %d MiB of device memory, %d MiB free",
			m, h, f, need>>20, free>>20)
	}
	b := &MLPBlock{gpuCtx: gpuCtx{dev: dev}, shape: s, l1: l1}
	if err := b.init(); err != nil {
		return nil, errors.Join(err, b.Close())
	}
	return b, nil
}

func (b *MLPBlock) init() error {
	k, err := kernelsFor(b.dev)
	if err != nil {
		return err
	}
	if err = b.open(k); err != nil {
		return err
	}
	ptrs := []**cuda.Buffer{&b.x, &b.dy, &b.wgu, &b.wd, &b.base, &b.out, &b.dx, &b.gGU, &b.gDown, &b.stat, &b.active,
		&b.region, &b.sc.dh, &b.sc.dgu, &b.sc.part, &b.sc.cnt, &b.sc.chunk, &b.sc.slots}
	for i, n := range b.shape.blockBuffers() {
		buf, err := b.dev.Alloc(n)
		if err != nil {
			return fmt.Errorf("trainer: allocating %d bytes for an MLP block: %w", n, err)
		}
		b.owned = append(b.owned, buf)
		*ptrs[i] = buf
	}
	return b.dev.Memset8(b.base, 0, b.s)
}

// Load sets the weights (gate and up [f][h], gate nil ungated; down
// [h][f]), the input x [m][h] and the output gradient dy [m][h], rounded
// to bf16.
func (b *MLPBlock) Load(gate, up, down, x, dy []float32) error {
	s := b.shape
	if (gate != nil) != s.gated || (gate != nil && len(gate) != s.f*s.h) || len(up) != s.f*s.h || len(down) != s.h*s.f ||
		len(x) != s.m*s.h || len(dy) != s.m*s.h {
		return fmt.Errorf("trainer: MLP block operands of %d, %d, %d, %d and %d values for m %d, h %d, f %d, gated %v",
			len(gate), len(up), len(down), len(x), len(dy), s.m, s.h, s.f, s.gated)
	}
	wgu := append(append([]float32(nil), gate...), up...)
	downT := make([]float32, len(down)) // the device layout: [f][h]
	train.Transpose(downT, down, s.h, s.f)
	for _, c := range []struct {
		dst *cuda.Buffer
		src []float32
	}{{b.x, x}, {b.dy, dy}, {b.wgu, wgu}, {b.wd, downT}} {
		h := make([]uint16, len(c.src))
		bf16.FromFloat32s(h, c.src)
		if err := b.dev.CopyHtoD(c.dst, cuda.Bytes(h)); err != nil {
			return err
		}
	}
	return b.Reset()
}

// Reset zeroes the weight gradients and the statistics, which Run adds to.
func (b *MLPBlock) Reset() error {
	for _, buf := range []*cuda.Buffer{b.gGU, b.gDown, b.stat, b.active} {
		if err := b.dev.Memset8(buf, 0, b.s); err != nil {
			return err
		}
	}
	return nil
}

// Run queues one forward and backward, dense or sparse, on Stream: the
// output and dx are overwritten, the weight gradients and statistics
// added to.
func (b *MLPBlock) Run(sparse bool) error {
	steps, err := b.steps(sparse, false)
	if err != nil {
		return err
	}
	return runSteps(steps, nil)
}

// steps lists the stages of one forward and backward; inline keeps every
// kernel on the main stream.
func (b *MLPBlock) steps(sparse, inline bool) ([]mlpStep, error) {
	a := mlpArgs{mlpShape: b.shape, x: b.x, wgu: b.wgu, wd: b.wd, base: b.base, out: b.out, region: b.region, sc: b.sc,
		stat: b.stat, active: b.active, l1Stat: b.l1 / float64(b.shape.m), l0Scale: 1 / float64(b.shape.m),
		dy: b.dy, dx: b.dx, gGU: b.gGU, gDown: b.gDown, l1Grad: float32(b.l1 / float64(b.shape.m)), inline: inline}
	fwd, err := b.mlpForwardSteps(a, sparse)
	if err != nil {
		return nil, err
	}
	bwd, err := b.mlpBackwardSteps(a, sparse)
	if err != nil {
		return nil, err
	}
	for i := range fwd {
		fwd[i].name = "forward: " + fwd[i].name
	}
	for i := range bwd {
		bwd[i].name = "backward: " + bwd[i].name
	}
	return append(fwd, bwd...), nil
}

// MLPStage is one stage of an MLP block's forward or backward and its
// median time.
type MLPStage struct {
	Name string  `json:"name"`
	MS   float64 `json:"ms"`
}

// Profile times each stage of reps forwards and backwards on one path,
// every stage alone (queued after the one before it finished, on the main
// stream: the column index too, which Run overlaps with the row kernels), and
// returns the median time of each. Their sum exceeds Run's time by the
// launch gaps the stages no longer hide.
func (b *MLPBlock) Profile(sparse bool, reps int) ([]MLPStage, error) {
	steps, err := b.steps(sparse, true)
	if err != nil {
		return nil, err
	}
	timer, err := b.dev.NewTimer()
	if err != nil {
		return nil, err
	}
	defer timer.Destroy()
	ts := make([][]float64, len(steps))
	for range max(reps, 1) {
		for i, st := range steps {
			ms, err := timer.TimeMS(b.s, st.run)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", st.name, err)
			}
			ts[i] = append(ts[i], ms)
		}
	}
	out := make([]MLPStage, len(steps))
	for i, st := range steps {
		slices.Sort(ts[i])
		out[i] = MLPStage{Name: st.name, MS: ts[i][len(ts[i])/2]}
	}
	return out, nil
}

// Stream is the stream Run queues on.
func (b *MLPBlock) Stream() *cuda.Stream { return b.s }

// MLPBlockResult is what Runs since the last Reset produced: the last
// output and input gradient, the summed weight gradients and statistics.
type MLPBlockResult struct {
	Out, DX    []float32 // [m][h]
	DGate, DUp []float32 // [f][h]; DGate nil ungated
	DDown      []float32 // [h][f]
	L1, L0     float64   // mean over tokens of Σ|h| times l1, of units fired
	Active     []int32   // [f] tokens each unit fired for
}

// Result waits for the device and copies the results to the host.
func (b *MLPBlock) Result() (*MLPBlockResult, error) {
	if err := b.s.Synchronize(); err != nil {
		return nil, err
	}
	s := b.shape
	r := &MLPBlockResult{Out: make([]float32, s.m*s.h), DX: make([]float32, s.m*s.h), DDown: make([]float32, s.h*s.f),
		Active: make([]int32, s.f)}
	dDownT := make([]float32, s.f*s.h)
	gu := make([]float32, s.guW()*s.h)
	st := make([]float64, 2)
	for _, c := range []struct {
		dst []byte
		src *cuda.Buffer
	}{{cuda.Bytes(r.Out), b.out}, {cuda.Bytes(r.DX), b.dx}, {cuda.Bytes(dDownT), b.gDown}, {cuda.Bytes(gu), b.gGU},
		{cuda.Bytes(st), b.stat}, {cuda.Bytes(r.Active), b.active}} {
		if err := b.dev.CopyDtoH(c.dst, c.src); err != nil {
			return nil, err
		}
	}
	train.Transpose(r.DDown, dDownT, s.f, s.h)
	r.L1, r.L0 = st[0], st[1]
	if s.gated {
		r.DGate, r.DUp = gu[:s.f*s.h], gu[s.f*s.h:]
	} else {
		r.DUp = gu
	}
	return r, nil
}

// Close waits for queued work and frees the block.
func (b *MLPBlock) Close() error {
	return b.close(func() error {
		var errs []error
		for _, buf := range b.owned {
			errs = append(errs, buf.Free())
		}
		b.owned = nil
		return errors.Join(errs...)
	})
}
