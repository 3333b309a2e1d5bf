package nvml

import (
	"errors"
	"os"
	"testing"
	"time"

	"github.com/twell-ai/twell/cuda/cudatest"
	"github.com/twell-ai/twell/cuda/internal/dl"
)

func TestBindingSignatures(t *testing.T) {
	if err := dl.Bind("fake libnvidia-ml", func(string) (uintptr, error) { return 0x1000, nil }, (&lib{}).symbols()); err != nil {
		t.Fatal(err)
	}
}

// TestPowerAndEnergy reads power and the energy counter of the GPU that CUDA
// calls device 0, while the GPU works.
func TestPowerAndEnergy(t *testing.T) {
	dev := cudatest.Device(t)
	d, err := DeviceByPCIBusID(dev.Properties().PCIBusID)
	if err != nil {
		if errors.Is(err, ErrNoNVML) && os.Getenv(cudatest.EnvRequireGPU) != "1" {
			t.Skip(err)
		}
		t.Fatal(err)
	}
	name, err := d.Name()
	if err != nil || name != dev.Properties().Name {
		t.Errorf("NVML name %q (%v), CUDA name %q", name, err, dev.Properties().Name)
	}
	ver, err := DriverVersion()
	if err != nil || ver == "" {
		t.Errorf("driver version %q: %v", ver, err)
	}
	m, err := d.StartMeter()
	if err != nil {
		t.Fatal(err)
	}
	// Keep the GPU busy for about half a second with device-to-device copies.
	buf, err := dev.Alloc(1 << 30)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	half, _ := buf.Slice(0, 1<<29)
	other, _ := buf.Slice(1<<29, 1<<29)
	stop := d.Sample(10 * time.Millisecond)
	deadline := time.Now().Add(500 * time.Millisecond)
	for time.Now().Before(deadline) {
		if err := dev.CopyDtoD(other, half, 1<<29); err != nil {
			t.Fatal(err)
		}
	}
	if err := dev.Synchronize(); err != nil {
		t.Fatal(err)
	}
	smp := stop()
	j, dt, err := m.Stop()
	if err != nil {
		t.Fatal(err)
	}
	w, err := d.Power()
	if err != nil {
		t.Fatal(err)
	}
	limit, _ := d.PowerLimit()
	temp, _ := d.Temperature()
	clock, _ := d.SMClock()
	maxClock, _ := d.MaxSMClock()
	t.Logf("%s, driver %s: %.1f J in %v (%.0f W average), power now %.0f W of %.0f W, %d °C, SM %d MHz (max %d); "+
		"%d samples: median SM %d MHz, power cap in %.0f%%",
		name, ver, j, dt, j/dt.Seconds(), w, limit, temp, clock, maxClock, smp.N, smp.MedianSMClock, 100*smp.PowerCapped)
	if smp.N < 10 || smp.MedianSMClock <= 0 || (maxClock > 0 && smp.MedianSMClock > maxClock) ||
		smp.PowerCapped != -1 && (smp.PowerCapped < 0 || smp.PowerCapped > 1) {
		t.Errorf("implausible samples %+v (max SM clock %d MHz)", smp, maxClock)
	}
	if j <= 0 || w <= 0 || j/dt.Seconds() > 2000 {
		t.Errorf("implausible energy %.1f J over %v, power %.0f W", j, dt, w)
	}
}
