package train

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/twell-ai/twell/internal/atomicfile"
	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/safetensors"
)

// A run's folder holds its newest checkpoint in checkpoint/, in Hugging
// Face layout (config.json, model.safetensors, generation_config.json and
// the run's Files, e.g. tokenizer.json) plus optimizer.safetensors and
// trainer_state.json. trainer_state.json is written last: a folder that
// holds one is complete.
//
// A checkpoint is written into a fresh .checkpoint-tmp-* folder, then
// rotated in: the previous checkpoint.old is removed, checkpoint/ is
// renamed to checkpoint.old, the new folder to checkpoint/, and
// checkpoint.old is removed. At every moment of this at least one complete
// checkpoint is on disk (the temporary folder counts), so a kill at any
// point leaves one that Resume finds; Resume takes the newest and tidies the
// rest away.
const (
	checkpointDir = "checkpoint"
	oldDir        = "checkpoint.old"
	tmpPrefix     = ".checkpoint-tmp-"
	stateFile     = "trainer_state.json"
	optimizerFile = "optimizer.safetensors"
)

// StateSchema names the layout of trainer_state.json and its version.
const StateSchema = "twell.train.state/1"

// trainerState is trainer_state.json in a checkpoint.
type trainerState struct {
	Schema   string    `json:"schema"` // StateSchema
	Step     int       `json:"step"`
	Tokens   int64     `json:"tokens"`
	AdamStep int64     `json:"adam_step"`
	LastFire [][]int64 `json:"last_fire"` // per layer, per unit: token count at its last firing
	Fires    [][]int64 `json:"fires"`     // per layer, per unit: tokens it fired on
	// SparseMLP is, per layer, whether the next step runs the MLP's sparse
	// kernels, for a backend that chooses from the step before
	// (PathKeeper); absent otherwise.
	SparseMLP []bool          `json:"sparse_mlp,omitempty"`
	Config    json.RawMessage `json:"config"`
}

// Checkpoint writes the model (Hugging Face format), the optimizer and the
// trainer state to Out/checkpoint, so that an interruption at any moment
// leaves a complete checkpoint on disk (see the rotation above).
func (r *Run) Checkpoint() error {
	if !r.writes() { // a data-parallel rank other than 0: only the gather
		if _, err := r.Backend.OptimizerState(); err != nil {
			return err
		}
		r.saved = r.step
		return nil
	}
	if err := removeTemps(r.Out); err != nil {
		return err
	}
	tmp, err := os.MkdirTemp(r.Out, tmpPrefix)
	if err != nil {
		return err
	}
	done := false
	defer func() {
		if !done {
			removeCheckpoint(tmp)
		}
	}()
	if err := os.Chmod(tmp, 0o755); err != nil {
		return err
	}
	mc := r.Cfg.ModelConfig()
	w, err := r.Backend.Weights()
	if err != nil {
		return err
	}
	if err := model.Save(tmp, mc, w, safetensors.F32); err != nil {
		return err
	}
	r.at("weights")
	opt, err := r.Backend.OptimizerState()
	if err != nil {
		return err
	}
	if err := writeOptimizer(tmp, mc, opt); err != nil {
		return err
	}
	r.at("optimizer")
	files := map[string][]byte{"generation_config.json": generationConfig(mc)}
	for name, data := range r.Files {
		files[name] = data
	}
	for name, data := range files {
		if name != filepath.Base(name) || name == stateFile {
			return fmt.Errorf("train: checkpoint file name %q: want a plain name other than %s", name, stateFile)
		}
		if err := atomicfile.WriteFile(filepath.Join(tmp, name), data); err != nil {
			return err
		}
	}
	cfgJSON, err := json.Marshal(r.Cfg)
	if err != nil {
		return err
	}
	st := trainerState{Schema: StateSchema, Step: r.step, Tokens: r.tokens, AdamStep: opt.Step,
		LastFire: r.lastFire, Fires: r.fires, Config: cfgJSON}
	if pk, ok := r.Backend.(PathKeeper); ok {
		st.SparseMLP = pk.SparseLayers()
	}
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	r.at("files")
	if err := atomicfile.WriteFile(filepath.Join(tmp, stateFile), b); err != nil {
		return err
	}
	atomicfile.SyncDir(tmp)
	r.at("complete")
	done = true
	if err := r.install(tmp); err != nil {
		return oneLine(err)
	}
	r.saved = r.step
	return nil
}

// install makes the complete checkpoint in dir (a temporary folder or
// checkpoint.old) the run's checkpoint/, keeping a complete checkpoint on
// disk at every moment, and removes the others.
func (r *Run) install(dir string) error {
	final, old := filepath.Join(r.Out, checkpointDir), filepath.Join(r.Out, oldDir)
	if dir == final {
		return errors.Join(removeCheckpoint(old), removeTemps(r.Out))
	}
	if _, err := os.Stat(final); err == nil {
		if dir == old {
			// checkpoint/ is older or incomplete; dir stays complete meanwhile.
			if err := removeCheckpoint(final); err != nil {
				return err
			}
		} else {
			if err := removeCheckpoint(old); err != nil {
				return err
			}
			r.at("old-removed")
			if err := os.Rename(final, old); err != nil {
				return err
			}
			r.at("moved-to-old")
		}
	}
	if err := os.Rename(dir, final); err != nil {
		return err
	}
	atomicfile.SyncDir(r.Out)
	r.at("in-place")
	return errors.Join(removeCheckpoint(old), removeTemps(r.Out))
}

// oneLine joins the lines of a multi-line error (errors.Join) with "; ",
// keeping what it wraps.
func oneLine(err error) error {
	if err == nil || !strings.Contains(err.Error(), "\n") {
		return err
	}
	return lineError{err}
}

type lineError struct{ err error }

func (e lineError) Error() string { return strings.ReplaceAll(e.err.Error(), "\n", "; ") }
func (e lineError) Unwrap() error { return e.err }

// removeCheckpoint deletes a checkpoint folder, its trainer_state.json
// first so that a half-deleted folder never looks complete.
func removeCheckpoint(dir string) error {
	if err := os.Remove(filepath.Join(dir, stateFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return os.RemoveAll(dir)
}

// removeTemps deletes the temporary checkpoint folders in dir.
func removeTemps(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), tmpPrefix) {
			errs = append(errs, removeCheckpoint(filepath.Join(dir, e.Name())))
		}
	}
	return errors.Join(errs...)
}

// generationConfig returns generation_config.json for a model, as
// transformers' save_pretrained writes it.
func generationConfig(c model.Config) []byte {
	g := struct {
		FromModelConfig bool `json:"_from_model_config"`
		BOS             *int `json:"bos_token_id,omitempty"`
		EOS             any  `json:"eos_token_id,omitempty"`
	}{FromModelConfig: true, BOS: c.BOSTokenID}
	switch len(c.EOSTokenIDs) {
	case 0:
	case 1:
		g.EOS = c.EOSTokenIDs[0]
	default:
		g.EOS = c.EOSTokenIDs
	}
	b, _ := json.MarshalIndent(g, "", "  ")
	return append(b, '\n')
}

// TokenizerConfig returns a tokenizer_config.json for a checkpoint whose
// tokenizer.json has the begin and end-of-text tokens bos and eos (the same
// for a GPT-2-style vocabulary), loading in transformers as a
// PreTrainedTokenizerFast.
func TokenizerConfig(bos, eos string, maxLength int) []byte {
	t := struct {
		Class      string `json:"tokenizer_class"`
		BOS        string `json:"bos_token"`
		EOS        string `json:"eos_token"`
		MaxLength  int    `json:"model_max_length"`
		CleanSpace bool   `json:"clean_up_tokenization_spaces"`
	}{"PreTrainedTokenizerFast", bos, eos, maxLength, false}
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false) // "<|endoftext|>" as written
	enc.SetIndent("", "  ")
	enc.Encode(t)
	return b.Bytes()
}

// writeOptimizer writes the AdamW moments as optimizer.safetensors, named
// exp_avg.<tensor> and exp_avg_sq.<tensor> as in PyTorch's AdamW.
func writeOptimizer(dir string, mc model.Config, o *OptimizerState) error {
	specs := Tensors(mc)
	if len(o.M) != len(specs) || len(o.V) != len(specs) {
		return fmt.Errorf("train: optimizer state of %d and %d moments for %d tensors", len(o.M), len(o.V), len(specs))
	}
	sw, err := safetensors.Create(filepath.Join(dir, optimizerFile))
	if err != nil {
		return err
	}
	for i, s := range specs {
		if err := sw.AddFloat32("exp_avg."+s.Name, safetensors.F32, s.Shape, o.M[i]); err != nil {
			sw.Abort()
			return err
		}
		if err := sw.AddFloat32("exp_avg_sq."+s.Name, safetensors.F32, s.Shape, o.V[i]); err != nil {
			sw.Abort()
			return err
		}
	}
	return sw.Close()
}

// readOptimizer reads optimizer.safetensors back, checking every tensor
// (names, shapes, finite values, second moments >= 0).
func readOptimizer(dir string, mc model.Config, step int64) (*OptimizerState, error) {
	path := filepath.Join(dir, optimizerFile)
	f, err := safetensors.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	o := &OptimizerState{Step: step}
	used := map[string]bool{}
	for _, s := range Tensors(mc) {
		for _, mv := range []struct {
			name string
			dst  *[][]float32
		}{{"exp_avg." + s.Name, &o.M}, {"exp_avg_sq." + s.Name, &o.V}} {
			used[mv.name] = true
			t, err := f.Expect(mv.name, safetensors.F32, s.Shape...)
			if err != nil {
				return nil, err
			}
			v, err := t.Float32()
			if err != nil {
				return nil, err
			}
			for i, x := range v {
				if !finite(float64(x)) || (mv.dst == &o.V && x < 0) {
					return nil, fmt.Errorf("%s: tensor %s: value %g at %d is not a valid moment", path, mv.name, x, i)
				}
			}
			*mv.dst = append(*mv.dst, v)
		}
	}
	if extra := f.Unused(used); len(extra) > 0 {
		return nil, fmt.Errorf("%s: tensor %q is not an AdamW moment of this model", path, extra[0])
	}
	return o, nil
}

// readWeights loads model.safetensors of a checkpoint, checking that every
// value is finite.
func readWeights(dir string, mc model.Config) (*model.Weights, error) {
	ck, err := safetensors.OpenDir(dir)
	if err != nil {
		return nil, err
	}
	w, err := model.LoadWeights(mc, ck)
	ck.Close()
	if err != nil {
		return nil, oneLine(err)
	}
	p := FromWeights(w)
	names := Tensors(mc)
	for i, t := range p.list() {
		for j, x := range *t {
			if !finite(float64(x)) {
				return nil, fmt.Errorf("%s: tensor %s: value %g at %d", dir, names[i].Name, x, j)
			}
		}
	}
	return w, nil
}

// decodeState parses and checks a trainer_state.json against the config it
// holds: the schema, the step and counters, and the shape and range of the
// dead-unit tracking. Errors name the field.
func decodeState(data []byte) (*trainerState, *Config, error) {
	var st trainerState
	if err := json.Unmarshal(data, &st); err != nil {
		return nil, nil, fmt.Errorf("not a trainer state: %w", err)
	}
	if st.Schema != StateSchema {
		return nil, nil, fmt.Errorf("schema %q: want %q", st.Schema, StateSchema)
	}
	if len(st.Config) == 0 || string(st.Config) == "null" {
		return nil, nil, errors.New("config: missing")
	}
	cfg, err := ParseConfig(st.Config)
	if err != nil {
		return nil, nil, fmt.Errorf("config: %w", err)
	}
	if st.Step < 1 || st.Step > cfg.Steps {
		return nil, nil, fmt.Errorf("step %d: want a step in [1, %d] (the config's steps)", st.Step, cfg.Steps)
	}
	perStep := int64(cfg.Accum) * int64(cfg.Batch) * int64(cfg.Seq)
	if st.Tokens != int64(st.Step)*perStep {
		return nil, nil, fmt.Errorf("tokens %d: step %d of %d tokens makes %d", st.Tokens, st.Step, perStep, int64(st.Step)*perStep)
	}
	if st.AdamStep != int64(st.Step) {
		return nil, nil, fmt.Errorf("adam_step %d: want the step, %d", st.AdamStep, st.Step)
	}
	mc := cfg.ModelConfig()
	for _, f := range []struct {
		key string
		v   [][]int64
	}{{"last_fire", st.LastFire}, {"fires", st.Fires}} {
		if len(f.v) != mc.NumHiddenLayers {
			return nil, nil, fmt.Errorf("%s: %d layers, the model has %d", f.key, len(f.v), mc.NumHiddenLayers)
		}
		for li, units := range f.v {
			if len(units) != mc.IntermediateSize {
				return nil, nil, fmt.Errorf("%s: layer %d has %d units, the model %d", f.key, li, len(units), mc.IntermediateSize)
			}
			for j, n := range units {
				if n < 0 || n > st.Tokens {
					return nil, nil, fmt.Errorf("%s: layer %d unit %d: %d is outside [0, tokens %d]", f.key, li, j, n, st.Tokens)
				}
			}
		}
	}
	if st.SparseMLP != nil && len(st.SparseMLP) != mc.NumHiddenLayers {
		return nil, nil, fmt.Errorf("sparse_mlp: %d layers, the model has %d", len(st.SparseMLP), mc.NumHiddenLayers)
	}
	return &st, cfg, nil
}
