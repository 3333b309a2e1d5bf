package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/twell-ai/twell/backend"
)

func TestTrainTinyAndResume(t *testing.T) {
	out := t.TempDir()
	var so, se bytes.Buffer
	if code := run([]string{"train", "-preset", "tiny", "-steps", "12", "-out", out}, &so, &se); code != 0 {
		t.Fatalf("exit %d: %s", code, se.String())
	}
	for _, f := range []string{"metrics.jsonl", "loss.png", "l0.png", "dead.png", "tokenizer.json", "checkpoint/model.safetensors", "checkpoint/tokenizer.json"} {
		if _, err := os.Stat(filepath.Join(out, f)); err != nil {
			t.Errorf("missing %s", f)
		}
	}
	b, _ := os.ReadFile(filepath.Join(out, "metrics.jsonl"))
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	var last map[string]any
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &last); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"step", "tokens", "loss", "l1", "l0", "dead_frac", "val_loss"} {
		if _, ok := last[k]; !ok {
			t.Errorf("metrics line lacks %q: %s", k, lines[len(lines)-1])
		}
	}
	// The trained checkpoint generates text.
	var g bytes.Buffer
	if code := run([]string{"generate", "-model", filepath.Join(out, "checkpoint"), "-prompt", "The fox", "-max-tokens", "5", "-temperature", "0"}, &g, &se); code != 0 {
		t.Fatalf("generate on the trained checkpoint: exit %d: %s", code, se.String())
	}
	// Training into a folder with a checkpoint needs -resume; nothing is overwritten.
	se.Reset()
	if code := run([]string{"train", "-preset", "tiny", "-steps", "12", "-out", out}, &so, &se); code != 1 || !strings.Contains(se.String(), "-resume") {
		t.Errorf("second run without -resume: exit %d, %q", code, se.String())
	}
	// Resuming a finished run extends it when asked for more steps.
	se.Reset()
	if code := run([]string{"train", "-preset", "tiny", "-steps", "14", "-out", out, "-resume"}, &so, &se); code != 0 || !strings.Contains(se.String(), "resuming") {
		t.Errorf("resume: exit %d, %q", code, se.String())
	}
}

func TestTrainBadInput(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.json")
	os.WriteFile(bad, []byte(`{"steps": 5}`), 0o644)
	mismatch := filepath.Join(dir, "mismatch.json")
	os.WriteFile(mismatch, []byte(`{"model": {"hidden_size": 16, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10, "hidden_act": "relu"}, "steps": 5, "batch": 2, "seq": 8}`), 0o644)
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"train", "-out", dir}, 2, "exactly one of -config FILE or -preset NAME"},
		{[]string{"train", "-preset", "tiny"}, 2, "-out is required"},
		{[]string{"train", "-preset", "huge", "-out", filepath.Join(dir, "o1")}, 2, "unknown preset"},
		{[]string{"train", "-config", bad, "-out", filepath.Join(dir, "o2")}, 1, `field "model" missing`},
		{[]string{"train", "-config", mismatch, "-out", filepath.Join(dir, "o3")}, 1, "vocabulary mismatch"},
		{[]string{"train", "-preset", "tiny", "-out", filepath.Join(dir, "o4"), "-resume"}, 1, "no readable checkpoint"},
		{[]string{"train", "-preset", "tiny", "-out", filepath.Join(dir, "o5"), "-data", dir, "-tokenizer", "x.json"}, 1, "x.json"},
	}
	for _, c := range cases {
		var so, se bytes.Buffer
		code := run(c.args, &so, &se)
		if code != c.code || !strings.Contains(se.String(), c.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit %d with %q", c.args, code, se.String(), c.code, c.want)
		}
	}
}

// trainRun runs twell with args and returns the exit code, stdout and stderr.
func trainRun(args ...string) (int, string, string) {
	var so, se bytes.Buffer
	code := run(args, &so, &se)
	return code, so.String(), se.String()
}

// TestTrainProcess is not a test: other tests run the twell command in a
// child process through it (TWELL_TRAIN_ARGS holds the arguments as JSON).
func TestTrainProcess(t *testing.T) {
	raw := os.Getenv("TWELL_TRAIN_ARGS")
	if raw == "" {
		t.Skip("the child process of the train tests")
	}
	var args []string
	if err := json.Unmarshal([]byte(raw), &args); err != nil {
		t.Fatal(err)
	}
	os.Exit(run(args, os.Stdout, os.Stderr))
}

// interruptTrain starts twell train with args in a child process, sends sig
// once it has printed a progress line, and returns the exit code and
// stderr.
func interruptTrain(t *testing.T, sig os.Signal, args ...string) (int, string) {
	t.Helper()
	a, _ := json.Marshal(append([]string{"train"}, args...))
	cmd := exec.Command(os.Args[0], "-test.run=^TestTrainProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), "TWELL_TRAIN_ARGS="+string(a))
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var se strings.Builder
	sc := bufio.NewScanner(stderr)
	sent := false
	for sc.Scan() {
		se.WriteString(sc.Text() + "\n")
		if !sent && strings.HasPrefix(sc.Text(), "step ") {
			cmd.Process.Signal(sig)
			sent = true
		}
	}
	err = cmd.Wait()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	return cmd.ProcessState.ExitCode(), se.String()
}

// stateStep reads the step of the run's checkpoint.
func stateStep(t *testing.T, out string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(out, "checkpoint", "trainer_state.json"))
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		Step int `json:"step"`
	}
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	return st.Step
}

// TestTrainInterruptSavesAndResumes sends SIGINT, then SIGTERM, to training
// runs: each saves a checkpoint of the last whole step and the plots, says
// how to resume and exits 130; -resume then continues without -preset.
func TestTrainInterruptSavesAndResumes(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	code, se := interruptTrain(t, os.Interrupt, "-preset", "tiny", "-out", out)
	if code != 130 || !strings.Contains(se, "interrupted at step") || !strings.Contains(se, "twell train -out "+out+" -resume") {
		t.Fatalf("SIGINT: exit %d, stderr:\n%s", code, se)
	}
	step := stateStep(t, out)
	if !strings.Contains(se, fmt.Sprintf("interrupted at step %d of 300", step)) {
		t.Fatalf("SIGINT: checkpoint at step %d, stderr:\n%s", step, se)
	}
	for _, f := range []string{"loss.png", "l0.png", "dead.png", "metrics.jsonl", "checkpoint/model.safetensors"} {
		if _, err := os.Stat(filepath.Join(out, f)); err != nil {
			t.Errorf("after SIGINT: %v", err)
		}
	}
	code, se = interruptTrain(t, syscall.SIGTERM, "-out", out, "-resume")
	step2 := stateStep(t, out)
	if code != 130 || step2 <= step || !strings.Contains(se, fmt.Sprintf("interrupted at step %d of 300", step2)) {
		t.Fatalf("SIGTERM after resuming at %d: exit %d, checkpoint at %d, stderr:\n%s", step, code, step2, se)
	}
	code, so, se := trainRun("train", "-out", out, "-resume", "-steps", strconv.Itoa(step2+2))
	if code != 0 || !strings.Contains(so, "trained 2 steps") {
		t.Fatalf("resume for 2 more steps: exit %d, stdout %q, stderr:\n%s", code, so, se)
	}
}

// TestTrainRefusesEarlierRun checks that a fresh run never reuses a folder
// with an earlier run's files, and that -overwrite replaces only those.
func TestTrainRefusesEarlierRun(t *testing.T) {
	for _, earlier := range []string{"checkpoint.old/config.json", "metrics.jsonl", ".checkpoint-tmp-42/model.safetensors", "tokenizer.json", "checkpoint/config.json"} {
		out := t.TempDir()
		p := filepath.Join(out, earlier)
		os.MkdirAll(filepath.Dir(p), 0o755)
		os.WriteFile(p, []byte("earlier"), 0o644)
		code, _, se := trainRun("train", "-preset", "tiny", "-steps", "1", "-out", out)
		name := strings.Split(earlier, "/")[0]
		if code != 1 || !strings.Contains(se, name) || !strings.Contains(se, "-overwrite") || !strings.Contains(se, "-resume") || strings.Count(se, "\n") != 1 {
			t.Errorf("earlier %s: exit %d, stderr %q", earlier, code, se)
		}
		if b, _ := os.ReadFile(p); string(b) != "earlier" {
			t.Errorf("earlier %s: changed by a refused run", earlier)
		}
	}
	out := t.TempDir()
	os.MkdirAll(filepath.Join(out, "checkpoint.old"), 0o755)
	os.WriteFile(filepath.Join(out, "metrics.jsonl"), []byte("{}\n"), 0o644)
	os.WriteFile(filepath.Join(out, "notes.txt"), []byte("mine"), 0o644)
	if code, _, se := trainRun("train", "-preset", "tiny", "-steps", "2", "-out", out, "-overwrite"); code != 0 {
		t.Fatalf("-overwrite: exit %d: %s", code, se)
	}
	if _, err := os.Stat(filepath.Join(out, "checkpoint.old")); err == nil {
		t.Error("-overwrite kept checkpoint.old")
	}
	if b, _ := os.ReadFile(filepath.Join(out, "notes.txt")); string(b) != "mine" {
		t.Error("-overwrite removed a file that is not the run's")
	}
	b, _ := os.ReadFile(filepath.Join(out, "metrics.jsonl"))
	if lines := strings.Split(strings.TrimSpace(string(b)), "\n"); len(lines) != 1 || !strings.Contains(lines[0], `"step":2`) {
		t.Errorf("-overwrite: metrics.jsonl %q", b)
	}
}

// TestTrainOverwriteKeepsRunWithoutDevice: with -overwrite and -device
// cuda on a machine without a GPU, the run is refused before the earlier
// run's files are removed.
func TestTrainOverwriteKeepsRunWithoutDevice(t *testing.T) {
	if backend.GPUPresent() {
		t.Skip("a GPU is present: -device cuda would train")
	}
	out := t.TempDir()
	p := filepath.Join(out, "metrics.jsonl")
	os.WriteFile(p, []byte("earlier"), 0o644)
	code, _, se := trainRun("train", "-preset", "tiny", "-steps", "1", "-out", out, "-overwrite", "-device", "cuda")
	if code != 1 || !strings.Contains(se, "-device cuda") {
		t.Errorf("exit %d, stderr %q", code, se)
	}
	if b, _ := os.ReadFile(p); string(b) != "earlier" {
		t.Error("the earlier run's metrics.jsonl was removed by a run that could not start")
	}
	if _, err := os.Stat(filepath.Join(out, "tokenizer.json")); err == nil {
		t.Error("a run that could not start wrote tokenizer.json")
	}
}

// TestTrainChecksBeforeWriting gives bad flags and configs: each is refused
// with one line (exit 2 for flags, 1 for files) before anything is written.
func TestTrainChecksBeforeWriting(t *testing.T) {
	dir := t.TempDir()
	model := `{"hidden_size": 16, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 1024, "hidden_act": "relu"}`
	config := func(name, rest string) string {
		p := filepath.Join(dir, name)
		os.WriteFile(p, []byte(`{"model": `+model+`, "steps": 5, "batch": 2, "seq": 8`+rest), 0o644)
		return p
	}
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"-preset", "tiny", "-steps", "0"}, 2, "-steps 0"},
		{[]string{"-preset", "tiny", "-steps", "-3"}, 2, "-steps -3"},
		{[]string{"-preset", "tiny", "-l1", "NaN"}, 2, "-l1 NaN"},
		{[]string{"-preset", "tiny", "-l1", "-1"}, 2, "-l1 -1"},
		{[]string{"-preset", "tiny", "-l1", "+Inf"}, 2, "-l1 +Inf"},
		{[]string{"-preset", "huge"}, 2, "unknown preset"},
		{[]string{"-preset", "tiny", "-resume", "-overwrite"}, 2, "-overwrite"},
		{[]string{"-preset", "tiny", "-config", "x.json"}, 2, "not both"},
		{[]string{"-config", "/nope.json"}, 1, "/nope.json"},
		{[]string{"-config", config("lr.json", `, "lr": 1e30}`)}, 1, "lr 1e+30"},
		{[]string{"-config", config("trail.json", `} {"steps": 9}`)}, 1, "text after the JSON object"},
		{[]string{"-config", config("zero.json", `, "accum": 0}`)}, 1, "accum 0"},
		{[]string{"-config", config("warm.json", `, "warmup": -1}`)}, 1, "warmup -1"},
	}
	for i, c := range cases {
		out := filepath.Join(dir, fmt.Sprintf("out%d", i))
		code, _, se := trainRun(append([]string{"train", "-out", out}, c.args...)...)
		if code != c.code || !strings.Contains(se, c.want) || strings.Count(se, "\n") != 1 {
			t.Errorf("%v: exit %d, stderr %q; want exit %d, one line with %q", c.args, code, se, c.code, c.want)
		}
		if _, err := os.Stat(out); err == nil {
			t.Errorf("%v: the refused run created %s", c.args, out)
		}
	}
}

// TestTrainResumeReadsTheRun trains, then resumes without -preset: the
// config comes from the checkpoint, the output counts only the new steps,
// and the checkpoint is a Hugging Face folder with a progress line per log
// step; a damaged trainer state is refused, naming the field.
func TestTrainResumeReadsTheRun(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	code, so, se := trainRun("train", "-preset", "tiny", "-steps", "10", "-out", out)
	if code != 0 || !strings.Contains(so, "trained 10 steps") {
		t.Fatalf("exit %d, stdout %q, stderr:\n%s", code, so, se)
	}
	if !regexp.MustCompile(`step 10/10 loss [0-9.]+ .* tok/s .* ETA 0s`).MatchString(se) {
		t.Errorf("no progress line with step, loss, tok/s and ETA:\n%s", se)
	}
	ck := filepath.Join(out, "checkpoint")
	var tc, gc map[string]any
	b, _ := os.ReadFile(filepath.Join(ck, "tokenizer_config.json"))
	json.Unmarshal(b, &tc)
	b, _ = os.ReadFile(filepath.Join(ck, "generation_config.json"))
	json.Unmarshal(b, &gc)
	if tc["eos_token"] != "<|endoftext|>" || gc["eos_token_id"] != float64(1023) {
		t.Errorf("tokenizer_config.json %v, generation_config.json %v", tc, gc)
	}
	if st, err := os.Stat(ck); err != nil || st.Mode().Perm() != 0o755 {
		t.Errorf("checkpoint folder mode: %v", err)
	}

	code, so, se = trainRun("train", "-out", out, "-resume", "-steps", "13")
	if code != 0 || !strings.Contains(so, "trained 3 steps (10 to 13)") || !strings.Contains(se, "resuming") {
		t.Fatalf("resume without -preset: exit %d, stdout %q, stderr:\n%s", code, so, se)
	}
	code, _, se = trainRun("train", "-preset", "small", "-out", out, "-resume")
	if code != 1 || !strings.Contains(se, "does not describe the run") {
		t.Errorf("resume with another preset: exit %d, %q", code, se)
	}
	code, _, se = trainRun("train", "-out", out, "-resume", "-steps", "12")
	if code != 1 || !strings.Contains(se, "-steps 12") {
		t.Errorf("resume with -steps before the checkpoint: exit %d, %q", code, se)
	}

	// A damaged trainer state: refused, naming the field; nothing changes.
	statePath := filepath.Join(ck, "trainer_state.json")
	good, _ := os.ReadFile(statePath)
	metrics, _ := os.ReadFile(filepath.Join(out, "metrics.jsonl"))
	bad := bytes.Replace(good, []byte(`"step":13,`), []byte(`"step":-1000000,`), 1)
	os.WriteFile(statePath, bad, 0o644)
	code, _, se = trainRun("train", "-out", out, "-resume", "-steps", "20")
	if code != 1 || !strings.Contains(se, "step -1000000") || !strings.Contains(se, "trainer_state.json") {
		t.Errorf("resume from step -1000000: exit %d, %q", code, se)
	}
	if b, _ := os.ReadFile(filepath.Join(out, "metrics.jsonl")); !bytes.Equal(b, metrics) {
		t.Error("a refused resume changed metrics.jsonl")
	}
	if b, _ := os.ReadFile(statePath); !bytes.Equal(b, bad) {
		t.Error("a refused resume changed the checkpoint")
	}
}

// TestTrainDeviceCUDA checks -device cuda: without a GPU it fails with an
// error naming the device; with one, the tiny preset (head_dim 16, which the
// GPU attention kernels do not take) is refused with the reason, and auto
// falls back to the CPU.
func TestTrainDeviceCUDA(t *testing.T) {
	var so, se bytes.Buffer
	code := run([]string{"train", "-preset", "tiny", "-steps", "2", "-device", "cuda", "-out", t.TempDir()}, &so, &se)
	if code != 1 || !strings.Contains(se.String(), "-device cuda:") {
		t.Fatalf("-device cuda: exit %d, stderr %q", code, se.String())
	}
	so.Reset()
	se.Reset()
	if code := run([]string{"train", "-preset", "tiny", "-steps", "2", "-device", "auto", "-out", t.TempDir()}, &so, &se); code != 0 ||
		!strings.Contains(se.String(), "training on the CPU") {
		t.Fatalf("-device auto: exit %d, stderr %q", code, se.String())
	}
}

// TestTrainRefusesWhatCannotFit: a model whose CPU training cannot fit in
// memory is refused with both figures before anything is written.
func TestTrainRefusesWhatCannotFit(t *testing.T) {
	cfg := `{"model": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
		"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
		"vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000,
		"hidden_act": "relu", "tie_word_embeddings": true},
		"steps": 1, "batch": 1, "seq": 64, "accum": 1, "lr": 1e-3, "min_lr": 1e-4, "warmup": 0,
		"weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "clip": 1, "l1": 0,
		"eval_every": 0, "eval_batches": 1, "checkpoint_every": 0, "log_every": 1, "dead_window": 1000}`
	dir := t.TempDir()
	path := filepath.Join(dir, "big.json")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "run")
	var so, se bytes.Buffer
	code := run([]string{"train", "-device", "cpu", "-config", path, "-out", out}, &so, &se)
	if code != 1 || !strings.Contains(se.String(), "memory") || !strings.Contains(se.String(), "available") {
		t.Fatalf("exit %d, stderr %q; want exit 1 with the memory needed and available", code, se.String())
	}
	if _, err := os.Stat(out); err == nil {
		t.Errorf("%s was created for a run that cannot fit", out)
	}
}

// TestTrainCPUNotesGPUMLPFlags: -mlp on the CPU trains (dense) and says so.
func TestTrainCPUNotesGPUMLPFlags(t *testing.T) {
	code, _, se := trainRun("train", "-preset", "tiny", "-steps", "1", "-device", "cpu", "-mlp", "sparse", "-out", t.TempDir())
	if code != 0 || !strings.Contains(se, "the CPU trainer runs its MLPs dense") {
		t.Errorf("exit %d, stderr %q", code, se)
	}
	code, _, se = trainRun("train", "-preset", "tiny", "-steps", "1", "-device", "cpu", "-out", t.TempDir())
	if code != 0 || strings.Contains(se, "-mlp") {
		t.Errorf("without -mlp: exit %d, stderr %q", code, se)
	}
}

// TestTrainRecomputeOnCPUNotes checks that -recompute, the GPU trainer's,
// is named in a note when the CPU trains, and the run goes on.
func TestTrainRecomputeOnCPUNotes(t *testing.T) {
	var so, se bytes.Buffer
	if code := run([]string{"train", "-device", "cpu", "-recompute", "-preset", "tiny", "-steps", "2", "-out", t.TempDir()}, &so, &se); code != 0 {
		t.Fatalf("exit %d: %s", code, se.String())
	}
	if !strings.Contains(se.String(), "note: -recompute is the GPU trainer's") {
		t.Errorf("no note on -recompute in %q", se.String())
	}
}
