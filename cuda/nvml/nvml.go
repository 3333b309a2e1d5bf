// Package nvml reads GPU power, energy and clocks through NVIDIA's
// management library (libnvidia-ml), opened at run time through purego, so
// that benchmarks can report joules per token and whether the power limit
// held the clocks down.
package nvml

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/twell-ai/twell/cuda/internal/dl"
)

// Error is a failed NVML call.
type Error struct {
	Op     string // e.g. "nvmlDeviceGetPowerUsage"
	Code   int32  // nvmlReturn_t
	Detail string // nvmlErrorString's text
}

// Error returns "nvml: OP: detail (code)".
func (e *Error) Error() string { return fmt.Sprintf("nvml: %s: %s (%d)", e.Op, e.Detail, e.Code) }

// ErrNoNVML is returned (wrapped) when libnvidia-ml cannot be loaded.
var ErrNoNVML = errors.New("nvml: libnvidia-ml not found")

type lib struct {
	l             *dl.Library
	init          func() int32
	shutdown      func() int32
	errorString   func(r int32) string
	driverVersion func(buf *byte, n uint32) int32
	count         func(n *uint32) int32
	byPCI         func(bus string, d *uintptr) int32
	name          func(d uintptr, buf *byte, n uint32) int32
	power         func(d uintptr, mw *uint32) int32
	energy        func(d uintptr, mj *uint64) int32
	powerLimit    func(d uintptr, mw *uint32) int32
	temperature   func(d uintptr, sensor int32, c *uint32) int32
	clock         func(d uintptr, typ int32, mhz *uint32) int32
	maxClock      func(d uintptr, typ int32, mhz *uint32) int32
	reasons       func(d uintptr, r *uint64) int32
}

func (n *lib) symbols() []dl.Symbol {
	S, O := dl.Sym, dl.OptSym
	return []dl.Symbol{
		S(&n.init, "nvmlInit_v2"),
		S(&n.shutdown, "nvmlShutdown"),
		S(&n.errorString, "nvmlErrorString"),
		S(&n.driverVersion, "nvmlSystemGetDriverVersion"),
		S(&n.count, "nvmlDeviceGetCount_v2"),
		S(&n.byPCI, "nvmlDeviceGetHandleByPciBusId_v2"),
		S(&n.name, "nvmlDeviceGetName"),
		S(&n.power, "nvmlDeviceGetPowerUsage"),
		O(&n.energy, "nvmlDeviceGetTotalEnergyConsumption"),
		O(&n.powerLimit, "nvmlDeviceGetEnforcedPowerLimit"),
		O(&n.temperature, "nvmlDeviceGetTemperature"),
		O(&n.clock, "nvmlDeviceGetClockInfo"),
		O(&n.maxClock, "nvmlDeviceGetMaxClockInfo"),
		O(&n.reasons, "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
	}
}

func (n *lib) check(r int32, op string) error {
	if r == 0 {
		return nil
	}
	return &Error{Op: op, Code: r, Detail: n.errorString(r)}
}

var (
	once   sync.Once
	loaded *lib
	errLib error
)

// open loads libnvidia-ml and calls nvmlInit once for the process.
func open() (*lib, error) {
	once.Do(func() {
		n := &lib{}
		lib, err := dl.Load(dl.Spec{Name: "libnvidia-ml", Sonames: []string{"libnvidia-ml.so.1", "libnvidia-ml.so"},
			ExtraDirs: []string{"/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64"}}, n.symbols())
		if err != nil {
			errLib = fmt.Errorf("%w: %v", ErrNoNVML, err)
			return
		}
		n.l = lib
		if err := n.check(n.init(), "nvmlInit"); err != nil {
			errLib = err
			return
		}
		loaded = n
	})
	return loaded, errLib
}

// DriverVersion returns the NVIDIA driver's version, e.g. "580.159.04".
func DriverVersion() (string, error) {
	n, err := open()
	if err != nil {
		return "", err
	}
	var buf [96]byte
	if err := n.check(n.driverVersion(&buf[0], uint32(len(buf))), "nvmlSystemGetDriverVersion"); err != nil {
		return "", err
	}
	return cstr(buf[:]), nil
}

// Device is one GPU as NVML sees it.
type Device struct {
	n *lib
	h uintptr
}

// DeviceByPCIBusID returns the device at a PCI bus id such as
// "0000:18:00.0" (from cuda.Properties.PCIBusID).
func DeviceByPCIBusID(id string) (*Device, error) {
	n, err := open()
	if err != nil {
		return nil, err
	}
	d := &Device{n: n}
	if err := n.check(n.byPCI(id, &d.h), fmt.Sprintf("nvmlDeviceGetHandleByPciBusId(%q)", id)); err != nil {
		return nil, err
	}
	return d, nil
}

// Name returns the device's name.
func (d *Device) Name() (string, error) {
	var buf [96]byte
	if err := d.n.check(d.n.name(d.h, &buf[0], uint32(len(buf))), "nvmlDeviceGetName"); err != nil {
		return "", err
	}
	return cstr(buf[:]), nil
}

// Power returns the current power draw in watts (averaged by the driver
// over about a second on recent GPUs).
func (d *Device) Power() (float64, error) {
	var mw uint32
	if err := d.n.check(d.n.power(d.h, &mw), "nvmlDeviceGetPowerUsage"); err != nil {
		return 0, err
	}
	return float64(mw) / 1000, nil
}

// PowerLimit returns the enforced power limit in watts.
func (d *Device) PowerLimit() (float64, error) {
	if d.n.powerLimit == nil {
		return 0, &Error{Op: "nvmlDeviceGetEnforcedPowerLimit", Code: 13, Detail: "not in this libnvidia-ml"}
	}
	var mw uint32
	if err := d.n.check(d.n.powerLimit(d.h, &mw), "nvmlDeviceGetEnforcedPowerLimit"); err != nil {
		return 0, err
	}
	return float64(mw) / 1000, nil
}

// Energy returns the total energy the GPU has used since the driver was
// loaded, in joules (millijoule counter, Volta and later).
func (d *Device) Energy() (float64, error) {
	if d.n.energy == nil {
		return 0, &Error{Op: "nvmlDeviceGetTotalEnergyConsumption", Code: 13, Detail: "not in this libnvidia-ml"}
	}
	var mj uint64
	if err := d.n.check(d.n.energy(d.h, &mj), "nvmlDeviceGetTotalEnergyConsumption"); err != nil {
		return 0, err
	}
	return float64(mj) / 1000, nil
}

// Temperature returns the GPU core temperature in °C.
func (d *Device) Temperature() (int, error) {
	if d.n.temperature == nil {
		return 0, &Error{Op: "nvmlDeviceGetTemperature", Code: 13, Detail: "not in this libnvidia-ml"}
	}
	var c uint32
	if err := d.n.check(d.n.temperature(d.h, 0, &c), "nvmlDeviceGetTemperature"); err != nil {
		return 0, err
	}
	return int(c), nil
}

// SMClock returns the current SM clock in MHz.
func (d *Device) SMClock() (int, error) { return d.smClock(d.n.clock, "nvmlDeviceGetClockInfo") }

// MaxSMClock returns the SM clock's maximum in MHz.
func (d *Device) MaxSMClock() (int, error) {
	return d.smClock(d.n.maxClock, "nvmlDeviceGetMaxClockInfo")
}

// smClock reads the SM clock (NVML_CLOCK_SM) through f, the NVML call op.
func (d *Device) smClock(f func(d uintptr, typ int32, mhz *uint32) int32, op string) (int, error) {
	if f == nil {
		return 0, &Error{Op: op, Code: 13, Detail: "not in this libnvidia-ml"}
	}
	var mhz uint32
	if err := d.n.check(f(d.h, 1, &mhz), op); err != nil {
		return 0, err
	}
	return int(mhz), nil
}

// swPowerCap is nvmlClocksEventReasonSwPowerCap: the driver holds the
// clocks down to keep the board's power within its limit.
const swPowerCap = 0x4

// PowerCapped reports whether the driver is holding the clocks down now to
// keep the board within its power limit.
func (d *Device) PowerCapped() (bool, error) {
	if d.n.reasons == nil {
		return false, &Error{Op: "nvmlDeviceGetCurrentClocksEventReasons", Code: 13, Detail: "not in this libnvidia-ml"}
	}
	var r uint64
	if err := d.n.check(d.n.reasons(d.h, &r), "nvmlDeviceGetCurrentClocksEventReasons"); err != nil {
		return false, err
	}
	return r&swPowerCap != 0, nil
}

// Samples summarizes the SM clock and the power cap's state over a piece of
// work (Device.Sample).
type Samples struct {
	N             int     // samples taken
	MedianSMClock int     // MHz; 0 where the clock was not readable
	PowerCapped   float64 // share of the samples with the power cap holding the clocks down; -1 where not readable
}

// Sample reads the SM clock and whether the power cap holds it down every
// interval, from a goroutine, until the returned stop is called; stop
// returns what the samples show.
func (d *Device) Sample(every time.Duration) (stop func() Samples) {
	done, out := make(chan struct{}), make(chan Samples, 1)
	go func() {
		var clocks []int
		n, capped, known := 0, 0, true
		read := func() {
			n++
			if c, err := d.SMClock(); err == nil {
				clocks = append(clocks, c)
			}
			if on, err := d.PowerCapped(); err != nil {
				known = false
			} else if on {
				capped++
			}
		}
		t := time.NewTicker(every)
		defer t.Stop()
		read()
		for {
			select {
			case <-t.C:
				read()
			case <-done:
				s := Samples{N: n, PowerCapped: -1}
				if len(clocks) > 0 {
					slices.Sort(clocks)
					s.MedianSMClock = clocks[len(clocks)/2]
				}
				if known {
					s.PowerCapped = float64(capped) / float64(n)
				}
				out <- s
				return
			}
		}
	}()
	return func() Samples {
		close(done)
		return <-out
	}
}

// Meter measures the energy a piece of work uses, from the GPU's total
// energy counter.
type Meter struct {
	d      *Device
	joules float64
	start  time.Time
}

// StartMeter reads the energy counter now.
func (d *Device) StartMeter() (*Meter, error) {
	j, err := d.Energy()
	if err != nil {
		return nil, err
	}
	return &Meter{d: d, joules: j, start: time.Now()}, nil
}

// Stop returns the joules used and the wall time since StartMeter. The
// counter updates every few milliseconds, so measure work lasting at least
// a few hundred milliseconds.
func (m *Meter) Stop() (joules float64, elapsed time.Duration, err error) {
	j, err := m.d.Energy()
	if err != nil {
		return 0, 0, err
	}
	return j - m.joules, time.Since(m.start), nil
}

// LibraryPath returns the loaded libnvidia-ml's path, or "".
func LibraryPath() string {
	if loaded != nil {
		return loaded.l.Path
	}
	return ""
}

func cstr(b []byte) string {
	if i := strings.IndexByte(string(b), 0); i >= 0 {
		return string(b[:i])
	}
	return string(b)
}
