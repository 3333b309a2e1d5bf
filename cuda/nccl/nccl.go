// Package nccl runs collectives between GPUs with NVIDIA's NCCL, opened at
// run time through purego like the rest of package cuda (no cgo): a
// communicator per GPU made from a shared UniqueID, and all-reduce,
// reduce-scatter, all-gather and broadcast queued on a stream.
//
// libnccl is searched for as the other CUDA libraries are (package
// cuda/internal/dl): TWELL_CUDA_LIB_DIR, the system loader, the CUDA
// toolkit, and the NVIDIA Python wheels (PyTorch ships
// site-packages/nvidia/nccl/lib/libnccl.so.2).
//
// Every call returns an error that names the call and carries NCCL's own
// message. A collective that cannot finish (a dead peer) is ended with
// Comm.Abort after Comm.Wait's timeout, never left to hang.
package nccl

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/internal/dl"
	"github.com/twell-ai/twell/internal/enum"
)

// UniqueID is ncclUniqueId: what every rank of a communicator is given
// (by one rank, through some other channel) to find the others.
type UniqueID struct{ Internal [128]byte }

// DataType is an element type of a collective.
type DataType int32

// The element types, with NCCL's values.
const (
	Int8     DataType = 0
	Uint8    DataType = 1
	Int32    DataType = 2
	Uint32   DataType = 3
	Int64    DataType = 4
	Uint64   DataType = 5
	Float16  DataType = 6
	Float32  DataType = 7
	Float64  DataType = 8
	BFloat16 DataType = 9
)

// Size returns the bytes of one element (0 for an unknown type).
func (t DataType) Size() int {
	switch t {
	case Int8, Uint8:
		return 1
	case Float16, BFloat16:
		return 2
	case Int32, Uint32, Float32:
		return 4
	case Int64, Uint64, Float64:
		return 8
	}
	return 0
}

// Op is a reduction.
type Op int32

// The reductions, with NCCL's values.
const (
	Sum  Op = 0
	Prod Op = 1
	Max  Op = 2
	Min  Op = 3
	Avg  Op = 4
)

// String returns "sum", "prod", "max", "min" or "avg".
func (o Op) String() string { return enum.String(o, "Op", "sum", "prod", "max", "min", "avg") }

// Result codes (ncclResult_t).
const (
	resSuccess    = 0
	resInProgress = 7
)

// Error is a failed NCCL call.
type Error struct {
	Op     string // the call, e.g. "ncclAllReduce"
	Code   int32  // ncclResult_t
	Detail string // ncclGetErrorString, and the communicator's last error when there is one
}

func (e *Error) Error() string {
	return fmt.Sprintf("nccl: %s: %s (ncclResult_t %d)", e.Op, e.Detail, e.Code)
}

// ErrNoNCCL is wrapped by every error of a machine without libnccl.
var ErrNoNCCL = errors.New("nccl: libnccl not available")

type library struct {
	lib *dl.Library

	getVersion        func(*int32) int32
	getUniqueID       func(*UniqueID) int32
	commInitRank      func(*uintptr, int32, UniqueID, int32) int32
	commDestroy       func(uintptr) int32
	commAbort         func(uintptr) int32
	commGetAsyncError func(uintptr, *int32) int32
	allReduce         func(uintptr, uintptr, uint64, int32, int32, uintptr, uintptr) int32
	reduceScatter     func(uintptr, uintptr, uint64, int32, int32, uintptr, uintptr) int32
	allGather         func(uintptr, uintptr, uint64, int32, uintptr, uintptr) int32
	broadcast         func(uintptr, uintptr, uint64, int32, int32, uintptr, uintptr) int32
	groupStart        func() int32
	groupEnd          func() int32
	getErrorString    func(int32) *byte
	getLastError      func(uintptr) *byte
}

var (
	libOnce sync.Once
	libNCCL *library
	libErr  error
)

// load opens libnccl once.
func load() (*library, error) {
	libOnce.Do(func() {
		l := &library{}
		table := []dl.Symbol{
			dl.Sym(&l.getVersion, "ncclGetVersion"), dl.Sym(&l.getUniqueID, "ncclGetUniqueId"),
			dl.Sym(&l.commInitRank, "ncclCommInitRank"), dl.Sym(&l.commDestroy, "ncclCommDestroy"),
			dl.Sym(&l.commAbort, "ncclCommAbort"), dl.Sym(&l.commGetAsyncError, "ncclCommGetAsyncError"),
			dl.Sym(&l.allReduce, "ncclAllReduce"), dl.Sym(&l.reduceScatter, "ncclReduceScatter"),
			dl.Sym(&l.allGather, "ncclAllGather"), dl.Sym(&l.broadcast, "ncclBroadcast"),
			dl.Sym(&l.groupStart, "ncclGroupStart"), dl.Sym(&l.groupEnd, "ncclGroupEnd"),
			dl.Sym(&l.getErrorString, "ncclGetErrorString"), dl.OptSym(&l.getLastError, "ncclGetLastError"),
		}
		lib, err := dl.Load(dl.Spec{Name: "libnccl", Sonames: []string{"libnccl.so.2", "libnccl.so"}, Toolkit: true, Wheels: true}, table)
		if err != nil {
			libErr = fmt.Errorf("%w: %v", ErrNoNCCL, err)
			return
		}
		l.lib = lib
		libNCCL = l
	})
	return libNCCL, libErr
}

// check turns a result into an error naming op (comm, when set, adds
// its last error message).
func (l *library) check(res int32, op string, comm uintptr) error {
	if res == resSuccess {
		return nil
	}
	detail := dl.GoString(l.getErrorString(res))
	if comm != 0 && l.getLastError != nil {
		if last := dl.GoString(l.getLastError(comm)); last != "" {
			detail += ": " + last
		}
	}
	return &Error{Op: op, Code: res, Detail: detail}
}

// Version returns NCCL's version code (e.g. 22703 for 2.27.3) and the
// library's path.
func Version() (int, string, error) {
	l, err := load()
	if err != nil {
		return 0, "", err
	}
	var v int32
	if err := l.check(l.getVersion(&v), "ncclGetVersion", 0); err != nil {
		return 0, "", err
	}
	return int(v), l.lib.Path, nil
}

// NewUniqueID returns a fresh id for a new communicator (rank 0 makes it
// and hands it to the others).
func NewUniqueID() (UniqueID, error) {
	var id UniqueID
	l, err := load()
	if err != nil {
		return id, err
	}
	return id, l.check(l.getUniqueID(&id), "ncclGetUniqueId", 0)
}

// Comm is one rank of a communicator, on one device.
type Comm struct {
	l          *library
	dev        *cuda.Device
	h          uintptr
	rank, size int
}

// NewComm joins rank (of size ranks) of the communicator id on dev. It
// returns when every rank has joined: call it for all ranks at once (one
// process per GPU, or one goroutine each inside Group).
func NewComm(dev *cuda.Device, id UniqueID, rank, size int) (*Comm, error) {
	if size < 1 || rank < 0 || rank >= size {
		return nil, fmt.Errorf("nccl: rank %d of %d ranks", rank, size)
	}
	l, err := load()
	if err != nil {
		return nil, err
	}
	c := &Comm{l: l, dev: dev, rank: rank, size: size}
	err = dev.Do(func() error {
		return l.check(l.commInitRank(&c.h, int32(size), id, int32(rank)), "ncclCommInitRank", 0)
	})
	if err != nil {
		return nil, err
	}
	return c, nil
}

// Rank and Size are the communicator's rank of this Comm and its number
// of ranks.
func (c *Comm) Rank() int { return c.rank }

// Size returns the number of ranks.
func (c *Comm) Size() int { return c.size }

// checkBufs checks that the buffers hold count elements of t (recv:
// recvMul times as many as send).
func checkBufs(op string, send, recv *cuda.Buffer, sendCount, recvCount int, t DataType) error {
	es := t.Size()
	switch {
	case es == 0:
		return fmt.Errorf("nccl: %s: unknown data type %d", op, t)
	case sendCount < 0 || recvCount < 0:
		return fmt.Errorf("nccl: %s: negative count", op)
	case send == nil || recv == nil:
		return fmt.Errorf("nccl: %s: nil buffer", op)
	case send.Len() < sendCount*es:
		return fmt.Errorf("nccl: %s: send buffer of %d bytes for %d elements of %d bytes", op, send.Len(), sendCount, es)
	case recv.Len() < recvCount*es:
		return fmt.Errorf("nccl: %s: receive buffer of %d bytes for %d elements of %d bytes", op, recv.Len(), recvCount, es)
	}
	return nil
}

func (c *Comm) call(op string, f func() int32) error {
	return c.dev.Do(func() error { return c.l.check(f(), op, c.h) })
}

// AllReduce queues recv = op over the ranks of send (count elements; recv
// may be send) on s.
func (c *Comm) AllReduce(send, recv *cuda.Buffer, count int, t DataType, op Op, s *cuda.Stream) error {
	if err := checkBufs("AllReduce", send, recv, count, count, t); err != nil {
		return err
	}
	return c.call("ncclAllReduce", func() int32 {
		return c.l.allReduce(uintptr(send.Ptr()), uintptr(recv.Ptr()), uint64(count), int32(t), int32(op), c.h, s.Handle())
	})
}

// ReduceScatter queues recv = this rank's recvCount-element block of op
// over the ranks of send (Size()·recvCount elements) on s.
func (c *Comm) ReduceScatter(send, recv *cuda.Buffer, recvCount int, t DataType, op Op, s *cuda.Stream) error {
	if err := checkBufs("ReduceScatter", send, recv, recvCount*c.size, recvCount, t); err != nil {
		return err
	}
	return c.call("ncclReduceScatter", func() int32 {
		return c.l.reduceScatter(uintptr(send.Ptr()), uintptr(recv.Ptr()), uint64(recvCount), int32(t), int32(op), c.h, s.Handle())
	})
}

// AllGather queues recv = every rank's send (sendCount elements each),
// in rank order, on s.
func (c *Comm) AllGather(send, recv *cuda.Buffer, sendCount int, t DataType, s *cuda.Stream) error {
	if err := checkBufs("AllGather", send, recv, sendCount, sendCount*c.size, t); err != nil {
		return err
	}
	return c.call("ncclAllGather", func() int32 {
		return c.l.allGather(uintptr(send.Ptr()), uintptr(recv.Ptr()), uint64(sendCount), int32(t), c.h, s.Handle())
	})
}

// Broadcast queues recv = root's send (count elements) on every rank, on
// s (send is read on root only).
func (c *Comm) Broadcast(send, recv *cuda.Buffer, count int, t DataType, root int, s *cuda.Stream) error {
	if root < 0 || root >= c.size {
		return fmt.Errorf("nccl: Broadcast: root %d of %d ranks", root, c.size)
	}
	if err := checkBufs("Broadcast", send, recv, count, count, t); err != nil {
		return err
	}
	return c.call("ncclBroadcast", func() int32 {
		return c.l.broadcast(uintptr(send.Ptr()), uintptr(recv.Ptr()), uint64(count), int32(t), int32(root), c.h, s.Handle())
	})
}

// AsyncError returns the communicator's asynchronous error (a failure
// seen by NCCL's own threads, e.g. a lost peer), or nil.
func (c *Comm) AsyncError() error {
	var res int32
	if err := c.call("ncclCommGetAsyncError", func() int32 { return c.l.commGetAsyncError(c.h, &res) }); err != nil {
		return err
	}
	if res == resSuccess || res == resInProgress {
		return nil
	}
	return c.l.check(res, "asynchronous error", c.h)
}

// Wait waits up to timeout for the work queued on s, polling the
// communicator's asynchronous error; when the time runs out or an
// asynchronous error appears it aborts the communicator (so that no rank
// hangs) and returns an error naming the cause.
func (c *Comm) Wait(s *cuda.Stream, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for pause := 50 * time.Microsecond; ; pause = min(2*pause, 10*time.Millisecond) {
		done, err := s.Done()
		if err != nil {
			return err
		}
		if done {
			return nil
		}
		if err := c.AsyncError(); err != nil {
			return errors.Join(err, c.Abort())
		}
		if time.Now().After(deadline) {
			return errors.Join(fmt.Errorf("nccl: rank %d of %d: collectives not done after %v (a rank is gone or stuck); communicator aborted",
				c.rank, c.size, timeout), c.Abort())
		}
		time.Sleep(pause)
	}
}

// Abort ends the communicator at once, ending its pending collectives
// (ncclCommAbort); the Comm is then closed.
func (c *Comm) Abort() error {
	if c.h == 0 {
		return nil
	}
	err := c.call("ncclCommAbort", func() int32 { return c.l.commAbort(c.h) })
	c.h = 0
	return err
}

// Close destroys the communicator after its queued work (ncclCommDestroy).
func (c *Comm) Close() error {
	if c.h == 0 {
		return nil
	}
	err := c.call("ncclCommDestroy", func() int32 { return c.l.commDestroy(c.h) })
	c.h = 0
	return err
}

// Group runs f between ncclGroupStart and ncclGroupEnd, so that the
// collectives f queues (for several Comms of one process, e.g. one per
// GPU) are launched together.
func Group(f func() error) error {
	l, err := load()
	if err != nil {
		return err
	}
	// NCCL's group state is per thread: keep start, the collectives and
	// end on one.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := l.check(l.groupStart(), "ncclGroupStart", 0); err != nil {
		return err
	}
	ferr := f()
	return errors.Join(ferr, l.check(l.groupEnd(), "ncclGroupEnd", 0))
}
