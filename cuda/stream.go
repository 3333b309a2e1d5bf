package cuda

import (
	"fmt"
	"sync/atomic"
	"time"
)

// Stream is a CUDA stream: work queued on it runs in order. A nil *Stream
// means the device's default (legacy) stream. Streams from NewStream are
// ordered with the default stream, so synchronous copies (CopyDtoH) see the
// results of work queued on them earlier.
type Stream struct {
	dev       *Device
	h         uintptr
	destroyed atomic.Bool
}

// NewStream creates a stream on the device (cuStreamCreate).
func (dev *Device) NewStream() (*Stream, error) {
	var h uintptr
	if err := dev.call("cuStreamCreate", func() int32 { return dev.drv.cuStreamCreate(&h, 0) }); err != nil {
		return nil, err
	}
	return &Stream{dev: dev, h: h}, nil
}

// NewUrgentStream creates a stream of the device's greatest priority
// (cuStreamCreateWithPriority): where its kernels and those of other
// streams wait for the same multiprocessors, its blocks start first.
func (dev *Device) NewUrgentStream() (*Stream, error) {
	var least, greatest int32
	if err := dev.call("cuCtxGetStreamPriorityRange", func() int32 { return dev.drv.cuCtxStreamPriorities(&least, &greatest) }); err != nil {
		return nil, err
	}
	var h uintptr
	if err := dev.call("cuStreamCreateWithPriority", func() int32 { return dev.drv.cuStreamCreatePriority(&h, 0, greatest) }); err != nil {
		return nil, err
	}
	return &Stream{dev: dev, h: h}, nil
}

// Handle returns the raw CUstream (0 for the default stream), for other
// CUDA libraries such as cuBLAS.
func (s *Stream) Handle() uintptr {
	if s == nil {
		return 0
	}
	return s.h
}

// streamHandle validates s for use on dev.
func (dev *Device) streamHandle(op string, s *Stream) (uintptr, error) {
	if s == nil {
		return 0, nil
	}
	if s.destroyed.Load() {
		return 0, misuse(op, ErrorInvalidHandle, "stream was destroyed")
	}
	if s.dev != dev {
		return 0, misuse(op, ErrorInvalidContext, "stream belongs to %v, not %v", s.dev, dev)
	}
	return s.h, nil
}

func (s *Stream) device(op string) (*Device, uintptr, error) {
	if s == nil {
		return nil, 0, misuse(op, ErrorInvalidHandle, "nil stream (use Device.Synchronize for the default stream)")
	}
	if s.destroyed.Load() {
		return nil, 0, misuse(op, ErrorInvalidHandle, "stream was destroyed")
	}
	return s.dev, s.h, nil
}

// Synchronize waits for all work queued on the stream.
func (s *Stream) Synchronize() error {
	dev, h, err := s.device("cuStreamSynchronize")
	if err != nil {
		return err
	}
	return dev.call("cuStreamSynchronize", func() int32 { return dev.drv.cuStreamSynchronize(h) })
}

// Done reports whether all work queued on the stream has finished.
func (s *Stream) Done() (bool, error) {
	dev, h, err := s.device("cuStreamQuery")
	if err != nil {
		return false, err
	}
	if err := dev.lock(); err != nil {
		return false, err
	}
	defer dev.unlock()
	r := dev.drv.cuStreamQuery(h)
	if Result(r) == ErrorNotReady {
		return false, nil
	}
	return r == 0, check(r, "cuStreamQuery")
}

// Wait makes later work on s wait until e has completed (cuStreamWaitEvent),
// without blocking the host.
func (s *Stream) Wait(e *Event) error {
	dev, h, err := s.device("cuStreamWaitEvent")
	if err != nil {
		return err
	}
	if e == nil || e.destroyed.Load() {
		return misuse("cuStreamWaitEvent", ErrorInvalidHandle, "nil or destroyed event")
	}
	return dev.hot("cuStreamWaitEvent", dev.drv.pStreamWaitEvent, h, e.h, 0)
}

// Destroy releases the stream once its queued work is done. Destroying it
// twice returns an error.
func (s *Stream) Destroy() error {
	if s == nil {
		return misuse("cuStreamDestroy", ErrorInvalidHandle, "nil stream")
	}
	return s.dev.destroyOnce(&s.destroyed, "stream", "cuStreamDestroy", func() int32 { return s.dev.drv.cuStreamDestroy(s.h) })
}

// destroyOnce marks a stream or event (what) destroyed and frees it with
// free, the driver call op. Destroying it again returns an error.
func (dev *Device) destroyOnce(destroyed *atomic.Bool, what, op string, free func() int32) error {
	if destroyed.Swap(true) {
		return misuse(op, ErrorInvalidHandle, "%s was already destroyed", what)
	}
	return dev.call(op, free)
}

// Event marks a point in a stream, for timing and for ordering streams.
type Event struct {
	dev       *Device
	h         uintptr
	destroyed atomic.Bool
}

// NewEvent creates an event that records timestamps (cuEventCreate).
func (dev *Device) NewEvent() (*Event, error) {
	var h uintptr
	if err := dev.call("cuEventCreate", func() int32 { return dev.drv.cuEventCreate(&h, 0) }); err != nil {
		return nil, err
	}
	return &Event{dev: dev, h: h}, nil
}

func (e *Event) usable(op string) error {
	if e == nil {
		return misuse(op, ErrorInvalidHandle, "nil event")
	}
	if e.destroyed.Load() {
		return misuse(op, ErrorInvalidHandle, "event was destroyed")
	}
	return nil
}

// Record queues the event on stream s (nil: the default stream).
func (e *Event) Record(s *Stream) error {
	if err := e.usable("cuEventRecord"); err != nil {
		return err
	}
	st, err := e.dev.streamHandle("cuEventRecord", s)
	if err != nil {
		return err
	}
	return e.dev.hot("cuEventRecord", e.dev.drv.pEventRecord, e.h, st)
}

// Synchronize waits until the event has completed.
func (e *Event) Synchronize() error {
	if err := e.usable("cuEventSynchronize"); err != nil {
		return err
	}
	return e.dev.call("cuEventSynchronize", func() int32 { return e.dev.drv.cuEventSynchronize(e.h) })
}

// Done reports whether the event has completed.
func (e *Event) Done() (bool, error) {
	if err := e.usable("cuEventQuery"); err != nil {
		return false, err
	}
	if err := e.dev.lock(); err != nil {
		return false, err
	}
	defer e.dev.unlock()
	r := e.dev.drv.cuEventQuery(e.h)
	if Result(r) == ErrorNotReady {
		return false, nil
	}
	return r == 0, check(r, "cuEventQuery")
}

// Elapsed returns the GPU time from e (the start) to end, both recorded and
// completed (cuEventElapsedTime; resolution about 0.5 µs).
func (e *Event) Elapsed(end *Event) (time.Duration, error) {
	if err := e.usable("cuEventElapsedTime"); err != nil {
		return 0, err
	}
	if err := end.usable("cuEventElapsedTime"); err != nil {
		return 0, err
	}
	if err := e.dev.lock(); err != nil {
		return 0, err
	}
	defer e.dev.unlock()
	var ms float32
	if err := check(e.dev.drv.cuEventElapsedTime(&ms, e.h, end.h), "cuEventElapsedTime"); err != nil {
		return 0, err
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}

// Destroy releases the event. Destroying it twice returns an error.
func (e *Event) Destroy() error {
	if e == nil {
		return misuse("cuEventDestroy", ErrorInvalidHandle, "nil event")
	}
	return e.dev.destroyOnce(&e.destroyed, "event", "cuEventDestroy", func() int32 { return e.dev.drv.cuEventDestroy(e.h) })
}

// Graph is an executable CUDA graph captured from a stream: replaying it
// launches all captured work with one call, which amortises per-launch
// overhead (e.g. for one decode step).
type Graph struct {
	dev       *Device
	graph     uintptr
	exec      uintptr
	destroyed atomic.Bool
}

// BeginCapture starts recording the work queued on s into a graph instead of
// running it. The default stream cannot be captured.
func (s *Stream) BeginCapture() error {
	dev, h, err := s.device("cuStreamBeginCapture")
	if err != nil {
		return err
	}
	if err := dev.lock(); err != nil {
		return err
	}
	defer dev.unlock()
	const relaxed = 2 // CU_STREAM_CAPTURE_MODE_RELAXED: goroutines move between threads
	return check(dev.drv.cuStreamBeginCapture(h, relaxed), "cuStreamBeginCapture")
}

// EndCapture stops recording and returns the instantiated graph.
func (s *Stream) EndCapture() (*Graph, error) {
	dev, h, err := s.device("cuStreamEndCapture")
	if err != nil {
		return nil, err
	}
	if err := dev.lock(); err != nil {
		return nil, err
	}
	defer dev.unlock()
	g := &Graph{dev: dev}
	if err := check(dev.drv.cuStreamEndCapture(h, &g.graph), "cuStreamEndCapture"); err != nil {
		return nil, err
	}
	if err := check(dev.drv.cuGraphInstantiate(&g.exec, g.graph, 0), "cuGraphInstantiate"); err != nil {
		dev.drv.cuGraphDestroy(g.graph)
		return nil, err
	}
	return g, nil
}

// Capturing reports whether work queued on s is being recorded into a graph
// (BeginCapture) rather than run. Work that must run now, such as timing a
// kernel, cannot be queued on a capturing stream. The default stream (nil)
// is never captured.
func (s *Stream) Capturing() (bool, error) {
	if s == nil {
		return false, nil
	}
	dev, h, err := s.device("cuStreamIsCapturing")
	if err != nil {
		return false, err
	}
	var st int32 // CU_STREAM_CAPTURE_STATUS_NONE, _ACTIVE or _INVALIDATED
	err = dev.call("cuStreamIsCapturing", func() int32 { return dev.drv.cuStreamIsCapturing(h, &st) })
	return st != 0, err
}

// Launch queues one replay of the graph on s (nil: the default stream).
func (g *Graph) Launch(s *Stream) error {
	if g == nil || g.destroyed.Load() {
		return misuse("cuGraphLaunch", ErrorInvalidHandle, "nil or destroyed graph")
	}
	st, err := g.dev.streamHandle("cuGraphLaunch", s)
	if err != nil {
		return err
	}
	return g.dev.hot("cuGraphLaunch", g.dev.drv.pGraphLaunch, g.exec, st)
}

// Destroy releases the graph. Destroying it twice returns an error.
func (g *Graph) Destroy() error {
	if g == nil || g.destroyed.Swap(true) {
		return misuse("cuGraphDestroy", ErrorInvalidHandle, "nil or already destroyed graph")
	}
	if err := g.dev.lock(); err != nil {
		return err
	}
	defer g.dev.unlock()
	err1 := check(g.dev.drv.cuGraphExecDestroy(g.exec), "cuGraphExecDestroy")
	err2 := check(g.dev.drv.cuGraphDestroy(g.graph), "cuGraphDestroy")
	if err1 != nil {
		return err1
	}
	return err2
}

// String returns e.g. "stream 0x5555 on GPU 0".
func (s *Stream) String() string {
	if s == nil {
		return "default stream"
	}
	return fmt.Sprintf("stream %#x on GPU %d", s.h, s.dev.props.Ordinal)
}
