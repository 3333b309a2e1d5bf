package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// fakeRank, set, has the test binary play a rank that twell train -gpus
// starts: "ok" prints its place and arguments and exits 0, "RANK:STATUS"
// has that rank exit with that status.
const fakeRank = "TWELL_TEST_FAKE_TRAIN_RANK"

func TestMain(m *testing.M) {
	if v := os.Getenv(fakeRank); v != "" {
		rank := os.Getenv("RANK")
		fmt.Printf("rank %s of %s: %q\n", rank, os.Getenv("WORLD_SIZE"), os.Args[1:])
		if r, status, ok := strings.Cut(v, ":"); ok && r == rank {
			code, _ := strconv.Atoi(status)
			os.Exit(code)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// noWorld unsets WORLD_SIZE for the test.
func noWorld(t *testing.T) {
	t.Setenv("WORLD_SIZE", "")
	os.Unsetenv("WORLD_SIZE")
}

func TestTrainGPUsBadInput(t *testing.T) {
	out := filepath.Join(t.TempDir(), "run")
	for _, c := range []struct {
		world string
		args  []string
		want  string
	}{
		{"", []string{"-gpus", "0"}, "-gpus 0: must be in [1, 64]"},
		{"", []string{"-gpus=65"}, "-gpus 65: must be in [1, 64]"},
		{"", []string{"-gpus", "-2"}, "-gpus -2: must be in [1, 64]"},
		{"", []string{"-gpus", "two"}, "-gpus"},
		{"2", []string{"-gpus", "2"}, "-gpus: WORLD_SIZE=2"},
		{"4", []string{"-gpus=1"}, "-gpus: WORLD_SIZE=4"},
	} {
		if c.world == "" {
			noWorld(t)
		} else {
			t.Setenv("WORLD_SIZE", c.world)
		}
		var so, se bytes.Buffer
		code := run(append([]string{"train", "-preset", "tiny", "-out", out}, c.args...), &so, &se)
		msg := se.String()
		if code != 2 || strings.Count(msg, "\n") != 1 || !strings.Contains(msg, c.want) {
			t.Errorf("WORLD_SIZE=%q, %q: exit %d, stderr %q; want exit 2 and one line with %q", c.world, c.args, code, msg, c.want)
		}
		if _, err := os.Stat(out); err == nil {
			t.Fatalf("%q wrote %s", c.args, out)
		}
	}
}

// TestTrainGPUsLaunches runs twell train -gpus N with ranks that only say
// what they were given: each is rank i of N with the arguments less -gpus,
// rank 0 on stdout, the others prefixed on stderr; a failing rank fails
// the command, named.
func TestTrainGPUsLaunches(t *testing.T) {
	rng, seed := testutil.Rand(t)
	noWorld(t)
	n := 2 + rng.IntN(3)
	out := t.TempDir()
	gpus := [][]string{{"-gpus", strconv.Itoa(n)}, {"-gpus=" + strconv.Itoa(n)}, {"--gpus", strconv.Itoa(n)}, {"--gpus=" + strconv.Itoa(n)}}[rng.IntN(4)]
	rest := []string{"-preset", "tiny", "-out", out, "-steps", "3"}
	at := rng.IntN(len(rest)/2+1) * 2 // between two flags
	args := slices.Concat([]string{"train"}, rest[:at], gpus, rest[at:])
	want := fmt.Sprintf("%q", append([]string{"train"}, rest...))

	t.Setenv(fakeRank, "ok")
	var so, se bytes.Buffer
	if code := run(args, &so, &se); code != 0 {
		t.Fatalf("seed %d: %q: exit %d, stderr %q", seed, args, code, se.String())
	}
	if got := so.String(); got != fmt.Sprintf("rank 0 of %d: %s\n", n, want) {
		t.Errorf("seed %d: %q: stdout %q, want rank 0's line with %s", seed, args, got, want)
	}
	var wantErr []string
	for r := 1; r < n; r++ {
		wantErr = append(wantErr, fmt.Sprintf("[rank %d] rank %d of %d: %s", r, r, n, want))
	}
	gotErr := strings.Split(strings.TrimSuffix(se.String(), "\n"), "\n")
	slices.Sort(gotErr)
	if !slices.Equal(gotErr, wantErr) {
		t.Errorf("seed %d: %q: stderr lines %q, want %q", seed, args, gotErr, wantErr)
	}

	failRank, status := rng.IntN(n), 1+rng.IntN(125)
	t.Setenv(fakeRank, fmt.Sprintf("%d:%d", failRank, status))
	se.Reset()
	wantMsg := fmt.Sprintf("twell train: dist: rank %d of %d failed: exit status %d\n", failRank, n, status)
	if code := run(args, &so, &se); code != 1 || !strings.HasSuffix(se.String(), wantMsg) {
		t.Errorf("seed %d: %q with rank %d failing: exit %d, stderr %q; want exit 1 and %q", seed, args, failRank, code, se.String(), wantMsg)
	}
}

func TestWithoutFlag(t *testing.T) {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.Int("gpus", 1, "")
	fs.String("out", "", "")
	fs.Bool("resume", false, "")
	for _, c := range []struct{ in, want string }{
		{"-gpus 4 -out x", "-out x"},
		{"-out x --gpus=4", "-out x"},
		{"-resume -gpus 2 -out y", "-resume -out y"},
		{"-resume=false --gpus 2 -gpus=3", "-resume=false"},
		{"-out -gpus -gpus 2", "-out -gpus"}, // -out's value stays
		{"-out x", "-out x"},
		{"-gpus 2 -- -gpus", "-- -gpus"},
	} {
		if got := strings.Join(withoutFlag(fs, strings.Fields(c.in), "gpus"), " "); got != c.want {
			t.Errorf("%q: %q, want %q", c.in, got, c.want)
		}
	}
}

// TestTrainRankBadInput: a rank of a data-parallel run refuses the CPU
// and an inconsistent place with a usage error, before touching -out.
func TestTrainRankBadInput(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		args []string
		want string
	}{
		{map[string]string{"WORLD_SIZE": "2", "RANK": "1"}, []string{"-device", "cpu"}, "runs on GPUs"},
		{map[string]string{"WORLD_SIZE": "2", "RANK": "2"}, nil, "RANK 2"},
		{map[string]string{"WORLD_SIZE": "two"}, nil, "WORLD_SIZE"},
		{map[string]string{"WORLD_SIZE": ""}, []string{"-gpus", "2", "-device", "cpu"}, "runs on GPUs"},
	} {
		for k, v := range tc.env {
			t.Setenv(k, v)
		}
		out := filepath.Join(t.TempDir(), "run")
		var stderr bytes.Buffer
		args := append([]string{"train", "-preset", "tiny", "-out", out}, tc.args...)
		code := run(args, io.Discard, &stderr)
		if code != 2 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%v %v: exit %d, stderr %q; want 2 and %q", tc.env, args, code, stderr.String(), tc.want)
		}
		if _, err := os.Stat(out); err == nil {
			t.Errorf("%v %v: -out was created", tc.env, args)
		}
		os.Unsetenv("WORLD_SIZE")
	}
}
