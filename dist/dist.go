// Package dist is what the processes of a data-parallel run agree on
// before NCCL takes over: where each process stands (the torchrun
// conventions: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK) and
// a small TCP rendezvous through which rank 0 hands every rank a payload
// (the NCCL unique id) after checking that all ranks are present once and
// run the same configuration. Every failure ends every rank with an error
// naming the cause; nothing waits past its context's deadline. Launch
// starts and supervises the ranks of a run on one host.
package dist

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"time"
)

// Env is one process's place in a run.
type Env struct {
	Rank, LocalRank, WorldSize int
	MasterAddr                 string // rank 0's host
	MasterPort                 int    // rank 0's rendezvous port
}

// Address is rank 0's rendezvous address.
func (e Env) Address() string { return net.JoinHostPort(e.MasterAddr, strconv.Itoa(e.MasterPort)) }

// Validate reports the first inconsistent field.
func (e Env) Validate() error {
	switch {
	case e.WorldSize < 1:
		return fmt.Errorf("dist: WORLD_SIZE %d: must be >= 1", e.WorldSize)
	case e.Rank < 0 || e.Rank >= e.WorldSize:
		return fmt.Errorf("dist: RANK %d outside [0, WORLD_SIZE %d)", e.Rank, e.WorldSize)
	case e.LocalRank < 0 || e.LocalRank > e.Rank:
		return fmt.Errorf("dist: LOCAL_RANK %d: must be in [0, RANK %d]", e.LocalRank, e.Rank)
	case e.WorldSize > 1 && e.MasterAddr == "":
		return errors.New("dist: MASTER_ADDR is empty")
	case e.WorldSize > 1 && (e.MasterPort < 1 || e.MasterPort > 65535):
		return fmt.Errorf("dist: MASTER_PORT %d: want a TCP port in [1, 65535]", e.MasterPort)
	}
	return nil
}

// FromEnv reads the torchrun variables through getenv (os.Getenv). With
// WORLD_SIZE unset it returns ok false: a single process. LOCAL_RANK
// defaults to RANK, MASTER_ADDR to 127.0.0.1 and MASTER_PORT to 29500.
func FromEnv(getenv func(string) string) (e Env, ok bool, err error) {
	ws := getenv("WORLD_SIZE")
	if ws == "" {
		return Env{WorldSize: 1}, false, nil
	}
	num := func(name, def string) (int, error) {
		v := getenv(name)
		if v == "" {
			v = def
		}
		n, err := strconv.Atoi(v)
		if err != nil {
			return 0, fmt.Errorf("dist: %s=%q is not a whole number", name, v)
		}
		return n, nil
	}
	if e.WorldSize, err = num("WORLD_SIZE", ""); err != nil {
		return e, true, err
	}
	if e.Rank, err = num("RANK", ""); err != nil {
		return e, true, err
	}
	if e.LocalRank, err = num("LOCAL_RANK", strconv.Itoa(e.Rank)); err != nil {
		return e, true, err
	}
	if e.MasterPort, err = num("MASTER_PORT", "29500"); err != nil {
		return e, true, err
	}
	e.MasterAddr = getenv("MASTER_ADDR")
	if e.MasterAddr == "" {
		e.MasterAddr = "127.0.0.1"
	}
	return e, true, e.Validate()
}

// The rendezvous protocol. A rank sends hello; rank 0 answers each with a
// reply: status (0 ok, 1 error) and a length-prefixed payload or message.
const (
	magic      = "TWDP"
	protoVer   = 1
	maxPayload = 1 << 20
	// failGrace is how long rank 0, ending a rendezvous, keeps telling
	// ranks that arrive late why.
	failGrace = 5 * time.Second
)

// hello is what a rank tells rank 0.
type hello struct {
	Rank, WorldSize uint32
	Digest          [32]byte
}

func writeHello(w io.Writer, h hello) error {
	var b bytes.Buffer
	b.WriteString(magic)
	b.WriteByte(protoVer)
	_ = binary.Write(&b, binary.LittleEndian, h) // a bytes.Buffer does not fail
	_, err := w.Write(b.Bytes())
	return err
}

func readHello(r io.Reader) (hello, error) {
	var h hello
	head := make([]byte, len(magic)+1)
	if _, err := io.ReadFull(r, head); err != nil {
		return h, err
	}
	if string(head[:len(magic)]) != magic || head[len(magic)] != protoVer {
		return h, fmt.Errorf("not a twell rendezvous hello (version %d expected)", protoVer)
	}
	err := binary.Read(r, binary.LittleEndian, &h)
	return h, err
}

func writeReply(w io.Writer, failed bool, body []byte) error {
	head := make([]byte, 5)
	if failed {
		head[0] = 1
	}
	binary.LittleEndian.PutUint32(head[1:], uint32(len(body)))
	_, err := w.Write(append(head, body...))
	return err
}

func readReply(r io.Reader) ([]byte, error) {
	head := make([]byte, 5)
	if _, err := io.ReadFull(r, head); err != nil {
		return nil, err
	}
	n := binary.LittleEndian.Uint32(head[1:])
	if n > maxPayload {
		return nil, fmt.Errorf("a reply of %d bytes", n)
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(r, body); err != nil {
		return nil, err
	}
	if head[0] != 0 {
		return nil, errors.New(string(body))
	}
	return body, nil
}

// Rendezvous gathers the run's ranks at rank 0 and returns payload (given
// by rank 0; ignored on the others) on every rank, once every rank of
// e.WorldSize has arrived exactly once with the same digest (a hash of
// what must agree across ranks: the config, the data, the code's
// version). A rank missing at ctx's deadline, a duplicate rank, a
// different world size or digest ends every rank that arrived with an
// error naming the cause. A single process returns payload at once.
func Rendezvous(ctx context.Context, e Env, digest [32]byte, payload []byte) ([]byte, error) {
	if err := e.Validate(); err != nil {
		return nil, err
	}
	if len(payload) > maxPayload {
		return nil, fmt.Errorf("dist: a payload of %d bytes (at most %d)", len(payload), maxPayload)
	}
	if e.WorldSize == 1 {
		return payload, nil
	}
	if e.Rank == 0 {
		return payload, serve(ctx, e, digest, payload)
	}
	return join(ctx, e, digest)
}

// serve is rank 0's side.
func serve(ctx context.Context, e Env, digest [32]byte, payload []byte) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", net.JoinHostPort("", strconv.Itoa(e.MasterPort)))
	if err != nil {
		return fmt.Errorf("dist: rank 0 cannot listen on port %d: %w", e.MasterPort, err)
	}
	defer ln.Close()
	if d, ok := ctx.Deadline(); ok {
		_ = ln.(*net.TCPListener).SetDeadline(d) // Accept reports a failure
	}
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	conns := map[uint32]net.Conn{}
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	// fail tells every rank that arrived why the run ends, then, for a
	// grace period, the ranks still on their way, so that none of them
	// waits for its deadline to learn it.
	fail := func(err error) error {
		msg := []byte(err.Error())
		for _, c := range conns {
			_ = writeReply(c, true, msg) // the rank may be gone already
		}
		grace := time.Now().Add(failGrace)
		if d, ok := ctx.Deadline(); ok && d.Before(grace) {
			grace = d
		}
		_ = ln.(*net.TCPListener).SetDeadline(grace)
		for told := len(conns); told < e.WorldSize-1; told++ {
			c, aerr := ln.Accept()
			if aerr != nil {
				break
			}
			_ = c.SetDeadline(grace)
			if _, herr := readHello(c); herr == nil {
				_ = writeReply(c, true, msg)
			}
			c.Close()
		}
		return err
	}
	for len(conns) < e.WorldSize-1 {
		c, err := ln.Accept()
		if err != nil {
			var missing []int
			for r := 1; r < e.WorldSize; r++ {
				if conns[uint32(r)] == nil {
					missing = append(missing, r)
				}
			}
			return fail(fmt.Errorf("dist: rendezvous at %s: ranks %v did not arrive (%v)", e.Address(), missing, errors.Join(ctx.Err(), err)))
		}
		if d, ok := ctx.Deadline(); ok {
			_ = c.SetDeadline(d) // reads report a failure
		}
		h, err := readHello(c)
		if err != nil {
			c.Close()
			continue // not one of ours, or gone: keep waiting for the ranks
		}
		switch {
		case h.WorldSize != uint32(e.WorldSize):
			conns[h.Rank] = c
			return fail(fmt.Errorf("dist: rank %d says WORLD_SIZE %d, rank 0 has %d", h.Rank, h.WorldSize, e.WorldSize))
		case h.Rank == 0 || h.Rank >= uint32(e.WorldSize):
			_ = writeReply(c, true, []byte(fmt.Sprintf("dist: rank %d outside [1, %d)", h.Rank, e.WorldSize)))
			c.Close()
			return fail(fmt.Errorf("dist: a process says it is rank %d of %d", h.Rank, e.WorldSize))
		case conns[h.Rank] != nil:
			_ = writeReply(c, true, []byte(fmt.Sprintf("dist: rank %d arrived twice", h.Rank)))
			c.Close()
			return fail(fmt.Errorf("dist: rank %d arrived twice", h.Rank))
		case h.Digest != digest:
			conns[h.Rank] = c
			return fail(fmt.Errorf("dist: rank %d runs a different configuration than rank 0 (digest %x, rank 0 %x)", h.Rank, h.Digest[:6], digest[:6]))
		}
		conns[h.Rank] = c
	}
	var errs []error
	for r, c := range conns {
		if err := writeReply(c, false, payload); err != nil {
			errs = append(errs, fmt.Errorf("dist: sending to rank %d: %w", r, err))
		}
	}
	return errors.Join(errs...)
}

// join is the side of every rank but 0: it retries until rank 0 listens.
func join(ctx context.Context, e Env, digest [32]byte) ([]byte, error) {
	var d net.Dialer
	var c net.Conn
	var err error
	for pause := 10 * time.Millisecond; ; pause = min(2*pause, time.Second) {
		if c, err = d.DialContext(ctx, "tcp", e.Address()); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("dist: rank %d cannot reach rank 0 at %s: %w", e.Rank, e.Address(), err)
		case <-time.After(pause):
		}
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	if err := writeHello(c, hello{Rank: uint32(e.Rank), WorldSize: uint32(e.WorldSize), Digest: digest}); err != nil {
		return nil, fmt.Errorf("dist: rank %d: %w", e.Rank, err)
	}
	p, err := readReply(c)
	if err != nil {
		if ctx.Err() != nil {
			err = errors.Join(err, ctx.Err())
		}
		return nil, fmt.Errorf("dist: rank %d: rendezvous failed: %w", e.Rank, err)
	}
	return p, nil
}
