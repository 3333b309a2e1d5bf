// Package cudatest gives GPU tests a device, or skips them with the reason
// when the machine has none. Set TWELL_REQUIRE_GPU=1 (as scripts/gpu-run.sh
// does) to make a missing GPU a test failure instead of a skip.
package cudatest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/twell-ai/twell/cuda"
)

// EnvRequireGPU names the environment variable that turns skips for a
// missing GPU into failures.
const EnvRequireGPU = "TWELL_REQUIRE_GPU"

// Device returns CUDA device 0, or skips the test (fails it under
// TWELL_REQUIRE_GPU=1) when there is no driver or GPU.
func Device(tb testing.TB) *cuda.Device {
	tb.Helper()
	dev, err := cuda.Open(0)
	if err != nil {
		if cuda.NoGPU(err) && os.Getenv(EnvRequireGPU) != "1" {
			tb.Skipf("no GPU: %v", err)
		}
		tb.Fatalf("opening GPU 0: %v", err)
	}
	return dev
}

// Alloc allocates n bytes on dev, freed when the test ends.
func Alloc(tb testing.TB, dev *cuda.Device, n int) *cuda.Buffer {
	tb.Helper()
	b, err := dev.Alloc(n)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { b.Free() })
	return b
}

// Compiler skips the test (fails it under TWELL_REQUIRE_GPU=1) when NVRTC
// cannot be loaded.
func Compiler(tb testing.TB) {
	tb.Helper()
	if _, _, _, err := cuda.NVRTCVersion(); err != nil {
		if os.Getenv(EnvRequireGPU) != "1" {
			tb.Skipf("no NVRTC: %v", err)
		}
		tb.Fatalf("NVRTC: %v", err)
	}
}

// Main runs a package's tests with the kernel cache in a fresh temporary
// directory, which keeps test compiles out of the user's cache, and exits
// with their status: func TestMain(m *testing.M) { cudatest.Main(m) }.
func Main(m *testing.M) {
	dir, err := os.MkdirTemp("", "twell-test-kernel-cache")
	if err == nil {
		os.Setenv(cuda.EnvKernelCache, dir)
	}
	code := m.Run()
	if err == nil {
		os.RemoveAll(dir)
	}
	os.Exit(code)
}

// spills matches a ptxas resource line with a nonzero spill count.
var spills = regexp.MustCompile(`[1-9][0-9]* bytes spill (stores|loads)`)

// CleanSASS compiles src to sm_90a machine code with NVRTC (ptxas runs on
// this machine, no GPU needed) and fails the test if ptxas serialized any
// wgmma (its warning C7515: each one waited for before the next, which
// costs most of their speed) or spilled registers. It skips the test where
// NVRTC is older than 12, which cannot target sm_90a.
func CleanSASS(tb testing.TB, name string, src []byte, opts ...cuda.CompileOption) {
	tb.Helper()
	Compiler(tb)
	if major, minor, _, _ := cuda.NVRTCVersion(); major < 12 {
		tb.Skipf("NVRTC %d.%d cannot target sm_90a", major, minor)
	}
	opts = append(opts, cuda.WithArch("sm_90a"), cuda.WithOptions("-Xptxas=-v"), cuda.WithoutCache())
	prog, err := cuda.CompileProgram(name, src, opts...)
	if err != nil {
		tb.Fatal(err)
	}
	if strings.Contains(prog.Log, "C7515") || strings.Contains(prog.Log, "serialized") {
		tb.Errorf("%s: ptxas serialized wgmma instructions:\n%s", name, prog.Log)
	}
	if spills.MatchString(prog.Log) {
		tb.Errorf("%s: ptxas spilled registers:\n%s", name, prog.Log)
	}
	logCodeSizes(tb, name, prog.Image)
}

// logCodeSizes logs the size of each kernel's machine code in cubin (an
// ELF image, a .text section a function): every warp that takes a path
// issues its instructions, so an epilogue that grows by thousands of
// instructions shows here before it runs on a GPU (go test -v).
func logCodeSizes(tb testing.TB, name string, cubin []byte) {
	tb.Helper()
	secs, err := elfSections(cubin)
	if err != nil {
		tb.Logf("%s: reading the machine code: %v", name, err)
		return
	}
	for _, s := range secs {
		if fn, ok := strings.CutPrefix(s.name, ".text."); ok {
			tb.Logf("%s: %s: %d bytes of machine code", name, fn, s.size)
		}
	}
}

type elfSection struct {
	name string
	size uint64
}

// elfSections lists the sections of a 64-bit little-endian ELF image by
// name and size. debug/elf refuses cubins: their header's version byte
// carries the CUDA ABI (EV_CURRENT + 123).
func elfSections(b []byte) ([]elfSection, error) {
	if len(b) < 64 || !bytes.HasPrefix(b, []byte("\x7fELF\x02\x01")) {
		return nil, errors.New("not a 64-bit little-endian ELF image")
	}
	le := binary.LittleEndian
	off, entSize := le.Uint64(b[0x28:]), uint64(le.Uint16(b[0x3a:]))
	n, strIdx := uint64(le.Uint16(b[0x3c:])), uint64(le.Uint16(b[0x3e:]))
	if entSize < 64 || strIdx >= n || off > uint64(len(b)) || n*entSize > uint64(len(b))-off {
		return nil, errors.New("section headers out of the image")
	}
	hdr := func(i uint64) []byte { return b[off+i*entSize:] }
	strOff, strSize := le.Uint64(hdr(strIdx)[0x18:]), le.Uint64(hdr(strIdx)[0x20:])
	if strOff > uint64(len(b)) || strSize > uint64(len(b))-strOff {
		return nil, errors.New("section names out of the image")
	}
	names := b[strOff : strOff+strSize]
	secs := make([]elfSection, 0, n)
	for i := range n {
		h := hdr(i)
		at := uint64(le.Uint32(h))
		if at >= uint64(len(names)) {
			return nil, errors.New("section name out of the name table")
		}
		nm := names[at:]
		if j := bytes.IndexByte(nm, 0); j >= 0 {
			nm = nm[:j]
		}
		secs = append(secs, elfSection{string(nm), le.Uint64(h[0x20:])})
	}
	return secs, nil
}

// touchesResults matches the PTX instructions that write memory or read
// what an earlier kernel wrote (the kernels read those through the L2,
// ld.global.cg).
var touchesResults = regexp.MustCompile(`\bst\.global|\batom\.global|\bred\.global|\bld\.global\.cg`)

// WaitsFirst fails the test unless kernel entry of prog (PTX, a compute_XX
// target) runs griddepcontrol.wait before its first global store, global
// atomic and L2-only load: what a kernel launched with early start
// (cuda.LaunchConfig.EarlyStart) must do before it touches the results of
// the kernels before it. entry is the kernel's name, or its name
// expression when prog was compiled with WithNameExpressions. The check
// reads the PTX in text order, which follows the source's for a kernel's
// straight-line prologue.
func WaitsFirst(tb testing.TB, prog *cuda.Program, entry string) {
	tb.Helper()
	name := entry
	if l, ok := prog.LoweredNames[entry]; ok {
		name = l
	}
	ptx := string(prog.Image)
	i := strings.Index(ptx, ".entry "+name+"(")
	if i < 0 {
		tb.Errorf("%s: kernel %s not in the PTX", prog.Name, entry)
		return
	}
	body := ptx[i+len(".entry "):]
	if j := strings.Index(body, ".entry "); j >= 0 {
		body = body[:j]
	}
	w := strings.Index(body, "griddepcontrol.wait")
	if w < 0 {
		tb.Errorf("%s: kernel %s never runs griddepcontrol.wait", prog.Name, entry)
		return
	}
	if loc := touchesResults.FindStringIndex(body); loc != nil && loc[0] < w {
		tb.Errorf("%s: kernel %s runs %q before griddepcontrol.wait", prog.Name, entry, body[loc[0]:loc[1]])
	}
}
