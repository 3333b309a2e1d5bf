//go:build linux

package llm

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/twell-ai/twell/engine"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/model"
)

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
	bos := 1
	c := model.Config{ModelType: "llama", Architectures: []string{"LlamaForCausalLM"},
		HiddenSize: 64, IntermediateSize: 256, NumHiddenLayers: 2, NumAttentionHeads: 4, NumKeyValueHeads: 2, HeadDim: 16,
		VocabSize: 97, MaxPositionEmbeddings: 8192, RMSNormEps: 1e-5, RopeTheta: 10000,
		HiddenAct: model.ActReLU, TieWordEmbeddings: true, MLPGated: true, BOSTokenID: &bos, EOSTokenIDs: []int{2}}
	m, err := model.New(c, model.RandomWeights(c, r))
	if err != nil {
		t.Fatal(err)
	}
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
	addr := uintptr(unsafe.Pointer(&kc.mem.mem[0]))
	check := func(what string, pages int) {
		t.Helper()
		got, ok := residentKiB(t, addr)
		if !ok {
			t.Fatalf("%s: no mapping at %#x", what, addr)
		}
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
	if _, ok := residentKiB(t, addr); ok {
		t.Fatal("the mapping is still there after Free")
	}
}
