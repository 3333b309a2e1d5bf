package dist

import (
	"bytes"
	"context"
	"crypto/sha256"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twell-ai/twell/internal/testutil"
)

func TestFromEnv(t *testing.T) {
	for _, c := range []struct {
		env  map[string]string
		want Env
		ok   bool
		err  string
	}{
		{map[string]string{}, Env{WorldSize: 1}, false, ""},
		{map[string]string{"WORLD_SIZE": "4", "RANK": "2"}, Env{Rank: 2, LocalRank: 2, WorldSize: 4, MasterAddr: "127.0.0.1", MasterPort: 29500}, true, ""},
		{map[string]string{"WORLD_SIZE": "16", "RANK": "9", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "1234"},
			Env{Rank: 9, LocalRank: 1, WorldSize: 16, MasterAddr: "node0", MasterPort: 1234}, true, ""},
		{map[string]string{"WORLD_SIZE": "four", "RANK": "0"}, Env{}, true, `WORLD_SIZE="four"`},
		{map[string]string{"WORLD_SIZE": "2"}, Env{}, true, `RANK=""`},
		{map[string]string{"WORLD_SIZE": "2", "RANK": "2"}, Env{}, true, "RANK 2 outside"},
		{map[string]string{"WORLD_SIZE": "0", "RANK": "0"}, Env{}, true, "WORLD_SIZE 0"},
		{map[string]string{"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "3"}, Env{}, true, "LOCAL_RANK 3"},
		{map[string]string{"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "70000"}, Env{}, true, "MASTER_PORT 70000"},
	} {
		e, ok, err := FromEnv(func(k string) string { return c.env[k] })
		if ok != c.ok || (c.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.err)) {
			t.Errorf("%v: ok %v, err %v; want ok %v, error with %q", c.env, ok, err, c.ok, c.err)
			continue
		}
		if c.err == "" && e != c.want {
			t.Errorf("%v: %+v, want %+v", c.env, e, c.want)
		}
	}
}

// freePort returns a TCP port that was free a moment ago.
func freePort(t *testing.T) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// ranks runs Rendezvous for the given ranks of a world of size n at once
// (digests[i] for ranks[i]) and returns each one's payload and error.
func ranks(t *testing.T, n int, rs []int, digests [][32]byte, timeout time.Duration) ([][]byte, []error) {
	port := freePort(t)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	out, errs := make([][]byte, len(rs)), make([]error, len(rs))
	var wg sync.WaitGroup
	for i, r := range rs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e := Env{Rank: r, LocalRank: 0, WorldSize: n, MasterAddr: "127.0.0.1", MasterPort: port}
			out[i], errs[i] = Rendezvous(ctx, e, digests[i], []byte("nccl id from rank 0"))
		}()
	}
	wg.Wait()
	return out, errs
}

func same(n int, d [32]byte) [][32]byte {
	out := make([][32]byte, n)
	for i := range out {
		out[i] = d
	}
	return out
}

func TestRendezvous(t *testing.T) {
	r, seed := testutil.Rand(t)
	d := sha256.Sum256([]byte{byte(r.IntN(256))})
	for _, n := range []int{1, 2, 5} {
		rs := make([]int, n)
		for i := range rs {
			rs[i] = (i + 1) % n // rank 0 last: the others wait for it
		}
		out, errs := ranks(t, n, rs, same(n, d), 20*time.Second)
		for i := range rs {
			if errs[i] != nil || !bytes.Equal(out[i], []byte("nccl id from rank 0")) {
				t.Errorf("seed %d: world %d, rank %d: %q, %v", seed, n, rs[i], out[i], errs[i])
			}
		}
	}
}

// TestRendezvousFailures: every kind of inconsistency ends every rank
// that arrived with an error naming the cause, within the deadline.
func TestRendezvousFailures(t *testing.T) {
	d := sha256.Sum256([]byte("config"))
	other := sha256.Sum256([]byte("another config"))
	for _, c := range []struct {
		name    string
		n       int
		rs      []int
		digests [][32]byte
		want0   string // rank 0's error
		wantAll string // every other rank's error
	}{
		{"digest", 3, []int{0, 1, 2}, [][32]byte{d, d, other}, "rank 2 runs a different configuration", "different configuration"},
		{"missing", 3, []int{0, 1}, [][32]byte{d, d}, "ranks [2] did not arrive", "rendezvous failed"},
		{"twice", 3, []int{0, 1, 1}, [][32]byte{d, d, d}, "rank 1 arrived twice", "dist: rank 1"},
		{"no rank 0", 2, []int{1}, [][32]byte{d}, "", "cannot reach rank 0"},
	} {
		start := time.Now()
		_, errs := ranks(t, c.n, c.rs, c.digests, 2*time.Second)
		if time.Since(start) > 10*time.Second {
			t.Errorf("%s: took %v", c.name, time.Since(start))
		}
		for i, r := range c.rs {
			want := c.wantAll
			if r == 0 {
				want = c.want0
			}
			if errs[i] == nil || !strings.Contains(errs[i].Error(), want) {
				t.Errorf("%s: rank %d: %v, want an error with %q", c.name, r, errs[i], want)
			}
		}
	}
}

func TestRendezvousWorldSizeMismatch(t *testing.T) {
	port := freePort(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	d := sha256.Sum256(nil)
	errc := make(chan error, 1)
	go func() {
		_, err := Rendezvous(ctx, Env{Rank: 1, WorldSize: 3, MasterAddr: "127.0.0.1", MasterPort: port}, d, nil)
		errc <- err
	}()
	_, err0 := Rendezvous(ctx, Env{Rank: 0, WorldSize: 2, MasterAddr: "127.0.0.1", MasterPort: port}, d, []byte("x"))
	err1 := <-errc
	if err0 == nil || !strings.Contains(err0.Error(), "WORLD_SIZE 3") || err1 == nil || !strings.Contains(err1.Error(), "WORLD_SIZE 3") {
		t.Errorf("rank 0: %v; rank 1: %v", err0, err1)
	}
}

// FuzzReplies: the rendezvous readers never panic and never allocate
// past their limit on any bytes.
func FuzzReplies(f *testing.F) {
	var b bytes.Buffer
	_ = writeHello(&b, hello{Rank: 1, WorldSize: 2})
	f.Add(b.Bytes())
	b.Reset()
	_ = writeReply(&b, false, []byte("payload"))
	f.Add(b.Bytes())
	f.Add([]byte("TWDP\x01"))
	f.Add([]byte{1, 255, 255, 255, 255})
	f.Fuzz(func(t *testing.T, data []byte) {
		_, _ = readHello(bytes.NewReader(data))
		p, err := readReply(bytes.NewReader(data))
		if err == nil && len(p) > maxPayload {
			t.Fatalf("a payload of %d bytes", len(p))
		}
	})
}
