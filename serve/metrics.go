package serve

import (
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/twell-ai/twell/engine"
)

// metrics are the counters /metrics shows.
type metrics struct {
	running, queued   atomic.Int64
	prompt, generated atomic.Int64
	preemptions       atomic.Int64

	// Latencies in seconds: time to first token (from the request's arrival
	// to its first generated token), inter-token latency (between two
	// tokens of one request) and end-to-end (arrival to the end of a
	// request that succeeded).
	ttft, itl, e2e *histogram

	mu       sync.Mutex
	requests map[[2]string]int64 // endpoint, status -> count
	units    []float64           // per layer: active units summed over tokens
	tokens   []int64             // per layer: tokens measured
}

func newMetrics(layers int) *metrics {
	return &metrics{requests: map[[2]string]int64{}, units: make([]float64, layers), tokens: make([]int64, layers),
		ttft: newHistogram(ttftBuckets), itl: newHistogram(itlBuckets), e2e: newHistogram(e2eBuckets)}
}

// The histograms' bucket bounds in seconds (vLLM's, with finer steps at
// the short end for small models).
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560}
	itlBuckets  = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80}
	e2eBuckets  = []float64{0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680}
)

// histogram is a Prometheus histogram: counts of observations per bucket
// (each bucket holds what is at most its bound and more than the one
// before), their sum and their number.
type histogram struct {
	mu     sync.Mutex
	bounds []float64
	counts []int64 // per bucket, and one past the last bound
	sum    float64
	n      int64
}

func newHistogram(bounds []float64) *histogram {
	return &histogram{bounds: bounds, counts: make([]int64, len(bounds)+1)}
}

// observe adds one value.
func (h *histogram) observe(v float64) {
	i := sort.SearchFloat64s(h.bounds, v) // the first bound >= v
	h.mu.Lock()
	h.counts[i]++
	h.sum += v
	h.n++
	h.mu.Unlock()
}

// write writes the histogram in the text format: cumulative _bucket lines
// up to le="+Inf", then _sum and _count.
func (h *histogram) write(b *strings.Builder, name, help string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	fmt.Fprintf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name)
	var cum int64
	for i, le := range h.bounds {
		cum += h.counts[i]
		fmt.Fprintf(b, "%s_bucket{le=\"%s\"} %d\n", name, strconv.FormatFloat(le, 'g', -1, 64), cum)
	}
	fmt.Fprintf(b, "%s_bucket{le=\"+Inf\"} %d\n%s_sum %s\n%s_count %d\n", name, h.n, name, strconv.FormatFloat(h.sum, 'g', -1, 64), name, h.n)
}

// addStats adds one Forward's MLP statistics.
func (m *metrics) addStats(st *engine.Stats) {
	if st == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for i, v := range st.MeanActive {
		if v >= 0 && i < len(m.units) {
			m.units[i] += v * float64(st.Tokens)
			m.tokens[i] += int64(st.Tokens)
		}
	}
}

// statusWriter records the status a handler answered.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the connection (to flush).
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// count wraps h to count its requests by endpoint and status.
func (s *Server) count(endpoint string, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sw := &statusWriter{ResponseWriter: w}
		defer func() {
			status := sw.status
			if status == 0 {
				status = http.StatusOK
			}
			if r.Context().Err() != nil && sw.status == 0 {
				status = 499 // the client went away before an answer
			}
			s.metrics.mu.Lock()
			s.metrics.requests[[2]string{endpoint, fmt.Sprint(status)}]++
			s.metrics.mu.Unlock()
		}()
		h.ServeHTTP(sw, r)
	})
}

// serveMetrics writes the counters in the Prometheus text format.
func (s *Server) serveMetrics(w http.ResponseWriter, r *http.Request) {
	m := s.metrics
	var b strings.Builder
	m.mu.Lock()
	keys := make([][2]string, 0, len(m.requests))
	for k := range m.requests {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		return keys[i][0] < keys[j][0] || keys[i][0] == keys[j][0] && keys[i][1] < keys[j][1]
	})
	b.WriteString("# HELP twell_requests_total HTTP requests answered, by endpoint and status.\n# TYPE twell_requests_total counter\n")
	for _, k := range keys {
		fmt.Fprintf(&b, "twell_requests_total{endpoint=%q,status=%q} %d\n", k[0], k[1], m.requests[k])
	}
	b.WriteString("# HELP twell_mlp_active_units Mean active MLP units per token since start, by layer (NaN: not measured).\n# TYPE twell_mlp_active_units gauge\n")
	for i := range m.units {
		v := "NaN"
		if m.tokens[i] > 0 {
			v = fmt.Sprintf("%g", m.units[i]/float64(m.tokens[i]))
		}
		fmt.Fprintf(&b, "twell_mlp_active_units{layer=\"%d\"} %s\n", i, v)
	}
	m.mu.Unlock()
	gauge := func(name, help, typ string, v int64) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n%s %d\n", name, help, name, typ, name, v)
	}
	gauge("twell_requests_running", "Requests (prompts) in the running batch.", "gauge", m.running.Load())
	gauge("twell_requests_queued", "Requests (prompts) waiting for room in the batch.", "gauge", m.queued.Load())
	gauge("twell_prompt_tokens_total", "Prompt tokens prefilled.", "counter", m.prompt.Load())
	gauge("twell_generated_tokens_total", "Tokens generated.", "counter", m.generated.Load())
	gauge("twell_mlp_units", "MLP hidden units per layer (the model's intermediate size).", "gauge", int64(s.e.Config().IntermediateSize))
	gauge("twell_preemptions_total", "Requests taken out of the batch because the KV pages ran out (they feed their tokens again later).", "counter", m.preemptions.Load())
	if s.pages != nil {
		ps := s.pageStats()
		gauge("twell_kv_pages_used", "KV cache pages held by running requests.", "gauge", int64(ps.InUse))
		gauge("twell_kv_pages_idle", "KV cache pages of memory kept for reuse after requests ended (free to take).", "gauge", int64(ps.Idle))
		gauge("twell_kv_pages_total", "KV cache pages in the budget (-kv-memory).", "gauge", int64(ps.Total))
		gauge("twell_kv_page_positions", "Positions (tokens) one KV cache page holds.", "gauge", int64(ps.PageSize))
	}
	m.ttft.write(&b, "twell_time_to_first_token_seconds", "Time from a request's arrival to its first generated token.")
	m.itl.write(&b, "twell_inter_token_latency_seconds", "Time between two generated tokens of a request.")
	m.e2e.write(&b, "twell_e2e_request_latency_seconds", "Time from a request's arrival to its end, for requests that succeeded.")
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	w.Write([]byte(b.String()))
}
