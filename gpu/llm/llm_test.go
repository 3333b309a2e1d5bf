package llm

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	cpullm "github.com/twell-ai/twell/cpu/llm"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/engine/enginetest"
	"github.com/twell-ai/twell/gpu"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/mlp"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/synth"
	"github.com/twell-ai/twell/synth/sparsify"
)

func TestMain(m *testing.M) { cudatest.Main(m) }

// earlyStartKernels are the kernels the engine launches with early start
// (normArgs, gemvRows, ropeArgs.qkvRope, decAttention, Decoder): each must wait with
// griddepcontrol.wait before it touches earlier kernels' results.
var earlyStartKernels = map[string]bool{"add_rmsnorm": true, "gemv_rows1": true, "gemv_rows4": true,
	"qkv_rope1": true, "qkv_rope4": true, "qkv_rope1n": true, "attn_dec64": true, "attn_dec128": true,
	"pick_rows": true}

// TestCompile compiles every .cu file of kernelFiles to PTX: it needs NVRTC
// but no GPU. The kernels launched with early start must wait first. The
// files run on every GPU from sm_80 on, so each is also assembled for
// sm_80 (ptxas rejects what sm_80 lacks, where the PTX passes).
func TestCompile(t *testing.T) {
	cudatest.Compiler(t)
	for _, file := range kernelFiles {
		t.Run(file.name, func(t *testing.T) {
			prog, err := cuda.CompileProgram(file.name, *file.src, append(headers(), cuda.WithArch("compute_90"))...)
			if err != nil {
				t.Fatal(err)
			}
			ptx := string(prog.Image)
			if n := strings.Count(ptx, ".entry "); n != len(file.kernels) {
				t.Errorf("%d kernels in the PTX, want %d", n, len(file.kernels))
			}
			for _, k := range file.kernels {
				if !strings.Contains(ptx, ".entry "+k+"(") {
					t.Errorf("kernel %s missing from the PTX", k)
				}
			}
			if strings.Contains(ptx, ".local") {
				t.Logf("note: the PTX uses local memory (register arrays indexed at run time?)")
			}
			for _, k := range file.kernels {
				if earlyStartKernels[k] {
					cudatest.WaitsFirst(t, prog, k)
				}
			}
			if prog.Log != "" {
				t.Logf("NVRTC log:\n%s", prog.Log)
			}
			if _, err := cuda.CompileProgram(file.name, *file.src, append(headers(), cuda.WithArch("sm_80"))...); err != nil {
				t.Errorf("sm_80: %v", err)
			}
		})
	}
}

// TestDecodeKernelsCleanSASS: the kernels of decode steps compile to sm_90a
// machine code without spills (norm.cu, proj.cu and pick.cu; attn.cu has the
// prefill kernels, which attn_fa64 at 128 registers spills 16 bytes).
func TestDecodeKernelsCleanSASS(t *testing.T) {
	cudatest.Compiler(t)
	for _, f := range []struct {
		name string
		src  []byte
	}{{"norm.cu", normSrc}, {"proj.cu", projSrc}, {"pick.cu", pickSrc}} {
		cudatest.CleanSASS(t, f.name, f.src, headers()...)
	}
}

// TestCompileWGMMA compiles attn_wgmma.cu for compute_90a, which needs
// NVRTC 12 or later (but no GPU).
func TestCompileWGMMA(t *testing.T) {
	cudatest.Compiler(t)
	if major, minor, _, _ := cuda.NVRTCVersion(); major < 12 {
		t.Skipf("NVRTC %d.%d cannot target compute_90a", major, minor)
	}
	exprs := append([]string{"attn_wg64_probe"}, wgExprs()...)
	prog, err := cuda.CompileProgram("attn_wgmma.cu", attnWGMMASrc,
		append(headers(), cuda.WithArch("compute_90a"), cuda.WithNameExpressions(exprs...))...)
	if err != nil {
		t.Fatal(err)
	}
	ptx := string(prog.Image)
	if n := strings.Count(ptx, ".entry "); n != len(exprs) {
		t.Errorf("%d kernels in the PTX, want %d", n, len(exprs))
	}
	if n := strings.Count(ptx, "wgmma.mma_async"); n < 8*len(exprs) {
		t.Errorf("%d wgmma.mma_async in the PTX, want at least %d", n, 8*len(exprs))
	}
	if strings.Contains(ptx, ".local") {
		t.Errorf("the PTX uses local memory")
	}
	cudatest.CleanSASS(t, "attn_wgmma.cu", attnWGMMASrc, append(headers(), cuda.WithNameExpressions(exprs...))...)
}

func TestSupported(t *testing.T) {
	c := testConfig(64, 4, 2, true)
	if err := Supported(c); err != nil {
		t.Fatalf("Supported(%+v): %v", c, err)
	}
	bad := c
	bad.HeadDim = 512
	bad.HiddenSize = 4 * 512
	if err := Supported(bad); err == nil {
		t.Error("head_dim 512 accepted")
	}
	bad = c
	bad.HiddenAct = "gelu"
	if err := Supported(bad); err == nil {
		t.Error("gelu accepted")
	}
}

// testConfig is a small Llama: hidden 256, MLP width 512, ReLU gate.
func testConfig(hd, nq, nkv int, tied bool) model.Config {
	return model.Config{
		ModelType: "llama", Architectures: []string{"LlamaForCausalLM"},
		HiddenSize: 256, IntermediateSize: 512, NumHiddenLayers: 2,
		NumAttentionHeads: nq, NumKeyValueHeads: nkv, HeadDim: hd,
		VocabSize: 384, MaxPositionEmbeddings: 512, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: model.ActReLU, TieWordEmbeddings: tied, MLPGated: true,
	}
}

// sparseModel returns a random model made sparse like a trained one.
func sparseModel(t *testing.T, c model.Config, r *rand.Rand, seed uint64) *model.Model {
	t.Helper()
	m, err := model.New(c, model.RandomWeights(c, r))
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	if act, _ := c.GateActivation(); act == model.ActReLU {
		if err := sparsify.Gates(m, 0.01, synth.Skewed, r); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
	}
	return m
}

// bf16Tol is the tolerance on max |diff| / max |logit| between the bf16 GPU
// forward and the float32 CPU model.
const bf16Tol = 3e-2

func newEngine(t *testing.T, dev *cuda.Device, m *model.Model, seed uint64) *Engine {
	t.Helper()
	e, err := NewEngine(dev, m)
	if err != nil {
		t.Fatalf("seed %d: NewEngine: %v", seed, err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// engineOnPath is newEngine with its MLP path set.
func engineOnPath(t *testing.T, dev *cuda.Device, m *model.Model, seed uint64, path string) *Engine {
	t.Helper()
	e := newEngine(t, dev, m, seed)
	if err := e.SetMLPPath(pathOf(t, path)); err != nil {
		t.Fatal(err)
	}
	return e
}

// gpuEngine skips the test without a GPU or a kernel compiler and returns
// an engine for a random sparse model of config c, with its MLP path set
// unless path is "", the random source and its seed.
func gpuEngine(t *testing.T, c model.Config, path string) (*Engine, *rand.Rand, uint64) {
	t.Helper()
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	r, seed := testutil.Rand(t)
	m := sparseModel(t, c, r, seed)
	if path == "" {
		return newEngine(t, dev, m, seed), r, seed
	}
	return engineOnPath(t, dev, m, seed, path), r, seed
}

// pathOf parses an MLP path name.
func pathOf(t *testing.T, s string) mlp.Path {
	t.Helper()
	p, err := mlp.ParsePath(s)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// cpuForward runs passes (each a batch of sequences, all logits) through the
// CPU engine on the given MLP path, with caches of capacity positions.
func cpuForward(t *testing.T, m *model.Model, path string, capacity int, passes ...[][]int) [][]float32 {
	t.Helper()
	e, err := cpullm.New(m, cpullm.Options{MLPPath: pathOf(t, path)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return enginetest.Passes(t, e, capacity, passes...)
}

// TestLogitsMatchCPU compares the GPU forward with the CPU model on small
// random sparse models: multi-head and grouped-query attention, tied and
// separate LM heads, head_dim 64 (tensor-core attention), 128 and 32 (the
// plain kernel), the plain kernel forced, the three MLP paths, a SiLU model
// (dense MLP on the GPU), a shape the TwELL kernels do not take, and the
// RoPE scaling variants.
func TestLogitsMatchCPU(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	type tc struct {
		name    string
		c       model.Config
		attn    string
		mlpPath string
	}
	silu := testConfig(64, 4, 4, true)
	silu.HiddenAct = model.ActSiLU
	odd := testConfig(32, 4, 2, false)
	odd.HiddenSize, odd.IntermediateSize = 128+32, 320 // not TwELL shapes
	odd.NumAttentionHeads, odd.NumKeyValueHeads = 5, 1
	nongated := testConfig(64, 4, 2, true)
	nongated.MLPGated = false
	linear := testConfig(64, 4, 2, true)
	linear.RopeScaling = &model.RopeScaling{Type: "linear", Factor: 2}
	dynamic := testConfig(64, 4, 2, true)
	dynamic.MaxPositionEmbeddings = 64 // the 77-token prompt goes past it
	dynamic.RopeScaling = &model.RopeScaling{Type: "dynamic", Factor: 2}
	llama3 := testConfig(64, 4, 2, true)
	llama3.RopeTheta = 500000
	llama3.RopeScaling = &model.RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositionEmbeddings: 32}
	cases := []tc{
		{"mha-tied-hd64", testConfig(64, 4, 4, true), "", "auto"},
		{"gqa-untied-hd64", testConfig(64, 4, 2, false), "", "auto"},
		{"gqa-hd64-sparse", testConfig(64, 8, 2, true), "", "sparse"},
		{"gqa-hd64-dense", testConfig(64, 8, 2, true), "", "dense"},
		{"gqa-hd64-ref", testConfig(64, 4, 2, true), "ref", "auto"},
		{"gqa-hd128", testConfig(128, 2, 1, true), "", "auto"},
		{"hd32-ref", testConfig(32, 8, 4, true), "", "auto"},
		{"silu-dense", silu, "", "auto"},
		{"odd-shape", odd, "", "auto"},
		{"non-gated", nongated, "", "auto"},
		{"rope-linear", linear, "", "auto"},
		{"rope-dynamic", dynamic, "", "auto"},
		{"rope-llama3", llama3, "", "auto"},
	}
	for _, k := range cases {
		t.Run(k.name, func(t *testing.T) {
			r, seed := testutil.Rand(t)
			m := sparseModel(t, k.c, r, seed)
			e := newEngine(t, dev, m, seed)
			e.Attention = k.attn
			if err := e.SetMLPPath(pathOf(t, k.mlpPath)); err != nil {
				t.Fatal(err)
			}
			// Two sequences of different lengths (one over a query block).
			toks := [][]int{enginetest.Tokens(r, 77, k.c.VocabSize), enginetest.Tokens(r, 5, k.c.VocabSize)}
			step := [][]int{{r.IntN(k.c.VocabSize)}, {r.IntN(k.c.VocabSize)}}
			cpuOut := cpuForward(t, m, k.mlpPath, 100, toks, step)
			want, wantStep := cpuOut[:82], cpuOut[82:]
			gc := enginetest.Caches(t, e, 2, 100)
			got, st := enginetest.Forward(t, e, gc, toks, true)
			d, err := enginetest.RelDiff(got, want)
			if err != nil || d > bf16Tol {
				t.Fatalf("seed %d: max |diff| / max |logit| = %.3g (err %v), want <= %g", seed, d, err, bf16Tol)
			}
			if gc[0].Len() != 77 || gc[1].Len() != 5 {
				t.Errorf("cache lengths %d, %d after the pass, want 77, 5", gc[0].Len(), gc[1].Len())
			}
			t.Logf("seed %d: rel diff %.2e; TwELL layers %d; mean active %v; sparse %v", seed, d, e.TwELLLayers(), st.MeanActive, st.Paths)
			// One decode step on both.
			got, _, err = e.Forward(gc, step, false)
			if err != nil {
				t.Fatalf("seed %d: decode: %v", seed, err)
			}
			if d, err := enginetest.RelDiff(got, wantStep); err != nil || d > bf16Tol {
				t.Fatalf("seed %d: decode step: rel diff %.3g (err %v)", seed, d, err)
			}
		})
	}
}

// TestDecodeMatchesRecompute checks on the GPU that a prompt followed by
// single-token steps through the cache gives the logits of recomputing the
// whole sequence at once.
func TestDecodeMatchesRecompute(t *testing.T) {
	c := testConfig(64, 4, 2, true)
	e, r, seed := gpuEngine(t, c, "sparse") // the same MLP arithmetic in every step
	seq := enginetest.Tokens(r, 90, c.VocabSize)
	const prompt = 70
	full := enginetest.Caches(t, e, 1, len(seq))
	all, _ := enginetest.Forward(t, e, full, [][]int{seq}, true)
	inc := enginetest.Caches(t, e, 1, len(seq))
	first, _ := enginetest.Forward(t, e, inc, [][]int{seq[:prompt]}, false)
	steps := [][]float32{first[0]}
	for i := prompt; i < len(seq)-2; i++ {
		l, _ := enginetest.Forward(t, e, inc, [][]int{{seq[i]}}, false)
		steps = append(steps, l[0])
	}
	// The last two tokens in one step, through the cache too.
	l, _ := enginetest.Forward(t, e, inc, [][]int{seq[len(seq)-2:]}, true)
	steps = append(steps, l...)
	d, err := enginetest.RelDiff(steps, all[prompt-1:])
	if err != nil || d > 1e-2 {
		t.Fatalf("seed %d: decode vs recompute: rel diff %.3g (err %v)", seed, d, err)
	}
	t.Logf("seed %d: decode vs recompute rel diff %.2e", seed, d)
}

// TestReuseLogits checks that ReuseLogits returns the logits a fresh
// slice gets, bit for bit, in one buffer that later (and larger) calls
// reuse.
func TestReuseLogits(t *testing.T) {
	c := testConfig(64, 2, 2, true)
	e, r, seed := gpuEngine(t, c, "dense") // the same arithmetic in every call
	seqs := [][]int{enginetest.Tokens(r, 9, c.VocabSize), enginetest.Tokens(r, 5, c.VocabSize)}
	run := func(reuse, all bool) [][]float32 {
		e.ReuseLogits = reuse
		l, _ := enginetest.Forward(t, e, enginetest.Caches(t, e, 2, 16), seqs, all)
		return l
	}
	for _, all := range []bool{false, true, false} {
		want := run(false, all)
		got := run(true, all)
		enginetest.SameBits(t, fmt.Sprintf("all %v, with ReuseLogits", all), got, want)
		again := run(true, all)
		if &again[0][0] != &got[0][0] {
			t.Errorf("seed %d: all %v: ReuseLogits returned a new buffer for a call of the same size", seed, all)
		}
	}
}

// TestProfile checks that a profiled pass reports every kind of step, with
// logits identical to an unprofiled pass, and that an unprofiled pass
// reports none.
func TestProfile(t *testing.T) {
	c := testConfig(64, 6, 2, true) // grouped-query attention, heads*head_dim != hidden
	e, r, seed := gpuEngine(t, c, "dense")
	seqs := [][]int{enginetest.Tokens(r, 70, c.VocabSize), enginetest.Tokens(r, 3, c.VocabSize)}
	want, st := enginetest.Forward(t, e, enginetest.Caches(t, e, 2, 80), seqs, false)
	if st.StepMS != nil {
		t.Errorf("seed %d: unprofiled pass reported steps %v", seed, st.StepMS)
	}
	e.Profile = true
	got, st := enginetest.Forward(t, e, enginetest.Caches(t, e, 2, 80), seqs, false)
	for _, step := range []string{"embed", "norm", "qkv", "rope", "attention", "o_proj", "mlp", "head"} {
		if v, ok := st.StepMS[step]; !ok || !(v > 0) || math.IsInf(v, 0) {
			t.Errorf("seed %d: step %q: %v ms (reported %v)", seed, step, v, ok)
		}
	}
	if len(st.StepMS) != 8 {
		t.Errorf("seed %d: steps %v, want 8 kinds", seed, st.StepMS)
	}
	if d, err := enginetest.RelDiff(got, want); err != nil || d != 0 {
		t.Errorf("seed %d: profiled logits differ: rel diff %g (err %v)", seed, d, err)
	}
}

// TestBatchedPrefillMatchesSeparate checks that a batch of two sequences of
// different lengths gives each sequence the logits of running it alone.
func TestBatchedPrefillMatchesSeparate(t *testing.T) {
	c := testConfig(64, 8, 2, false)
	e, r, seed := gpuEngine(t, c, "sparse") // no path switch between the runs
	a, b := enginetest.Tokens(r, 130, c.VocabSize), enginetest.Tokens(r, 9, c.VocabSize)
	both, _ := enginetest.Forward(t, e, enginetest.Caches(t, e, 2, 140), [][]int{a, b}, true)
	la, _ := enginetest.Forward(t, e, enginetest.Caches(t, e, 1, 140), [][]int{a}, true)
	lb, _ := enginetest.Forward(t, e, enginetest.Caches(t, e, 1, 140), [][]int{b}, true)
	d, err := enginetest.RelDiff(both, append(la, lb...))
	if err != nil || d > 1e-2 { // GEMMs of other shapes may round differently
		t.Fatalf("seed %d: batched vs separate: rel diff %.3g (err %v)", seed, d, err)
	}
	t.Logf("seed %d: batched vs separate rel diff %.2e", seed, d)
}

// TestForwardErrors checks that bad calls return errors naming the fault.
func TestForwardErrors(t *testing.T) {
	c := testConfig(64, 4, 2, true)
	e, _, _ := gpuEngine(t, c, "")
	cs := enginetest.Caches(t, e, 2, 8)
	for _, k := range []struct {
		caches []engine.Cache
		toks   [][]int
		want   string
	}{
		{cs[:1], [][]int{{1}, {2}}, "1 caches for 2 sequences"},
		{cs[:1], [][]int{{}}, "no new tokens"},
		{cs[:1], [][]int{make([]int, 9)}, "past its cache of 8"},
		{cs[:1], [][]int{{c.VocabSize}}, "outside the vocabulary"},
		{[]engine.Cache{cs[0], cs[0]}, [][]int{{1}, {2}}, "share one cache"},
	} {
		if _, _, err := e.Forward(k.caches, k.toks, false); err == nil || !strings.Contains(err.Error(), k.want) {
			t.Errorf("Forward(%v): %v, want an error with %q", k.toks, err, k.want)
		}
	}
	if err := e.SetMLPPath(mlp.Path(9)); err == nil {
		t.Error("SetMLPPath(mlp.Path(9)) accepted")
	}
}

// TestGraphDecodeMatchesEager runs the same batched decode with and without
// CUDA graphs: on a fixed MLP path the logits must be bit-identical (the
// graph replays the same kernels), also after a larger prefill in between
// grew the buffers the graph uses (it must be recorded again); on the
// automatic path the graphs must take over once the paths have settled.
func TestGraphDecodeMatchesEager(t *testing.T) {
	c := testConfig(64, 4, 2, true)
	e, r, seed := gpuEngine(t, c, "")
	prompts := [][]int{enginetest.Tokens(r, 20, c.VocabSize), enginetest.Tokens(r, 33, c.VocabSize), enginetest.Tokens(r, 7, c.VocabSize)}
	next := make([][]int, 16)
	for i := range next {
		next[i] = enginetest.Tokens(r, len(prompts), c.VocabSize)
	}
	grow := enginetest.Tokens(r, 300, c.VocabSize)
	// decode returns the logits of every step of the batch.
	decode := func(graphs bool) [][]float32 {
		e.NoGraphs = !graphs
		caches := enginetest.Caches(t, e, len(prompts), 80)
		enginetest.Forward(t, e, caches, prompts, false)
		var out [][]float32
		for i, ids := range next {
			if i == len(next)/2 { // grow the workspace mid-decode
				enginetest.Forward(t, e, enginetest.Caches(t, e, 1, len(grow)), [][]int{grow}, false)
			}
			step := make([][]int, len(ids))
			for s, id := range ids {
				step[s] = []int{id}
			}
			l, _, err := e.Forward(caches, step, false)
			if err != nil {
				t.Fatalf("seed %d: step %d: %v", seed, i, err)
			}
			out = append(out, l...)
		}
		return out
	}
	for _, path := range []string{"sparse", "dense"} {
		if err := e.SetMLPPath(pathOf(t, path)); err != nil {
			t.Fatal(err)
		}
		eager := decode(false)
		before := e.GraphReplays()
		graphed := decode(true)
		if e.GraphError() != nil {
			t.Fatalf("seed %d: %s: recording a graph failed: %v", seed, path, e.GraphError())
		}
		if n := e.GraphReplays() - before; n < len(next)-2 {
			t.Errorf("seed %d: %s: %d of %d decode steps replayed a graph", seed, path, n, len(next))
		}
		enginetest.SameBits(t, path+" path, graph vs eager", graphed, eager)
	}
	if err := e.SetMLPPath(pathOf(t, "auto")); err != nil {
		t.Fatal(err)
	}
	eager := decode(false)
	before := e.GraphReplays()
	graphed := decode(true)
	if n := e.GraphReplays() - before; n == 0 || e.GraphError() != nil {
		t.Errorf("seed %d: auto: %d graph replays (error %v)", seed, n, e.GraphError())
	}
	if d, err := enginetest.RelDiff(graphed, eager); err != nil || d > 1e-2 {
		t.Errorf("seed %d: auto: graph vs eager rel diff %.3g (%v)", seed, d, err)
	}
}

// TestGraphFollowsSettings changes the attention kernel (Engine.Attention)
// every three decode steps, back to the first at the end: steps replayed
// from graphs must run the kernel set at the time, bit for bit as the same
// steps run kernel by kernel, so each change records the graph again.
func TestGraphFollowsSettings(t *testing.T) {
	c := testConfig(64, 4, 2, true)
	e, r, seed := gpuEngine(t, c, "dense")
	kernels := attnKernels(e.dev, c.HeadDim)
	prompts := [][]int{enginetest.Tokens(r, 21, c.VocabSize), enginetest.Tokens(r, 9, c.VocabSize)}
	next := make([][]int, 3*(len(kernels)+1))
	for i := range next {
		next[i] = enginetest.Tokens(r, len(prompts), c.VocabSize)
	}
	decode := func(graphs bool) [][]float32 {
		e.NoGraphs = !graphs
		e.Attention = kernels[0]
		caches := enginetest.Caches(t, e, len(prompts), 64)
		enginetest.Forward(t, e, caches, prompts, false)
		var out [][]float32
		for i, ids := range next {
			e.Attention = kernels[(i/3)%len(kernels)]
			step := make([][]int, len(ids))
			for s, id := range ids {
				step[s] = []int{id}
			}
			l, _, err := e.Forward(caches, step, false)
			if err != nil {
				t.Fatalf("seed %d: step %d (%s): %v", seed, i, e.Attention, err)
			}
			out = append(out, l...)
		}
		return out
	}
	eager := decode(false)
	records := e.GraphRecords()
	graphed := decode(true)
	if err := e.GraphError(); err != nil {
		t.Fatalf("seed %d: recording a graph failed: %v", seed, err)
	}
	if n := e.GraphRecords() - records; n < len(kernels)+1 {
		t.Errorf("seed %d: %d graphs recorded over %d attention settings in turn, want at least %d", seed, n,
			len(kernels)+1, len(kernels)+1)
	}
	enginetest.SameBits(t, fmt.Sprintf("seed %d: attention changed between steps, graph vs eager", seed), graphed, eager)
}

// TestAttentionRepeatable runs each attention build three times on the same
// long passes and wants bit-identical logits: the kernels are deterministic,
// so a difference means a race (such as a block read before its cp.async
// group has landed), which a tolerance check can miss.
func TestAttentionRepeatable(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	c := testConfig(64, 4, 2, true)
	c.MaxPositionEmbeddings = 1024
	r, seed := testutil.Rand(t)
	m := sparseModel(t, c, r, seed)
	toks := [][]int{enginetest.Tokens(r, 1024, c.VocabSize), enginetest.Tokens(r, 1000, c.VocabSize), enginetest.Tokens(r, 700, c.VocabSize)}
	kernels := []string{"mma"}
	if dev.Properties().Arch == "sm_90a" {
		kernels = append(kernels, wgNames()...)
	}
	for _, k := range kernels {
		e := engineOnPath(t, dev, m, seed, "dense")
		e.Attention = k
		var first [][]float32
		for rep := 0; rep < 3; rep++ {
			caches := enginetest.Caches(t, e, len(toks), 1024)
			got, _, err := e.Forward(caches, toks, true)
			if err != nil {
				t.Fatalf("seed %d: %s: %v", seed, k, err)
			}
			if rep == 0 {
				first = got
				continue
			}
			enginetest.SameBits(t, fmt.Sprintf("%s, run %d vs run 1", k, rep+1), got, first)
		}
	}
}

// TestAttnRopeSameBits checks Engine.AttnRope: prefill passes whose
// queries attn_wg64 rotates as it loads them (rope_kv then writes only keys
// and values) give the same logits, bit for bit, as passes where rope_kv
// rotates them; over sequences that start mid-page in a second pass, a
// one-token sequence, and a decode step after (which AttnRope leaves to
// qkv_rope), with the attention chosen automatically and forced.
func TestAttnRopeSameBits(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	if dev.Properties().Arch != "sm_90a" {
		t.Skip("attn_wg64 needs sm_90a")
	}
	c := testConfig(64, 4, 2, true)
	r, seed := testutil.Rand(t)
	m := sparseModel(t, c, r, seed)
	n0, n1 := 65+r.IntN(300), 1+r.IntN(3)
	passes := [][][]int{
		{enginetest.Tokens(r, n0, c.VocabSize), enginetest.Tokens(r, n1, c.VocabSize), enginetest.Tokens(r, 130, c.VocabSize)},
		{enginetest.Tokens(r, 1+r.IntN(100), c.VocabSize), enginetest.Tokens(r, 129, c.VocabSize), enginetest.Tokens(r, 70, c.VocabSize)},
		{enginetest.Tokens(r, 1, c.VocabSize), enginetest.Tokens(r, 1, c.VocabSize), enginetest.Tokens(r, 1, c.VocabSize)},
	}
	for _, attn := range append([]string{"auto"}, wgNames()...) {
		run := func(rope bool) [][]float32 {
			e := engineOnPath(t, dev, m, seed, "dense")
			e.Attention, e.AttnRope = attn, rope
			out := enginetest.Passes(t, e, 520, passes...)
			if k, err := e.attentionKernel(n0 + n1 + 130); err != nil || !k.wg {
				t.Fatalf("seed %d, %s attention: the first pass did not run attn_wg64 (err %v): nothing rotated its queries", seed, attn, err)
			}
			return out
		}
		enginetest.SameBits(t, fmt.Sprintf("seed %d, %s attention: queries rotated by attn_wg64 vs by rope_kv (first lengths %d, %d)", seed, attn, n0, n1),
			run(true), run(false))
	}
}

// TestAttentionLongMatchesRef runs sequences over several query and key
// blocks through the tensor-core attention kernels (mma.sync for head_dim
// 64 and 128, and on Hopper the wgmma kernel for 64) and the
// plain kernel: a prefill of 300 and 1 tokens, then a second pass adding
// 150 and 129 tokens after them (queries that start past block edges, and
// a cache already holding keys). Logits of every kernel must agree with
// the plain kernel's and with the CPU model's.
func TestAttentionLongMatchesRef(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	for _, c := range []model.Config{testConfig(64, 4, 2, true), testConfig(128, 2, 1, true)} {
		t.Run(fmt.Sprintf("hd%d", c.HeadDim), func(t *testing.T) {
			r, seed := testutil.Rand(t)
			m := sparseModel(t, c, r, seed)
			passes := [][][]int{
				{enginetest.Tokens(r, 300, c.VocabSize), enginetest.Tokens(r, 1, c.VocabSize)},
				{enginetest.Tokens(r, 150, c.VocabSize), enginetest.Tokens(r, 129, c.VocabSize)},
			}
			run := func(attn string) [][]float32 {
				e := engineOnPath(t, dev, m, seed, "dense")
				e.Attention = attn
				return enginetest.Passes(t, e, 460, passes...)
			}
			kernels := []string{"mma"}
			if c.HeadDim == 64 && dev.Properties().Arch == "sm_90a" {
				kernels = append(kernels, wgNames()...)
			}
			ref := run("ref")
			want := cpuForward(t, m, "dense", 460, passes...)
			for _, k := range kernels {
				got := run(k)
				if d, err := enginetest.RelDiff(got, ref); err != nil || d > 1e-2 {
					t.Errorf("seed %d: %s vs plain kernel: rel diff %.3g (err %v)", seed, k, d, err)
				}
				d, err := enginetest.RelDiff(got, want)
				if err != nil || d > bf16Tol {
					t.Errorf("seed %d: %s vs CPU: rel diff %.3g (err %v)", seed, k, d, err)
				}
				t.Logf("seed %d: %s vs CPU rel diff %.2e", seed, k, d)
			}
		})
	}
}

// TestDecodeAttentionMatchesRef runs decode steps, where every sequence
// has one new token (the split-key decode kernel under auto), after
// prefills of 1500, 700, 129 and 1 tokens: keys over one run and over
// several blocks a run, a run that ends inside a block, and a sequence
// with fewer blocks than runs; grouped-query attention with head_dim 64,
// and head_dim 128. The decode steps' logits must agree with the plain
// kernel's and the CPU model's, and repeat bit for bit.
func TestDecodeAttentionMatchesRef(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	// 40 heads: 160 (sequence, head) pairs, which decRuns cuts into fewer
	// runs than the others' 16 (4 on an H200).
	for _, c := range []model.Config{testConfig(64, 4, 2, true), testConfig(128, 2, 1, true), testConfig(64, 40, 8, true)} {
		t.Run(fmt.Sprintf("hd%d_heads%d", c.HeadDim, c.NumAttentionHeads), func(t *testing.T) {
			c.MaxPositionEmbeddings = 2048
			r, seed := testutil.Rand(t)
			m := sparseModel(t, c, r, seed)
			passes := [][][]int{{enginetest.Tokens(r, 1500, c.VocabSize), enginetest.Tokens(r, 700, c.VocabSize),
				enginetest.Tokens(r, 129, c.VocabSize), enginetest.Tokens(r, 1, c.VocabSize)}}
			passes = append(passes, decodeSteps(r, 3, 4, c.VocabSize)...)
			run := func(attn string, global bool) [][]float32 {
				e := engineOnPath(t, dev, m, seed, "dense")
				e.Attention, e.decGlobalMerge = attn, global
				return enginetest.Passes(t, e, 1504, passes...)[2330:] // the decode steps' logits
			}
			got := run("auto", false)
			checkDecodeKernel(t, seed, got, run("ref", false), cpuForward(t, m, "dense", 1504, passes...)[2330:], run("auto", false))
			// Runs merged through global memory instead of a cluster's
			// shared memory: the same sums in the same order.
			enginetest.SameBits(t, "decode kernel, runs merged in global memory", run("auto", true), got)
		})
	}
}

// decodeSteps returns n passes of one random token for each of S
// sequences.
func decodeSteps(r *rand.Rand, n, S, vocab int) [][][]int {
	steps := make([][][]int, n)
	for k := range steps {
		steps[k] = make([][]int, S)
		for i := range steps[k] {
			steps[k][i] = enginetest.Tokens(r, 1, vocab)
		}
	}
	return steps
}

// checkDecodeKernel compares the decode steps' logits of the decode
// attention kernel (got, then again from a second run) with the plain
// kernel's (ref) and the CPU model's (want).
func checkDecodeKernel(t *testing.T, seed uint64, got, ref, want, again [][]float32) {
	t.Helper()
	if d, err := enginetest.RelDiff(got, ref); err != nil || d > 1e-2 {
		t.Errorf("seed %d: decode kernel vs plain kernel: rel diff %.3g (err %v)", seed, d, err)
	}
	if d, err := enginetest.RelDiff(got, want); err != nil || d > bf16Tol {
		t.Errorf("seed %d: decode kernel vs CPU: rel diff %.3g (err %v)", seed, d, err)
	}
	enginetest.SameBits(t, "decode kernel, second run", again, got)
}

// TestDecodeAttentionFirstToken runs the decode kernel on passes whose
// sequences start with one token each (nothing cached: the only key is the
// new token's, read after grid_wait, and every other run is empty), then
// on two decode steps: the logits must agree with the plain kernel's and
// the CPU model's, and repeat bit for bit.
func TestDecodeAttentionFirstToken(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	c := testConfig(64, 4, 2, true)
	r, seed := testutil.Rand(t)
	m := sparseModel(t, c, r, seed)
	passes := decodeSteps(r, 3, 3, c.VocabSize)
	run := func(attn string) [][]float32 {
		e := engineOnPath(t, dev, m, seed, "dense")
		e.Attention = attn
		return enginetest.Passes(t, e, 64, passes...)
	}
	checkDecodeKernel(t, seed, run("auto"), run("ref"), cpuForward(t, m, "dense", 64, passes...), run("auto"))
}

// TestDecodeAttentionManySequences runs the decode kernel on decode steps
// of enough sequences that it cuts each query's keys into 2 runs (merged
// in a cluster and, again, through global memory: the same bits), and
// into 1 (each CTA then writes its output itself), at head_dim 64 and 128:
// the logits must agree with the plain kernel's and the CPU model's, and
// repeat bit for bit; with 8 times the runs (Engine.decRunsFixed) they must
// agree with the plain kernel's.
func TestDecodeAttentionManySequences(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	for _, c := range []model.Config{testConfig(64, 40, 8, true), testConfig(128, 16, 4, true)} {
		for _, runs := range []int{2, 1} {
			// The fewest sequences whose (sequence, head) pairs get runs.
			S := 1
			k, err := kernelsFor(dev)
			if err != nil {
				t.Fatal(err)
			}
			kd := k.dec[c.HeadDim]
			if dev.Properties().Major == 9 && !kd.cluster {
				t.Errorf("head_dim %d: no clusters of %d runs on %v (Hopper holds them)", c.HeadDim, decSplits, dev)
			}
			for decRunsFor(S*c.NumAttentionHeads, kd.slots) > runs {
				S++
			}
			t.Run(fmt.Sprintf("hd%d_heads%d_seqs%d_runs%d", c.HeadDim, c.NumAttentionHeads, S, runs), func(t *testing.T) {
				r, seed := testutil.Rand(t)
				m := sparseModel(t, c, r, seed)
				prompts := make([][]int, S)
				for i := range prompts {
					prompts[i] = enginetest.Tokens(r, 1+r.IntN(300), c.VocabSize)
				}
				passes := [][][]int{prompts}
				passes = append(passes, decodeSteps(r, 2, S, c.VocabSize)...)
				first := 0
				for _, p := range prompts {
					first += len(p)
				}
				run := func(attn string, global bool, forced int) [][]float32 {
					e := engineOnPath(t, dev, m, seed, "dense")
					e.Attention, e.decGlobalMerge, e.decRunsFixed = attn, global, forced
					if got, want := e.decRuns(S*c.NumAttentionHeads, kd), cmp.Or(forced, runs); attn == "auto" && got != want {
						t.Fatalf("%d sequences: %d runs, want %d", S, got, want)
					}
					return enginetest.Passes(t, e, 304, passes...)[first:] // the decode steps' logits
				}
				got, ref := run("auto", false, 0), run("ref", false, 0)
				checkDecodeKernel(t, seed, got, ref, cpuForward(t, m, "dense", 304, passes...)[first:], run("auto", false, 0))
				enginetest.SameBits(t, "decode kernel, runs merged in global memory", run("auto", true, 0), got)
				// More runs than the batch gets (Engine.decRunsFixed): the same
				// attention, summed in another order.
				if d, err := enginetest.RelDiff(run("auto", false, 8*runs), ref); err != nil || d > 1e-2 {
					t.Errorf("seed %d: decode kernel with %d runs vs plain kernel: rel diff %.3g (err %v)", seed, 8*runs, d, err)
				}
			})
		}
	}
}

// TestDecodeRope decodes batches whose q/k/v projections run on cuBLASLt
// with RoPE and the cache write done by the decode attention kernel
// (Engine.DecRope) and by rope_kv: the logits must be the same bits,
// replayed from graphs or kernel by kernel, with runs merged in a cluster
// or in global memory, and agree with the CPU model. The positions of the
// new tokens fall at the start, the end and the middle of key blocks, and
// at 0 (a first pass of one token a sequence); 3 sequences with NoGEMV cut
// the keys into more runs than blocks.
func TestDecodeRope(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	type setting struct{ rope, kernelByKernel, global, noGEMV bool }
	for _, c := range []model.Config{testConfig(64, 4, 2, true), testConfig(128, 2, 1, true), testConfig(64, 40, 8, true)} {
		for _, first := range []bool{false, true} {
			t.Run(fmt.Sprintf("hd%d_heads%d_first%v", c.HeadDim, c.NumAttentionHeads, first), func(t *testing.T) {
				r, seed := testutil.Rand(t)
				m := sparseModel(t, c, r, seed)
				lens := []int{1, 63, 64, 65, 130, 257}
				if first {
					lens = []int{1, 1, 1, 1, 1, 1}
				}
				prompts := make([][]int, len(lens))
				for i, n := range lens {
					prompts[i] = enginetest.Tokens(r, n, c.VocabSize)
				}
				passes := append([][][]int{prompts}, decodeSteps(r, 3, len(lens), c.VocabSize)...)
				few := [][][]int{prompts[:3]}
				few = append(few, decodeSteps(r, 2, 3, c.VocabSize)...)
				run := func(p [][][]int, st setting) [][]float32 {
					e := engineOnPath(t, dev, m, seed, "sparse")
					e.DecRope, e.NoGraphs, e.decGlobalMerge, e.NoGEMV = st.rope, st.kernelByKernel, st.global, st.noGEMV
					return enginetest.Passes(t, e, 320, p...)
				}
				base := run(passes, setting{})
				if d, err := enginetest.RelDiff(base, cpuForward(t, m, "sparse", 320, passes...)); err != nil || d > bf16Tol {
					t.Errorf("seed %d: decode steps vs CPU: rel diff %.3g (err %v)", seed, d, err)
				}
				for _, st := range []setting{{rope: true}, {rope: true, kernelByKernel: true}, {rope: true, global: true}} {
					enginetest.SameBits(t, fmt.Sprintf("seed %d: %+v", seed, st), run(passes, st), base)
				}
				enginetest.SameBits(t, fmt.Sprintf("seed %d: 3 sequences on cuBLASLt, DecRope", seed),
					run(few, setting{noGEMV: true, rope: true}), run(few, setting{noGEMV: true}))
			})
		}
	}
}

// TestFusedNormsMatchUnfused decodes one sequence with the norms fused
// into the kernels after them (FuseNorms: qkv_rope1n, and gemv_mlp on
// graph-replayed sparse steps) and without: the logits must be the same
// bit for bit, replayed from graphs or kernel by kernel, on the sparse and
// the dense MLP path.
func TestFusedNormsMatchUnfused(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	c := testConfig(64, 4, 2, true)
	r, seed := testutil.Rand(t)
	m := sparseModel(t, c, r, seed)
	prompt := enginetest.Tokens(r, 40, c.VocabSize)
	steps := make([][][]int, 12)
	for i := range steps {
		steps[i] = [][]int{{r.IntN(c.VocabSize)}}
	}
	passes := append([][][]int{{prompt}}, steps...)
	for _, path := range []string{"sparse", "dense"} {
		for _, graphs := range []bool{true, false} {
			run := func(fuse bool) ([][]float32, *Engine) {
				e := engineOnPath(t, dev, m, seed, path)
				e.FuseNorms, e.NoGraphs = fuse, !graphs
				return enginetest.Passes(t, e, 64, passes...), e
			}
			plain, _ := run(false)
			fused, e := run(true)
			name := fmt.Sprintf("%s path, graphs %v", path, graphs)
			enginetest.SameBits(t, name+": fused vs unfused norms", fused, plain)
			if graphs && (e.GraphReplays() == 0 || e.GraphError() != nil) {
				t.Errorf("seed %d: %s: %d graph replays (error %v)", seed, name, e.GraphReplays(), e.GraphError())
			}
		}
	}
	// QueueNormed refuses to write the residual sum over its input.
	e := engineOnPath(t, dev, m, seed, "sparse")
	enginetest.Passes(t, e, 64, [][]int{prompt})
	ws := &e.ws
	err := e.layers[0].mlp.QueueNormed(e.stream, ws.proj, gpu.NormedInput{Resid: ws.resid, ResidOut: ws.resid, Weight: e.layers[0].mlpNorm})
	if err == nil || !strings.Contains(err.Error(), "buffer it reads") {
		t.Errorf("QueueNormed with the same residual buffer in and out: %v", err)
	}
}

// TestCalibrateAtLongPrefill: with hot units on, the engine's first pass
// of gpu.CalibrationTokens tokens or more calibrates every layer's MLP (at
// the SparseLM widths, where the skewed rates make hot units worth it), and
// that pass's logits and a decode step's after it match the CPU model's.
func TestCalibrateAtLongPrefill(t *testing.T) {
	dev := cudatest.Device(t)
	cudatest.Compiler(t)
	c := testConfig(64, 32, 4, true)
	c.HiddenSize, c.IntermediateSize = 2048, 5632
	r, seed := testutil.Rand(t)
	m := sparseModel(t, c, r, seed)
	e := engineOnPath(t, dev, m, seed, "sparse")
	e.HotUnits = true      // whatever TWELL_HOT_UNITS says
	const seqs, n = 9, 460 // 4140 tokens
	toks := make([][]int, seqs)
	step := make([][]int, seqs)
	for i := range toks {
		toks[i] = enginetest.Tokens(r, n, c.VocabSize)
		step[i] = []int{r.IntN(c.VocabSize)}
	}
	want := cpuForward(t, m, "sparse", n+1, toks, step)
	gc := enginetest.Caches(t, e, seqs, n+1)
	got, _ := enginetest.Forward(t, e, gc, toks, true)
	if d, err := enginetest.RelDiff(got, want[:seqs*n]); err != nil || d > bf16Tol {
		t.Fatalf("seed %d: prefill: rel diff %.3g (err %v), want <= %g", seed, d, err, bf16Tol)
	}
	if err := e.CalibrationError(); err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	hot, counts := 0, e.HotUnitCounts()
	for i, l := range e.layers {
		if !l.mlp.Calibrated() {
			t.Errorf("seed %d: layer %d not calibrated after a pass of %d tokens", seed, i, seqs*n)
		}
		if counts[i] != l.mlp.HotUnits() {
			t.Errorf("seed %d: layer %d: HotUnitCounts %d, its MLP %d", seed, i, counts[i], l.mlp.HotUnits())
		}
		hot += l.mlp.HotUnits()
		t.Logf("seed %d: layer %d: %d hot units", seed, i, l.mlp.HotUnits())
	}
	if hot == 0 {
		t.Errorf("seed %d: no layer chose hot units", seed)
	}
	got, _ = enginetest.Forward(t, e, gc, step, true)
	if d, err := enginetest.RelDiff(got, want[seqs*n:]); err != nil || d > bf16Tol {
		t.Fatalf("seed %d: decode step: rel diff %.3g (err %v), want <= %g", seed, d, err, bf16Tol)
	}
}
