package handoff

import (
	"context"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/bench/report"
	"github.com/kvhandoff/kvhandoff/transferagent/agentproc"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/simengine"
)

// Scenario is what the benchmark runs.
type Scenario struct {
	Provider     string
	QPS          float64
	PromptTokens int
	TP           int
	// Duration is how long requests arrive, per mode.
	Duration time.Duration
	// LoadFraction scales KV per token so the offered load is this fraction of the
	// provider bandwidth measured in the same run.
	LoadFraction float64
	// Utilisation sets prefill speed so the prefill engine is this busy (DESIGN.md §2).
	Utilisation float64
	// CacheRequests sizes each rank's KV cache, in requests.
	CacheRequests int
	// Lease, RegistrationTimeout and BlocksTTL are the engines' policy timeouts (0: the
	// agents' defaults).
	Lease, RegistrationTimeout, BlocksTTL time.Duration

	Seed     uint64
	AgentBin string
	WorkDir  string
	Log      io.Writer
}

// Default is the scenario: 8 QPS of 16k-token prompts at TP 8, 30% of the wire.
func Default() Scenario {
	return Scenario{Provider: "tcp;ofi_rxm", QPS: 8, PromptTokens: 16384, TP: 8, Duration: 20 * time.Second,
		LoadFraction: 0.30, Utilisation: 0.65, CacheRequests: 8, Seed: 1}
}

// Percentiles are in milliseconds.
type Percentiles = report.Percentiles

// Result is one mode's outcome.
type Result struct {
	Mode            string      `json:"mode"`
	QPS             float64     `json:"qps"`
	PromptTokens    int         `json:"prompt_tokens"`
	BytesPerRequest uint64      `json:"bytes_per_request"`
	TTFT            Percentiles `json:"ttft_ms"`
	Handoff         Percentiles `json:"handoff_ms"`
	// CoordinationOverhead is each request's handoff minus the wire floor: what the
	// agents, the engines and their coordination add to moving the bytes.
	CoordinationOverhead Percentiles `json:"coordination_overhead_ms"`
	// WireFloorMs is the fastest way the request's bytes cross: TP endpoint pairs
	// writing their rank's share at once, signalled (the handoff's own parallelism).
	WireFloorMs float64 `json:"wire_floor_ms"`
	// WireFloorOnePairMs is the same bytes over one pair, for context.
	WireFloorOnePairMs    float64 `json:"wire_floor_one_pair_ms"`
	DescriptorsPerRequest float64 `json:"descriptors_per_request"`
	// StagesMs is the agents' own mean time per stage and rank (their metrics).
	StagesMs         map[string]float64 `json:"agent_stage_mean_ms"`
	Arrivals         int                `json:"arrivals"`
	VerifiedRequests int                `json:"verified_requests"`
	FailedRequests   int                `json:"failed_requests"`
	// UnreturnedBlocks is how many blocks were not back in the engines' pools once every
	// request had ended: 0 unless an agent never answered (leaked_rank_blocks).
	UnreturnedBlocks int `json:"unreturned_blocks"`

	handoffs []float64
}

// Report is the whole run.
type Report struct {
	Provider string `json:"provider"`
	// BandwidthGBps is one endpoint pair's; BandwidthTPGBps TP pairs' together, which
	// the load is sized from (the run's own parallelism).
	BandwidthGBps   float64 `json:"bandwidth_gb_per_s"`
	BandwidthTPGBps float64 `json:"bandwidth_tp_pairs_gb_per_s"`
	OfferedLoad     float64 `json:"offered_load_fraction"`
	TP              int     `json:"tp"`
	Layout          string  `json:"layout"`
	PrefillMs       float64 `json:"prefill_ms"`
	DurationS       float64 `json:"arrivals_s_per_mode"`
	// LeakedRanks counts ranks' blocks held back because an agent never answered.
	LeakedRanks      int64    `json:"leaked_rank_blocks"`
	Results          []Result `json:"results"`
	PushOverFloorP50 float64  `json:"push_handoff_p50_over_wire_floor"`
	PullMinusPushP50 float64  `json:"pull_minus_push_handoff_p50_ms"`
}

func (sc Scenario) logf(format string, args ...any) {
	if sc.Log != nil {
		fmt.Fprintf(sc.Log, format+"\n", args...)
	}
}

// Run measures the wire, sizes the model to the offered load, and runs push then pull.
func Run(ctx context.Context, sc Scenario) (*Report, error) {
	bw, err := MeasureBandwidth(sc.Provider, 64<<20)
	if err != nil {
		return nil, fmt.Errorf("measuring bandwidth: %w", err)
	}
	// The load is sized from what TP pairs move together, the run's own parallelism: one
	// pair's figure overstates what each rank gets when all of them write at once.
	sizing, err := wireFloorParallel(sc.Provider, 64<<20, sc.TP)
	if err != nil {
		return nil, fmt.Errorf("measuring bandwidth over %d pairs: %w", sc.TP, err)
	}
	bwTP := float64(64<<20) / sizing.Seconds()
	l := sizeLayout(sc, bwTP)
	blocksPerRequest := (sc.PromptTokens + l.BlockSize - 1) / l.BlockSize
	l.Blocks = blocksPerRequest * sc.CacheRequests
	bytesPerRequest := uint64(l.BytesPerToken()) * uint64(blocksPerRequest*l.BlockSize)
	floor, err := wireFloor(sc.Provider, int(bytesPerRequest))
	if err != nil {
		return nil, err
	}
	floorTP, err := wireFloorParallel(sc.Provider, int(bytesPerRequest), sc.TP)
	if err != nil {
		return nil, err
	}
	sc.logf("wire floor over %d endpoint pairs at once: %.1f ms", sc.TP, ms(floorTP))
	speedup := simengine.SpeedupFor(sc.TP, 1, sc.QPS, sc.PromptTokens, sc.Utilisation)
	prefill := simengine.Prefill{TP: sc.TP, Speedup: speedup}.Time(sc.PromptTokens)
	rep := &Report{
		Provider: sc.Provider, BandwidthGBps: bw / 1e9, BandwidthTPGBps: bwTP / 1e9, TP: sc.TP,
		OfferedLoad: sc.QPS * float64(bytesPerRequest) / bwTP,
		Layout:      fmt.Sprintf("%d layers × K,V × %d KV heads × head dim %d × %d B, block %d tokens: %d B/token", l.Layers, l.KVHeads, l.HeadDim, l.DTypeBytes, l.BlockSize, l.BytesPerToken()),
		PrefillMs:   ms(prefill), DurationS: sc.Duration.Seconds(),
	}
	sc.logf("provider %s: %.2f GB/s one pair, %.2f GB/s over %d pairs; %d bytes per request (%.0f%% of the wire at %.0f QPS); wire floor %.1f ms (one pair %.1f ms); prefill %.1f ms per request",
		sc.Provider, bw/1e9, bwTP/1e9, sc.TP, bytesPerRequest, rep.OfferedLoad*100, sc.QPS, ms(floorTP), ms(floor), ms(prefill))

	a, b, err := agentproc.StartPair(sc.AgentBin, sc.WorkDir, sc.Provider)
	if err != nil {
		return nil, err
	}
	defer a.Stop()
	defer b.Stop()
	for _, mode := range []agentv1.Mode{agentv1.Mode_MODE_PUSH, agentv1.Mode_MODE_PULL} {
		r, leaked, err := runMode(ctx, sc, mode, l, a, b, prefill)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", mode, err)
		}
		rep.LeakedRanks += leaked
		r.BytesPerRequest, r.WireFloorMs, r.WireFloorOnePairMs = bytesPerRequest, ms(floorTP), ms(floor)
		over := make([]float64, len(r.handoffs))
		for i, h := range r.handoffs {
			over[i] = h - ms(floorTP)
		}
		r.CoordinationOverhead = report.Of(over)
		r.StagesMs = stageMeans(r.Mode, a, b)
		sc.logf("%s: agent stage means per rank (ms): %v", r.Mode, r.StagesMs)
		rep.Results = append(rep.Results, *r)
	}
	rep.PushOverFloorP50 = rep.Results[0].Handoff.P50 / rep.Results[0].WireFloorMs
	rep.PullMinusPushP50 = rep.Results[1].Handoff.P50 - rep.Results[0].Handoff.P50
	return rep, nil
}

// stageMeans reads the agents' stage histograms: mean milliseconds per stage.
func stageMeans(mode string, agents ...*agentproc.Proc) map[string]float64 {
	var scraped []map[string]float64
	for _, a := range agents {
		if m, err := a.Metrics(); err == nil {
			scraped = append(scraped, m)
		}
	}
	out := map[string]float64{}
	for _, stage := range []string{"rendezvous_wait", "post", "wire", "notify"} {
		var sum, count float64
		labels := fmt.Sprintf(`{mode="%s",stage="%s"}`, mode, stage)
		for _, m := range scraped {
			sum += m["kvhandoff_agent_handoff_stage_seconds_sum"+labels]
			count += m["kvhandoff_agent_handoff_stage_seconds_count"+labels]
		}
		if count > 0 {
			out[stage] = report.Round(sum / count * 1000)
		}
	}
	return out
}

// sizeLayout keeps Qwen3-32B's shape (64 layers, 8 KV heads, 16-token blocks) and scales
// the head dimension so that the offered load is LoadFraction of the measured bandwidth.
func sizeLayout(sc Scenario, bw float64) simengine.Layout {
	l := simengine.Qwen3_32B(sc.TP, 1)
	perToken := sc.LoadFraction * bw / (sc.QPS * float64(sc.PromptTokens))
	perHeadDim := float64(2 * l.Layers * l.KVHeads * l.DTypeBytes)
	l.HeadDim = max(1, int(math.Round(perToken/perHeadDim)))
	for l.BlockBytes()%8 != 0 {
		l.HeadDim++
	}
	return l
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// ranks is a mode's engines: one prefill and one decode engine per TP rank.
type ranks struct {
	P, D []*simengine.Engine
}

func startRanks(ctx context.Context, sc Scenario, mode agentv1.Mode, l simengine.Layout, a, b *agentproc.Proc) (*ranks, error) {
	rk := &ranks{}
	name := map[agentv1.Mode]string{agentv1.Mode_MODE_PUSH: "push", agentv1.Mode_MODE_PULL: "pull"}[mode]
	for r := range sc.TP {
		p, err := simengine.Start(ctx, simengine.Config{ID: "qwen3-prefill-" + name, Role: agentv1.Role_ROLE_PREFILL, Mode: mode, Rank: r, Layout: l, Socket: a.Socket,
			Lease: sc.Lease, RegistrationTimeout: sc.RegistrationTimeout, BlocksTTL: sc.BlocksTTL})
		if err != nil {
			rk.stop()
			return nil, err
		}
		rk.P = append(rk.P, p)
		d, err := simengine.Start(ctx, simengine.Config{ID: "qwen3-decode-" + name, Role: agentv1.Role_ROLE_DECODE, Mode: mode, Rank: r, Layout: l, Socket: b.Socket,
			Lease: sc.Lease, RegistrationTimeout: sc.RegistrationTimeout, BlocksTTL: sc.BlocksTTL})
		if err != nil {
			rk.stop()
			return nil, err
		}
		rk.D = append(rk.D, d)
	}
	return rk, nil
}

func (rk *ranks) stop() {
	for _, e := range append(rk.P, rk.D...) {
		e.Stop()
	}
}

// outcome is one request's measurements.
type outcome struct {
	ttft, handoff time.Duration
	descriptors   uint64
	err           error
}

// runMode runs one mode's arrivals; it also returns the ranks' blocks it had to hold
// back because an agent never answered for them.
func runMode(ctx context.Context, sc Scenario, mode agentv1.Mode, l simengine.Layout, a, b *agentproc.Proc, prefill time.Duration) (*Result, int64, error) {
	rk, err := startRanks(ctx, sc, mode, l, a, b)
	if err != nil {
		return nil, 0, err
	}
	defer rk.stop()
	blocks := (sc.PromptTokens + l.BlockSize - 1) / l.BlockSize
	pf := newPrefillServer(rk, prefill, blocks)
	defer pf.stop()
	one := func(req string, arrival time.Time) outcome {
		if mode == agentv1.Mode_MODE_PUSH {
			return pushRequest(ctx, rk, pf, req, arrival, blocks)
		}
		return pullRequest(ctx, rk, pf, req, arrival, blocks)
	}
	// Warm-up: the first transfer on a connection pays for forming it (LIBFABRIC-NOTES 3).
	for i := range 2 {
		if o := one(fmt.Sprintf("warmup-%d", i), time.Now()); o.err != nil {
			sc.logf("%s: warm-up request failed: %v", mode, o.err)
		}
	}
	// Both modes get the same arrival sequence: their TTFTs compare like with like.
	rng := rand.New(rand.NewPCG(sc.Seed, 0))
	var wg sync.WaitGroup
	var mu sync.Mutex
	var outs []outcome
	start := time.Now()
	next := start
	for i := 0; ; i++ {
		next = next.Add(time.Duration(rng.ExpFloat64() / sc.QPS * float64(time.Second)))
		if next.Sub(start) > sc.Duration {
			break
		}
		time.Sleep(time.Until(next)) // open-loop Poisson arrivals
		wg.Add(1)
		go func(req string, arrival time.Time) {
			defer wg.Done()
			o := one(req, arrival)
			mu.Lock()
			outs = append(outs, o)
			mu.Unlock()
		}(fmt.Sprintf("req-%05d", i), next)
	}
	wg.Wait()
	// Every request has waited for its prefill's blocks to be returned (or counted leaked).
	res := &Result{Mode: map[agentv1.Mode]string{agentv1.Mode_MODE_PUSH: "push", agentv1.Mode_MODE_PULL: "pull"}[mode], QPS: sc.QPS, PromptTokens: sc.PromptTokens, Arrivals: len(outs)}
	for _, e := range append(rk.P, rk.D...) {
		res.UnreturnedBlocks += l.Blocks - e.FreeBlocks()
	}
	var ttfts []float64
	var desc uint64
	for _, o := range outs {
		if o.err != nil {
			res.FailedRequests++
			sc.logf("%s failed: %v", res.Mode, o.err)
			continue
		}
		res.VerifiedRequests++
		ttfts = append(ttfts, ms(o.ttft))
		res.handoffs = append(res.handoffs, ms(o.handoff))
		desc += o.descriptors
	}
	res.TTFT, res.Handoff = report.Of(ttfts), report.Of(res.handoffs)
	if res.VerifiedRequests > 0 {
		res.DescriptorsPerRequest = float64(desc) / float64(res.VerifiedRequests)
	}
	sc.logf("%s: %d verified, %d failed; handoff p50 %.1f ms", res.Mode, res.VerifiedRequests, res.FailedRequests, res.Handoff.P50)
	return res, pf.leaked.Load(), nil
}
