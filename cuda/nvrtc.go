package cuda

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/twell-ai/twell/cuda/internal/dl"
)

// Environment variables that steer kernel compilation.
const (
	// EnvKernelCache: "off" disables the on-disk CUBIN cache; a folder path
	// moves it (default: the user cache dir + /twell/kernels).
	EnvKernelCache = "TWELL_KERNEL_CACHE"
	// EnvCUBINDump: a folder where every compiled image is also written as
	// NAME.ARCH.KEY.cubin (or .ptx), for cuobjdump --dump-sass and ncu.
	EnvCUBINDump = "TWELL_CUBIN_DUMP"
	// EnvIncludeDir: the CUDA include folder (with cuda_bf16.h) to pass to
	// NVRTC, if it is not found by itself.
	EnvIncludeDir = "TWELL_CUDA_INCLUDE_DIR"
)

type nvrtcLib struct {
	lib         *dl.Library
	version     func(major, minor *int32) int32
	create      func(prog *uintptr, src unsafe.Pointer, name unsafe.Pointer, n int32, headers, names unsafe.Pointer) int32
	compile     func(prog uintptr, n int32, opts unsafe.Pointer) int32
	logSize     func(prog uintptr, n *uint64) int32
	log         func(prog uintptr, out unsafe.Pointer) int32
	cubinSize   func(prog uintptr, n *uint64) int32
	cubin       func(prog uintptr, out unsafe.Pointer) int32
	ptxSize     func(prog uintptr, n *uint64) int32
	ptx         func(prog uintptr, out unsafe.Pointer) int32
	destroy     func(prog *uintptr) int32
	errorString func(r int32) string
	addName     func(prog uintptr, expr string) int32
	lowered     func(prog uintptr, expr string, out **byte) int32
	major       int
	minor       int
}

func (n *nvrtcLib) symbols() []dl.Symbol {
	S, O := dl.Sym, dl.OptSym
	return []dl.Symbol{
		S(&n.version, "nvrtcVersion"),
		S(&n.create, "nvrtcCreateProgram"),
		S(&n.compile, "nvrtcCompileProgram"),
		S(&n.logSize, "nvrtcGetProgramLogSize"),
		S(&n.log, "nvrtcGetProgramLog"),
		O(&n.cubinSize, "nvrtcGetCUBINSize"),
		O(&n.cubin, "nvrtcGetCUBIN"),
		S(&n.ptxSize, "nvrtcGetPTXSize"),
		S(&n.ptx, "nvrtcGetPTX"),
		S(&n.destroy, "nvrtcDestroyProgram"),
		S(&n.errorString, "nvrtcGetErrorString"),
		S(&n.addName, "nvrtcAddNameExpression"),
		S(&n.lowered, "nvrtcGetLoweredName"),
	}
}

var (
	nvrtcOnce sync.Once
	nvrtc     *nvrtcLib
	nvrtcErr  error
)

var nvrtcSpec = dl.Spec{
	Name:    "libnvrtc",
	Sonames: []string{"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so"},
	Toolkit: true,
	Wheels:  true,
	Preload: []string{"libnvrtc-builtins.so.*"},
}

func loadNVRTC() (*nvrtcLib, error) {
	nvrtcOnce.Do(func() {
		n := &nvrtcLib{}
		lib, err := dl.Load(nvrtcSpec, n.symbols())
		if err != nil {
			nvrtcErr = fmt.Errorf("%w: %v", ErrNoNVRTC, err)
			return
		}
		n.lib = lib
		var ma, mi int32
		if r := n.version(&ma, &mi); r != 0 {
			nvrtcErr = fmt.Errorf("cuda: nvrtcVersion failed with status %d", r)
			return
		}
		n.major, n.minor = int(ma), int(mi)
		nvrtc = n
	})
	return nvrtc, nvrtcErr
}

// NVRTCVersion returns the NVRTC library's version, e.g. (13, 0), and its path.
func NVRTCVersion() (major, minor int, path string, err error) {
	n, err := loadNVRTC()
	if err != nil {
		return 0, 0, "", err
	}
	return n.major, n.minor, n.lib.Path, nil
}

// NVRTCError is a failed NVRTC call; for a compile error Log holds the
// compiler's messages ("file.cu(12): error: ...").
type NVRTCError struct {
	Op     string   // e.g. "compile vecadd.cu for sm_90a"
	Code   int32    // nvrtcResult
	Name   string   // e.g. "NVRTC_ERROR_COMPILATION"
	Log    string   // compiler output
	Option []string // the options used
}

// Error returns the operation, the NVRTC error name and the compiler log.
func (e *NVRTCError) Error() string {
	s := fmt.Sprintf("cuda: NVRTC %s: %s", e.Op, e.Name)
	if log := strings.TrimSpace(e.Log); log != "" {
		s += "\n" + log
	}
	return s
}

func (n *nvrtcLib) err(op string, r int32, log string, opts []string) error {
	if r == 0 {
		return nil
	}
	return &NVRTCError{Op: op, Code: r, Name: n.errorString(r), Log: log, Option: opts}
}

// CompileOption adjusts a kernel compilation.
type CompileOption func(*compileConfig)

type compileConfig struct {
	arch      string
	options   []string
	headers   []header
	nameExprs []string
	noCache   bool
}

type header struct {
	name string
	src  []byte
}

// WithArch compiles for arch, e.g. "sm_90a" (CUBIN) or "compute_90" (PTX,
// which the driver JIT-compiles at load). Device.Compile uses the device's
// own architecture by default.
func WithArch(arch string) CompileOption { return func(c *compileConfig) { c.arch = arch } }

// WithOptions adds raw NVRTC options, e.g. "-DTILE=256", "--use_fast_math",
// "-maxrregcount=128".
func WithOptions(opts ...string) CompileOption {
	return func(c *compileConfig) { c.options = append(c.options, opts...) }
}

// WithHeader supplies an in-memory header that the source can #include by
// name (e.g. a shared "twell.cuh" embedded beside the kernels). Headers are
// part of the cache key.
func WithHeader(name string, src []byte) CompileOption {
	return func(c *compileConfig) { c.headers = append(c.headers, header{name, src}) }
}

// WithNameExpressions registers C++ names (e.g. "scale<256>") so that
// templated kernels can be looked up by them with Module.Function.
func WithNameExpressions(exprs ...string) CompileOption {
	return func(c *compileConfig) { c.nameExprs = append(c.nameExprs, exprs...) }
}

// WithoutCache compiles even if the disk cache holds the result.
func WithoutCache() CompileOption { return func(c *compileConfig) { c.noCache = true } }

// Program is the result of an NVRTC compilation.
type Program struct {
	Name         string            // source name, e.g. "vecadd.cu"
	Arch         string            // e.g. "sm_90a"
	Image        []byte            // CUBIN, or NUL-terminated PTX when PTX is true
	PTX          bool              // Image is PTX (a compute_XX target)
	Log          string            // compiler warnings
	Options      []string          // every NVRTC option used
	LoweredNames map[string]string // name expression -> mangled name
	Key          string            // cache key (hex SHA-256)
	FromCache    bool              // not compiled by this call: from this process's or the disk cache
	CompileTime  time.Duration     // time spent in NVRTC (0 from cache)
}

var (
	includeOnce sync.Once
	includeDir  string
	compiled    sync.Map // cache key -> *Program: compiled in this process
)

// CUDAIncludeDir returns a folder holding cuda_bf16.h and the other CUDA
// headers, or "" if none is found: TWELL_CUDA_INCLUDE_DIR, the toolkit's
// include folders, the include folder beside the loaded NVRTC, or the NVIDIA
// Python wheels' include folders.
func CUDAIncludeDir() string {
	includeOnce.Do(func() {
		var cands []string
		if v := os.Getenv(EnvIncludeDir); v != "" {
			cands = append(cands, v)
		}
		if n, err := loadNVRTC(); err == nil && filepath.IsAbs(n.lib.Path) {
			cands = append(cands, filepath.Join(filepath.Dir(n.lib.Path), "..", "include"))
		}
		cands = append(cands, dl.ToolkitDirs("include")...)
		cands = append(cands, dl.ToolkitDirs("targets/x86_64-linux/include")...)
		cands = append(cands, dl.WheelDirs("include")...)
		for _, c := range cands {
			if _, err := os.Stat(filepath.Join(c, "cuda_bf16.h")); err == nil {
				includeDir = filepath.Clean(c)
				return
			}
		}
	})
	return includeDir
}

// Compile compiles a CUDA C++ source with NVRTC for the device's
// architecture (sm_90a on H100/H200), loads it, and returns the module.
// Results are cached on disk (see EnvKernelCache) and in memory, so calling
// Compile again with the same source and options is cheap. A compile error
// is an *NVRTCError whose text holds the compiler log with file and line.
func (dev *Device) Compile(name string, src []byte, opts ...CompileOption) (*Module, error) {
	opts = append([]CompileOption{WithArch(dev.props.Arch)}, opts...)
	prog, err := CompileProgram(name, src, opts...)
	if err != nil {
		return nil, err
	}
	dev.modMu.Lock()
	defer dev.modMu.Unlock()
	if m, ok := dev.modules[prog.Key]; ok {
		return m, nil
	}
	m, err := dev.LoadModule(name, prog.Image)
	if err != nil {
		return nil, err
	}
	m.prog = prog
	dev.modules[prog.Key] = m
	return m, nil
}

// CompileProgram compiles a CUDA C++ source with NVRTC without loading it;
// it needs no GPU, only libnvrtc, and WithArch is required.
func CompileProgram(name string, src []byte, opts ...CompileOption) (*Program, error) {
	var c compileConfig
	for _, o := range opts {
		o(&c)
	}
	if c.arch == "" {
		return nil, errors.New("cuda: CompileProgram needs WithArch (e.g. \"sm_90a\")")
	}
	n, err := loadNVRTC()
	if err != nil {
		return nil, err
	}
	options := []string{"--gpu-architecture=" + c.arch, "-default-device", "--std=c++17", "-lineinfo"}
	if inc := CUDAIncludeDir(); inc != "" {
		options = append(options, "-I"+inc)
	}
	options = append(options, c.options...)
	ptx := strings.HasPrefix(c.arch, "compute_")

	key := cacheKey(name, src, c.headers, options, c.nameExprs, n)
	if !c.noCache {
		if p, ok := compiled.Load(key); ok {
			cp := *p.(*Program)
			cp.FromCache, cp.CompileTime = true, 0
			return &cp, nil
		}
	}
	prog := &Program{Name: name, Arch: c.arch, PTX: ptx, Options: options, Key: key}
	defer func() {
		if prog.Image != nil {
			compiled.Store(key, prog)
		}
	}()
	if !c.noCache {
		if cached, ok := readCache(key); ok {
			prog.Image, prog.Log, prog.LoweredNames, prog.FromCache = cached.image, cached.meta.Log, cached.meta.Lowered, true
			dump(prog)
			return prog, nil
		}
	}
	start := time.Now()
	if err := n.run(prog, src, c.headers, c.nameExprs); err != nil {
		return nil, err
	}
	prog.CompileTime = time.Since(start)
	if !c.noCache {
		writeCache(key, prog)
	}
	dump(prog)
	return prog, nil
}

// run compiles src into prog.
func (n *nvrtcLib) run(prog *Program, src []byte, headers []header, nameExprs []string) error {
	// NVRTC is handed C strings; the pointer arrays keep them alive.
	cstr := func(s []byte) unsafe.Pointer {
		b := make([]byte, len(s)+1)
		copy(b, s)
		return unsafe.Pointer(&b[0])
	}
	srcC := cstr(src)
	nameC := cstr([]byte(prog.Name))
	hdrs := make([]unsafe.Pointer, len(headers)+1)
	names := make([]unsafe.Pointer, len(headers)+1)
	for i, h := range headers {
		hdrs[i] = cstr(h.src)
		names[i] = cstr([]byte(h.name))
	}
	opts := make([]unsafe.Pointer, len(prog.Options)+1)
	for i, o := range prog.Options {
		opts[i] = cstr([]byte(o))
	}
	what := fmt.Sprintf("compile %s for %s", prog.Name, prog.Arch)
	var p uintptr
	r := n.create(&p, srcC, nameC, int32(len(headers)), unsafe.Pointer(&hdrs[0]), unsafe.Pointer(&names[0]))
	runtime.KeepAlive(srcC)
	runtime.KeepAlive(nameC)
	runtime.KeepAlive(hdrs)
	runtime.KeepAlive(names)
	if err := n.err("create program "+prog.Name, r, "", prog.Options); err != nil {
		return err
	}
	defer n.destroy(&p)
	for _, e := range nameExprs {
		if err := n.err("add name expression "+e, n.addName(p, e), "", prog.Options); err != nil {
			return err
		}
	}
	r = n.compile(p, int32(len(prog.Options)), unsafe.Pointer(&opts[0]))
	runtime.KeepAlive(opts)
	log := n.programLog(p)
	if err := n.err(what, r, log, prog.Options); err != nil {
		return err
	}
	prog.Log = strings.TrimSpace(log)
	if len(nameExprs) > 0 {
		prog.LoweredNames = map[string]string{}
		for _, e := range nameExprs {
			var low *byte
			if err := n.err("lowered name of "+e, n.lowered(p, e, &low), "", prog.Options); err != nil {
				return err
			}
			prog.LoweredNames[e] = goString(low)
		}
	}
	var size uint64
	if prog.PTX || n.cubinSize == nil {
		if !prog.PTX {
			return &NVRTCError{Op: what, Name: "NVRTC too old: no nvrtcGetCUBIN", Option: prog.Options}
		}
		if err := n.err("PTX size", n.ptxSize(p, &size), "", nil); err != nil {
			return err
		}
		prog.Image = make([]byte, size)
		return n.err("get PTX", n.ptx(p, unsafe.Pointer(&prog.Image[0])), "", nil)
	}
	if err := n.err("CUBIN size", n.cubinSize(p, &size), "", nil); err != nil {
		return err
	}
	if size == 0 {
		return &NVRTCError{Op: what, Name: "no CUBIN produced (is the target a real sm_XX architecture?)", Option: prog.Options}
	}
	prog.Image = make([]byte, size)
	return n.err("get CUBIN", n.cubin(p, unsafe.Pointer(&prog.Image[0])), "", nil)
}

func (n *nvrtcLib) programLog(p uintptr) string {
	var size uint64
	if n.logSize(p, &size) != 0 || size <= 1 {
		return ""
	}
	buf := make([]byte, size)
	if n.log(p, unsafe.Pointer(&buf[0])) != 0 {
		return ""
	}
	return cBytes(buf)
}

// cacheKey hashes everything that decides the compiled image.
func cacheKey(name string, src []byte, headers []header, options, nameExprs []string, n *nvrtcLib) string {
	h := sha256.New()
	w := func(s []byte) {
		var l [8]byte
		binary.LittleEndian.PutUint64(l[:], uint64(len(s)))
		h.Write(l[:])
		h.Write(s)
	}
	w([]byte("twell-kernel-v1"))
	w([]byte(fmt.Sprintf("nvrtc %d.%d", n.major, n.minor)))
	w([]byte(name))
	w(src)
	hs := append([]header(nil), headers...)
	sort.Slice(hs, func(i, j int) bool { return hs[i].name < hs[j].name })
	for _, hd := range hs {
		w([]byte(hd.name))
		w(hd.src)
	}
	for _, o := range options {
		w([]byte("opt " + o))
	}
	for _, e := range nameExprs {
		w([]byte("expr " + e))
	}
	return hex.EncodeToString(h.Sum(nil))
}

// cacheDir returns the disk cache folder, or "" when caching is off.
func cacheDir() string {
	v := os.Getenv(EnvKernelCache)
	if v == "off" || v == "0" {
		return ""
	}
	if v != "" {
		return v
	}
	base, err := os.UserCacheDir()
	if err != nil {
		return ""
	}
	return filepath.Join(base, "twell", "kernels")
}

type cacheMeta struct {
	Name    string            `json:"name"`
	Arch    string            `json:"arch"`
	Log     string            `json:"log,omitempty"`
	Lowered map[string]string `json:"lowered,omitempty"`
}

type cacheEntry struct {
	meta  cacheMeta
	image []byte
}

// Cache file layout: 8-byte little-endian length of the JSON metadata, the
// metadata, then the image.
func readCache(key string) (cacheEntry, bool) {
	dir := cacheDir()
	if dir == "" {
		return cacheEntry{}, false
	}
	data, err := os.ReadFile(filepath.Join(dir, key+".bin"))
	if err != nil || len(data) < 8 {
		return cacheEntry{}, false
	}
	n := binary.LittleEndian.Uint64(data)
	if n > uint64(len(data)-8) {
		return cacheEntry{}, false
	}
	var e cacheEntry
	if json.Unmarshal(data[8:8+n], &e.meta) != nil || int(8+n) == len(data) {
		return cacheEntry{}, false
	}
	e.image = data[8+n:]
	return e, true
}

// writeCache stores prog; failures only cost a later recompile.
func writeCache(key string, prog *Program) {
	dir := cacheDir()
	if dir == "" || os.MkdirAll(dir, 0o755) != nil {
		return
	}
	meta, err := json.Marshal(cacheMeta{Name: prog.Name, Arch: prog.Arch, Log: prog.Log, Lowered: prog.LoweredNames})
	if err != nil {
		return
	}
	buf := make([]byte, 8, 8+len(meta)+len(prog.Image))
	binary.LittleEndian.PutUint64(buf, uint64(len(meta)))
	buf = append(append(buf, meta...), prog.Image...)
	tmp, err := os.CreateTemp(dir, key+".tmp*")
	if err != nil {
		return
	}
	_, werr := tmp.Write(buf)
	cerr := tmp.Close()
	if werr != nil || cerr != nil || os.Rename(tmp.Name(), filepath.Join(dir, key+".bin")) != nil {
		os.Remove(tmp.Name())
	}
}

// dump writes the image to TWELL_CUBIN_DUMP if set.
func dump(prog *Program) {
	dir := os.Getenv(EnvCUBINDump)
	if dir == "" || os.MkdirAll(dir, 0o755) != nil {
		return
	}
	ext := ".cubin"
	if prog.PTX {
		ext = ".ptx"
	}
	base := strings.TrimSuffix(filepath.Base(prog.Name), filepath.Ext(prog.Name))
	_ = os.WriteFile(filepath.Join(dir, fmt.Sprintf("%s.%s.%s%s", base, prog.Arch, prog.Key[:12], ext)), prog.Image, 0o644)
}
