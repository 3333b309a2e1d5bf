package train

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The kill test trains a small run in child processes and SIGKILLs them:
// at random moments, and at chosen points inside checkpoint writes
// (including twice in a row, the second inside the resumed run's first
// checkpoint). After every kill a complete checkpoint must be on disk, no
// older than the one before; each restart resumes from it, and the finished
// run must be bit-identical (weights, optimizer moments, losses) to an
// uninterrupted one. By default it kills 4 times (skipped with -short);
// TWELL_KILL_TEST=N kills N times:
//
//	TWELL_KILL_TEST=20 go test ./train -run TestKillAndResume -v

// killConfig is the run the child processes train.
func killConfig(t testing.TB) *Config {
	c := smallConfig(t, 40)
	c.CheckpointEvery, c.EvalEvery, c.LogEvery = 3, 10, 1
	return c
}

const killSeed = 42

// TestKillChild is the child process of TestKillAndResume; it runs only
// when TWELL_KILL_CHILD names its run folder. TWELL_KILL_AT=stage:n makes it
// SIGKILL itself at the n-th time it reaches that point of a checkpoint.
func TestKillChild(t *testing.T) {
	dir := os.Getenv("TWELL_KILL_CHILD")
	if dir == "" {
		t.Skip("the child process of TestKillAndResume")
	}
	c := killConfig(t)
	r := newTestRun(t, c, dir, killSeed)
	s, err := LoadCheckpoint(dir)
	switch {
	case err == nil:
		if err := r.ResumeFrom(s); err != nil {
			t.Fatal(err)
		}
	case errors.Is(err, ErrNoCheckpoint):
		if err := ClearRun(dir); err != nil {
			t.Fatal(err)
		}
	default:
		t.Fatal(err)
	}
	if at := os.Getenv("TWELL_KILL_AT"); at != "" {
		stage, nth, _ := strings.Cut(at, ":")
		n, _ := strconv.Atoi(nth)
		seen := 0
		r.hook = func(s string) {
			if s == stage {
				if seen++; seen == n {
					syscall.Kill(os.Getpid(), syscall.SIGKILL)
					time.Sleep(time.Minute)
				}
			}
		}
	}
	if err := r.Loop(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// runKillChild runs the child on dir, SIGKILLing it after delay (if
// positive) and reports whether it was killed.
func runKillChild(t *testing.T, dir, killAt string, delay time.Duration) (killed bool) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestKillChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), "TWELL_KILL_CHILD="+dir, "TWELL_KILL_AT="+killAt)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if delay > 0 {
		timer := time.AfterFunc(delay, func() { cmd.Process.Kill() })
		defer timer.Stop()
	}
	err := cmd.Wait()
	if err == nil {
		return false
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
			return true
		}
	}
	t.Fatalf("child on %s (kill at %q, after %v): %v\n%s", dir, killAt, delay, err, out.String())
	return false
}

func TestKillAndResume(t *testing.T) {
	if testing.Short() {
		t.Skip("trains in child processes (-short)")
	}
	want := 4
	if v := os.Getenv("TWELL_KILL_TEST"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("TWELL_KILL_TEST=%q: want a number of kills >= 1", v)
		}
		want = n
	}
	seed := rand.Uint64()
	rng := rand.New(rand.NewPCG(seed, 7))
	ref := t.TempDir()
	t0 := time.Now()
	runKillChild(t, ref, "", 0)
	full := time.Since(t0)
	wantFinal := readFinal(t, ref)

	// The first kills are chosen: twice in a row inside checkpoint
	// rotations, then inside writes; the rest are random.
	plan := []string{"moved-to-old:1", "old-removed:1", "complete:1", "weights:2"}
	dir := t.TempDir()
	kills, lastStep, episodes := 0, 0, 1
	var log, all []string
	check := func(what string) {
		s, err := LoadCheckpoint(dir)
		switch {
		case errors.Is(err, ErrNoCheckpoint) && lastStep == 0:
		case err != nil:
			t.Fatalf("seed %d: after %s (%v): %v", seed, what, log, err)
		case s.Step < lastStep:
			t.Fatalf("seed %d: after %s (%v): the newest checkpoint is at step %d, an earlier one was at %d", seed, what, log, s.Step, lastStep)
		default:
			lastStep = s.Step
		}
	}
	for kills < want {
		at, delay := "", time.Duration(0)
		switch {
		case kills < len(plan):
			at = plan[kills]
		case rng.IntN(3) == 0:
			at = fmt.Sprintf("%s:%d", checkpointStages[rng.IntN(len(checkpointStages))], 1+rng.IntN(3))
		default:
			delay = time.Duration(rng.Int64N(int64(full)))
		}
		what := at
		if delay > 0 {
			what = "after " + delay.Round(time.Millisecond).String()
		}
		if runKillChild(t, dir, at, delay) {
			kills++
			log = append(log, what)
			all = append(all, what)
			check("kill " + what)
			continue
		}
		// The run finished before the kill: check it, and start another.
		if got := readFinal(t, dir); !got.equal(wantFinal) {
			t.Fatalf("seed %d: killed at %v, the run ends unlike the uninterrupted one", seed, log)
		}
		if err := ClearRun(dir); err != nil {
			t.Fatal(err)
		}
		lastStep, log = 0, nil
		episodes++
	}
	if runKillChild(t, dir, "", 0) {
		t.Fatal("the last child was killed")
	}
	if got := readFinal(t, dir); !got.equal(wantFinal) {
		t.Fatalf("seed %d: killed at %v, the run ends unlike the uninterrupted one", seed, log)
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), tmpPrefix) || e.Name() == oldDir {
			t.Errorf("seed %d: %s left in the finished run", seed, e.Name())
		}
	}
	t.Logf("seed %d: %d kills over %d runs of %v each, all resumed bit-identical; kills: %v", seed, kills, episodes, full.Round(time.Millisecond), all)
}
