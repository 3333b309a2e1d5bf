package main

import (
	"errors"
	"fmt"
	"io"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/cuda/nvml"
)

func init() {
	register(command{name: "devices", summary: "list CUDA GPUs and the CUDA libraries found (or say the CPU backend will be used)", run: runDevices})
}

func runDevices(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("devices", stderr)
	verbose := fs.Bool("v", false, "also print library paths and, without a GPU, why")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	n, err := cuda.Count()
	if err != nil {
		if !cuda.NoGPU(err) {
			return err
		}
		what := "no CUDA driver found"
		if !errors.Is(err, cuda.ErrNoDriver) {
			what = "a CUDA driver but no GPU found"
		}
		fmt.Fprintf(stdout, "%s; the CPU backend will be used\n", what)
		if *verbose {
			fmt.Fprintf(stdout, "  %v\n", err)
		}
		return nil
	}
	drv, _ := cuda.DriverVersion()
	line := fmt.Sprintf("CUDA driver API %d.%d", drv/1000, drv%1000/10)
	if v, err := nvml.DriverVersion(); err == nil {
		line += ", NVIDIA driver " + v
	}
	fmt.Fprintln(stdout, line)
	if ma, mi, path, err := cuda.NVRTCVersion(); err == nil {
		fmt.Fprintf(stdout, "NVRTC %d.%d", ma, mi)
		if *verbose {
			fmt.Fprintf(stdout, " (%s; CUDA headers: %s)", path, orNone(cuda.CUDAIncludeDir()))
		}
		fmt.Fprintln(stdout)
	} else {
		fmt.Fprintf(stdout, "NVRTC: not found (kernels cannot be compiled): %v\n", err)
	}
	ltv, ltPath, cbv, cbPath, cbErr := cublas.Versions()
	switch {
	case ltv != 0 || cbv != "":
		fmt.Fprintf(stdout, "cuBLAS %s, cuBLASLt %s", orNone(cbv), ltVersion(ltv))
		if *verbose {
			fmt.Fprintf(stdout, " (%s; %s)", orNone(cbPath), orNone(ltPath))
		}
		fmt.Fprintln(stdout)
	default:
		fmt.Fprintf(stdout, "cuBLAS: not found: %v\n", cbErr)
	}
	if *verbose {
		fmt.Fprintf(stdout, "libcuda: %s, libnvidia-ml: %s\n", cuda.LibraryPath(), orNone(nvml.LibraryPath()))
	}
	for i := 0; i < n; i++ {
		dev, err := cuda.Open(i)
		if err != nil {
			fmt.Fprintf(stdout, "GPU %d: %v\n", i, err)
			continue
		}
		p := dev.Properties()
		free, _, _ := dev.MemInfo()
		fmt.Fprintf(stdout, "GPU %d: %s, CC %s (%s), %d SMs, %.1f GiB (%.1f GiB free), L2 %d MiB, shared memory %d KiB/block, PCI %s\n",
			i, p.Name, p.ComputeCapability(), p.Arch, p.SMs, gib(p.TotalMemory), gib(free), p.L2Bytes>>20, p.SharedPerBlockOptin>>10, p.PCIBusID)
	}
	return nil
}

func ltVersion(v int) string {
	if v == 0 {
		return "none"
	}
	return fmt.Sprintf("%d.%d.%d", v/10000, v/100%100, v%100)
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

func gib(b int64) float64 { return float64(b) / (1 << 30) }
