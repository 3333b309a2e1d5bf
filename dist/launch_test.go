package dist

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/twell-ai/twell/internal/testutil"
)

// The test binary doubles as the processes Launch starts: with fakeMode set
// it plays a rank (or, for TestLauncherDeathKillsRanks, a launcher) and
// exits instead of running the tests.
const (
	fakeMode    = "TWELL_DIST_TEST_MODE"    // report, fail, stop, output, launcher
	fakeDir     = "TWELL_DIST_TEST_DIR"     // where ranks leave their files
	fakeSeed    = "TWELL_DIST_TEST_SEED"    // output: the test's seed
	fakeFail    = "TWELL_DIST_TEST_FAIL"    // fail: "rank:status", status -9 for SIGKILL
	fakeIgnore  = "TWELL_DIST_TEST_IGNORE"  // fail, stop: ranks that ignore SIGTERM, "1,3"
	fakePayload = "TWELL_DIST_TEST_PAYLOAD" // report: what rank 0 hands out
)

// runVars are the variables Launch sets; report sends them back.
var runVars = []string{"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NCCL_NVLS_ENABLE", "CUDA_VISIBLE_DEVICES"}

func TestMain(m *testing.M) {
	if mode := os.Getenv(fakeMode); mode != "" {
		os.Exit(fake(mode))
	}
	os.Exit(m.Run())
}

// report is what a rank in report mode writes to DIR/rankN.json.
type report struct {
	Pid     int
	Args    []string
	Env     map[string]string
	Payload string
	Err     string
}

// fake plays a process of mode and returns its exit status.
func fake(mode string) int {
	dir := os.Getenv(fakeDir)
	rank, _ := strconv.Atoi(os.Getenv("RANK"))
	ignores := slices.Contains(strings.Split(os.Getenv(fakeIgnore), ","), strconv.Itoa(rank))
	// ready tells the test this rank runs, as a file holding its pid.
	ready := func() {
		name := filepath.Join(dir, fmt.Sprintf("rank%d.pid", rank))
		if err := os.WriteFile(name+".tmp", []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
			panic(err)
		}
		if err := os.Rename(name+".tmp", name); err != nil {
			panic(err)
		}
	}
	switch mode {
	case "report":
		r := report{Pid: os.Getpid(), Args: os.Args[1:], Env: map[string]string{}}
		for _, k := range runVars {
			r.Env[k] = os.Getenv(k)
		}
		// The ranks meet as a training run's do.
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if e, _, err := FromEnv(os.Getenv); err != nil {
			r.Err = err.Error()
		} else if p, err := Rendezvous(ctx, e, sha256.Sum256([]byte("config")), []byte(os.Getenv(fakePayload))); err != nil {
			r.Err = err.Error()
		} else {
			r.Payload = string(p)
		}
		b, _ := json.Marshal(r)
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("rank%d.json", rank)), b, 0o644); err != nil {
			panic(err)
		}
		time.Sleep(time.Duration(rand.IntN(30)) * time.Millisecond) // ranks end one by one
		return 0
	case "fail":
		if ignores {
			signal.Ignore(syscall.SIGTERM)
		}
		ready()
		failRank, status, _ := strings.Cut(os.Getenv(fakeFail), ":")
		if failRank != strconv.Itoa(rank) {
			time.Sleep(time.Minute)
			return 0
		}
		// Fail once every rank runs, so that the test knows their pids.
		world, _ := strconv.Atoi(os.Getenv("WORLD_SIZE"))
		for r := 0; r < world; r++ {
			for {
				if _, err := os.Stat(filepath.Join(dir, fmt.Sprintf("rank%d.pid", r))); err == nil {
					break
				}
				time.Sleep(time.Millisecond)
			}
		}
		code, _ := strconv.Atoi(status)
		if code == -9 {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			time.Sleep(time.Minute)
		}
		return code
	case "stop":
		term := make(chan os.Signal, 1)
		if ignores {
			signal.Ignore(syscall.SIGTERM)
		} else {
			signal.Notify(term, syscall.SIGTERM)
		}
		ready()
		select {
		case <-term:
			if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("rank%d.term", rank)), nil, 0o644); err != nil {
				panic(err)
			}
			return 130
		case <-time.After(time.Minute):
			return 0
		}
	case "output":
		seed, _ := strconv.ParseUint(os.Getenv(fakeSeed), 10, 64)
		rng := rand.New(rand.NewPCG(seed, uint64(rank)))
		for _, l := range rankLines(seed, rank) {
			w := os.Stdout
			if l.stderr {
				w = os.Stderr
			}
			// Other ranks' lines must not land inside this one.
			for s := l.text; s != ""; {
				k := len(s)
				if rank != 0 || !l.stderr { // rank 0's stderr is shared as it is
					k = 1 + rng.IntN(len(s))
				}
				if _, err := w.WriteString(s[:k]); err != nil {
					panic(err)
				}
				s = s[k:]
				time.Sleep(time.Duration(rng.IntN(200)) * time.Microsecond)
			}
		}
		return 0
	case "launcher":
		exe, _ := os.Executable()
		err := Launch(context.Background(), LaunchOptions{Ranks: 3, Path: exe, Env: append(os.Environ(), fakeMode+"=fail", fakeFail+"=-1:0")})
		fmt.Fprintln(os.Stderr, "launcher: Launch returned:", err)
		return 1
	}
	fmt.Fprintln(os.Stderr, "unknown", fakeMode, mode)
	return 2
}

// outLine is one line a rank writes in output mode.
type outLine struct {
	text   string
	stderr bool
}

// rankLines returns the lines rank writes in output mode: the same in the
// rank and in the test. The last one of a rank other than 0 lacks its end.
func rankLines(seed uint64, rank int) []outLine {
	rng := rand.New(rand.NewPCG(seed, 1000+uint64(rank)))
	lines := make([]outLine, 1+rng.IntN(20))
	for j := range lines {
		payload := make([]byte, rng.IntN(100))
		for k := range payload {
			payload[k] = byte('a' + rng.IntN(26))
		}
		lines[j] = outLine{fmt.Sprintf("rank %d line %d %s\n", rank, j, payload), rng.IntN(2) == 0}
	}
	if rank != 0 {
		last := &lines[len(lines)-1]
		last.text = strings.TrimSuffix(last.text, "\n")
	}
	return lines
}

// fakeEnv is the test's environment without the run's variables (nor
// fakeMode), plus kv.
func fakeEnv(kv ...string) []string {
	var env []string
	for _, e := range os.Environ() {
		k, _, _ := strings.Cut(e, "=")
		if !slices.Contains(runVars, k) && !strings.HasPrefix(k, "TWELL_DIST_TEST_") {
			env = append(env, e)
		}
	}
	return append(env, kv...)
}

func testExe(t *testing.T) string {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return exe
}

// alive reports whether pid runs (a zombie does not).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	_, after, _ := strings.Cut(string(b), ") ")
	return after != "" && after[0] != 'Z' && after[0] != 'X'
}

// waitPids waits for the pid files of ranks 0 to n-1 and returns the pids,
// failing the test when they are not all there within 20 s or when launch
// (Launch's error) ends first.
func waitPids(t *testing.T, dir string, n int, launch <-chan error) []int {
	t.Helper()
	pids := make([]int, n)
	deadline := time.Now().Add(20 * time.Second)
	for r := range n {
		for {
			b, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("rank%d.pid", r)))
			if err == nil {
				pids[r], _ = strconv.Atoi(string(b))
				break
			}
			select {
			case err := <-launch:
				t.Fatalf("Launch returned %v before rank %d ran", err, r)
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("rank %d did not start within 20 s", r)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	return pids
}

func TestLaunchAllSucceed(t *testing.T) {
	for _, nvls := range []string{"", "1"} {
		t.Run("NCCL_NVLS_ENABLE="+nvls, func(t *testing.T) {
			rng, seed := testutil.Rand(t)
			n := 1 + rng.IntN(6)
			dir := t.TempDir()
			args := []string{"train", fmt.Sprintf("-x=%d", rng.IntN(1000)), "a b"}
			cvd := fmt.Sprintf("%d,%d", rng.IntN(8), rng.IntN(8))
			payload := fmt.Sprintf("id %x", rng.Uint64())
			// A stale RANK must not leak through.
			env := fakeEnv(fakeMode+"=report", fakeDir+"="+dir, fakePayload+"="+payload, "CUDA_VISIBLE_DEVICES="+cvd, "RANK=99")
			want := "0"
			if nvls != "" {
				env, want = append(env, "NCCL_NVLS_ENABLE="+nvls), nvls
			}
			var stdout, stderr bytes.Buffer
			if err := Launch(context.Background(), LaunchOptions{Ranks: n, Path: testExe(t), Args: args, Env: env, Stdout: &stdout, Stderr: &stderr}); err != nil {
				t.Fatalf("seed %d, %d ranks: %v; stderr %q", seed, n, err, stderr.String())
			}
			var port string
			for r := range n {
				var got report
				testutil.ReadJSON(t, filepath.Join(dir, fmt.Sprintf("rank%d.json", r)), &got)
				if r == 0 {
					port = got.Env["MASTER_PORT"]
				}
				wantEnv := map[string]string{"WORLD_SIZE": strconv.Itoa(n), "RANK": strconv.Itoa(r), "LOCAL_RANK": strconv.Itoa(r),
					"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NCCL_NVLS_ENABLE": want, "CUDA_VISIBLE_DEVICES": cvd}
				p, err := strconv.Atoi(port)
				if err != nil || p < 1 || p > 65535 {
					t.Errorf("seed %d: rank %d: MASTER_PORT %q", seed, r, port)
				}
				if fmt.Sprint(got.Env) != fmt.Sprint(wantEnv) {
					t.Errorf("seed %d: rank %d of %d saw %v, want %v", seed, r, n, got.Env, wantEnv)
				}
				if !slices.Equal(got.Args, args) {
					t.Errorf("seed %d: rank %d args %q, want %q", seed, r, got.Args, args)
				}
				if got.Err != "" || got.Payload != payload {
					t.Errorf("seed %d: rank %d: rendezvous gave %q, error %q; want %q", seed, r, got.Payload, got.Err, payload)
				}
				if alive(got.Pid) {
					t.Errorf("seed %d: rank %d (pid %d) still runs", seed, r, got.Pid)
				}
			}
		})
	}
}

func TestLaunchRankFails(t *testing.T) {
	for _, c := range []struct {
		name   string
		signal bool // the failing rank dies by SIGKILL instead of exiting
		ignore bool // the other ranks ignore SIGTERM
	}{{"exit", false, false}, {"signal", true, false}, {"others ignore SIGTERM", false, true}} {
		t.Run(c.name, func(t *testing.T) {
			rng, seed := testutil.Rand(t)
			n := 2 + rng.IntN(5)
			failRank := rng.IntN(n)
			status := 1 + rng.IntN(125)
			want := fmt.Sprintf("rank %d of %d failed: exit status %d", failRank, n, status)
			if c.signal {
				status, want = -9, fmt.Sprintf("rank %d of %d failed: signal: killed", failRank, n)
			}
			o := LaunchOptions{Ranks: n, Path: testExe(t), FailGrace: time.Minute}
			var others []string
			if c.ignore {
				for r := range n {
					if r != failRank {
						others = append(others, strconv.Itoa(r))
					}
				}
				o.FailGrace = time.Duration(50+rng.IntN(200)) * time.Millisecond
			}
			dir := t.TempDir()
			o.Env = fakeEnv(fakeMode+"=fail", fakeDir+"="+dir, fmt.Sprintf("%s=%d:%d", fakeFail, failRank, status), fakeIgnore+"="+strings.Join(others, ","))
			t0 := time.Now()
			err := Launch(context.Background(), o)
			took := time.Since(t0)
			var re *RankError
			if !errors.As(err, &re) || re.Rank != failRank || !strings.Contains(err.Error(), want) {
				t.Fatalf("seed %d: Launch returned %v, want a RankError with %q", seed, err, want)
			}
			// The other ranks sleep for a minute: they were stopped at once,
			// or at the end of the grace when they ignore SIGTERM.
			if took > 15*time.Second || (c.ignore && took < o.FailGrace) {
				t.Errorf("seed %d: Launch took %v (fail grace %v)", seed, took, o.FailGrace)
			}
			for r, pid := range waitPids(t, dir, n, nil) {
				if alive(pid) {
					t.Errorf("seed %d: rank %d (pid %d) still runs after Launch returned", seed, r, pid)
				}
			}
		})
	}
}

func TestLaunchStops(t *testing.T) {
	for _, c := range []struct {
		name   string
		ignore string // some, all or none of the ranks ignore SIGTERM
		kill   bool   // close Kill after cancelling
	}{{"all stop", "none", false}, {"some ignore SIGTERM", "some", false}, {"kill", "all", true}} {
		t.Run(c.name, func(t *testing.T) {
			rng, seed := testutil.Rand(t)
			n := 1 + rng.IntN(6)
			var ignored []int
			var ignore []string
			for r := range n {
				if c.ignore == "all" || (c.ignore == "some" && (rng.IntN(2) == 0 || r == n-1)) {
					ignored = append(ignored, r)
					ignore = append(ignore, strconv.Itoa(r))
				}
			}
			dir := t.TempDir()
			kill := make(chan struct{})
			o := LaunchOptions{Ranks: n, Path: testExe(t), StopGrace: time.Minute, Kill: kill,
				Env: fakeEnv(fakeMode+"=stop", fakeDir+"="+dir, fakeIgnore+"="+strings.Join(ignore, ","))}
			if c.ignore == "some" {
				o.StopGrace = time.Duration(50+rng.IntN(200)) * time.Millisecond
			}
			cause := fmt.Errorf("stop %d", rng.Uint64())
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			launch := make(chan error, 1)
			go func() { launch <- Launch(ctx, o) }()
			pids := waitPids(t, dir, n, launch)
			t0 := time.Now()
			cancel(cause)
			if c.kill {
				close(kill)
			}
			err := <-launch
			took := time.Since(t0)
			var se *StoppedError
			if !errors.As(err, &se) || !errors.Is(err, cause) || !slices.Equal(se.Killed, ignored) {
				t.Fatalf("seed %d, %d ranks: Launch returned %v, want a StoppedError for %v killing %v", seed, n, err, cause, ignored)
			}
			if took > 15*time.Second || (c.ignore == "some" && took < o.StopGrace) {
				t.Errorf("seed %d: Launch took %v after the cancel (stop grace %v)", seed, took, o.StopGrace)
			}
			for r, pid := range pids {
				_, terr := os.Stat(filepath.Join(dir, fmt.Sprintf("rank%d.term", r)))
				if got, want := terr == nil, !slices.Contains(ignored, r); got != want {
					t.Errorf("seed %d: rank %d saw SIGTERM: %v, want %v", seed, r, got, want)
				}
				if alive(pid) {
					t.Errorf("seed %d: rank %d (pid %d) still runs after Launch returned", seed, r, pid)
				}
			}
		})
	}
}

func TestLaunchCancelledBeforeStart(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := Launch(ctx, LaunchOptions{Ranks: 2, Path: testExe(t), Env: fakeEnv(fakeMode+"=stop", fakeDir+"="+dir)})
	var se *StoppedError
	if !errors.As(err, &se) || !errors.Is(err, context.Canceled) {
		t.Fatalf("Launch returned %v, want a StoppedError", err)
	}
	if files, _ := os.ReadDir(dir); len(files) != 0 {
		t.Errorf("ranks ran: %v", files)
	}
}

func TestLaunchOutput(t *testing.T) {
	for _, files := range []bool{false, true} {
		t.Run(fmt.Sprintf("files=%v", files), func(t *testing.T) {
			rng, seed := testutil.Rand(t)
			n := 2 + rng.IntN(4)
			o := LaunchOptions{Ranks: n, Path: testExe(t), Env: fakeEnv(fakeMode+"=output", fakeSeed+"="+strconv.FormatUint(seed, 10))}
			var stdoutBuf, stderrBuf bytes.Buffer
			o.Stdout, o.Stderr = &stdoutBuf, &stderrBuf
			if files {
				dir := t.TempDir()
				o.Stdout, o.Stderr = createFile(t, filepath.Join(dir, "stdout")), createFile(t, filepath.Join(dir, "stderr"))
			}
			if err := Launch(context.Background(), o); err != nil {
				t.Fatalf("seed %d: %v", seed, err)
			}
			stdout, stderr := stdoutBuf.String(), stderrBuf.String()
			if files {
				stdout, stderr = readFile(t, o.Stdout.(*os.File).Name()), readFile(t, o.Stderr.(*os.File).Name())
			}
			// Rank 0's output as it wrote it; the other ranks' lines, stdout
			// and stderr alike, whole and prefixed on stderr.
			var want0out, want0err []string
			wantRank := map[string][]string{}
			for r := range n {
				for _, l := range rankLines(seed, r) {
					switch {
					case r > 0:
						wantRank[fmt.Sprintf("[rank %d] ", r)] = append(wantRank[fmt.Sprintf("[rank %d] ", r)], strings.TrimSuffix(l.text, "\n"))
					case l.stderr:
						want0err = append(want0err, strings.TrimSuffix(l.text, "\n"))
					default:
						want0out = append(want0out, l.text)
					}
				}
			}
			if got := strings.Join(want0out, ""); stdout != got {
				t.Errorf("seed %d: stdout %q, want rank 0's %q", seed, stdout, got)
			}
			if !strings.HasSuffix(stderr, "\n") {
				t.Errorf("seed %d: stderr does not end a line: %q", seed, stderr)
			}
			gotRank := map[string][]string{}
			var got0err []string
			for _, l := range strings.Split(strings.TrimSuffix(stderr, "\n"), "\n") {
				if p, _, ok := strings.Cut(l, "] "); ok && strings.HasPrefix(l, "[rank ") {
					gotRank[p+"] "] = append(gotRank[p+"] "], l[len(p)+2:])
				} else {
					got0err = append(got0err, l)
				}
			}
			if !slices.Equal(got0err, want0err) {
				t.Errorf("seed %d: rank 0's stderr lines %q, want %q", seed, got0err, want0err)
			}
			if fmt.Sprint(gotRank) != fmt.Sprint(wantRank) {
				t.Errorf("seed %d: other ranks' lines\n%q\nwant\n%q", seed, gotRank, wantRank)
			}
		})
	}
}

func createFile(t *testing.T, name string) *os.File {
	f, err := os.Create(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func readFile(t *testing.T, name string) string {
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestPrefixWriter feeds random text, long lines included, in random
// pieces: each line comes out whole and prefixed, a line longer than
// maxLine in non-empty pieces of about maxLine, an unended last line ended.
func TestPrefixWriter(t *testing.T) {
	rng, seed := testutil.Rand(t)
	const prefix = "[rank 7] "
	var in []string
	var text strings.Builder
	for range 1 + rng.IntN(40) {
		n := rng.IntN(80)
		if rng.IntN(8) == 0 {
			n = maxLine - len(prefix) - 2 + rng.IntN(3*maxLine)
		}
		line := make([]byte, n)
		for k := range line {
			line[k] = byte('a' + rng.IntN(26))
		}
		in = append(in, string(line))
		text.Write(line)
		text.WriteByte('\n')
	}
	src := text.String()
	if rng.IntN(2) == 0 && in[len(in)-1] != "" {
		src = strings.TrimSuffix(src, "\n") // an unended last line
	}
	var out bytes.Buffer
	p := &prefixWriter{prefix: prefix, w: &out}
	const maxChunk = 32 << 10 // what exec.Cmd copies at a time
	for s := src; s != ""; {
		k := 1 + rng.IntN(min(len(s), maxChunk))
		if n, err := p.Write([]byte(s[:k])); n != k || err != nil {
			t.Fatalf("seed %d: Write of %d bytes: %d, %v", seed, k, n, err)
		}
		s = s[k:]
	}
	if err := p.flush(); err != nil {
		t.Fatal(err)
	}
	pieces := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	for i, l := range in {
		got := ""
		for first := true; first || len(got) < len(l); first = false {
			if len(pieces) == 0 {
				t.Fatalf("seed %d: output ends before line %d", seed, i)
			}
			piece, ok := strings.CutPrefix(pieces[0], prefix)
			if !ok || (!first && piece == "") || len(pieces[0]) > maxLine+maxChunk {
				t.Fatalf("seed %d: line %d: a piece of %d bytes: %.40q...", seed, i, len(pieces[0]), pieces[0])
			}
			if !first && len(prefix)+len(l) < maxLine {
				t.Fatalf("seed %d: line %d of %d bytes was split", seed, i, len(l))
			}
			got += piece
			pieces = pieces[1:]
		}
		if got != l {
			t.Fatalf("seed %d: line %d: got %d bytes, want %d", seed, i, len(got), len(l))
		}
	}
	if len(pieces) != 0 || !strings.HasSuffix(out.String(), "\n") {
		t.Fatalf("seed %d: %d pieces more than the input's lines, or no final newline", seed, len(pieces))
	}
}

func TestLaunchBadOptions(t *testing.T) {
	exe := testExe(t)
	for _, c := range []struct {
		o    LaunchOptions
		want string
	}{
		{LaunchOptions{Ranks: 0, Path: exe}, "0 ranks"},
		{LaunchOptions{Ranks: MaxLocalRanks + 1, Path: exe}, "65 ranks"},
		{LaunchOptions{Ranks: 2, Path: exe, FailGrace: -time.Second}, "negative grace"},
		{LaunchOptions{Ranks: 2, Path: filepath.Join(t.TempDir(), "nothing")}, "starting rank 0"},
	} {
		if err := Launch(context.Background(), c.o); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error with %q", c.o, err, c.want)
		}
	}
}

// TestLauncherDeathKillsRanks kills a launching process with SIGKILL: its
// ranks die with it.
func TestLauncherDeathKillsRanks(t *testing.T) {
	dir := t.TempDir()
	// A file, not a pipe that the ranks would hold open.
	stderr := createFile(t, filepath.Join(dir, "launcher.stderr"))
	launcher := exec.Command(testExe(t))
	launcher.Env = fakeEnv(fakeMode+"=launcher", fakeDir+"="+dir)
	launcher.Stderr = stderr
	if err := launcher.Start(); err != nil {
		t.Fatal(err)
	}
	launched := make(chan error, 1)
	go func() { launched <- launcher.Wait() }()
	pids := waitPids(t, dir, 3, launched)
	if err := launcher.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-launched
	deadline := time.Now().Add(10 * time.Second)
	for r, pid := range pids {
		for alive(pid) {
			if time.Now().After(deadline) {
				for _, p := range pids {
					_ = syscall.Kill(p, syscall.SIGKILL)
				}
				t.Fatalf("rank %d (pid %d) outlived its launcher by 10 s; launcher stderr %q", r, pid, readFile(t, stderr.Name()))
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}
