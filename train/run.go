package train

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"time"

	"github.com/twell-ai/twell/model"
)

// Run is a training run: the loop, written once over a Backend. It owns the
// schedule, the data order, gradient accumulation, dead-unit tracking,
// evaluation, checkpoints, metrics.jsonl, plots and resume; the backend
// owns the model, its gradients and the optimizer state.
type Run struct {
	Cfg     *Config
	Out     string
	Backend Backend
	Train   Source
	// Val holds the held-out windows (seq+1 tokens each) for evaluation.
	Val [][]int
	// Files are written into each checkpoint beside the model, by name
	// (e.g. tokenizer.json and tokenizer_config.json).
	Files map[string][]byte
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
	saved    int // the step of the newest checkpoint on disk; -1 when none

	// Test hooks: hook is called at each point of the checkpoint protocol
	// (tests stop or copy the run there); noPlots skips the plots.
	hook    func(stage string)
	noPlots bool
}

// NewRun starts a run at step 0 of cfg on backend b, whose weights are the
// run's starting point. Call Resume before Loop to continue a run instead.
func NewRun(cfg *Config, out string, b Backend, trainSrc Source, val [][]int) *Run {
	r := &Run{Cfg: cfg, Out: out, Backend: b, Train: trainSrc, Val: val, saved: -1}
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

// at marks a point of the checkpoint protocol.
func (r *Run) at(stage string) {
	if r.hook != nil {
		r.hook(stage)
	}
}

// Step returns the number of steps done.
func (r *Run) Step() int { return r.step }

// Fires returns, per layer and unit, the number of tokens the unit fired on
// since the run began (re-initialised units keep their count).
func (r *Run) Fires() [][]int64 { return r.fires }

// Interrupted is Loop's error when its context was cancelled (e.g. by
// Ctrl-C): the run stopped after Step, whose checkpoint is in Checkpoint.
type Interrupted struct {
	Step       int
	Checkpoint string
}

// Error says where the run stopped.
func (e *Interrupted) Error() string {
	return fmt.Sprintf("interrupted at step %d; checkpoint %s", e.Step, e.Checkpoint)
}

// errAbandoned reports a step given up between micro-batches.
var errAbandoned = errors.New("train: step abandoned")

// Loop trains until Cfg.Steps, writing metrics, evaluations, checkpoints
// and plots into Out. When ctx is cancelled it finishes the micro-batch
// under way, abandons the rest of the step (no update), saves a checkpoint
// of the last whole step unless one is on disk, writes the plots and
// returns an *Interrupted.
func (r *Run) Loop(ctx context.Context) error {
	c := r.Cfg
	if err := os.MkdirAll(r.Out, 0o755); err != nil {
		return err
	}
	var mw *metricsWriter
	if r.writes() {
		var err error
		if mw, err = openMetrics(r.Out); err != nil {
			return err
		}
		defer mw.Close()
	}
	prog := newProgress(r.step, r.tokens)
	if pr, ok := r.Backend.(PeakRater); ok {
		prog.peak, prog.flopsPerToken = pr.PeakFLOPS(), FLOPsPerToken(c.ModelConfig(), c.Seq)
	}
	for r.step < c.Steps {
		stop := ctx.Err() != nil
		if p, _, world := r.parallel(); world > 0 {
			var err error
			if stop, err = p.AnyStop(stop); err != nil {
				return err
			}
		}
		if stop {
			return r.interrupted()
		}
		m, err := r.trainStep(ctx)
		if errors.Is(err, errAbandoned) {
			return r.interrupted()
		}
		if err != nil {
			return err
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
			if mw != nil {
				if err := mw.write(m); err != nil {
					return err
				}
			}
			r.history = append(r.history, m)
			r.logf("%s", prog.line(m, c))
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

// parallel returns the backend as a Parallel with its rank and world, or
// world 0 when the run is not data-parallel.
func (r *Run) parallel() (Parallel, int, int) {
	p, ok := r.Backend.(Parallel)
	if !ok {
		return nil, 0, 0
	}
	rank, world := p.Ranks()
	return p, rank, world
}

// writes reports whether this process writes the run folder: always, but
// in a data-parallel run only rank 0.
func (r *Run) writes() bool {
	_, rank, _ := r.parallel()
	return rank == 0
}

// interrupted saves what an interruption must not lose and returns the
// *Interrupted error.
func (r *Run) interrupted() error {
	if r.saved != r.step && r.step > 0 {
		if err := r.Checkpoint(); err != nil {
			return fmt.Errorf("train: interrupted at step %d, and the checkpoint failed: %w", r.step, err)
		}
	}
	if err := r.Plot(); err != nil {
		return err
	}
	dir := filepath.Join(r.Out, checkpointDir)
	if r.step == 0 {
		dir = ""
	}
	return &Interrupted{Step: r.step, Checkpoint: dir}
}

// trainStep runs one optimizer step and returns its metrics (without the
// held-out loss).
func (r *Run) trainStep(ctx context.Context) (Metrics, error) {
	c, b := r.Cfg, r.Backend
	mc := c.ModelConfig()
	t0 := time.Now()
	if err := b.BeginStep(c.Accum); err != nil {
		return Metrics{}, err
	}
	win := make([]int, c.Seq+1)
	batchTokens := make([]int, c.Batch*(c.Seq+1))
	tokens0 := r.tokens
	_, rank, world := r.parallel()
	for a := 0; a < c.Accum; a++ {
		if world > 0 && MicroBatchRank(a, world) != rank { // another rank's
			r.tokens += int64(c.Batch * c.Seq)
			continue
		}
		// A data-parallel step is never abandoned alone: the ranks agree
		// on stopping between steps.
		if a > 0 && world == 0 && ctx.Err() != nil {
			r.tokens = tokens0
			return Metrics{}, errAbandoned
		}
		for bi := 0; bi < c.Batch; bi++ {
			idx := (int64(r.step)*int64(c.Accum)+int64(a))*int64(c.Batch) + int64(bi)
			if err := r.Train.Window(win, idx); err != nil {
				return Metrics{}, err
			}
			copy(batchTokens[bi*(c.Seq+1):], win)
		}
		if err := b.Accumulate(batchTokens, c.Batch, c.Seq, c.L1); err != nil {
			return Metrics{}, err
		}
		r.tokens += int64(c.Batch * c.Seq)
	}
	st, err := b.EndStep()
	if err != nil {
		return Metrics{}, err
	}
	if len(st.L0) != mc.NumHiddenLayers || len(st.Active) != mc.NumHiddenLayers {
		return Metrics{}, fmt.Errorf("train: the backend reported statistics of %d layers, the model has %d", len(st.Active), mc.NumHiddenLayers)
	}
	for li, a := range st.Active {
		if len(a) != mc.IntermediateSize {
			return Metrics{}, fmt.Errorf("train: the backend reported %d units for layer %d, the model has %d", len(a), li, mc.IntermediateSize)
		}
	}
	if !finite(st.Loss) || !finite(st.L1) {
		return Metrics{}, fmt.Errorf("train: step %d: loss is %g (l1 term %g); lower lr or check the data", r.step, st.Loss, st.L1)
	}
	norm, err := b.ClipGradients(c.Clip)
	if err != nil {
		return Metrics{}, err
	}
	if !finite(norm) {
		return Metrics{}, fmt.Errorf("train: step %d: gradient norm is %g; lower lr or check the data", r.step, norm)
	}
	lr := Schedule(r.step, c.Warmup, c.Steps, c.LR, c.MinLR)
	if err := b.Update(c.AdamW(), lr); err != nil {
		return Metrics{}, err
	}
	dead, units := r.track(st.Active)
	if len(units) > 0 {
		if err := b.ReinitUnits(units); err != nil {
			return Metrics{}, err
		}
	}
	r.step++
	m := newMetrics(r.step, r.tokens, st, dead, lr, norm, time.Since(t0))
	return m, nil
}

// track updates per-unit firing and returns the fraction of dead units and,
// when the config asks for it, their fresh state (their dead-unit clock
// restarts).
func (r *Run) track(active [][]int32) (float64, []UnitInit) {
	c := r.Cfg
	dead, total := 0, 0
	var inits []UnitInit
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
					inits = append(inits, r.freshUnit(li, j))
					r.lastFire[li][j] = r.tokens
				}
			}
		}
	}
	return float64(dead) / float64(max(total, 1)), inits
}

// freshUnit draws new gate and up rows (normal, std 0.02) for unit j of
// layer li from a generator seeded by (seed, step, layer, unit), so every
// backend re-initialises alike.
func (r *Run) freshUnit(li, j int) UnitInit {
	mc := r.Cfg.ModelConfig()
	h := mc.HiddenSize
	rng := rand.New(rand.NewPCG(r.Cfg.Seed^0xdead, uint64(r.step)<<32|uint64(li)<<20|uint64(j)))
	row := func() []float32 {
		w := make([]float32, h)
		for k := range w {
			w[k] = float32(rng.NormFloat64() * 0.02)
		}
		return w
	}
	u := UnitInit{Layer: li, Unit: j}
	if mc.MLPGated {
		u.Gate = row()
	}
	u.Up = row()
	return u
}

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
		loss, err := r.Backend.Loss(toks, len(chunk), c.Seq)
		if err != nil {
			return 0, err
		}
		total += loss * float64(len(chunk))
		n += len(chunk)
	}
	v := total / float64(n)
	if !finite(v) {
		return 0, fmt.Errorf("train: step %d: held-out loss is %g; lower lr", r.step, v)
	}
	return v, nil
}

// Schedule returns the learning rate at step (0-based): linear warmup over
// warmup steps, then cosine decay from lr to minLR at total steps.
func Schedule(step, warmup, total int, lr, minLR float64) float64 {
	if step < warmup {
		return lr * float64(step+1) / float64(warmup)
	}
	if total <= warmup {
		return lr
	}
	frac := math.Min(1, float64(step-warmup)/float64(total-warmup))
	return minLR + 0.5*(lr-minLR)*(1+math.Cos(math.Pi*frac))
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

// progress measures the speed of a run for its log lines.
type progress struct {
	start      time.Time
	startStep  int
	last       time.Time
	lastTokens int64
	// peak is the device's peak dense bf16 FLOP/s (0: unknown, no MFU) and
	// flopsPerToken the training FLOPs of one token.
	peak, flopsPerToken float64
}

func newProgress(step int, tokens int64) *progress {
	now := time.Now()
	return &progress{start: now, startStep: step, last: now, lastTokens: tokens}
}

// line formats the progress line of metrics m: step, losses, sparsity,
// learning rate, tokens per second since the previous line and the time
// left at the pace of this process so far.
func (p *progress) line(m Metrics, c *Config) string {
	now := time.Now()
	val := ""
	if m.ValLoss != nil {
		val = fmt.Sprintf(" val %.4f", *m.ValLoss)
	}
	rate := float64(m.Tokens-p.lastTokens) / max(now.Sub(p.last).Seconds(), 1e-9)
	perStep := now.Sub(p.start) / time.Duration(max(m.Step-p.startStep, 1))
	eta := perStep * time.Duration(c.Steps-m.Step)
	p.last, p.lastTokens = now, m.Tokens
	mfu := ""
	if p.peak > 0 {
		mfu = fmt.Sprintf(" MFU %.1f%%", 100*rate*p.flopsPerToken/p.peak)
	}
	sparse := ""
	if m.SparseLayers != nil {
		sparse = fmt.Sprintf(" sparse MLP %d/%d", *m.SparseLayers, len(m.L0))
	}
	return fmt.Sprintf("step %d/%d loss %.4f%s l1 %.4f l0 %.1f/%d%s dead %.2f lr %.2e | %s tok/s%s %.0fms/step ETA %s",
		m.Step, c.Steps, m.Loss, val, m.L1, m.L0Mean, c.ModelConfig().IntermediateSize, sparse, m.DeadFrac, m.LR,
		humanRate(rate), mfu, float64(perStep.Microseconds())/1000, eta.Round(time.Second))
}

// FLOPsPerToken returns the training FLOPs of one token of a sequence of
// seq tokens: 6 per weight of every matrix product (forward, and the two
// backward products), the LM head included and the embedding lookup not,
// plus causal attention's score and value products, 6 * layers * seq *
// heads * head_dim (half of the 12 a full attention matrix would take).
func FLOPsPerToken(c model.Config, seq int) float64 {
	h, f, hd := float64(c.HiddenSize), float64(c.IntermediateSize), float64(c.HeadDim)
	q, kv := float64(c.NumAttentionHeads), float64(c.NumKeyValueHeads)
	mlp := 2.0
	if c.MLPGated {
		mlp = 3
	}
	perLayer := h*hd*(q+2*kv) + q*hd*h + mlp*h*f
	matmul := float64(c.NumHiddenLayers)*perLayer + float64(c.VocabSize)*h
	return 6*matmul + 6*float64(c.NumHiddenLayers)*float64(seq)*q*hd
}

func humanRate(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%.2fM", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%.1fk", v/1e3)
	}
	return fmt.Sprintf("%.0f", v)
}
