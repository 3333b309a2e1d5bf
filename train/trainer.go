package train

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/safetensors"
)

// Metrics is one line of metrics.jsonl.
type Metrics struct {
	Step     int       `json:"step"`
	Tokens   int64     `json:"tokens"`
	Loss     float64   `json:"loss"`
	L1       float64   `json:"l1"`
	L0       []float64 `json:"l0"`      // mean active MLP units per token, per layer
	L0Mean   float64   `json:"l0_mean"` // mean over layers
	DeadFrac float64   `json:"dead_frac"`
	ValLoss  *float64  `json:"val_loss,omitempty"`
	LR       float64   `json:"lr"`
	GradNorm float64   `json:"grad_norm"`
	MS       float64   `json:"ms"` // wall time of the step
}

// Run is a training run: model, optimizer, data, sparsity tracker and the
// output folder.
type Run struct {
	Cfg    *Config
	Out    string
	Params *Params[float32]
	Opt    *AdamW
	Train  Source
	// Val holds the held-out windows (seq+1 tokens each) for evaluation.
	Val [][]int
	// Extra files (e.g. tokenizer.json) copied into each checkpoint.
	Extra map[string]string
	// Log receives progress lines; nil discards them.
	Log io.Writer
	// StopAt, when positive, ends Loop after that step without finishing
	// the run, as an interruption would (checkpoint cadence unchanged).
	StopAt int

	step     int
	tokens   int64
	lastFire [][]int64 // per layer, per unit: token count at its last firing
	fires    [][]int64 // per layer, per unit: tokens on which it fired, over the run
	history  []Metrics
}

// trainerState is trainer_state.json in a checkpoint.
type trainerState struct {
	Step     int             `json:"step"`
	Tokens   int64           `json:"tokens"`
	AdamStep int64           `json:"adam_step"`
	LastFire [][]int64       `json:"last_fire"`
	Fires    [][]int64       `json:"fires"` // per layer, per unit: tokens it fired on
	Config   json.RawMessage `json:"config"`
}

// NewRun starts a run from fresh weights.
func NewRun(cfg *Config, out string, w *model.Weights, trainSrc Source, val [][]int) *Run {
	p := FromWeights(w)
	r := &Run{Cfg: cfg, Out: out, Params: p, Train: trainSrc, Val: val,
		Opt: NewAdamW(p, cfg.Beta1, cfg.Beta2, cfg.Eps, cfg.WeightDecay)}
	mc := cfg.ModelConfig()
	for range mc.NumHiddenLayers {
		r.lastFire = append(r.lastFire, make([]int64, mc.IntermediateSize))
		r.fires = append(r.fires, make([]int64, mc.IntermediateSize))
	}
	return r
}

func (r *Run) logf(format string, a ...any) {
	if r.Log != nil {
		fmt.Fprintf(r.Log, format+"\n", a...)
	}
}

// Step returns the number of steps done.
func (r *Run) Step() int { return r.step }

// Loop trains until cfg.Steps, writing metrics, evaluations, checkpoints
// and plots into Out.
func (r *Run) Loop() error {
	c := r.Cfg
	mc := c.ModelConfig()
	if err := os.MkdirAll(r.Out, 0o755); err != nil {
		return err
	}
	mf, err := os.OpenFile(filepath.Join(r.Out, "metrics.jsonl"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer mf.Close()
	enc := json.NewEncoder(mf)
	win := make([]int, c.Seq+1)
	batchTokens := make([]int, c.Batch*(c.Seq+1))
	for r.step < c.Steps {
		t0 := time.Now()
		g := zerosLike[float32](r.Params)
		var loss, l1 float64
		l0 := make([]float64, mc.NumHiddenLayers)
		active := make([][]int32, mc.NumHiddenLayers)
		for a := 0; a < c.Accum; a++ {
			for b := 0; b < c.Batch; b++ {
				idx := (int64(r.step)*int64(c.Accum)+int64(a))*int64(c.Batch) + int64(b)
				if err := r.Train.Window(win, idx); err != nil {
					return err
				}
				copy(batchTokens[b*(c.Seq+1):], win)
			}
			st, err := lossAndGrad(mc, r.Params, g, batchTokens, c.Batch, c.Seq, c.L1)
			if err != nil {
				return err
			}
			loss += st.Loss / float64(c.Accum)
			l1 += st.L1 / float64(c.Accum)
			for li := range l0 {
				l0[li] += st.L0[li] / float64(c.Accum)
				if active[li] == nil {
					active[li] = make([]int32, mc.IntermediateSize)
				}
				for j, n := range st.Active[li] {
					active[li][j] += n
				}
			}
			r.tokens += int64(c.Batch * c.Seq)
		}
		if c.Accum > 1 {
			s := float32(1 / float64(c.Accum))
			for _, t := range g.list() {
				for j := range *t {
					(*t)[j] *= s
				}
			}
		}
		if math.IsNaN(loss) || math.IsInf(loss, 0) {
			return fmt.Errorf("train: step %d: loss is %g; lower lr or check the data", r.step, loss)
		}
		norm := clipGradients(g, c.Clip)
		lr := Schedule(r.step, c.Warmup, c.Steps, c.LR, c.MinLR)
		r.Opt.Update(r.Params, g, lr)
		dead := r.track(active)
		r.step++

		m := Metrics{Step: r.step, Tokens: r.tokens, Loss: loss, L1: l1, L0: l0, DeadFrac: dead, LR: lr, GradNorm: norm,
			MS: float64(time.Since(t0).Microseconds()) / 1000}
		for _, v := range l0 {
			m.L0Mean += v / float64(len(l0))
		}
		last := r.step == c.Steps
		if (c.EvalEvery > 0 && r.step%c.EvalEvery == 0) || last {
			v, err := r.Evaluate()
			if err != nil {
				return err
			}
			m.ValLoss = &v
		}
		if r.step%c.LogEvery == 0 || m.ValLoss != nil || last {
			if err := enc.Encode(m); err != nil {
				return err
			}
			r.history = append(r.history, m)
			val := ""
			if m.ValLoss != nil {
				val = fmt.Sprintf(" val %.4f", *m.ValLoss)
			}
			r.logf("step %d/%d loss %.4f%s l1 %.4f l0 %.1f dead %.2f lr %.2e %.0fms", r.step, c.Steps, loss, val, l1, m.L0Mean, dead, lr, m.MS)
		}
		if (c.CheckpointEvery > 0 && r.step%c.CheckpointEvery == 0) || last {
			if err := r.Checkpoint(); err != nil {
				return err
			}
		}
		if r.StopAt > 0 && r.step >= r.StopAt && !last {
			return nil
		}
	}
	return r.Plot()
}

// track updates per-unit firing and returns the fraction of dead units; it
// re-initialises them when the config asks for it.
func (r *Run) track(active [][]int32) float64 {
	c := r.Cfg
	dead, total := 0, 0
	for li, units := range active {
		for j, n := range units {
			if n > 0 {
				r.lastFire[li][j] = r.tokens
				r.fires[li][j] += int64(n)
			}
			total++
			if r.tokens-r.lastFire[li][j] >= c.DeadWindow {
				dead++
				if c.ReinitDead {
					r.reinitUnit(li, j)
				}
			}
		}
	}
	return float64(dead) / float64(max(total, 1))
}

// reinitUnit draws fresh gate and up rows for unit j of layer li, zeroes its
// down column and optimizer moments, and restarts its dead-unit clock.
func (r *Run) reinitUnit(li, j int) {
	mc := r.Cfg.ModelConfig()
	h, f := mc.HiddenSize, mc.IntermediateSize
	rng := rand.New(rand.NewPCG(r.Cfg.Seed^0xdead, uint64(r.step)<<32|uint64(li)<<20|uint64(j)))
	l := &r.Params.Layers[li]
	for _, w := range [][]float32{l.Gate, l.Up} {
		if w == nil {
			continue
		}
		for k := 0; k < h; k++ {
			w[j*h+k] = float32(rng.NormFloat64() * 0.02)
		}
	}
	for k := 0; k < h; k++ {
		l.Down[k*f+j] = 0
	}
	for i, t := range r.Params.list() {
		switch {
		case &(*t)[0] == &l.Up[0] || (l.Gate != nil && &(*t)[0] == &l.Gate[0]):
			r.Opt.resetRange(i, j*h, (j+1)*h)
		case &(*t)[0] == &l.Down[0]:
			for k := 0; k < h; k++ {
				r.Opt.resetRange(i, k*f+j, k*f+j+1)
			}
		}
	}
	r.lastFire[li][j] = r.tokens
}

// Fires returns, per layer and unit, the number of tokens the unit fired on
// since the run began (re-initialised units keep their count).
func (r *Run) Fires() [][]int64 { return r.fires }

// Evaluate returns the mean cross-entropy over the held-out windows.
func (r *Run) Evaluate() (float64, error) {
	c := r.Cfg
	wins := r.Val[:min(len(r.Val), c.EvalBatches*c.Batch)]
	if len(wins) == 0 {
		return 0, fmt.Errorf("train: the held-out split has no window of %d tokens", c.Seq+1)
	}
	for i, w := range wins {
		if len(w) != c.Seq+1 {
			return 0, fmt.Errorf("train: held-out window %d has %d tokens, want %d", i, len(w), c.Seq+1)
		}
	}
	total, n := 0.0, 0
	for i := 0; i < len(wins); i += c.Batch {
		chunk := wins[i:min(i+c.Batch, len(wins))]
		toks := make([]int, 0, len(chunk)*(c.Seq+1))
		for _, w := range chunk {
			toks = append(toks, w...)
		}
		st, err := lossAndGrad(c.ModelConfig(), r.Params, nil, toks, len(chunk), c.Seq, 0)
		if err != nil {
			return 0, err
		}
		total += st.Loss * float64(len(chunk))
		n += len(chunk)
	}
	return total / float64(n), nil
}

// Checkpoint writes the model (Hugging Face format), optimizer and trainer
// state to Out/checkpoint, atomically: a new folder is written and renamed
// into place, so an interruption leaves the previous checkpoint intact.
func (r *Run) Checkpoint() error {
	tmp, err := os.MkdirTemp(r.Out, ".checkpoint-tmp-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	mc := r.Cfg.ModelConfig()
	if err := model.Save(tmp, mc, r.Params.weights(), safetensors.F32); err != nil {
		return err
	}
	sw, err := safetensors.Create(filepath.Join(tmp, "optimizer.safetensors"))
	if err != nil {
		return err
	}
	for i := range r.Opt.m {
		if err := sw.AddFloat32(fmt.Sprintf("m.%d", i), safetensors.F32, []int{len(r.Opt.m[i])}, r.Opt.m[i]); err != nil {
			sw.Abort()
			return err
		}
		if err := sw.AddFloat32(fmt.Sprintf("v.%d", i), safetensors.F32, []int{len(r.Opt.v[i])}, r.Opt.v[i]); err != nil {
			sw.Abort()
			return err
		}
	}
	if err := sw.Close(); err != nil {
		return err
	}
	cfgJSON, err := json.Marshal(r.Cfg)
	if err != nil {
		return err
	}
	st := trainerState{Step: r.step, Tokens: r.tokens, AdamStep: r.Opt.Step, LastFire: r.lastFire, Fires: r.fires, Config: cfgJSON}
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(tmp, "trainer_state.json"), b, 0o644); err != nil {
		return err
	}
	for name, src := range r.Extra {
		data, err := os.ReadFile(src)
		if err != nil {
			return fmt.Errorf("train: checkpoint extra file: %w", err)
		}
		if err := os.WriteFile(filepath.Join(tmp, name), data, 0o644); err != nil {
			return err
		}
	}
	final := filepath.Join(r.Out, "checkpoint")
	old := final + ".old"
	os.RemoveAll(old)
	if _, err := os.Stat(final); err == nil {
		if err := os.Rename(final, old); err != nil {
			return err
		}
	}
	if err := os.Rename(tmp, final); err != nil {
		return err
	}
	return os.RemoveAll(old)
}

// Resume loads Out/checkpoint (or the previous one, if an interrupted
// checkpoint left only that) into the run and truncates metrics.jsonl to
// the checkpoint's step, so the run continues the same curve.
func (r *Run) Resume() error {
	dir := filepath.Join(r.Out, "checkpoint")
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		dir += ".old"
	}
	b, err := os.ReadFile(filepath.Join(dir, "trainer_state.json"))
	if err != nil {
		return fmt.Errorf("train: resume: no readable checkpoint in %s: %w", r.Out, err)
	}
	var st trainerState
	if err := json.Unmarshal(b, &st); err != nil {
		return fmt.Errorf("train: resume: %s: %w", filepath.Join(dir, "trainer_state.json"), err)
	}
	mc := r.Cfg.ModelConfig()
	ck, err := safetensors.OpenDir(dir)
	if err != nil {
		return fmt.Errorf("train: resume: %w", err)
	}
	w, err := model.LoadWeights(mc, ck)
	ck.Close()
	if err != nil {
		return fmt.Errorf("train: resume: checkpoint does not match the model config: %w", err)
	}
	of, err := safetensors.Open(filepath.Join(dir, "optimizer.safetensors"))
	if err != nil {
		return fmt.Errorf("train: resume: %w", err)
	}
	defer of.Close()
	p := FromWeights(w)
	opt := NewAdamW(p, r.Cfg.Beta1, r.Cfg.Beta2, r.Cfg.Eps, r.Cfg.WeightDecay)
	for i := range opt.m {
		for _, mv := range []struct {
			name string
			dst  []float32
		}{{fmt.Sprintf("m.%d", i), opt.m[i]}, {fmt.Sprintf("v.%d", i), opt.v[i]}} {
			t, err := of.Expect(mv.name, safetensors.F32, len(mv.dst))
			if err != nil {
				return fmt.Errorf("train: resume: optimizer state: %w", err)
			}
			if err := t.Float32Into(mv.dst); err != nil {
				return err
			}
		}
	}
	if len(st.LastFire) != mc.NumHiddenLayers || len(st.Fires) != mc.NumHiddenLayers {
		return fmt.Errorf("train: resume: trainer state has %d layers, the model %d", len(st.LastFire), mc.NumHiddenLayers)
	}
	opt.Step = st.AdamStep
	r.Params, r.Opt, r.step, r.tokens, r.lastFire, r.fires = p, opt, st.Step, st.Tokens, st.LastFire, st.Fires
	return r.truncateMetrics()
}

// truncateMetrics drops metrics lines past the resumed step and reloads the
// history for plots.
func (r *Run) truncateMetrics() error {
	path := filepath.Join(r.Out, "metrics.jsonl")
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var keep []string
	r.history = nil
	for _, line := range strings.Split(string(b), "\n") {
		if strings.TrimSpace(line) == "" {
			continue
		}
		var m Metrics
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			break // a torn last line from the interruption
		}
		if m.Step > r.step {
			break
		}
		keep = append(keep, line)
		r.history = append(r.history, m)
	}
	data := strings.Join(keep, "\n")
	if data != "" {
		data += "\n"
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(data), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
