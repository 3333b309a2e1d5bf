package serve

import (
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/twell-ai/twell/engine"
)

// metrics are the counters /metrics shows.
type metrics struct {
	running, queued   atomic.Int64
	prompt, generated atomic.Int64

	mu       sync.Mutex
	requests map[[2]string]int64 // endpoint, status -> count
	units    []float64           // per layer: active units summed over tokens
	tokens   []int64             // per layer: tokens measured
}

func newMetrics(layers int) *metrics {
	return &metrics{requests: map[[2]string]int64{}, units: make([]float64, layers), tokens: make([]int64, layers)}
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
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	w.Write([]byte(b.String()))
}
