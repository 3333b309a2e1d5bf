// Package dl finds and opens the CUDA shared libraries (driver, NVRTC,
// cuBLAS, cuBLASLt, NVML, CUPTI) with purego, without cgo and without CUDA headers,
// and binds their symbols to Go function variables.
//
// A library is searched for, in order: in the folders of TWELL_CUDA_LIB_DIR
// (a colon-separated list), by its plain soname through the system loader
// (ldconfig, LD_LIBRARY_PATH), in the CUDA toolkit's lib64 folders
// (CUDA_HOME, CUDA_PATH, /usr/local/cuda*), and in the lib folders of the
// NVIDIA Python wheels (site-packages/nvidia/*/lib).
package dl

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"sort"
	"strings"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// EnvLibDir names the environment variable whose folders (colon-separated)
// are searched first for every CUDA library.
const EnvLibDir = "TWELL_CUDA_LIB_DIR"

// Library is an opened shared library.
type Library struct {
	Name   string  // what was asked for, e.g. "libnvrtc"
	Path   string  // what dlopen accepted: a full path or a soname
	handle uintptr // dlopen handle
}

// Spec says which library to open and where it may live.
type Spec struct {
	// Name is a short name for messages, e.g. "libcublasLt".
	Name string
	// Sonames are the file names to try, most wanted first,
	// e.g. "libcublasLt.so.13", "libcublasLt.so.12".
	Sonames []string
	// Toolkit: look in the CUDA toolkit's lib64 folders.
	Toolkit bool
	// Wheels: look in the lib folders of NVIDIA Python wheels.
	Wheels bool
	// ExtraDirs are searched after the system loader (e.g. the driver's
	// /usr/local/nvidia/lib64 mount).
	ExtraDirs []string
	// Preload names sibling libraries (glob patterns, e.g.
	// "libnvrtc-builtins.so.*") to open from the same folder first, with
	// RTLD_GLOBAL, so that the library's own dependencies resolve there.
	Preload []string
}

// NotFoundError says that no candidate of a library could be opened.
type NotFoundError struct {
	Name  string   // e.g. "libcuda"
	Tried []string // every path or soname tried, with dlopen's message
}

// Error lists what was tried.
func (e *NotFoundError) Error() string {
	return fmt.Sprintf("%s not found (set %s to its folder); tried: %s",
		e.Name, EnvLibDir, strings.Join(e.Tried, "; "))
}

// Open finds and opens the library that spec describes.
func Open(spec Spec) (*Library, error) {
	var tried []string
	try := func(path string) (*Library, bool) {
		// dlerror is per thread: keep Dlopen and its error on one.
		runtime.LockOSThread()
		h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
		runtime.UnlockOSThread()
		if err != nil {
			tried = append(tried, fmt.Sprintf("%s (%v)", path, shortErr(err)))
			return nil, false
		}
		return &Library{Name: spec.Name, Path: path, handle: h}, true
	}
	tryDir := func(dir string) (*Library, bool) {
		for _, so := range spec.Sonames {
			p := filepath.Join(dir, so)
			if _, err := os.Stat(p); err != nil {
				continue
			}
			preload(dir, spec.Preload)
			if l, ok := try(p); ok {
				return l, true
			}
		}
		return nil, false
	}
	for _, dir := range envDirs() {
		if l, ok := tryDir(dir); ok {
			return l, nil
		}
	}
	for _, so := range spec.Sonames {
		if l, ok := try(so); ok {
			return l, nil
		}
	}
	var dirs []string
	dirs = append(dirs, spec.ExtraDirs...)
	if spec.Toolkit {
		dirs = append(dirs, ToolkitDirs("lib64")...)
		dirs = append(dirs, ToolkitDirs("targets/x86_64-linux/lib")...)
	}
	if spec.Wheels {
		dirs = append(dirs, WheelDirs("lib")...)
	}
	for _, dir := range dirs {
		if l, ok := tryDir(dir); ok {
			return l, nil
		}
	}
	if len(tried) == 0 {
		tried = append(tried, "no candidate file in "+strings.Join(dirs, ", "))
	}
	return nil, &NotFoundError{Name: spec.Name, Tried: tried}
}

// shortErr keeps dlerror's message to its first line.
func shortErr(err error) string {
	s := err.Error()
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	return s
}

func preload(dir string, patterns []string) {
	for _, pat := range patterns {
		matches, _ := filepath.Glob(filepath.Join(dir, pat))
		sort.Sort(sort.Reverse(sort.StringSlice(matches)))
		for _, m := range matches {
			if _, err := purego.Dlopen(m, purego.RTLD_NOW|purego.RTLD_GLOBAL); err == nil {
				break
			}
		}
	}
}

func envDirs() []string {
	var out []string
	for _, d := range filepath.SplitList(os.Getenv(EnvLibDir)) {
		if d != "" {
			out = append(out, d)
		}
	}
	return out
}

// ToolkitRoots returns the CUDA toolkit folders that exist, most likely
// first: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, then /usr/local/cuda-*
// newest version first.
func ToolkitRoots() []string {
	var roots []string
	for _, env := range []string{"CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"} {
		if v := os.Getenv(env); v != "" {
			roots = append(roots, v)
		}
	}
	roots = append(roots, "/usr/local/cuda")
	versioned, _ := filepath.Glob("/usr/local/cuda-*")
	sort.Sort(sort.Reverse(sort.StringSlice(versioned)))
	roots = append(roots, versioned...)
	return existing(roots)
}

// ToolkitDirs returns sub (e.g. "lib64" or "include") under each toolkit root,
// where it exists.
func ToolkitDirs(sub string) []string {
	var out []string
	for _, r := range ToolkitRoots() {
		out = append(out, filepath.Join(r, sub))
	}
	return existing(out)
}

var (
	sitePackagesOnce sync.Once
	sitePackages     []string
)

// SitePackages returns the Python site-packages folders that hold an
// "nvidia" package folder.
func SitePackages() []string {
	sitePackagesOnce.Do(func() {
		var pats []string
		if v := os.Getenv("VIRTUAL_ENV"); v != "" {
			pats = append(pats, filepath.Join(v, "lib/python3*/site-packages"))
		}
		if v := os.Getenv("CONDA_PREFIX"); v != "" {
			pats = append(pats, filepath.Join(v, "lib/python3*/site-packages"))
		}
		if home, err := os.UserHomeDir(); err == nil {
			pats = append(pats, filepath.Join(home, ".local/lib/python3*/site-packages"))
		}
		pats = append(pats,
			"/opt/*/.venv/lib/python3*/site-packages",
			"/opt/*/lib/python3*/site-packages",
			"/opt/venv/lib/python3*/site-packages",
			"/usr/local/lib/python3*/dist-packages",
			"/usr/local/lib/python3*/site-packages",
			"/usr/lib/python3/dist-packages",
			"/usr/lib/python3*/site-packages",
		)
		seen := map[string]bool{}
		for _, p := range pats {
			matches, _ := filepath.Glob(p)
			sort.Sort(sort.Reverse(sort.StringSlice(matches)))
			for _, m := range matches {
				if seen[m] {
					continue
				}
				seen[m] = true
				if fi, err := os.Stat(filepath.Join(m, "nvidia")); err == nil && fi.IsDir() {
					sitePackages = append(sitePackages, m)
				}
			}
		}
	})
	return sitePackages
}

// WheelDirs returns sub (e.g. "lib" or "include") in every NVIDIA wheel
// folder (site-packages/nvidia/*/sub), the CUDA 13 "cu13" layout first.
func WheelDirs(sub string) []string {
	var out []string
	for _, sp := range SitePackages() {
		out = append(out, filepath.Join(sp, "nvidia", "cu13", sub))
		matches, _ := filepath.Glob(filepath.Join(sp, "nvidia", "*", sub))
		sort.Strings(matches)
		out = append(out, matches...)
	}
	return existing(dedup(out))
}

func existing(paths []string) []string {
	var out []string
	for _, p := range paths {
		if fi, err := os.Stat(p); err == nil && fi.IsDir() {
			out = append(out, p)
		}
	}
	return dedup(out)
}

func dedup(in []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, s := range in {
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	return out
}

// Symbol is one entry of a binding table: a C symbol and where to put it.
type Symbol struct {
	// Names are tried in order (e.g. "cuMemAlloc_v2").
	Names []string
	// Target is a pointer to a func variable (bound with purego.RegisterFunc)
	// or a *uintptr (filled with the raw address, for purego.SyscallN).
	Target any
	// Optional symbols may be missing; the target is then left zero/nil.
	Optional bool
}

// Sym returns a Symbol for target named by names.
func Sym(target any, names ...string) Symbol { return Symbol{Names: names, Target: target} }

// OptSym is Sym for a symbol that older libraries may lack.
func OptSym(target any, names ...string) Symbol {
	return Symbol{Names: names, Target: target, Optional: true}
}

// ErrMissingSymbol is wrapped by Bind when a required symbol is missing.
var ErrMissingSymbol = errors.New("missing symbol")

// Lookup resolves a symbol address; tests substitute it.
type Lookup func(name string) (uintptr, error)

// Lookup returns the library's symbol resolver.
func (l *Library) Lookup(name string) (uintptr, error) { return purego.Dlsym(l.handle, name) }

// Load opens the library that spec describes and binds table in it.
func Load(spec Spec, table []Symbol) (*Library, error) {
	lib, err := Open(spec)
	if err != nil {
		return nil, err
	}
	if err := Bind(lib.Path, lib.Lookup, table); err != nil {
		return nil, err
	}
	return lib, nil
}

// Bind resolves every symbol in table through lookup and stores it in its
// target. It returns an error (never panics) for a missing required symbol
// or a target of the wrong type; lib names the library in messages.
func Bind(lib string, lookup Lookup, table []Symbol) (err error) {
	for _, s := range table {
		var addr uintptr
		var lastErr error
		for _, n := range s.Names {
			a, e := lookup(n)
			if e == nil && a != 0 {
				addr = a
				break
			}
			lastErr = e
		}
		if addr == 0 {
			if s.Optional {
				continue
			}
			return fmt.Errorf("%s: %w %s (%v)", lib, ErrMissingSymbol, strings.Join(s.Names, " or "), lastErr)
		}
		if err := set(s.Target, addr); err != nil {
			return fmt.Errorf("%s: symbol %s: %w", lib, s.Names[0], err)
		}
	}
	return nil
}

func set(target any, addr uintptr) (err error) {
	if p, ok := target.(*uintptr); ok {
		*p = addr
		return nil
	}
	v := reflect.ValueOf(target)
	if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Func {
		return fmt.Errorf("target %T is neither *uintptr nor a pointer to a func", target)
	}
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("purego cannot bind %T: %v", target, r)
		}
	}()
	purego.RegisterFunc(target, addr)
	return nil
}

// GoString copies the NUL-terminated C string at p ("" for nil).
func GoString(p *byte) string {
	if p == nil {
		return ""
	}
	n := 0
	for *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 {
		n++
	}
	return string(unsafe.Slice(p, n))
}
