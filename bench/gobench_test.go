package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/twell-ai/twell/internal/testutil"
)

// TestReadGoBench writes go test -bench output of random benchmarks and
// runs and checks that every metric's median comes back, in the order the
// benchmarks first appear, and that the figure draws.
func TestReadGoBench(t *testing.T) {
	r, seed := testutil.Rand(t)
	var sb strings.Builder
	sb.WriteString("goos: linux\ngoarch: amd64\npkg: example.com/p\ncpu: Some CPU\n")
	names := []string{"BenchmarkA/x=1", "BenchmarkA/x=2", "BenchmarkB"}
	want := map[string][]float64{}
	for run := 0; run < 1+r.IntN(5); run++ {
		for _, n := range names {
			v := 1 + 1000*r.Float64()
			want[n] = append(want[n], v)
			fmt.Fprintf(&sb, "%s-16\t%d\t%d ns/op\t%.4f us/step\n", n, 1+r.IntN(100), 1+r.IntN(1000000), v)
		}
	}
	sb.WriteString("PASS\nok  \texample.com/p\t1.0s\n")
	got, err := ReadGoBench(strings.NewReader(sb.String()), "in.txt")
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	if len(got) != len(names) {
		t.Fatalf("seed %d: %d benchmarks, want %d", seed, len(got), len(names))
	}
	for i, g := range got {
		n := strings.TrimPrefix(names[i], "Benchmark") + "-16"
		if g.Name != n || g.Runs != len(want[names[i]]) || g.Config["pkg"] != "example.com/p" {
			t.Fatalf("seed %d: benchmark %d: %+v, want %s with %d runs", seed, i, g, n, len(want[names[i]]))
		}
		vs := slices.Clone(want[names[i]])
		for j := range vs { // as printed
			fmt.Sscanf(fmt.Sprintf("%.4f", vs[j]), "%g", &vs[j])
		}
		if m := g.Median["us/step"]; m != Median(vs) {
			t.Errorf("seed %d: %s median %g, want %g", seed, n, m, Median(vs))
		}
		if _, ok := g.Median["ns/op"]; !ok {
			t.Errorf("seed %d: %s: no ns/op", seed, n)
		}
	}
	png := filepath.Join(t.TempDir(), "g.png")
	if err := PlotGoBench(got, "us/step", "test", png); err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	if st, err := os.Stat(png); err != nil || st.Size() < 1000 {
		t.Fatalf("seed %d: figure: %v", seed, err)
	}
	if err := PlotGoBench(got, "GB/s", "test", png); err == nil {
		t.Errorf("seed %d: a metric no benchmark reports drew a figure", seed)
	}
}

// TestReadGoBenchRefuses names the file of output without benchmarks or
// with a malformed benchmark line.
func TestReadGoBenchRefuses(t *testing.T) {
	for _, in := range []string{"", "PASS\n", "BenchmarkX-8\t10\tfast ns/op\n"} {
		if _, err := ReadGoBench(strings.NewReader(in), "bad.txt"); err == nil || !strings.Contains(err.Error(), "bad.txt") {
			t.Errorf("%q: error %v, want one naming bad.txt", in, err)
		}
	}
}

// FuzzReadGoBench feeds arbitrary text to ReadGoBench: it returns results
// or an error, never panics, and every result has a run and finite medians
// only where the input had them.
func FuzzReadGoBench(f *testing.F) {
	f.Add("BenchmarkX-8\t10\t5 ns/op\t3 us/step\n")
	f.Add("pkg: p\nBenchmarkX/a=1-8 1 2 ns/op\nBenchmarkX/a=1-8 1 4 ns/op\n")
	f.Fuzz(func(t *testing.T, in string) {
		rs, err := ReadGoBench(strings.NewReader(in), "fuzz.txt")
		if err != nil {
			return
		}
		for _, r := range rs {
			if r.Runs < 1 {
				t.Fatalf("%q: %+v", in, r)
			}
		}
	})
}
