package train

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/twell-ai/twell/model"
)

// ErrNoCheckpoint reports a run folder without a complete checkpoint.
var ErrNoCheckpoint = errors.New("no readable checkpoint")

// Saved is a complete checkpoint read back from a run's folder: what a run
// needs to resume.
type Saved struct {
	// Dir is the folder it was read from: checkpoint/, or checkpoint.old or
	// a temporary folder left by an interrupted rotation.
	Dir       string
	Config    *Config // the run's config, as saved
	Step      int
	Weights   *model.Weights
	Optimizer *OptimizerState
	state     *trainerState
}

// LoadCheckpoint finds the newest complete checkpoint in the run folder out
// (of checkpoint/, checkpoint.old and temporary folders left by an
// interrupted rotation: those holding a trainer_state.json, ordered by
// step) and reads it, checking all of it: the trainer state against its
// config, the weights and the optimizer moments. It changes nothing on
// disk. A damaged newest checkpoint is an error naming the file and field,
// not a reason to fall back silently to an older one.
func LoadCheckpoint(out string) (*Saved, error) {
	type cand struct {
		dir  string
		step int
		rank int
	}
	var cands []cand
	ents, err := os.ReadDir(out)
	if err != nil {
		return nil, fmt.Errorf("train: resume: %w in %s: %w", ErrNoCheckpoint, out, err)
	}
	for _, e := range ents {
		rank := 2
		switch name := e.Name(); {
		case name == checkpointDir:
			rank = 0
		case name == oldDir:
			rank = 1
		case !strings.HasPrefix(name, tmpPrefix):
			continue
		}
		dir := filepath.Join(out, e.Name())
		b, err := os.ReadFile(filepath.Join(dir, stateFile))
		if errors.Is(err, os.ErrNotExist) {
			continue // incomplete
		}
		if err != nil {
			return nil, fmt.Errorf("train: resume: %w", err)
		}
		var s struct {
			Step int `json:"step"`
		}
		if err := json.Unmarshal(b, &s); err != nil {
			return nil, fmt.Errorf("train: resume: %s: not a trainer state: %w", filepath.Join(dir, stateFile), err)
		}
		cands = append(cands, cand{dir, s.Step, rank})
	}
	if len(cands) == 0 {
		return nil, fmt.Errorf("train: resume: %w in %s (no %s/ with a %s)", ErrNoCheckpoint, out, checkpointDir, stateFile)
	}
	sort.Slice(cands, func(i, j int) bool {
		if cands[i].step != cands[j].step {
			return cands[i].step > cands[j].step
		}
		return cands[i].rank < cands[j].rank || cands[i].rank == cands[j].rank && cands[i].dir < cands[j].dir
	})
	return readSaved(cands[0].dir)
}

// readSaved reads and checks the complete checkpoint in dir.
func readSaved(dir string) (*Saved, error) {
	path := filepath.Join(dir, stateFile)
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("train: resume: %w", err)
	}
	st, cfg, err := decodeState(b)
	if err != nil {
		return nil, fmt.Errorf("train: resume: %s: %w", path, err)
	}
	mc := cfg.ModelConfig()
	w, err := readWeights(dir, mc)
	if err != nil {
		return nil, fmt.Errorf("train: resume: the weights do not match the config in %s: %w", path, err)
	}
	opt, err := readOptimizer(dir, mc, st.AdamStep)
	if err != nil {
		return nil, fmt.Errorf("train: resume: optimizer state: %w", err)
	}
	return &Saved{Dir: dir, Config: cfg, Step: st.Step, Weights: w, Optimizer: opt, state: st}, nil
}

// Resume continues the run from the newest complete checkpoint in Out (see
// LoadCheckpoint and ResumeFrom).
func (r *Run) Resume() error {
	s, err := LoadCheckpoint(r.Out)
	if err != nil {
		return err
	}
	return r.ResumeFrom(s)
}

// ResumeFrom continues the run from s: the run's config must be the saved
// one apart from steps (which may extend the run, but not end it before
// s.Step), l1, data and tokenizer. It loads the weights and optimizer state
// into the backend, moves s into checkpoint/ if an interrupted rotation
// left it elsewhere, removes the other checkpoint folders, and cuts
// metrics.jsonl back to the resumed step.
func (r *Run) ResumeFrom(s *Saved) error {
	if err := r.restore(s); err != nil {
		return err
	}
	if !r.writes() { // rank 0 of a data-parallel run tidies the folder
		r.saved = r.step
		return nil
	}
	if err := r.install(s.Dir); err != nil {
		return fmt.Errorf("train: resume: tidying the checkpoints: %w", oneLine(err))
	}
	s.Dir = filepath.Join(r.Out, checkpointDir)
	r.saved = r.step
	return r.truncateMetrics()
}

// restore puts the saved state into the run and its backend, without
// touching the disk.
func (r *Run) restore(s *Saved) error {
	if d := r.Cfg.Diff(s.Config, "steps", "l1", "data", "tokenizer"); d != "" {
		return fmt.Errorf("train: resume: the run's %s differs from the checkpoint's in %s", d, s.Dir)
	}
	if s.Step > r.Cfg.Steps {
		return fmt.Errorf("train: resume: the checkpoint in %s is at step %d, past the run's steps %d", s.Dir, s.Step, r.Cfg.Steps)
	}
	if err := r.Backend.Load(s.Weights, s.Optimizer); err != nil {
		return fmt.Errorf("train: resume: %w", err)
	}
	if pk, ok := r.Backend.(PathKeeper); ok && s.state.SparseMLP != nil {
		if err := pk.SetSparseLayers(s.state.SparseMLP); err != nil {
			return fmt.Errorf("train: resume: %w", err)
		}
	}
	r.step, r.tokens, r.lastFire, r.fires = s.state.Step, s.state.Tokens, s.state.LastFire, s.state.Fires
	return nil
}

// runFiles are the names a run writes into its folder (besides temporary
// checkpoint folders).
var runFiles = []string{metricsFile, checkpointDir, oldDir, "loss.png", "l0.png", "dead.png"}

// EarlierRun lists what an earlier run left in the folder out (metrics,
// checkpoints, interrupted checkpoint writes, plots); none when out does
// not exist. A fresh run must not start over these unless asked to.
func EarlierRun(out string) ([]string, error) {
	ents, err := os.ReadDir(out)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var found []string
	for _, e := range ents {
		n := e.Name()
		if isRunFile(n) {
			found = append(found, n)
		}
	}
	return found, nil
}

func isRunFile(name string) bool {
	for _, f := range runFiles {
		if name == f {
			return true
		}
	}
	return strings.HasPrefix(name, tmpPrefix) || strings.HasPrefix(name, "."+metricsFile+".tmp-")
}

// ClearRun deletes what EarlierRun lists, and the files named in extra, from
// out, leaving anything else there alone.
func ClearRun(out string, extra ...string) error {
	found, err := EarlierRun(out)
	if err != nil {
		return err
	}
	var errs []error
	for _, n := range append(found, extra...) {
		p := filepath.Join(out, n)
		if n == checkpointDir || n == oldDir || strings.HasPrefix(n, tmpPrefix) {
			errs = append(errs, removeCheckpoint(p))
		} else if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
