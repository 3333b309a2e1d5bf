// Package cupti records when each kernel ran on the GPU, through the
// activity API of NVIDIA's CUDA Profiling Tools Interface (libcupti, opened
// at run time through purego like the other CUDA libraries; no cgo).
//
// It answers what CUDA events around a whole call cannot: how long each
// kernel of a replayed CUDA graph ran, and how much each added to the
// step, when kernels overlap through early start (programmatic dependent
// launch). A Recorder collects the kernels that start between Start and
// Stop, on every device and stream:
//
//	r, err := cupti.Start()
//	... launch work, synchronize ...
//	kernels, err := r.Stop()
//
// Timestamps are CUPTI's nanoseconds, on the clock of Now. CUPTI may record
// kernels of a CUDA graph instantiated before Start as one graph-level
// record, or not at all, so graphs meant to be seen kernel by kernel are
// recorded after Start. Recording adds a little to each kernel; compare
// traced and untraced timings before reading small differences.
package cupti

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ebitengine/purego"
	"github.com/twell-ai/twell/cuda/internal/dl"
)

// Kernel is one kernel execution that CUPTI recorded.
type Kernel struct {
	// Name is the kernel's name, demangled where it is a plain function or
	// a template on integer and bool arguments (Demangle).
	Name string
	// Start and End are when the kernel's first block began and its last
	// block ended, in nanoseconds on Now's clock.
	Start, End uint64
	// Device, Context and Stream identify where it ran (CUPTI's ids).
	Device, Context, Stream uint32
	// Correlation is the id of the launching API call; the kernels of one
	// graph launch share it.
	Correlation uint32
	// Graph is the id of the CUDA graph the kernel ran in (0: none), and
	// GraphNode its node there.
	Graph     uint32
	GraphNode uint64
	// Grid and Block are the launch's dimensions.
	Grid, Block [3]int32
	// Registers per thread, and static and dynamic shared memory in bytes.
	Registers                   uint16
	StaticShared, DynamicShared int32
}

// Duration returns End - Start in nanoseconds.
func (k Kernel) Duration() uint64 { return k.End - k.Start }

// ErrNoCUPTI is returned (wrapped) when libcupti cannot be loaded.
var ErrNoCUPTI = errors.New("cupti: CUPTI library not found")

// ErrBusy is returned by Start while another Recorder is recording: CUPTI's
// activity buffers belong to the whole process.
var ErrBusy = errors.New("cupti: a recording is already running")

// CUPTI's constants used here (cupti_activity.h, cupti_result.h).
const (
	kindKernel           = 3  // CUPTI_ACTIVITY_KIND_KERNEL
	kindConcurrentKernel = 10 // CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL
	flagFlushForced      = 1  // CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
	resultSuccess        = 0  // CUPTI_SUCCESS
	resultMaxLimit       = 12 // CUPTI_ERROR_MAX_LIMIT_REACHED: no more records
)

// Offsets in a kernel record (CUpti_ActivityKernel5 to 10 share these, and
// CUPTI 12 and 13 write versions 9 and 10). A record is at least
// kernelRecordMin bytes.
const (
	offRegisters     = 6
	offStart         = 16
	offEnd           = 24
	offDevice        = 40
	offContext       = 44
	offStream        = 48
	offGrid          = 52
	offBlock         = 64
	offStaticShared  = 76
	offDynamicShared = 80
	offCorrelation   = 92
	offName          = 104
	offGraphNode     = 144
	offGraph         = 156
	kernelRecordMin  = 160
)

// bufferBytes is the size of each activity buffer handed to CUPTI: large
// enough that a recording of a few thousand kernels fills none before the
// forced flush in Stop.
const bufferBytes = 8 << 20

type lib struct {
	lib          *dl.Library
	registerCBs  func(requested, completed uintptr) int32
	enable       func(kind int32) int32
	disable      func(kind int32) int32
	flushAll     func(flag uint32) int32
	nextRecord   func(buf unsafe.Pointer, valid uint64, rec *unsafe.Pointer) int32
	dropped      func(ctx uintptr, stream uint32, n *uint64) int32
	timestamp    func(t *uint64) int32
	resultString func(r int32, s **byte) int32
	registerOnce sync.Once
	registerErr  error
	requestedCB  uintptr
	completedCB  uintptr
	freeBuffers  [][]byte
	buffers      map[uintptr][]byte // the mapped buffers CUPTI holds, by address
	kernels      []Kernel
	droppedN     uint64
	parseErr     error
	names        map[uintptr]string
	recording    bool
	mu           sync.Mutex // guards the fields from freeBuffers on
}

func (l *lib) symbols() []dl.Symbol {
	S := dl.Sym
	return []dl.Symbol{
		S(&l.registerCBs, "cuptiActivityRegisterCallbacks"),
		S(&l.enable, "cuptiActivityEnable"),
		S(&l.disable, "cuptiActivityDisable"),
		S(&l.flushAll, "cuptiActivityFlushAll"),
		S(&l.nextRecord, "cuptiActivityGetNextRecord"),
		S(&l.dropped, "cuptiActivityGetNumDroppedRecords"),
		S(&l.timestamp, "cuptiGetTimestamp"),
		S(&l.resultString, "cuptiGetResultString"),
	}
}

var (
	loadOnce sync.Once
	loaded   *lib
	loadErr  error
)

// load opens libcupti: TWELL_CUDA_LIB_DIR, the system loader, the CUDA
// toolkit (extras/CUPTI/lib64 and lib64) and NVIDIA's Python wheels.
func load() (*lib, error) {
	loadOnce.Do(func() {
		l := &lib{buffers: map[uintptr][]byte{}, names: map[uintptr]string{}}
		spec := dl.Spec{Name: "libcupti", Sonames: []string{"libcupti.so.13", "libcupti.so.12", "libcupti.so"},
			Toolkit: true, Wheels: true, ExtraDirs: dl.ToolkitDirs("extras/CUPTI/lib64")}
		lib, err := dl.Load(spec, l.symbols())
		if err != nil {
			loadErr = fmt.Errorf("%w: %v", ErrNoCUPTI, err)
			return
		}
		l.lib = lib
		loaded = l
	})
	return loaded, loadErr
}

// check turns a CUPTI result into an error naming the call.
func (l *lib) check(call string, r int32) error {
	if r == resultSuccess {
		return nil
	}
	var s *byte
	msg := fmt.Sprintf("CUPTI error %d", r)
	if l.resultString(r, &s) == resultSuccess && s != nil {
		msg = dl.GoString(s)
	}
	return fmt.Errorf("cupti: %s: %s", call, msg)
}

// Available returns nil when libcupti can be loaded (ErrNoCUPTI wrapped
// when not): for a program to refuse a traced run at once rather than after
// its untraced work.
func Available() error {
	_, err := load()
	return err
}

// Now returns CUPTI's current timestamp in nanoseconds, the clock of
// Kernel.Start and End: a host-side mark between launches.
func Now() (uint64, error) {
	l, err := load()
	if err != nil {
		return 0, err
	}
	var t uint64
	err = l.check("cuptiGetTimestamp", l.timestamp(&t))
	return t, err
}

// Recorder is a running recording of kernel executions.
type Recorder struct {
	l    *lib
	done bool
}

// Start begins recording every kernel that runs from now on, until Stop.
// Only one Recorder records at a time (ErrBusy).
func Start() (*Recorder, error) {
	l, err := load()
	if err != nil {
		return nil, err
	}
	l.registerOnce.Do(func() {
		l.requestedCB = purego.NewCallback(l.bufferRequested)
		l.completedCB = purego.NewCallback(l.bufferCompleted)
		l.registerErr = l.check("cuptiActivityRegisterCallbacks", l.registerCBs(l.requestedCB, l.completedCB))
	})
	if l.registerErr != nil {
		return nil, l.registerErr
	}
	l.mu.Lock()
	if l.recording {
		l.mu.Unlock()
		return nil, ErrBusy
	}
	l.recording, l.kernels, l.droppedN, l.parseErr = true, nil, 0, nil
	l.mu.Unlock()
	if err := l.check("cuptiActivityEnable", l.enable(kindConcurrentKernel)); err != nil {
		l.mu.Lock()
		l.recording = false
		l.mu.Unlock()
		return nil, err
	}
	return &Recorder{l: l}, nil
}

// Stop ends the recording and returns the kernels recorded since Start,
// ordered by start time. It waits for CUPTI to hand over every record, so
// the work to be seen must have finished (synchronize first). It fails if
// CUPTI dropped records (its buffers ran out) or wrote one it could not
// read.
func (r *Recorder) Stop() ([]Kernel, error) {
	if r.done {
		return nil, errors.New("cupti: Stop called twice")
	}
	r.done = true
	l := r.l
	err := errors.Join(l.check("cuptiActivityDisable", l.disable(kindConcurrentKernel)),
		l.check("cuptiActivityFlushAll", l.flushAll(flagFlushForced)))
	l.mu.Lock()
	defer l.mu.Unlock()
	l.recording = false
	ks := l.kernels
	l.kernels = nil
	if l.parseErr != nil {
		err = errors.Join(err, l.parseErr)
	}
	if l.droppedN > 0 {
		err = errors.Join(err, fmt.Errorf("cupti: %d kernel records were dropped", l.droppedN))
	}
	sort.SliceStable(ks, func(i, j int) bool { return ks[i].Start < ks[j].Start })
	return ks, err
}

// bufferRequested is CUPTI's CUpti_BuffersCallbackRequestFunc: it hands
// CUPTI an 8-byte aligned buffer outside the Go heap (an anonymous
// mapping), reused once CUPTI returns it. It may run on any thread.
func (l *lib) bufferRequested(buf *unsafe.Pointer, size *uint64, maxRecords *uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b []byte
	if n := len(l.freeBuffers); n > 0 {
		b, l.freeBuffers = l.freeBuffers[n-1], l.freeBuffers[:n-1]
	} else {
		var err error
		if b, err = unix.Mmap(-1, 0, bufferBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANON); err != nil {
			// A null buffer tells CUPTI to drop records; Stop reports them.
			*buf, *size, *maxRecords = nil, 0, 0
			return
		}
	}
	p := unsafe.Pointer(&b[0])
	l.buffers[uintptr(p)] = b
	*buf, *size, *maxRecords = p, uint64(len(b)), 0
}

// bufferCompleted is CUPTI's CUpti_BuffersCallbackCompleteFunc: it reads
// the kernel records of a filled buffer and takes the buffer back.
func (l *lib) bufferCompleted(ctx uintptr, stream uint32, buf unsafe.Pointer, size, valid uint64) {
	var ks []Kernel
	var perr error
	if buf != nil && valid > 0 {
		for rec := unsafe.Pointer(nil); ; {
			r := l.nextRecord(buf, valid, &rec)
			if r == resultMaxLimit {
				break
			}
			if r != resultSuccess {
				perr = l.check("cuptiActivityGetNextRecord", r)
				break
			}
			// The record lies inside buf, which holds size bytes.
			off := uintptr(rec) - uintptr(buf)
			if off >= uintptr(size) {
				perr = fmt.Errorf("cupti: a record at offset %d of a %d-byte buffer", off, size)
				break
			}
			rb := unsafe.Slice((*byte)(rec), uintptr(size)-off)
			if k, ok, err := parseKernel(rb, l.name); err != nil {
				perr = err
				break
			} else if ok {
				ks = append(ks, k)
			}
		}
	}
	var n uint64
	derr := l.check("cuptiActivityGetNumDroppedRecords", l.dropped(ctx, stream, &n))
	l.mu.Lock()
	defer l.mu.Unlock()
	l.kernels = append(l.kernels, ks...)
	l.droppedN += n
	l.parseErr = errors.Join(l.parseErr, perr, derr)
	if b, ok := l.buffers[uintptr(buf)]; ok {
		delete(l.buffers, uintptr(buf))
		l.freeBuffers = append(l.freeBuffers, b)
	}
}

// name returns the demangled name at the C string p, which CUPTI shares
// between the records of a kernel and keeps for the life of the process.
// It is called with l.mu not held.
func (l *lib) name(p unsafe.Pointer) string {
	l.mu.Lock()
	s, ok := l.names[uintptr(p)]
	l.mu.Unlock()
	if ok {
		return s
	}
	s = Demangle(dl.GoString((*byte)(p)))
	l.mu.Lock()
	l.names[uintptr(p)] = s
	l.mu.Unlock()
	return s
}

// parseKernel reads a kernel record from rec (the record and the rest of its
// buffer). ok is false for other kinds of records; an error means a kernel
// record too short to hold the fields read. name turns the record's name
// pointer into the kernel's name.
func parseKernel(rec []byte, name func(unsafe.Pointer) string) (k Kernel, ok bool, err error) {
	if len(rec) < 4 {
		return Kernel{}, false, fmt.Errorf("cupti: a %d-byte activity record", len(rec))
	}
	le := binary.LittleEndian
	kind := le.Uint32(rec)
	if kind != kindConcurrentKernel && kind != kindKernel {
		return Kernel{}, false, nil
	}
	if len(rec) < kernelRecordMin {
		return Kernel{}, false, fmt.Errorf("cupti: a kernel record of %d bytes, want at least %d", len(rec), kernelRecordMin)
	}
	k = Kernel{
		Start: le.Uint64(rec[offStart:]), End: le.Uint64(rec[offEnd:]),
		Device: le.Uint32(rec[offDevice:]), Context: le.Uint32(rec[offContext:]), Stream: le.Uint32(rec[offStream:]),
		Correlation: le.Uint32(rec[offCorrelation:]), Graph: le.Uint32(rec[offGraph:]), GraphNode: le.Uint64(rec[offGraphNode:]),
		Registers:    le.Uint16(rec[offRegisters:]),
		StaticShared: int32(le.Uint32(rec[offStaticShared:])), DynamicShared: int32(le.Uint32(rec[offDynamicShared:])),
	}
	for i := range 3 {
		k.Grid[i] = int32(le.Uint32(rec[offGrid+4*i:]))
		k.Block[i] = int32(le.Uint32(rec[offBlock+4*i:]))
	}
	if p := *(*unsafe.Pointer)(unsafe.Pointer(&rec[offName])); p != nil {
		k.Name = name(p)
	}
	return k, true, nil
}
