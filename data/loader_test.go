package data

import (
	"encoding/json"
	"errors"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// countingEncoder makes each document one token per word, numbered in stream order, so that a
// window's first token tells where it starts.
type seqEncoder struct{ vocab int }

func (e seqEncoder) Encode(s string) ([]int, error) {
	var t []int
	for _, f := range strings.Fields(s) {
		var v int
		for _, c := range f {
			v = v*10 + int(c-'0')
		}
		t = append(t, v)
	}
	return t, nil
}
func (e seqEncoder) VocabSize() int { return e.vocab }
func (e seqEncoder) EOS() int       { return e.vocab - 1 }

// seqDataset builds an in-memory dataset whose training stream is 0, 1, 2, ..., n-1 (documents
// of random length; the EOS after each is replaced by the next number by construction).
func seqDataset(t *testing.T, r *rand.Rand, n int, shardTokens int) *Dataset {
	t.Helper()
	var docs []string
	for i := 0; i < n; {
		k := min(1+r.IntN(50), n-i) // k tokens: k-1 numbers and the EOS
		var sb strings.Builder
		for j := range k - 1 {
			if j > 0 {
				sb.WriteByte(' ')
			}
			sb.WriteString(itoa(i + j))
		}
		if k == 1 {
			sb.WriteString(itoa(i)) // a one-number document: the EOS position is i+1
			k = min(2, n-i)
		}
		docs = append(docs, sb.String())
		i += k
	}
	d, err := BuildMemory(BuildConfig{Sources: []Source{{Name: "s", Docs: docs}}, Encoder: seqEncoder{vocab: 1 << 20}, ShardTokens: shardTokens})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func itoa(i int) string {
	if i == 0 {
		return "0"
	}
	var b []byte
	for ; i > 0; i /= 10 {
		b = append([]byte{byte('0' + i%10)}, b...)
	}
	return string(b)
}

func TestLoaderDeterministicCoverageResume(t *testing.T) {
	r, seed := testutil.Rand(t)
	for trial := range 6 {
		d := seqDataset(t, r, 200+r.IntN(3000), 50+r.IntN(400))
		n := d.TrainTokens()
		all := make([]int32, n)
		d.TrainTokensAt(all, 0)
		cfg := LoaderConfig{Batch: 1 + r.IntN(7), SeqLen: 1 + r.IntN(60), Seed: r.Uint64()}
		if trial == 0 {
			cfg.SeqLen = int(n) - 1 // a single window
		}
		l, err := d.NewLoader(cfg)
		if err != nil {
			t.Fatalf("seed %d trial %d: %v", seed, trial, err)
		}
		w := l.WindowsPerEpoch()
		// Every window of an epoch is visited once; windows are whole runs of the stream.
		var starts []int64
		var buf []int32
		steps := int(3*w)/cfg.Batch + 2
		var saved LoaderState
		var afterSave [][]int32
		for s := range steps {
			if s == steps/2 {
				saved = l.State()
			}
			buf, err = l.Next(buf)
			if err != nil {
				t.Fatal(err)
			}
			if s >= steps/2 {
				afterSave = append(afterSave, slices.Clone(buf))
			}
			for j := range cfg.Batch {
				row := buf[j*(cfg.SeqLen+1) : (j+1)*(cfg.SeqLen+1)]
				off := findRow(all, row)
				if off < 0 {
					t.Fatalf("seed %d trial %d: row %v is not a run of the stream", seed, trial, row[:min(len(row), 8)])
				}
				starts = append(starts, off)
			}
		}
		for e := range uint64(3) {
			ep := starts[e*w : (e+1)*w]
			k := map[int64]bool{}
			shift := ep[0] % int64(cfg.SeqLen)
			for _, o := range ep {
				if k[o] || o%int64(cfg.SeqLen) != shift {
					t.Fatalf("seed %d trial %d epoch %d: window start %d repeated or misaligned (shift %d)", seed, trial, e, o, shift)
				}
				k[o] = true
			}
		}
		// Window(i) is row i of the concatenated batches.
		l5, _ := d.NewLoader(cfg)
		win := make([]int, cfg.SeqLen+1)
		for k := range 3 {
			b5, _ := l5.Next(nil)
			for j := range cfg.Batch {
				if err := l5.Window(win, int64(k*cfg.Batch+j)); err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(intsOf32(b5[j*(cfg.SeqLen+1):(j+1)*(cfg.SeqLen+1)]), win) {
					t.Fatalf("seed %d trial %d: Window(%d) is not row %d of batch %d", seed, trial, k*cfg.Batch+j, j, k)
				}
			}
		}
		if err := l5.Window(make([]int, cfg.SeqLen), 0); err == nil {
			t.Errorf("seed %d: Window with a short buffer did not fail", seed)
		}
		// A fresh loader restored from the JSON state repeats the second half exactly.
		js, _ := json.Marshal(saved)
		var st LoaderState
		json.Unmarshal(js, &st)
		l2, _ := d.NewLoader(LoaderConfig{Batch: cfg.Batch, SeqLen: cfg.SeqLen, Seed: 12345})
		if err := l2.Restore(st); err != nil {
			t.Fatal(err)
		}
		for i, want := range afterSave {
			got, _ := l2.Next(nil)
			if !slices.Equal(got, want) {
				t.Fatalf("seed %d trial %d: batch %d after restore differs", seed, trial, i)
			}
		}
		// Data-parallel ranks split a global batch.
		b := cfg.Batch
		whole, _ := d.NewLoader(LoaderConfig{Batch: 2 * b, SeqLen: cfg.SeqLen, Seed: cfg.Seed})
		r0, _ := d.NewLoader(LoaderConfig{Batch: b, SeqLen: cfg.SeqLen, Seed: cfg.Seed, Rank: 0, World: 2})
		r1, _ := d.NewLoader(LoaderConfig{Batch: b, SeqLen: cfg.SeqLen, Seed: cfg.Seed, Rank: 1, World: 2})
		for range 3 {
			g, _ := whole.Next(nil)
			a, _ := r0.Next(nil)
			c, _ := r1.Next(nil)
			if !slices.Equal(g, append(a, c...)) {
				t.Fatalf("seed %d trial %d: ranks 0 and 1 do not make up the global batch", seed, trial)
			}
		}
		if r0.State() != whole.State() {
			t.Errorf("seed %d: rank state %+v, global %+v", seed, r0.State(), whole.State())
		}
		// Another seed, another order.
		l3, _ := d.NewLoader(LoaderConfig{Batch: cfg.Batch, SeqLen: cfg.SeqLen, Seed: cfg.Seed + 1})
		l4, _ := d.NewLoader(cfg)
		same := true
		for range 4 {
			x, _ := l3.Next(nil)
			y, _ := l4.Next(nil)
			same = same && slices.Equal(x, y)
		}
		if same && w > 8 {
			t.Errorf("seed %d trial %d: seeds %d and %d give the same batches", seed, trial, cfg.Seed, cfg.Seed+1)
		}
		// Restoring a state of another shape fails.
		bad := saved
		bad.SeqLen++
		if err := l2.Restore(bad); err == nil {
			t.Errorf("seed %d: restored a state with another sequence length", seed)
		}
		bad = saved
		bad.TrainTokens++
		if err := l2.Restore(bad); err == nil {
			t.Errorf("seed %d: restored a state of another dataset", seed)
		}
		d.Close()
		if _, err := l2.Next(nil); err == nil {
			t.Errorf("seed %d: Next after Close did not fail", seed)
		}
	}
}

func intsOf32(s []int32) []int {
	out := make([]int, len(s))
	for i, v := range s {
		out[i] = int(v)
	}
	return out
}

// findRow returns where row occurs in the stream all (whose tokens are distinct except EOS),
// or -1.
func findRow(all, row []int32) int64 {
	for off := range len(all) - len(row) + 1 {
		if slices.Equal(all[off:off+len(row)], row) {
			return int64(off)
		}
	}
	return -1
}

func TestFeistelIsPermutation(t *testing.T) {
	r, seed := testutil.Rand(t)
	for range 200 {
		n := 1 + r.Uint64N(3000)
		f := newFeistel(n, r.Uint64(), r.Uint64N(5))
		seen := make([]bool, n)
		for k := range n {
			v := f.at(k)
			if v >= n || seen[v] {
				t.Fatalf("seed %d: n %d: at(%d) = %d repeats or is out of range", seed, n, k, v)
			}
			seen[v] = true
		}
	}
}

func TestLoaderErrors(t *testing.T) {
	d, err := BuildMemory(BuildConfig{Sources: []Source{{Name: "s", Docs: []string{"1 2 3"}}}, Encoder: seqEncoder{vocab: 100}})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		cfg  LoaderConfig
		want string
	}{
		{LoaderConfig{Batch: 0, SeqLen: 2}, "batch 0"},
		{LoaderConfig{Batch: 1, SeqLen: 0}, "sequence length 0"},
		{LoaderConfig{Batch: 1, SeqLen: 2, Rank: 2, World: 2}, "rank 2 of world 2"},
		{LoaderConfig{Batch: 1, SeqLen: 4}, "has 4 tokens, fewer than one sequence of 4+1"},
	} {
		if _, err := d.NewLoader(c.cfg); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: want %q, got %v", c.cfg, c.want, err)
		}
	}
	if _, err := d.Val("s", 1, 2); err == nil || !strings.Contains(err.Error(), "no validation split") {
		t.Errorf("val of a source without one: %v", err)
	}
}

func TestValIter(t *testing.T) {
	r, seed := testutil.Rand(t)
	var docs []string
	for i := range 40 {
		docs = append(docs, strings.Repeat(itoa(i)+" ", 1+r.IntN(30)))
	}
	d, err := BuildMemory(BuildConfig{Sources: []Source{{Name: "s", Docs: docs}}, Encoder: seqEncoder{vocab: 100}, ValFrac: 0.5, ShardTokens: 7})
	if err != nil {
		t.Fatal(err)
	}
	n := d.ValTokens("s")
	all := make([]int32, n)
	it, _ := d.Val("s", 1, int(n)-1)
	all, _, _ = it.Next(all)
	seqLen := 1 + r.IntN(20)
	batch := 1 + r.IntN(5)
	it, err = d.Val("s", batch, seqLen)
	if err != nil {
		t.Fatal(err)
	}
	if it.Windows() != (n-1)/int64(seqLen) {
		t.Fatalf("seed %d: %d windows for %d tokens, T=%d", seed, it.Windows(), n, seqLen)
	}
	var got int64
	var buf []int32
	for {
		var rows int
		buf, rows, err = it.Next(buf)
		if errors.Is(err, io.EOF) {
			break
		}
		for j := range rows {
			off := got * int64(seqLen)
			if !slices.Equal(buf[j*(seqLen+1):(j+1)*(seqLen+1)], all[off:off+int64(seqLen)+1]) {
				t.Fatalf("seed %d: window %d differs", seed, got)
			}
			got++
		}
	}
	if got != it.Windows() {
		t.Errorf("seed %d: %d windows yielded, want %d", seed, got, it.Windows())
	}
	win := make([]int, seqLen+1)
	for i := range it.Windows() {
		if err := it.Window(win, i); err != nil || !slices.Equal(win, intsOf32(all[i*int64(seqLen):i*int64(seqLen)+int64(seqLen)+1])) {
			t.Fatalf("seed %d: Window(%d) = %v, %v", seed, i, win, err)
		}
	}
	if err := it.Window(win, it.Windows()); err == nil {
		t.Errorf("seed %d: Window past the end did not fail", seed)
	}
	it.Reset()
	if _, rows, err := it.Next(nil); err != nil || rows != int(min(int64(batch), it.Windows())) {
		t.Errorf("seed %d: after Reset: %d rows, %v", seed, rows, err)
	}
}

func BenchmarkLoaderNext(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	var docs []string
	for i := range 2000 {
		docs = append(docs, strings.Repeat(itoa(i%1000)+" ", 200+r.IntN(500)))
	}
	d, err := BuildMemory(BuildConfig{Sources: []Source{{Name: "s", Docs: docs}}, Encoder: seqEncoder{vocab: 8192}})
	if err != nil {
		b.Fatal(err)
	}
	l, err := d.NewLoader(LoaderConfig{Batch: 64, SeqLen: 1024, Seed: 1})
	if err != nil {
		b.Fatal(err)
	}
	var buf []int32
	b.SetBytes(int64(4 * l.BatchLen()))
	for b.Loop() {
		buf, _ = l.Next(buf)
	}
}
