package gpu

import (
	"fmt"
	"testing"

	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/internal/testutil"
	"github.com/twell-ai/twell/twell"
)

// TestLengthOrder checks TailSorted's counting sort on its own: random list
// lengths (mostly short, some over the last bin, zeros for flagged rows),
// counted into the bins as t2u counts them, must come back as a
// permutation of the tokens in non-increasing order of the clamped length,
// with len_scatter launched with and without early start.
func TestLengthOrder(t *testing.T) {
	dev, blas := setup(t)
	r, seed := testutil.Rand(t)
	d, f := 256, 512
	l, err := NewMLP(dev, blas, nil, make([]float32, f*d), make([]float32, d*f), d, f, twell.DefaultLayout)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for _, m := range []int{1, 37, 1000 + r.IntN(5000), 70000 + r.IntN(70000)} {
		ws, err := l.sparseWorkspace(m)
		if err != nil {
			t.Fatal(err)
		}
		set, err := l.k.t2dFor(d)
		if err != nil {
			t.Fatal(err)
		}
		cnt := make([]int32, m)
		for i := range cnt {
			switch v := r.IntN(100); {
			case v < 5:
				cnt[i] = 0
			case v < 8:
				cnt[i] = int32(lenBins + r.IntN(3000))
			default:
				cnt[i] = int32(r.IntN(60))
			}
		}
		cb, err := ws.cnt.Slice(0, 4*m)
		if err != nil {
			t.Fatal(err)
		}
		if err := dev.CopyHtoD(cb, cuda.Bytes(cnt)); err != nil {
			t.Fatal(err)
		}
		hist := make([]int32, lenBins)
		for _, n := range cnt {
			hist[lenBins-1-min(n, lenBins-1)]++
		}
		for _, early := range []bool{false, EarlyStart(dev, false)} {
			// t2u counts the lengths into the bins; runD2T zeroes the fill
			// counts.
			if err := dev.CopyHtoD(ws.lenBins, cuda.Bytes(hist)); err != nil {
				t.Fatal(err)
			}
			if err := dev.Memset32(ws.lenCur, 0, nil); err != nil {
				t.Fatal(err)
			}
			if err := l.lengthOrder(nil, set, tailArgs{cnt: ws.cnt, order: ws.order, lenBins: ws.lenBins, lenCur: ws.lenCur, m: m, early: early}); err != nil {
				t.Fatalf("seed %d: m=%d: %v", seed, m, err)
			}
			checkOrder(t, seed, dev, ws.order, cnt, fmt.Sprintf("m=%d, early start %v", m, early))
		}
	}
}

// checkOrder fails the test unless the first len(cnt) entries of ob are a
// permutation of the tokens in non-increasing order of their clamped list
// lengths cnt.
func checkOrder(t *testing.T, seed uint64, dev *cuda.Device, ob *cuda.Buffer, cnt []int32, what string) {
	t.Helper()
	m := len(cnt)
	order := make([]int32, m)
	ob, err := ob.Slice(0, 4*m)
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.CopyDtoH(cuda.Bytes(order), ob); err != nil {
		t.Fatalf("seed %d: %s: %v", seed, what, err)
	}
	seen := make([]bool, m)
	clamp := func(n int32) int32 { return min(n, lenBins-1) }
	for i, tok := range order {
		if tok < 0 || int(tok) >= m || seen[tok] {
			t.Fatalf("seed %d: %s: position %d holds token %d (out of range or repeated)", seed, what, i, tok)
		}
		seen[tok] = true
		if i > 0 && clamp(cnt[tok]) > clamp(cnt[order[i-1]]) {
			t.Fatalf("seed %d: %s: position %d: length %d after %d", seed, what, i, cnt[tok], cnt[order[i-1]])
		}
	}
}
