package dist

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// MaxLocalRanks is the most processes Launch starts on one host.
const MaxLocalRanks = 64

// The grace periods Launch gives ranks between SIGTERM and SIGKILL when
// LaunchOptions leaves them zero.
const (
	DefaultFailGrace = 10 * time.Second
	DefaultStopGrace = 2 * time.Minute
)

// maxLine is about the longest line of a rank's output held back waiting
// for its end; a longer one is passed on in pieces.
const maxLine = 64 << 10

// LaunchOptions says what Launch starts and how it stops it.
type LaunchOptions struct {
	// Ranks is the number of processes, one per GPU: 1 to MaxLocalRanks.
	Ranks int
	// Path and Args are the command every rank runs (Args without the
	// program name).
	Path string
	Args []string
	// Env is the environment the ranks start from (nil: os.Environ()).
	// Launch sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR (127.0.0.1)
	// and MASTER_PORT over it, and NCCL_NVLS_ENABLE=0 unless Env sets it
	// (NVLink multicast stays off unless asked for). CUDA_VISIBLE_DEVICES
	// is left as it is: a rank picks its GPU by LOCAL_RANK.
	Env []string
	// Stdout and Stderr receive rank 0's output unchanged (nil: os.Stdout
	// and os.Stderr). The other ranks' output, stdout and stderr alike,
	// goes to Stderr a whole line at a time, each line prefixed with
	// "[rank i] ".
	Stdout, Stderr io.Writer
	// FailGrace is how long the other ranks have to exit after SIGTERM
	// once one rank has failed, before SIGKILL (0: DefaultFailGrace).
	FailGrace time.Duration
	// StopGrace is how long the ranks have to exit after SIGTERM once ctx
	// has ended, before SIGKILL (0: DefaultStopGrace); they may be saving
	// a checkpoint.
	StopGrace time.Duration
	// Kill, once ctx has ended, kills the ranks still running at once when
	// it is closed: the caller's second interrupt.
	Kill <-chan struct{}
}

// RankError is Launch's error when a rank failed: the first one to exit
// with a non-zero status or to die by a signal Launch did not send.
type RankError struct {
	Rank, Ranks int
	Err         error // from exec.Cmd.Wait; an *exec.ExitError holds the status
}

// Error names the rank and how it ended.
func (e *RankError) Error() string {
	return fmt.Sprintf("dist: rank %d of %d failed: %v", e.Rank, e.Ranks, e.Err)
}

// Unwrap returns the rank's exec.Cmd.Wait error.
func (e *RankError) Unwrap() error { return e.Err }

// StoppedError is Launch's error when ctx ended the run and not every
// rank exited 0.
type StoppedError struct {
	Cause  error // context.Cause of Launch's ctx
	Killed []int // the ranks that had not exited at the end of StopGrace or at Kill
}

// Error gives the cause and the ranks killed.
func (e *StoppedError) Error() string {
	msg := "dist: run stopped: " + e.Cause.Error()
	if len(e.Killed) > 0 {
		msg += fmt.Sprintf("; ranks %v had not exited after SIGTERM and were killed", e.Killed)
	}
	return msg
}

// Unwrap returns the cause, so that errors.Is(err, context.Canceled) holds.
func (e *StoppedError) Unwrap() error { return e.Cause }

// Launch runs o.Ranks copies of a command on this host as the ranks of one
// run and returns when all of them have exited: nil when every one exited
// 0. When a rank fails, the others get SIGTERM, and SIGKILL FailGrace
// later, and the error is a *RankError naming the first one. When ctx
// ends, every rank gets SIGTERM, and SIGKILL StopGrace later or at Kill,
// and the error is a *StoppedError. Each rank runs in a process group of
// its own, so that a terminal's Ctrl-C reaches only Launch's caller (which
// passes it on once, through ctx), and dies by SIGKILL when Launch's
// process dies, however it dies (Linux only).
func Launch(ctx context.Context, o LaunchOptions) error {
	if o.Ranks < 1 || o.Ranks > MaxLocalRanks {
		return fmt.Errorf("dist: %d ranks: want 1 to %d", o.Ranks, MaxLocalRanks)
	}
	if o.FailGrace < 0 || o.StopGrace < 0 {
		return fmt.Errorf("dist: a negative grace period (fail %v, stop %v)", o.FailGrace, o.StopGrace)
	}
	attr, err := sysProcAttr()
	if err != nil {
		return err
	}
	if ctx.Err() != nil {
		return &StoppedError{Cause: context.Cause(ctx)}
	}
	if o.FailGrace == 0 {
		o.FailGrace = DefaultFailGrace
	}
	if o.StopGrace == 0 {
		o.StopGrace = DefaultStopGrace
	}
	if o.Env == nil {
		o.Env = os.Environ()
	}
	if o.Stdout == nil {
		o.Stdout = os.Stdout
	}
	if o.Stderr == nil {
		o.Stderr = os.Stderr
	}
	port, err := pickPort()
	if err != nil {
		return err
	}

	// Rank 0 writes straight into a file, and into any other writer
	// through the lock that the other ranks' lines take.
	shared := &lockedWriter{w: o.Stderr}
	out0, err0 := o.Stdout, o.Stderr
	if _, ok := o.Stderr.(*os.File); !ok {
		err0 = shared
		if sameWriter(o.Stdout, o.Stderr) {
			out0 = shared
		}
	}
	cmds := make([]*exec.Cmd, o.Ranks)
	lines := make([]*prefixWriter, o.Ranks)
	for i := range cmds {
		c := exec.Command(o.Path, o.Args...)
		c.Env = rankEnv(o.Env, o.Ranks, i, port)
		a := *attr
		c.SysProcAttr = &a
		// A process the rank started may keep its output open after it
		// exits; the rank's exit is what counts.
		c.WaitDelay = time.Second
		if i == 0 {
			c.Stdout, c.Stderr = out0, err0
		} else {
			lines[i] = &prefixWriter{prefix: fmt.Sprintf("[rank %d] ", i), w: shared}
			c.Stdout, c.Stderr = lines[i], lines[i]
		}
		cmds[i] = c
	}

	started := make(chan error)
	release := make(chan struct{})
	defer close(release)
	go func() {
		// The parent-death signal fires when the thread that started a
		// child ends, not the process: this one lives until every rank
		// has been waited for.
		runtime.LockOSThread()
		started <- start(cmds)
		<-release
	}()
	if err := <-started; err != nil {
		return err
	}

	type exit struct {
		rank int
		err  error
	}
	exits := make(chan exit, len(cmds))
	for i, c := range cmds {
		go func() {
			err := c.Wait()
			if lines[i] != nil {
				if ferr := lines[i].flush(); err == nil {
					err = ferr
				}
			}
			exits <- exit{i, err}
		}()
	}

	var (
		failed  *RankError
		stopped bool // ctx ended the run
		allOK   = true
		exited  = make([]bool, len(cmds))
		killed  []int
		done    = ctx.Done()
		killAt  <-chan time.Time
		killNow <-chan struct{}
	)
	signalAll := func(sig os.Signal) {
		for i, c := range cmds {
			if !exited[i] {
				_ = c.Process.Signal(sig) // it may have exited since
			}
		}
	}
	killRest := func() {
		for i := range cmds {
			if !exited[i] {
				killed = append(killed, i)
			}
		}
		signalAll(syscall.SIGKILL)
		killAt, killNow = nil, nil
	}
	for left := len(cmds); left > 0; {
		select {
		case e := <-exits:
			left--
			exited[e.rank] = true
			if e.err == nil {
				continue
			}
			allOK = false
			if failed == nil && !stopped {
				failed = &RankError{Rank: e.rank, Ranks: len(cmds), Err: e.err}
				signalAll(syscall.SIGTERM)
				killAt = time.After(o.FailGrace)
			}
		case <-done:
			done = nil
			killNow = o.Kill
			if failed == nil {
				stopped = true
				signalAll(syscall.SIGTERM)
				killAt = time.After(o.StopGrace)
			}
		case <-killAt:
			killRest()
		case <-killNow:
			killRest()
		}
	}
	switch {
	case failed != nil:
		return failed
	case stopped && !allOK:
		return &StoppedError{Cause: context.Cause(ctx), Killed: killed}
	}
	return nil
}

// start starts every rank; when one cannot start, it kills those started.
func start(cmds []*exec.Cmd) error {
	for i, c := range cmds {
		if err := c.Start(); err != nil {
			for _, s := range cmds[:i] {
				_ = s.Process.Kill()
				_ = s.Wait() // it was killed: that is its error
			}
			return fmt.Errorf("dist: starting rank %d: %w", i, err)
		}
	}
	return nil
}

// rankEnv returns rank's environment: base with the run's variables set.
// Later entries win over earlier ones of the same name (exec.Cmd.Env).
func rankEnv(base []string, ranks, rank, port int) []string {
	env := append(base[:len(base):len(base)],
		"WORLD_SIZE="+strconv.Itoa(ranks),
		"RANK="+strconv.Itoa(rank),
		"LOCAL_RANK="+strconv.Itoa(rank),
		"MASTER_ADDR=127.0.0.1",
		"MASTER_PORT="+strconv.Itoa(port))
	for _, kv := range base {
		if strings.HasPrefix(kv, "NCCL_NVLS_ENABLE=") {
			return env
		}
	}
	return append(env, "NCCL_NVLS_ENABLE=0")
}

// pickPort returns a TCP port of 127.0.0.1 that was free a moment ago.
// Another process may take it before rank 0 listens on it; rank 0 then
// fails with that error and the run ends: start it again.
func pickPort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("dist: finding a free port for MASTER_PORT: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// sameWriter reports whether a and b are the same writer; writers of an
// uncomparable type are not (as exec.Cmd compares Stdout and Stderr).
func sameWriter(a, b io.Writer) (same bool) {
	defer func() { _ = recover() }()
	return a == b
}

// lockedWriter serializes writes to w.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

// prefixWriter passes a rank's output on to w a whole line at a time, each
// line prefixed, so that ranks' lines do not interleave.
type prefixWriter struct {
	prefix string
	w      io.Writer
	line   []byte // the line so far, prefix included
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	n := len(b)
	for len(b) > 0 {
		// A line without end (a progress bar?) is passed on in pieces
		// rather than held; never as an empty piece.
		if len(p.line) >= maxLine && b[0] != '\n' {
			if err := p.flush(); err != nil {
				return n - len(b), err
			}
		}
		if len(p.line) == 0 {
			p.line = append(p.line, p.prefix...)
		}
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			p.line = append(p.line, b...)
			return n, nil
		}
		p.line = append(p.line, b[:i+1]...)
		b = b[i+1:]
		if err := p.emit(); err != nil {
			return n - len(b), err
		}
	}
	return n, nil
}

// flush ends and passes on the line under way, if any.
func (p *prefixWriter) flush() error {
	if len(p.line) == 0 {
		return nil
	}
	p.line = append(p.line, '\n')
	return p.emit()
}

func (p *prefixWriter) emit() error {
	_, err := p.w.Write(p.line)
	p.line = p.line[:0]
	return err
}
