package train

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"gonum.org/v1/plot"
)

// copyTree copies the folder src to dst, as a kill at that moment would
// leave it on disk.
func copyTree(t *testing.T, src, dst string) {
	t.Helper()
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		to := filepath.Join(dst, rel)
		if d.IsDir() {
			return os.MkdirAll(to, 0o755)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(to, b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// finalState is what must match between an interrupted and an
// uninterrupted run: the weights, the optimizer moments and the losses.
type finalState struct {
	weights, optimizer []byte
	losses             []float64
}

func readFinal(t *testing.T, out string) finalState {
	t.Helper()
	var f finalState
	var err error
	if f.weights, err = os.ReadFile(filepath.Join(out, checkpointDir, "model.safetensors")); err != nil {
		t.Fatal(err)
	}
	if f.optimizer, err = os.ReadFile(filepath.Join(out, checkpointDir, optimizerFile)); err != nil {
		t.Fatal(err)
	}
	for _, m := range readMetrics(t, out) {
		f.losses = append(f.losses, float64(m.Step), m.Loss, m.L1)
	}
	return f
}

func (f finalState) equal(o finalState) bool {
	return bytes.Equal(f.weights, o.weights) && bytes.Equal(f.optimizer, o.optimizer) && slices.Equal(f.losses, o.losses)
}

// smallConfig is a config for tests that train many short runs.
func smallConfig(t testing.TB, steps int) *Config {
	t.Helper()
	c := testConfig(t, steps, 1e-3)
	mc := c.ModelConfig()
	mc.HiddenSize, mc.IntermediateSize, mc.NumAttentionHeads, mc.NumKeyValueHeads, mc.HeadDim = 16, 64, 2, 1, 8
	if err := c.SetModelConfig(mc); err != nil {
		t.Fatal(err)
	}
	c.Batch, c.Seq = 2, 8
	return c
}

// checkpointStages are the points of Checkpoint a kill can fall between.
var checkpointStages = []string{"weights", "optimizer", "files", "complete", "old-removed", "moved-to-old", "in-place"}

// TestKilledCheckpointAlwaysResumes stops a run inside the checkpoint at
// step 8 at every stage (the folder is copied as a kill would leave it),
// resumes each copy, stops the resumed run again inside its first
// checkpoint, and checks that a complete checkpoint is always found, no
// temporary folder outlives a resume, and every resumed run ends
// bit-identical to an uninterrupted one.
func TestKilledCheckpointAlwaysResumes(t *testing.T) {
	seed := rand.Uint64()
	c := smallConfig(t, 12)
	c.CheckpointEvery, c.EvalEvery = 4, 6
	ctx := context.Background()
	ref := newTestRun(t, c, t.TempDir(), seed)
	ref.noPlots = true
	if err := ref.Loop(ctx); err != nil {
		t.Fatal(err)
	}
	want := readFinal(t, ref.Out)

	// snapshotAt runs r, copying its folder at every stage of the checkpoint
	// of step `at`.
	snapshotAt := func(r *Run, at int) map[string]string {
		r.noPlots = true
		snaps := map[string]string{}
		r.hook = func(stage string) {
			if r.step == at {
				dir := t.TempDir()
				copyTree(t, r.Out, dir)
				snaps[stage] = dir
			}
		}
		if err := r.Loop(ctx); err != nil {
			t.Fatal(err)
		}
		return snaps
	}
	// resumeAndCheck checks that dir holds a complete checkpoint of step
	// first or second and resumes it; with again > 0 it snapshots the
	// resumed run's checkpoint of that step and returns the copies.
	resumeAndCheck := func(what, dir string, first, second, again int) map[string]string {
		s, err := LoadCheckpoint(dir)
		if err != nil {
			t.Fatalf("seed %d: %s: no complete checkpoint: %v", seed, what, err)
		}
		if s.Step != first && s.Step != second {
			t.Fatalf("seed %d: %s: resumed at step %d, want %d or %d", seed, what, s.Step, first, second)
		}
		r := newTestRun(t, c, dir, seed)
		r.noPlots = true
		if err := r.ResumeFrom(s); err != nil {
			t.Fatalf("seed %d: %s: %v", seed, what, err)
		}
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), tmpPrefix) || e.Name() == oldDir {
				t.Fatalf("seed %d: %s: %s left after the resume", seed, what, e.Name())
			}
		}
		var snaps map[string]string
		if again > 0 {
			snaps = snapshotAt(r, again)
		} else if err := r.Loop(ctx); err != nil {
			t.Fatal(err)
		}
		if got := readFinal(t, dir); !got.equal(want) {
			t.Fatalf("seed %d: %s: the resumed run does not end like the uninterrupted one", seed, what)
		}
		return snaps
	}

	first := snapshotAt(newTestRun(t, c, t.TempDir(), seed), 8)
	for i, stage := range checkpointStages {
		dir, ok := first[stage]
		if !ok {
			t.Fatalf("seed %d: the checkpoint of step 8 never reached stage %q", seed, stage)
		}
		// Before trainer_state.json is written the step-4 checkpoint is the
		// newest complete one; after, the step-8 one.
		again := 0
		if stage == "moved-to-old" {
			again = 12 // and stopped again inside the next checkpoint
		}
		second := resumeAndCheck("killed at "+stage, dir, 4+4*min(i/3, 1), 8, again)
		for _, stage2 := range checkpointStages {
			if dir2, ok := second[stage2]; ok {
				resumeAndCheck("killed at "+stage+", then at "+stage2, dir2, 8, 12, 0)
			}
		}
		if again > 0 && len(second) != len(checkpointStages) {
			t.Fatalf("seed %d: killed at %s: the resumed run's checkpoint passed %d stages", seed, stage, len(second))
		}
	}
}

// TestCheckpointFolderIsHuggingFace checks the files and permissions of a
// checkpoint.
func TestCheckpointFolderIsHuggingFace(t *testing.T) {
	c := testConfig(t, 2, 0)
	r := newTestRun(t, c, t.TempDir(), 1)
	r.Files = map[string][]byte{"tokenizer_config.json": TokenizerConfig("<s>", "</s>", 64)}
	if err := r.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(r.Out, checkpointDir)
	st, err := os.Stat(dir)
	if err != nil || st.Mode().Perm() != 0o755 {
		t.Fatalf("checkpoint folder: %v, mode %v; want 0755", err, st.Mode().Perm())
	}
	for _, f := range []string{"config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json", optimizerFile, stateFile} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("checkpoint lacks %s", f)
		}
	}
	var gen map[string]any
	b, _ := os.ReadFile(filepath.Join(dir, "generation_config.json"))
	if err := json.Unmarshal(b, &gen); err != nil || gen["_from_model_config"] != true {
		t.Errorf("generation_config.json %s: %v", b, err)
	}
	var tc map[string]any
	b, _ = os.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
	if err := json.Unmarshal(b, &tc); err != nil || tc["eos_token"] != "</s>" || tc["tokenizer_class"] != "PreTrainedTokenizerFast" {
		t.Errorf("tokenizer_config.json %s: %v", b, err)
	}
}

// TestResumeRefusesBadState corrupts one field of trainer_state.json at a
// time: Resume must refuse with an error naming the field, and change
// nothing on disk.
func TestResumeRefusesBadState(t *testing.T) {
	seed := rand.Uint64()
	c := testConfig(t, 6, 1e-3)
	c.CheckpointEvery = 3
	base := newTestRun(t, c, t.TempDir(), seed)
	base.StopAt = 4
	if err := base.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	good, err := os.ReadFile(filepath.Join(base.Out, checkpointDir, stateFile))
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := os.ReadFile(filepath.Join(base.Out, metricsFile))
	r := rand.New(rand.NewPCG(seed, 9))
	layer, unit := r.IntN(2), r.IntN(128)
	cases := []struct {
		name, want string
		edit       func(m map[string]any)
	}{
		{"empty last_fire", "last_fire", func(m map[string]any) { m["last_fire"] = []any{} }},
		{"empty fires", "fires", func(m map[string]any) { m["fires"] = []any{} }},
		{"short layer", "fires: layer", func(m map[string]any) { m["fires"].([]any)[layer] = []any{1, 2} }},
		{"negative count", "last_fire: layer", func(m map[string]any) { m["last_fire"].([]any)[layer].([]any)[unit] = -1 }},
		{"count past tokens", "fires: layer", func(m map[string]any) { m["fires"].([]any)[layer].([]any)[unit] = 1e12 }},
		{"null fires", "fires", func(m map[string]any) { m["fires"] = nil }},
		{"sparse_mlp short", "sparse_mlp: 1 layers", func(m map[string]any) { m["sparse_mlp"] = []any{true} }},
		{"sparse_mlp not bools", "sparse_mlp", func(m map[string]any) { m["sparse_mlp"] = []any{1, 2} }},
		{"negative step", "step -1000000", func(m map[string]any) { m["step"] = -1000000 }},
		{"step 0", "step 0", func(m map[string]any) { m["step"] = 0 }},
		{"step past steps", "step 7", func(m map[string]any) { m["step"] = 7 }},
		{"fractional step", "step", func(m map[string]any) { m["step"] = 2.5 }},
		{"tokens", "tokens", func(m map[string]any) { m["tokens"] = 5 }},
		{"adam_step", "adam_step", func(m map[string]any) { m["adam_step"] = 2 }},
		{"schema", "schema", func(m map[string]any) { delete(m, "schema") }},
		{"config missing", "config", func(m map[string]any) { delete(m, "config") }},
		{"config invalid", "lr", func(m map[string]any) { m["config"].(map[string]any)["lr"] = -1 }},
		{"other model", "the weights do not match", func(m map[string]any) {
			m["config"].(map[string]any)["model"].(map[string]any)["hidden_size"] = 64
			m["config"].(map[string]any)["model"].(map[string]any)["head_dim"] = 16
		}},
	}
	for _, tc := range cases {
		var m map[string]any
		json.Unmarshal(good, &m)
		tc.edit(m)
		bad, _ := json.Marshal(m)
		dir := t.TempDir()
		copyTree(t, base.Out, dir)
		os.WriteFile(filepath.Join(dir, checkpointDir, stateFile), bad, 0o644)
		run := newTestRun(t, c, dir, seed)
		err := run.Resume()
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), stateFile) {
			t.Errorf("seed %d: %s: Resume = %v; want an error naming %s and %q", seed, tc.name, err, stateFile, tc.want)
		}
		if got, _ := os.ReadFile(filepath.Join(dir, metricsFile)); !bytes.Equal(got, metrics) {
			t.Errorf("seed %d: %s: a refused resume changed metrics.jsonl", seed, tc.name)
		}
		if got, _ := os.ReadFile(filepath.Join(dir, checkpointDir, stateFile)); !bytes.Equal(got, bad) {
			t.Errorf("seed %d: %s: a refused resume changed the checkpoint", seed, tc.name)
		}
	}
	// Extending the run is fine; ending it before the checkpoint is not.
	short := c.Clone()
	short.Steps = 2
	run := newTestRun(t, short, base.Out, seed)
	if err := run.Resume(); err == nil || !strings.Contains(err.Error(), "past the run's steps 2") {
		t.Errorf("resume at step 3 with steps 2: %v", err)
	}
	other := c.Clone()
	other.LR *= 2
	run = newTestRun(t, other, base.Out, seed)
	if err := run.Resume(); err == nil || !strings.Contains(err.Error(), "lr") {
		t.Errorf("resume with another lr: %v", err)
	}
}

// TestResumeCutsMetricsAndKeepsKeys checks metrics.jsonl: every line has the
// schema and the same keys, and a resume cuts the lines past the resumed
// step (a torn last line included).
func TestResumeCutsMetricsAndKeepsKeys(t *testing.T) {
	seed := rand.Uint64()
	c := testConfig(t, 10, 1e-3)
	c.CheckpointEvery, c.EvalEvery = 4, 3
	r1 := newTestRun(t, c, t.TempDir(), seed)
	r1.StopAt = 7
	if err := r1.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	f, _ := os.OpenFile(filepath.Join(r1.Out, metricsFile), os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString(`{"schema":"twell.train.metrics/1","step":8,"lo`)
	f.Close()
	r2 := newTestRun(t, c, r1.Out, seed)
	if err := r2.Resume(); err != nil {
		t.Fatal(err)
	}
	if ms := readMetrics(t, r1.Out); len(ms) != 4 || ms[3].Step != 4 {
		t.Fatalf("seed %d: after resuming at step 4 metrics.jsonl has %d lines", seed, len(ms))
	}
	if err := r2.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(filepath.Join(r1.Out, metricsFile))
	var keys []string
	for i, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var m map[string]json.RawMessage
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("line %d: %v", i+1, err)
		}
		var k []string
		for key := range m {
			k = append(k, key)
		}
		slices.Sort(k)
		if keys == nil {
			keys = k
		}
		if !slices.Equal(k, keys) || string(m["schema"]) != `"`+MetricsSchema+`"` || string(m["step"]) != fmt2(i+1) {
			t.Fatalf("seed %d: line %d: keys %v (first line %v), schema %s, step %s", seed, i+1, k, keys, m["schema"], m["step"])
		}
	}
	st, _ := os.ReadFile(filepath.Join(r1.Out, checkpointDir, stateFile))
	if !bytes.Contains(st, []byte(`"schema":"`+StateSchema+`"`)) {
		t.Errorf("trainer_state.json lacks its schema")
	}
}

func fmt2(i int) string { b, _ := json.Marshal(i); return string(b) }

// TestLoopInterrupted cancels the loop's context: it stops at a whole step,
// saves a checkpoint of it and the plots, and a resume ends like an
// uninterrupted run.
func TestLoopInterrupted(t *testing.T) {
	seed := rand.Uint64()
	c := testConfig(t, 9, 1e-3)
	c.CheckpointEvery, c.Accum = 4, 2
	ref := newTestRun(t, c, t.TempDir(), seed)
	if err := ref.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	stopAt := 1 + rand.New(rand.NewPCG(seed, 3)).IntN(7)
	ctx, cancel := context.WithCancel(context.Background())
	r := newTestRun(t, c, t.TempDir(), seed)
	r.Train = cancelAt{r.Train, int64(stopAt * c.Accum * c.Batch), cancel}
	err := r.Loop(ctx)
	var intr *Interrupted
	if !errors.As(err, &intr) || intr.Step != stopAt || intr.Checkpoint != filepath.Join(r.Out, checkpointDir) {
		t.Fatalf("seed %d: cancelled in step %d: Loop = %v", seed, stopAt+1, err)
	}
	for _, f := range []string{"loss.png", "l0.png", "dead.png"} {
		if _, err := os.Stat(filepath.Join(r.Out, f)); err != nil && stopAt >= c.LogEvery {
			t.Errorf("seed %d: no %s after the interruption", seed, f)
		}
	}
	s, err := LoadCheckpoint(r.Out)
	if err != nil || s.Step != stopAt {
		t.Fatalf("seed %d: checkpoint after the interruption at step %d: %v", seed, stopAt, err)
	}
	r2 := newTestRun(t, c, r.Out, seed)
	if err := r2.ResumeFrom(s); err != nil {
		t.Fatal(err)
	}
	if err := r2.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !readFinal(t, r.Out).equal(readFinal(t, ref.Out)) {
		t.Fatalf("seed %d: interrupted at step %d and resumed: not the uninterrupted result", seed, stopAt)
	}
}

// cancelAt cancels a context when window i is first read (inside a step,
// after its first micro-batch).
type cancelAt struct {
	Source
	i      int64
	cancel func()
}

func (c cancelAt) Window(dst []int, i int64) error {
	if i == c.i+1 {
		c.cancel()
	}
	return c.Source.Window(dst, i)
}

// TestEarlierRunAndClear checks what counts as an earlier run and that
// ClearRun removes only that.
func TestEarlierRunAndClear(t *testing.T) {
	dir := t.TempDir()
	if got, err := EarlierRun(filepath.Join(dir, "none")); err != nil || got != nil {
		t.Fatalf("missing folder: %v %v", got, err)
	}
	for _, n := range []string{"checkpoint.old/config.json", ".checkpoint-tmp-123/model.safetensors", "metrics.jsonl", "notes.txt", "loss.png"} {
		os.MkdirAll(filepath.Dir(filepath.Join(dir, n)), 0o755)
		os.WriteFile(filepath.Join(dir, n), []byte("x"), 0o644)
	}
	got, err := EarlierRun(dir)
	slices.Sort(got)
	if err != nil || !slices.Equal(got, []string{".checkpoint-tmp-123", "checkpoint.old", "loss.png", "metrics.jsonl"}) {
		t.Fatalf("EarlierRun = %v, %v", got, err)
	}
	if err := ClearRun(dir); err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 || ents[0].Name() != "notes.txt" {
		t.Fatalf("after ClearRun: %v", ents)
	}
}

// TestPlotsReadable checks the plots a person reads: step on x over the
// whole run, the dead fraction on [0, 1] even when no unit is dead, the MLP
// width in the L0 title and axis, units on every y axis, legends outside
// the data area.
func TestPlotsReadable(t *testing.T) {
	c := smallConfig(t, 5)
	r := newTestRun(t, c, t.TempDir(), rand.Uint64())
	r.StopAt = 3
	if err := r.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	charts, err := r.charts()
	if err != nil || len(charts) != 3 {
		t.Fatalf("charts: %d, %v", len(charts), err)
	}
	width := fmt2(c.ModelConfig().IntermediateSize)
	for _, ch := range charts {
		p := ch.p
		if p.X.Label.Text != "step" || p.X.Min != 0 || p.X.Max != float64(c.Steps) || p.Y.Label.Text == "" || p.Title.Text == "" {
			t.Errorf("%s: x %q [%g, %g], y %q, title %q", ch.file, p.X.Label.Text, p.X.Min, p.X.Max, p.Y.Label.Text, p.Title.Text)
		}
		if len(ch.names) == 0 || !reflect.DeepEqual(p.Legend, plot.NewLegend()) {
			t.Errorf("%s: legend entries %v, or drawn inside the plot", ch.file, ch.names)
		}
		switch ch.file {
		case "dead.png":
			if p.Y.Min != 0 || p.Y.Max != 1 || !strings.Contains(p.Y.Label.Text, "fraction") {
				t.Errorf("dead.png: y %q over [%g, %g], want a fraction over [0, 1]", p.Y.Label.Text, p.Y.Min, p.Y.Max)
			}
		case "l0.png":
			if !strings.Contains(p.Title.Text, width) || !strings.Contains(p.Y.Label.Text, width) || p.Y.Min != 0 {
				t.Errorf("l0.png: title %q, y %q from %g: want the MLP width %s", p.Title.Text, p.Y.Label.Text, p.Y.Min, width)
			}
		case "loss.png":
			if !strings.Contains(p.Y.Label.Text, "nats") {
				t.Errorf("loss.png: y %q has no unit", p.Y.Label.Text)
			}
		}
	}
	if err := r.Plot(); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"loss.png", "l0.png", "dead.png"} {
		b, err := os.ReadFile(filepath.Join(r.Out, f))
		if err != nil || !bytes.HasPrefix(b, []byte("\x89PNG")) {
			t.Errorf("%s: not a PNG (%v)", f, err)
		}
	}
}

// keeper is a backend that chooses MLP paths from the step before: the CPU
// backend plus a path per layer that flips with each step's L0.
type keeper struct {
	Backend
	paths []bool
	set   [][]bool // what SetSparseLayers was given
}

func (k *keeper) EndStep() (*StepStats, error) {
	st, err := k.Backend.EndStep()
	if err == nil {
		for l, u := range st.L0 {
			k.paths[l] = int(u*1000)%2 == 1 // depends on the run's history
		}
	}
	return st, err
}

func (k *keeper) SparseLayers() []bool { return slices.Clone(k.paths) }

func (k *keeper) SetSparseLayers(s []bool) error {
	k.set = append(k.set, slices.Clone(s))
	copy(k.paths, s)
	return nil
}

// TestResumeRestoresMLPPaths: a checkpoint records the paths a PathKeeper
// backend chose for the next step, and a resume hands them back.
func TestResumeRestoresMLPPaths(t *testing.T) {
	seed := rand.Uint64()
	c := testConfig(t, 8, 1e-3)
	c.CheckpointEvery = 4
	r1 := newTestRun(t, c, t.TempDir(), seed)
	k1 := &keeper{Backend: r1.Backend, paths: make([]bool, c.ModelConfig().NumHiddenLayers)}
	r1.Backend = k1
	r1.StopAt = 4
	if err := r1.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	want := k1.SparseLayers()
	r2 := newTestRun(t, c, r1.Out, seed)
	k2 := &keeper{Backend: r2.Backend, paths: make([]bool, len(want))}
	r2.Backend = k2
	if err := r2.Resume(); err != nil {
		t.Fatal(err)
	}
	if len(k2.set) != 1 || !slices.Equal(k2.set[0], want) {
		t.Fatalf("seed %d: resume set the paths %v, want once %v", seed, k2.set, want)
	}
	st, _ := os.ReadFile(filepath.Join(r1.Out, checkpointDir, stateFile))
	if !bytes.Contains(st, []byte(`"sparse_mlp":[`)) {
		t.Errorf("seed %d: trainer_state.json lacks sparse_mlp: %.200s", seed, st)
	}
}
