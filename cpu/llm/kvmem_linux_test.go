//go:build linux

package llm

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/model"
)

// residentBytes returns how much of the n bytes at addr is resident, from
// /proc/self/pagemap (bit 63 of a page's entry: present).
func residentBytes(t *testing.T, addr uintptr, n int) int {
	t.Helper()
	f, err := os.Open("/proc/self/pagemap")
	if err != nil {
		t.Skipf("no /proc/self/pagemap: %v", err)
	}
	defer f.Close()
	ps := uintptr(os.Getpagesize())
	first, last := addr/ps, (addr+uintptr(n)-1)/ps
	buf := make([]byte, 8*(last-first+1))
	if _, err := f.ReadAt(buf, int64(first*8)); err != nil {
		t.Fatalf("pagemap: %v", err)
	}
	present := 0
	for i := 0; i < len(buf); i += 8 {
		if buf[i+7]&0x80 != 0 {
			present++
		}
	}
	return present * int(ps)
}

// mapped reports whether a mapping holds addr, from /proc/self/smaps.
func mapped(t *testing.T, addr uintptr) bool {
	_, ok := residentKiB(t, addr)
	return ok
}

// residentKiB returns the resident memory of the mapping that holds addr,
// from /proc/self/smaps, and whether there is such a mapping.
func residentKiB(t *testing.T, addr uintptr) (int, bool) {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Skipf("no /proc/self/smaps: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	in := false
	for sc.Scan() {
		line := sc.Text()
		if fields := strings.Fields(line); len(fields) > 0 && !strings.HasSuffix(fields[0], ":") {
			if lo, hi, ok := strings.Cut(fields[0], "-"); ok {
				a, err1 := strconv.ParseUint(lo, 16, 64)
				b, err2 := strconv.ParseUint(hi, 16, 64)
				in = err1 == nil && err2 == nil && uint64(addr) >= a && uint64(addr) < b
			}
			continue
		}
		if v, ok := strings.CutPrefix(line, "Rss:"); ok && in {
			n, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			if err != nil {
				t.Fatalf("smaps line %q: %v", line, err)
			}
			return n, true
		}
	}
	return 0, false
}

// TestMemoryFollowsTokens: the memory a cache holds (resident pages of its
// mapping) grows with the positions written and shrinks on Truncate, and
// the mapping goes on Free; a large capacity costs address space only.
func TestMemoryFollowsTokens(t *testing.T) {
	r, seed := testutil.Rand(t)
	m := pagedTestModel(t, r, 8192)
	c := m.Config
	e, err := New(m, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ps := e.KVPages()
	pageKiB := int(ps.PageBytes / 1024) // every region's share is whole OS pages
	if int64(pageKiB)*1024 != ps.PageBytes || ps.PageBytes%int64(2*c.NumHiddenLayers*os.Getpagesize()) != 0 {
		t.Fatalf("default page of %d positions is %d bytes: not whole OS pages per layer", ps.PageSize, ps.PageBytes)
	}
	ec, err := e.NewCache(8000)
	if err != nil {
		t.Fatal(err)
	}
	kc := ec.(*cache)
	addr, size := uintptr(unsafe.Pointer(&kc.mem.mem[0])), len(kc.mem.mem)
	check := func(what string, pages int) {
		t.Helper()
		got := residentBytes(t, addr, size) / 1024
		if got > pages*pageKiB || pages > 0 && got == 0 {
			t.Fatalf("seed %d: %s: %d KiB resident; the cache holds %d pages of %d KiB", seed, what, got, pages, pageKiB)
		}
		if e.KVPages().InUse != pages {
			t.Fatalf("%s: %d pages in use; want %d", what, e.KVPages().InUse, pages)
		}
	}
	check("new", 0)
	forward := func(n int) {
		ids := make([]int, n)
		for i := range ids {
			ids[i] = r.IntN(c.VocabSize)
		}
		if _, _, err := e.Forward([]engine.Cache{kc}, [][]int{ids}, false); err != nil {
			t.Fatal(err)
		}
	}
	n := 1 + r.IntN(300)
	forward(n)
	check(fmt.Sprintf("%d positions", n), ps.PagesFor(n))
	keep := r.IntN(n)
	if err := kc.Truncate(keep); err != nil {
		t.Fatal(err)
	}
	check(fmt.Sprintf("truncated to %d", keep), ps.PagesFor(keep))
	forward(5)
	check(fmt.Sprintf("%d positions", keep+5), ps.PagesFor(keep+5))
	if err := kc.Free(); err != nil {
		t.Fatal(err)
	}
	if mapped(t, addr) {
		t.Fatal("the mapping is still there after Free")
	}
}

// TestFreedMemoryKeptForReuse: with a budget, a freed cache's memory stays
// with the engine (idle pages) and the next cache writes into it without
// taking more; Close gives it back.
func TestFreedMemoryKeptForReuse(t *testing.T) {
	r, seed := testutil.Rand(t)
	m := pagedTestModel(t, r, 1024)
	c := m.Config
	e, err := New(m, Options{KVMemory: 64 * PageBytes(c, DefaultPageSize(c))})
	if err != nil {
		t.Fatal(err)
	}
	ps := e.KVPages()
	forward := func(kc engine.Cache, n int) {
		ids := make([]int, n)
		for i := range ids {
			ids[i] = r.IntN(c.VocabSize)
		}
		if _, _, err := e.Forward([]engine.Cache{kc}, [][]int{ids}, false); err != nil {
			t.Fatal(err)
		}
	}
	first, _ := e.NewCache(1 + r.IntN(1000))
	n1 := 1 + r.IntN(first.Capacity())
	forward(first, n1)
	addr, size := uintptr(unsafe.Pointer(&first.(*cache).mem.mem[0])), len(first.(*cache).mem.mem)
	rss1 := residentBytes(t, addr, size)
	if err := first.Free(); err != nil {
		t.Fatal(err)
	}
	if got := e.KVPages(); got.InUse != 0 || got.Idle != ps.PagesFor(n1) {
		t.Fatalf("seed %d: after Free of %d positions: %d pages in use, %d idle; want 0 and %d", seed, n1, got.InUse, got.Idle, ps.PagesFor(n1))
	}
	second, _ := e.NewCache(1 + r.IntN(1000))
	if a := uintptr(unsafe.Pointer(&second.(*cache).mem.mem[0])); a != addr {
		t.Fatalf("the next cache is at %#x, not in the freed one's memory at %#x", a, addr)
	}
	n2 := 1 + r.IntN(min(n1, second.Capacity()))
	forward(second, n2)
	if rss2 := residentBytes(t, addr, size); rss2 > rss1 || rss1 == 0 {
		t.Fatalf("seed %d: %d bytes resident after writing %d positions into memory that held %d (%d bytes)", seed, rss2, n2, n1, rss1)
	}
	if got := e.KVPages(); got.InUse != ps.PagesFor(n2) || got.Idle != ps.PagesFor(n1)-ps.PagesFor(n2) {
		t.Fatalf("seed %d: %d pages in use, %d idle; want %d and %d", seed, got.InUse, got.Idle, ps.PagesFor(n2), ps.PagesFor(n1)-ps.PagesFor(n2))
	}
	third, _ := e.NewCache(8) // a mapping of its own: the stash is empty
	forward(third, 1)
	second.Free()
	if !mapped(t, addr) || residentBytes(t, addr, size) != rss1 {
		t.Fatal("the freed memory was not kept")
	}
	e.Close()
	if mapped(t, addr) {
		t.Fatal("the kept memory is still mapped after Close")
	}
	third.Free() // after Close: given back, not kept
	if got := e.KVPages(); got.InUse != 0 || got.Idle != 0 {
		t.Fatalf("after Close and Free: %d pages in use, %d idle", got.InUse, got.Idle)
	}
}

// pagedTestModel is a small random ReLU model of maxPos positions for the
// KV memory tests.
func pagedTestModel(t *testing.T, r *rand.Rand, maxPos int) *model.Model {
	t.Helper()
	bos := 1
	c := model.Config{ModelType: "llama", Architectures: []string{"LlamaForCausalLM"},
		HiddenSize: 64, IntermediateSize: 256, NumHiddenLayers: 2, NumAttentionHeads: 4, NumKeyValueHeads: 2, HeadDim: 16,
		VocabSize: 97, MaxPositionEmbeddings: maxPos, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: model.ActReLU, TieWordEmbeddings: true, MLPGated: true, BOSTokenID: &bos, EOSTokenIDs: []int{2}}
	m, err := model.New(c, model.RandomWeights(c, r))
	if err != nil {
		t.Fatal(err)
	}
	return m
}
