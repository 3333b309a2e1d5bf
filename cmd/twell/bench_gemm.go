package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/twell-ai/twell/bench"
	"github.com/twell-ai/twell/bf16"
	"github.com/twell-ai/twell/cuda"
	"github.com/twell-ai/twell/cuda/cublas"
	"github.com/twell-ai/twell/cuda/nvml"
)

func init() {
	register(command{name: "bench gemm", summary: "bf16 GEMM TFLOP/s on the GPU (cuBLASLt and cuBLAS), checked against a CPU float64 reference", run: runBenchGemm})
}

// gemmSize is one M×N×K problem.
type gemmSize struct{ M, N, K int }

// parseGemmSizes reads "4096,8192" (cubes) or "4096x1024x8192" entries.
func parseGemmSizes(s string) ([]gemmSize, error) {
	var out []gemmSize
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		parts := strings.Split(strings.ToLower(f), "x")
		if len(parts) != 1 && len(parts) != 3 {
			return nil, fmt.Errorf("size %q: want N or MxNxK", f)
		}
		var v []int
		for _, p := range parts {
			n, err := strconv.Atoi(p)
			if err != nil || n <= 0 {
				return nil, fmt.Errorf("size %q: %q is not a positive integer", f, p)
			}
			v = append(v, n)
		}
		if len(v) == 1 {
			v = []int{v[0], v[0], v[0]}
		}
		out = append(out, gemmSize{v[0], v[1], v[2]})
	}
	if len(out) == 0 {
		return nil, errors.New("no sizes given")
	}
	return out, nil
}

// gemmResult is one timed size and backend.
type gemmResult struct {
	M             int     `json:"m"`
	N             int     `json:"n"`
	K             int     `json:"k"`
	Backend       string  `json:"backend"`
	Reps          int     `json:"reps"`
	InputSets     int     `json:"input_sets"` // input pairs rotated through, so that L2 holds none
	MedianMS      float64 `json:"median_ms"`
	MeanMS        float64 `json:"mean_ms"`
	MinMS         float64 `json:"min_ms"`
	TFLOPSMedian  float64 `json:"tflops_median"`
	TFLOPSMean    float64 `json:"tflops_mean"`
	CheckSamples  int     `json:"check_samples"`
	RelErr        float64 `json:"rel_err"`         // ‖c − ref‖₂/‖ref‖₂ over the samples
	MaxAbsErrRel  float64 `json:"max_abs_err_rel"` // max |c − ref| / rms(ref)
	JoulesPerGemm float64 `json:"joules_per_gemm,omitempty"`
	AvgWatts      float64 `json:"avg_watts,omitempty"`
	// SMClockMHz is the median SM clock sampled every 10 ms through the
	// energy window, PowerCapped the share of those samples in which the
	// driver held the clocks down to keep within the power limit.
	SMClockMHz  int      `json:"sm_clock_mhz,omitempty"`
	PowerCapped *float64 `json:"power_capped,omitempty"`
	EnergyNote  string   `json:"energy_note,omitempty"`
	// Tuning is the tuned backend's choice: every algorithm cuBLASLt's
	// heuristic offered, timed, and the one kept.
	Tuning *cublas.Tuning `json:"tuning,omitempty"`
}

// gemmReport is the JSON file -json writes.
type gemmReport struct {
	Schema      string       `json:"schema"` // "twell.bench.gemm/1"
	Date        string       `json:"date"`
	Host        string       `json:"host"`
	GPU         string       `json:"gpu"`
	Arch        string       `json:"arch"`
	SMs         int          `json:"sms"`
	MemoryGiB   float64      `json:"memory_gib"`
	Driver      string       `json:"driver"`
	CUDADriver  int          `json:"cuda_driver_api"`
	CUBLAS      string       `json:"cublas"`
	CUBLASLt    string       `json:"cublaslt"`
	Seed        uint64       `json:"seed"`
	Description string       `json:"description"`
	Results     []gemmResult `json:"results"`
}

func runBenchGemm(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench gemm", stderr)
	m := fs.Int("m", 0, "rows of A and C (with -n and -k: one size instead of -sizes)")
	n := fs.Int("n", 0, "columns of B and C")
	k := fs.Int("k", 0, "inner dimension")
	sizesFlag := fs.String("sizes", "4096,8192", "comma-separated sizes: N for N×N×N, or MxNxK")
	reps := fs.Int("reps", 30, "timed GEMMs per size and backend (median reported)")
	warmup := fs.Int("warmup", 5, "untimed GEMMs first")
	backends := fs.String("backend", "lt,cublas", "comma-separated: lt (cuBLASLt, the heuristic's first choice), tuned (cuBLASLt, the fastest of the heuristic's candidates, each timed), cublas (plain cuBLAS), auto")
	transB := fs.Bool("transb", false, "B stored N×K (C = A·Bᵀ), as the model's weights are")
	samples := fs.Int("check", 256, "output entries checked against a float64 CPU reference")
	energy := fs.Duration("energy", time.Second, "also run this long under the NVML energy counter (0: skip)")
	device := fs.Int("device", 0, "CUDA device ordinal")
	seed := fs.Uint64("seed", 0, "random seed (0: a fresh one, printed)")
	jsonPath := fs.String("json", "", "write the results as JSON to this file")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	var sizes []gemmSize
	switch set := *m != 0 || *n != 0 || *k != 0; {
	case set && (*m <= 0 || *n <= 0 || *k <= 0):
		return usagef("-m, -n and -k must be given together, all positive")
	case set:
		sizes = []gemmSize{{*m, *n, *k}}
	default:
		var err error
		if sizes, err = parseGemmSizes(*sizesFlag); err != nil {
			return usagef("-sizes: %v", err)
		}
	}
	if *reps < 1 || *warmup < 0 || *samples < 1 {
		return usagef("-reps and -check must be positive, -warmup not negative")
	}
	var bks []gemmBackend
	for _, b := range strings.Split(*backends, ",") {
		switch strings.TrimSpace(b) {
		case "lt":
			bks = append(bks, gemmBackend{name: cublas.Lt.String(), lib: cublas.Lt})
		case "tuned":
			bks = append(bks, gemmBackend{name: "cublasLt tuned", lib: cublas.Lt, tuned: true})
		case "cublas":
			bks = append(bks, gemmBackend{name: cublas.Legacy.String(), lib: cublas.Legacy})
		case "auto":
			bks = append(bks, gemmBackend{name: cublas.Auto.String(), lib: cublas.Auto})
		default:
			return usagef("-backend %q: want lt, tuned, cublas or auto", b)
		}
	}
	if *seed == 0 {
		*seed = rand.Uint64()
	}
	if *jsonPath != "" { // fail before a long run, not after it
		_, statErr := os.Stat(*jsonPath)
		f, err := os.OpenFile(*jsonPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
		if err != nil {
			return fmt.Errorf("-json: %w", err)
		}
		f.Close()
		if statErr != nil {
			os.Remove(*jsonPath)
		}
	}

	dev, err := cuda.Open(*device)
	if err != nil {
		if cuda.NoGPU(err) {
			return fmt.Errorf("bench gemm needs a CUDA GPU: %w", err)
		}
		return err
	}
	h, err := cublas.New(dev)
	if err != nil {
		return err
	}
	defer h.Close()
	for i := range bks {
		bks[i].h = h
		if bks[i].tuned { // a handle of its own, so that its choices are not the lt rows'
			th, err := cublas.New(dev)
			if err != nil {
				return err
			}
			defer th.Close()
			th.TuneFlops = 1
			bks[i].h = th
		}
	}
	p := dev.Properties()
	rep := gemmReport{Schema: "twell.bench.gemm/1", Date: time.Now().UTC().Format(time.RFC3339), GPU: p.Name, Arch: p.Arch, SMs: p.SMs,
		MemoryGiB: gib(p.TotalMemory), Seed: *seed,
		Description: "bf16 A·B → bf16 C with fp32 accumulation, row-major, no transposes; CUDA-event time per GEMM, median over reps after warm-up, inputs rotated so L2 holds none; output sampled against a float64 CPU product of the same bf16 inputs"}
	if *transB {
		rep.Description = strings.Replace(rep.Description, "A·B → bf16 C", "A·Bᵀ → bf16 C (B stored N×K)", 1)
		rep.Description = strings.Replace(rep.Description, "no transposes", "B transposed", 1)
	}
	rep.Host, _ = os.Hostname()
	rep.CUDADriver, _ = cuda.DriverVersion()
	rep.Driver, _ = nvml.DriverVersion()
	ltv, _, cbv, _, _ := cublas.Versions()
	rep.CUBLAS, rep.CUBLASLt = cbv, ltVersion(ltv)
	fmt.Fprintf(stderr, "bench gemm: %v, driver %s, cuBLAS %s, cuBLASLt %s, seed %d\n", dev, orNone(rep.Driver), orNone(cbv), rep.CUBLASLt, *seed)
	var meter *nvml.Device
	if *energy > 0 {
		if d, err := nvml.DeviceByPCIBusID(p.PCIBusID); err == nil {
			meter = d
		} else {
			fmt.Fprintf(stderr, "  no energy figures: %v\n", err)
		}
	}

	for _, sz := range sizes {
		res, err := benchGemmSize(dev, sz, *transB, bks, *reps, *warmup, *samples, *energy, meter, *seed, stderr)
		rep.Results = append(rep.Results, res...)
		if err != nil {
			return err
		}
	}

	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(stdout, "%s (%s, %d SMs), driver %s, cuBLAS %s\n", p.Name, p.Arch, p.SMs, orNone(rep.Driver), orNone(cbv))
	fmt.Fprintln(tw, "M\tN\tK\tbackend\tmedian ms\tTFLOP/s\tmean TFLOP/s\trel err\tJ/GEMM\tW\tSM MHz\tcapped\t")
	for _, r := range rep.Results {
		j, w, clk, capped := "-", "-", "-", "-"
		if r.JoulesPerGemm > 0 {
			j, w = fmt.Sprintf("%.3f", r.JoulesPerGemm), fmt.Sprintf("%.0f", r.AvgWatts)
		}
		if r.SMClockMHz > 0 {
			clk = strconv.Itoa(r.SMClockMHz)
		}
		if r.PowerCapped != nil {
			capped = fmt.Sprintf("%.0f%%", 100**r.PowerCapped)
		}
		fmt.Fprintf(tw, "%d\t%d\t%d\t%s\t%.3f\t%.1f\t%.1f\t%.1e\t%s\t%s\t%s\t%s\t\n", r.M, r.N, r.K, r.Backend, r.MedianMS, r.TFLOPSMedian, r.TFLOPSMean, r.RelErr, j, w, clk, capped)
	}
	tw.Flush()
	if *jsonPath != "" {
		data, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(*jsonPath, append(data, '\n'), 0o644); err != nil {
			return fmt.Errorf("-json: %w", err)
		}
	}
	return nil
}

// randomBF16 fills n bf16 values uniform in [-1, 1), in parallel.
func randomBF16(n int, seed uint64) []uint16 {
	out := make([]uint16, n)
	workers := runtime.GOMAXPROCS(0)
	chunk := (n + workers - 1) / workers
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		lo, hi := w*chunk, min((w+1)*chunk, n)
		if lo >= hi {
			break
		}
		wg.Add(1)
		go func(lo, hi int, s uint64) {
			defer wg.Done()
			r := rand.New(rand.NewPCG(seed, s))
			for i := lo; i < hi; i++ {
				out[i] = bf16.FromFloat32(float32(r.Float64()*2 - 1))
			}
		}(lo, hi, uint64(w)+1)
	}
	wg.Wait()
	return out
}

// gemmBackend is one -backend entry: the handle and library that run it.
type gemmBackend struct {
	name  string
	lib   cublas.Backend
	tuned bool // h tunes every product (TuneFlops)
	h     *cublas.Handle
}

func benchGemmSize(dev *cuda.Device, sz gemmSize, transB bool, bks []gemmBackend, reps, warmup, samples int,
	energy time.Duration, meter *nvml.Device, seed uint64, log io.Writer) ([]gemmResult, error) {
	p := dev.Properties()
	aBytes, bBytes, cBytes := 2*sz.M*sz.K, 2*sz.K*sz.N, 2*sz.M*sz.N
	// Rotate input pairs so that together they are several times the L2.
	sets := min(4, max(1, (4*p.L2Bytes+aBytes+bBytes-1)/(aBytes+bBytes)))
	type pair struct {
		a, b   []uint16
		da, db *cuda.Buffer
	}
	pairs := make([]pair, sets)
	defer func() {
		for _, pr := range pairs {
			if pr.da != nil {
				pr.da.Free()
			}
			if pr.db != nil {
				pr.db.Free()
			}
		}
	}()
	for i := range pairs {
		pr := &pairs[i]
		pr.a = randomBF16(sz.M*sz.K, seed^uint64(2*i+1)*0x9e3779b97f4a7c15)
		pr.b = randomBF16(sz.K*sz.N, seed^uint64(2*i+2)*0x9e3779b97f4a7c15)
		var err error
		if pr.da, err = dev.Alloc(aBytes); err != nil {
			return nil, err
		}
		if pr.db, err = dev.Alloc(bBytes); err != nil {
			return nil, err
		}
		if err := dev.CopyHtoD(pr.da, cuda.Bytes(pr.a)); err != nil {
			return nil, err
		}
		if err := dev.CopyHtoD(pr.db, cuda.Bytes(pr.b)); err != nil {
			return nil, err
		}
	}
	dc, err := dev.Alloc(cBytes)
	if err != nil {
		return nil, err
	}
	defer dc.Free()
	events := make([]*cuda.Event, reps+1)
	for i := range events {
		if events[i], err = dev.NewEvent(); err != nil {
			return nil, err
		}
		defer events[i].Destroy()
	}
	var out []gemmResult
	for _, bk := range bks {
		g := cublas.Gemm{M: sz.M, N: sz.N, K: sz.K, TransB: transB, Backend: bk.lib}
		run := func(i int) error { return bk.h.Matmul(nil, g, pairs[i%sets].da, pairs[i%sets].db, dc) }
		tuned := len(bk.h.Tunings())
		for i := 0; i < warmup; i++ {
			if err := run(i); err != nil {
				return out, err
			}
		}
		if err := dev.Memset8(dc, 0xff, nil); err != nil { // NaN: a GEMM that writes nothing fails the check
			return out, err
		}
		for i := 0; i < reps; i++ {
			if err := events[i].Record(nil); err != nil {
				return out, err
			}
			if err := run(i); err != nil {
				return out, err
			}
		}
		if err := events[reps].Record(nil); err != nil {
			return out, err
		}
		if err := events[reps].Synchronize(); err != nil {
			return out, err
		}
		times := make([]float64, reps)
		for i := range times {
			d, err := events[i].Elapsed(events[i+1])
			if err != nil {
				return out, err
			}
			times[i] = d.Seconds()
		}
		total, _ := events[0].Elapsed(events[reps])
		sorted := slices.Clone(times)
		median := bench.Median(sorted) // sorts sorted
		flops := g.Flops()
		r := gemmResult{M: sz.M, N: sz.N, K: sz.K, Backend: bk.name, Reps: reps, InputSets: sets,
			MedianMS: median * 1e3, MeanMS: total.Seconds() / float64(reps) * 1e3, MinMS: sorted[0] * 1e3,
			TFLOPSMedian: flops / median / 1e12, TFLOPSMean: flops * float64(reps) / total.Seconds() / 1e12}
		if tn := bk.h.Tunings(); len(tn) > tuned { // this size's first call chose by timing
			r.Tuning = &tn[len(tn)-1]
			for _, c := range r.Tuning.Candidates {
				mark := ""
				if c.Rank == r.Tuning.Chosen {
					mark = " (kept)"
				}
				if c.Err != "" {
					fmt.Fprintf(log, "  %dx%dx%d candidate %d: %s\n", sz.M, sz.N, sz.K, c.Rank, c.Err)
					continue
				}
				fmt.Fprintf(log, "  %dx%dx%d candidate %d: %.3f ms, %.1f TFLOP/s, workspace %d B%s\n", sz.M, sz.N, sz.K, c.Rank,
					c.Time.Seconds()*1e3, flops/c.Time.Seconds()/1e12, c.Workspace, mark)
			}
		}

		// Check the last product against float64 on a sample of entries.
		last := pairs[(reps-1)%sets]
		c := make([]uint16, sz.M*sz.N)
		if err := dev.CopyDtoH(cuda.Bytes(c), dc); err != nil {
			return out, err
		}
		rng := rand.New(rand.NewPCG(seed, uint64(sz.M*31+sz.N*17+sz.K)))
		var num, den, maxAbs float64
		for s := 0; s < samples; s++ {
			i, j := rng.IntN(sz.M), rng.IntN(sz.N)
			var ref float64
			for kk := 0; kk < sz.K; kk++ {
				bkj := kk*sz.N + j
				if transB {
					bkj = j*sz.K + kk
				}
				ref += float64(bf16.ToFloat32(last.a[i*sz.K+kk])) * float64(bf16.ToFloat32(last.b[bkj]))
			}
			d := float64(bf16.ToFloat32(c[i*sz.N+j])) - ref
			num += d * d
			den += ref * ref
			maxAbs = math.Max(maxAbs, math.Abs(d))
		}
		r.CheckSamples = samples
		r.RelErr = math.Sqrt(num / den)
		r.MaxAbsErrRel = maxAbs / math.Sqrt(den/float64(samples))
		if math.IsNaN(r.RelErr) {
			r.RelErr = math.Inf(1)
		}

		if meter != nil && energy > 0 {
			n := max(1, int(energy.Seconds()/median))
			w, err := bench.MeasureEnergy(meter, func() error {
				for i := range n {
					if err := run(i); err != nil {
						return err
					}
				}
				return dev.Synchronize()
			})
			if err != nil {
				return out, err
			}
			r.SMClockMHz, r.PowerCapped = w.SMClockMHz, w.PowerCapped
			switch {
			case w.OK && w.Joules > 0:
				r.JoulesPerGemm = w.Joules / float64(n)
				r.AvgWatts = w.Watts
			case w.OK:
				r.EnergyNote = fmt.Sprintf("energy counter: %v (%.3f J)", error(nil), w.Joules)
			default:
				r.EnergyNote = w.Note
			}
		}
		fmt.Fprintf(log, "  %dx%dx%d %s: median %.3f ms, %.1f TFLOP/s, rel err %.1e over %d samples\n",
			sz.M, sz.N, sz.K, r.Backend, r.MedianMS, r.TFLOPSMedian, r.RelErr, samples)
		out = append(out, r)
		if r.RelErr > 1e-2 {
			return out, fmt.Errorf("%dx%dx%d %s: relative error %.3g against the float64 reference exceeds 1e-2", sz.M, sz.N, sz.K, r.Backend, r.RelErr)
		}
	}
	return out, nil
}
