package handoff

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhandoff/kvhandoff/bench/report"
	"github.com/kvhandoff/kvhandoff/bench/workload"
	"github.com/kvhandoff/kvhandoff/test/agentproc"
	"github.com/kvhandoff/kvhandoff/test/simengine"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// Scenario is what the benchmark runs.
type Scenario struct {
	workload.Load
	workload.Env
	// LoadFraction scales KV per token so the offered load is this fraction of the
	// provider bandwidth measured in the same run.
	LoadFraction float64
	// Rails is how many endpoints each engine rank's session opens (the agents'
	// --rails); the floors use as many per pair.
	Rails int
	// LayerGroups is how many layer groups push-layered reports a request in (0: that
	// mode is not run).
	LayerGroups int
	// Lease, RegistrationTimeout and BlocksTTL are the engines' policy timeouts (0: the
	// agents' defaults).
	Lease, RegistrationTimeout, BlocksTTL time.Duration

	// AgentCPUs, when set, is the CPU list the agents (and the floors' threads) run on;
	// the caller runs the benchmark's process, whose simulated engines fill and verify
	// KV, on the others (bench/cmd/bench-handoff does), so that work does not compete with the
	// transfers timed.
	AgentCPUs string
	// Fabtests, when set, is a fabtests install (hack/fabtests.sh): the agent's write
	// throughput is then measured beside its fi_rma_bw.
	Fabtests string
}

// Default is the reference load at 30% of the wire, with push-layered in 8 groups.
func Default() Scenario {
	return Scenario{Load: workload.Default(), LoadFraction: 0.30, Rails: 1, LayerGroups: 8}
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
	// CoordinationOverhead is each request's handoff minus its wire floor (push-layered:
	// the last group's): what the agents, the engines and their coordination add to
	// moving the bytes.
	CoordinationOverhead Percentiles `json:"coordination_overhead_ms"`
	// WireFloorMs is the fastest way the request's bytes cross: TP endpoint pairs
	// writing their rank's share at once, signalled (the handoff's own parallelism).
	WireFloorMs float64 `json:"wire_floor_ms"`
	// WireFloorOnePairMs is the same bytes over one pair, for context.
	WireFloorOnePairMs float64 `json:"wire_floor_one_pair_ms"`
	// WireFloorUnderEngineLoadMs is the TP-pairs floor measured while the simulated
	// engines' own CPU work (producing and checking each request's KV at the run's
	// rate) runs beside it: on CPUs that work competes with the transfers, on GPUs not.
	WireFloorUnderEngineLoadMs float64 `json:"wire_floor_under_engine_load_ms"`
	// LayerGroups and WireFloorLastGroupMs (push-layered): what is left to move at
	// prefill end is the last group, whose bytes' TP-pairs floor this is.
	LayerGroups           int     `json:"layer_groups,omitempty"`
	WireFloorLastGroupMs  float64 `json:"wire_floor_last_group_ms,omitempty"`
	DescriptorsPerRequest float64 `json:"descriptors_per_request"`
	// StagesMs is the agents' own mean time per stage and rank (their metrics).
	StagesMs         map[string]float64 `json:"agent_stage_mean_ms"`
	Arrivals         int                `json:"arrivals"`
	VerifiedRequests int                `json:"verified_requests"`
	FailedRequests   int                `json:"failed_requests"`
	// UnreturnedBlocks is how many blocks were not back in the engines' pools once every
	// request had ended: 0 unless an agent never answered (leaked_rank_blocks).
	UnreturnedBlocks int `json:"unreturned_blocks"`
	// The overhead split by whether a request's handoff overlapped another's: those that
	// ran alone had the wire to themselves, as the floor does; the others shared it.
	HandoffsAlone                  int         `json:"handoffs_alone"`
	CoordinationOverheadAlone      Percentiles `json:"coordination_overhead_alone_ms"`
	CoordinationOverheadOverlapped Percentiles `json:"coordination_overhead_overlapped_ms"`
	// RankSpread is, per request, how long after its first rank its last rank had the KV:
	// the handoff ends with the slowest of the TP ranks.
	RankSpread Percentiles `json:"rank_spread_ms"`

	handoffs []float64
	spans    [][2]time.Time // each handoff's start and end, as handoffs
}

// Report is the whole run.
type Report struct {
	Provider string `json:"provider"`
	// Rails is the endpoints per engine rank (and per floor pair).
	Rails int `json:"rails"`
	// BandwidthGBps is one endpoint pair's; BandwidthTPGBps TP pairs' together, which
	// the load is sized from (the run's own parallelism).
	BandwidthGBps   float64 `json:"bandwidth_gb_per_s"`
	BandwidthTPGBps float64 `json:"bandwidth_tp_pairs_gb_per_s"`
	OfferedLoad     float64 `json:"offered_load_fraction"`
	TP              int     `json:"tp"`
	Layout          string  `json:"layout"`
	PrefillMs       float64 `json:"prefill_ms"`
	// AgentCPUs are the CPUs the agents and floors ran on, the engines on the others
	// (empty: all shared).
	AgentCPUs string  `json:"agent_cpus,omitempty"`
	DurationS float64 `json:"arrivals_s_per_mode"`
	// LeakedRanks counts ranks' blocks held back because an agent never answered.
	LeakedRanks int64 `json:"leaked_rank_blocks"`
	// WireFloorRounds is the TP-pairs floor's 31 rounds (p99: the slowest): the wire's
	// own spread, beside the handoffs' tails.
	WireFloorRounds  Percentiles `json:"wire_floor_rounds_ms"`
	Results          []Result    `json:"results"`
	PushOverFloorP50 float64     `json:"push_handoff_p50_over_wire_floor"`
	PullMinusPushP50 float64     `json:"pull_minus_push_handoff_p50_ms"`
	// PushOverLayeredP50 is how many times shorter push-layered's handoff p50 is than
	// whole-request push's (target ≥ 4).
	PushOverLayeredP50 float64 `json:"push_over_push_layered_handoff_p50,omitempty"`
	// Throughput is the agent's write throughput against fi_rma_bw (with Fabtests).
	Throughput *Throughput `json:"throughput,omitempty"`
	// RailsGain is one rank's throughput on one rail against two.
	RailsGain *RailsGain `json:"rails_gain,omitempty"`
}

// agents are the options the scenario's agents run with. Engines that send no policy
// timeouts (the throughput measurements') get a registration timeout and blocks TTL well
// inside waitLimit, so that a lost message surfaces as the agents' own report of it.
func (sc Scenario) agents() agentproc.Options {
	return agentproc.Options{CPUs: sc.AgentCPUs, Flags: []string{"--rails", strconv.Itoa(max(sc.Rails, 1)),
		"--registration-timeout", "60s", "--blocks-ttl", "30s"}}
}

// mode is one way of handing off a request: the agents' mode, and for push how many
// layer groups prefill reports it in (1: whole).
type mode struct {
	name   string
	agent  agentv1.Mode
	groups int
}

// modes are the modes a scenario runs, all on the same arrivals.
func (sc Scenario) modes() []mode {
	list := []mode{{"push", agentv1.Mode_MODE_PUSH, 1}}
	if sc.LayerGroups > 1 {
		list = append(list, mode{"push-layered", agentv1.Mode_MODE_PUSH, sc.LayerGroups})
	}
	return append(list, mode{"pull", agentv1.Mode_MODE_PULL, 1})
}

// Run measures the wire, sizes the model to the offered load, runs every mode (push,
// push-layered, pull) on the same arrivals and, with Fabtests, measures the agent's write
// throughput beside fi_rma_bw.
func Run(ctx context.Context, sc Scenario) (*Report, error) {
	sc.Rails = max(sc.Rails, 1)
	var cpus *unix.CPUSet
	if sc.AgentCPUs != "" {
		var err error
		if cpus, err = ParseCPUs(sc.AgentCPUs); err != nil {
			return nil, err
		}
	}
	f, err := measureFloors(sc, cpus)
	if err != nil {
		return nil, err
	}
	speedup := simengine.SpeedupFor(sc.TP, 1, sc.QPS, sc.PromptTokens, sc.Utilisation)
	prefill := simengine.Prefill{TP: sc.TP, Speedup: speedup}.Time(sc.PromptTokens)
	l := f.layout
	rep := &Report{
		Provider: sc.Provider, Rails: sc.Rails, BandwidthGBps: f.bandwidth / 1e9, BandwidthTPGBps: f.bandwidthTP / 1e9, TP: sc.TP,
		OfferedLoad: sc.QPS * float64(f.bytesPerRequest) / f.bandwidthTP,
		Layout: fmt.Sprintf("%d layers × K,V × %d KV heads × head dim %d × %d B, block %d tokens: %d B/token",
			l.Layers, l.KVHeads, l.HeadDim, l.DTypeBytes, l.BlockSize, l.BytesPerToken()),
		PrefillMs: ms(prefill), DurationS: sc.Duration.Seconds(), AgentCPUs: sc.AgentCPUs,
	}
	var roundsMs []float64
	for _, d := range f.rounds {
		roundsMs = append(roundsMs, ms(d))
	}
	rep.WireFloorRounds = report.Of(roundsMs)
	sc.Logf("provider %s: %.2f GB/s one pair, %.2f GB/s over %d pairs; %d bytes per request (%.0f%% of the wire at %.0f QPS); "+
		"wire floor %.1f ms (one pair %.1f ms); prefill %.1f ms per request",
		sc.Provider, f.bandwidth/1e9, f.bandwidthTP/1e9, sc.TP, f.bytesPerRequest, rep.OfferedLoad*100, sc.QPS, ms(f.tp), ms(f.onePair), ms(prefill))

	if err := runModes(ctx, sc, f, prefill, rep); err != nil {
		return nil, err
	}
	rep.compare()
	one := l // one rank, one request
	one.Blocks = f.blocksPerRequest
	if sc.Fabtests != "" {
		if rep.Throughput, err = MeasureThroughput(ctx, sc, sc.Fabtests, one); err != nil {
			return nil, fmt.Errorf("throughput: %w", err)
		}
		sc.Logf("throughput: %+v", *rep.Throughput)
	}
	if rep.RailsGain, err = MeasureRailsGain(ctx, sc, one, cpus); err != nil {
		return nil, fmt.Errorf("one rail against two: %w", err)
	}
	sc.Logf("one rail against two: %+v", *rep.RailsGain)
	return rep, nil
}

// floors are what the wire alone gives, measured before the modes run: the bandwidth the
// load is sized from, the layout sized to it, and the floors each handoff is held against.
type floors struct {
	bandwidth, bandwidthTP float64 // bytes/s: one endpoint pair, TP pairs at once
	layout                 simengine.Layout
	blocksPerRequest       int
	bytesPerRequest        uint64
	onePair, tp            time.Duration   // a request's bytes over one pair, over TP pairs
	rounds                 []time.Duration // the TP-pairs floor's rounds, sorted
	underLoad              time.Duration   // the TP-pairs floor beside the engines' CPU work
	lastGroup              time.Duration   // push-layered: the last layer group's TP-pairs floor
}

func measureFloors(sc Scenario, cpus *unix.CPUSet) (*floors, error) {
	f := &floors{}
	var err error
	if f.bandwidth, err = MeasureBandwidth(sc.Provider, sc.Rails, 64<<20, cpus); err != nil {
		return nil, fmt.Errorf("measuring bandwidth: %w", err)
	}
	// The load is sized from what TP pairs move together, the run's own parallelism: one
	// pair's figure overstates what each rank gets when all of them write at once.
	sizing, err := wireFloorParallel(sc.Provider, sc.Rails, 64<<20, sc.TP, 16, cpus) // 4 MiB writes
	if err != nil {
		return nil, fmt.Errorf("measuring bandwidth over %d pairs: %w", sc.TP, err)
	}
	f.bandwidthTP = float64(64<<20) / sizing.Seconds()
	f.layout = sizeLayout(sc, f.bandwidthTP)
	l := &f.layout
	f.blocksPerRequest = (sc.PromptTokens + l.BlockSize - 1) / l.BlockSize
	l.Blocks = f.blocksPerRequest * sc.CacheRequests
	f.bytesPerRequest = uint64(l.BytesPerToken()) * uint64(f.blocksPerRequest*l.BlockSize)
	if f.onePair, err = wireFloor(sc.Provider, sc.Rails, int(f.bytesPerRequest), cpus); err != nil {
		return nil, err
	}
	// The floor's own spread, over more rounds, sets the handoffs' tails beside the wire's.
	if f.rounds, err = wireFloorRounds(sc.Provider, sc.Rails, int(f.bytesPerRequest), sc.TP, l.Regions(), 31, cpus); err != nil {
		return nil, err
	}
	f.tp = f.rounds[len(f.rounds)/2]
	sc.Logf("wire floor over %d endpoint pairs at once: %.1f ms", sc.TP, ms(f.tp))
	if f.underLoad, err = floorUnderLoad(sc, *l, f.blocksPerRequest, int(f.bytesPerRequest), cpus); err != nil {
		return nil, err
	}
	sc.Logf("the same under the engines' CPU work at %.0f QPS: %.1f ms", sc.QPS, ms(f.underLoad))
	if sc.LayerGroups > 1 {
		groupBytes, groupRegions := int(f.bytesPerRequest)/sc.LayerGroups, l.Regions()/sc.LayerGroups
		if f.lastGroup, err = wireFloorParallel(sc.Provider, sc.Rails, groupBytes, sc.TP, groupRegions, cpus); err != nil {
			return nil, err
		}
		sc.Logf("the last of %d layer groups over %d endpoint pairs: %.1f ms", sc.LayerGroups, sc.TP, ms(f.lastGroup))
	}
	return f, nil
}

// runModes runs every mode on one pair of agents and adds each mode's result, held
// against the floors, to rep.
func runModes(ctx context.Context, sc Scenario, f *floors, prefill time.Duration, rep *Report) error {
	a, b, err := agentproc.StartPairWith(sc.AgentBin, sc.WorkDir, sc.Provider, sc.agents())
	if err != nil {
		return err
	}
	defer a.Stop()
	defer b.Stop()
	for _, m := range sc.modes() {
		before := scrape(a, b)
		r, leaked, err := runMode(ctx, sc, m, f.layout, a, b, prefill)
		if err != nil {
			return fmt.Errorf("%s: %w", m.name, err)
		}
		rep.LeakedRanks += leaked
		r.BytesPerRequest, r.WireFloorMs, r.WireFloorOnePairMs, r.WireFloorUnderEngineLoadMs = f.bytesPerRequest, ms(f.tp), ms(f.onePair), ms(f.underLoad)
		// What is left to move at prefill end: the request, or its last layer group.
		left := r.WireFloorMs
		if m.groups > 1 {
			r.LayerGroups, r.WireFloorLastGroupMs = m.groups, ms(f.lastGroup)
			left = r.WireFloorLastGroupMs
		}
		r.overheads(left)
		r.StagesMs = stageMeans(m.agent, before, scrape(a, b))
		sc.Logf("%s: agent stage means per rank (ms): %v", r.Mode, r.StagesMs)
		rep.Results = append(rep.Results, *r)
	}
	if rep.LeakedRanks > 0 {
		// An agent broke its promise to answer: keep what the agents said about it.
		for _, line := range warnings(a, b) {
			sc.Logf("%s", line)
		}
	}
	return nil
}

// overheads is each handoff minus left, the wire floor of what was left to move at
// prefill end: in all, and split by whether the handoff shared the wire with another.
func (r *Result) overheads(left float64) {
	var over, alone, overlapped []float64
	for i, h := range r.handoffs {
		over = append(over, h-left)
		if overlaps(r.spans, i) {
			overlapped = append(overlapped, h-left)
		} else {
			alone = append(alone, h-left)
		}
	}
	r.CoordinationOverhead = report.Of(over)
	r.HandoffsAlone, r.CoordinationOverheadAlone, r.CoordinationOverheadOverlapped = len(alone), report.Of(alone), report.Of(overlapped)
}

// compare sets the ratios between the modes.
func (rep *Report) compare() {
	byName := map[string]*Result{}
	for i := range rep.Results {
		byName[rep.Results[i].Mode] = &rep.Results[i]
	}
	push := byName["push"]
	rep.PushOverFloorP50 = push.Handoff.P50 / push.WireFloorMs
	rep.PullMinusPushP50 = byName["pull"].Handoff.P50 - push.Handoff.P50
	if l := byName["push-layered"]; l != nil && l.Handoff.P50 > 0 {
		rep.PushOverLayeredP50 = push.Handoff.P50 / l.Handoff.P50
	}
}

// scrape reads the agents' metrics, summed over the agents.
func scrape(agents ...*agentproc.Proc) map[string]float64 {
	sum := map[string]float64{}
	for _, a := range agents {
		if m, err := a.Metrics(); err == nil {
			for k, v := range m {
				sum[k] += v
			}
		}
	}
	return sum
}

// stageMeans reads the agents' stage histograms between two scrapes: mean milliseconds
// per stage of what ran in between.
func stageMeans(mode agentv1.Mode, before, after map[string]float64) map[string]float64 {
	name := map[agentv1.Mode]string{agentv1.Mode_MODE_PUSH: "push", agentv1.Mode_MODE_PULL: "pull"}[mode]
	out := map[string]float64{}
	for _, stage := range []string{"rendezvous_wait", "post", "wire", "notify"} {
		labels := fmt.Sprintf(`{mode="%s",stage="%s"}`, name, stage)
		sum := after["kvhandoff_agent_handoff_stage_seconds_sum"+labels] - before["kvhandoff_agent_handoff_stage_seconds_sum"+labels]
		count := after["kvhandoff_agent_handoff_stage_seconds_count"+labels] - before["kvhandoff_agent_handoff_stage_seconds_count"+labels]
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

// warnings are the agents' WARN and ERROR log lines, each after its agent's name.
func warnings(agents ...*agentproc.Proc) []string {
	var out []string
	for _, p := range agents {
		for _, line := range strings.Split(p.Log(), "\n") {
			if strings.Contains(line, `"level":"WARN"`) || strings.Contains(line, `"level":"ERROR"`) {
				out = append(out, p.Name+": "+line)
			}
		}
	}
	return out
}

// overlaps reports whether span i shares any instant with another span.
func overlaps(spans [][2]time.Time, i int) bool {
	for j, s := range spans {
		if j != i && s[0].Before(spans[i][1]) && spans[i][0].Before(s[1]) {
			return true
		}
	}
	return false
}

// ranks is a mode's engines: one prefill and one decode engine per TP rank.
type ranks struct {
	P, D []*simengine.Engine
}

func startRanks(ctx context.Context, sc Scenario, m mode, l simengine.Layout, a, b *agentproc.Proc) (*ranks, error) {
	rk := &ranks{}
	for r := range sc.TP {
		p, err := simengine.Start(ctx, simengine.Config{ID: "qwen3-prefill-" + m.name, Role: agentv1.Role_ROLE_PREFILL, Mode: m.agent,
			Rank: r, Layout: l, Socket: a.Socket,
			Lease: sc.Lease, RegistrationTimeout: sc.RegistrationTimeout, BlocksTTL: sc.BlocksTTL})
		if err != nil {
			rk.stop()
			return nil, err
		}
		rk.P = append(rk.P, p)
		d, err := simengine.Start(ctx, simengine.Config{ID: "qwen3-decode-" + m.name, Role: agentv1.Role_ROLE_DECODE, Mode: m.agent,
			Rank: r, Layout: l, Socket: b.Socket,
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
// outcome is one request's: its TTFT, and its handoff from prefill end (from) to the
// decode side holding the KV (to), when its first rank had it.
type outcome struct {
	ttft                time.Duration
	from, firstRank, to time.Time
	descriptors         uint64
	err                 error
}

// runMode runs one mode's arrivals; it also returns the ranks' blocks it had to hold
// back because an agent never answered for them.
func runMode(ctx context.Context, sc Scenario, m mode, l simengine.Layout, a, b *agentproc.Proc, prefill time.Duration) (*Result, int64, error) {
	rk, err := startRanks(ctx, sc, m, l, a, b)
	if err != nil {
		return nil, 0, err
	}
	defer rk.stop()
	blocks := (sc.PromptTokens + l.BlockSize - 1) / l.BlockSize
	pf := newPrefillServer(rk, prefill, blocks, m.groups)
	defer pf.stop()
	// Decode engines renew their registrations' leases, as vLLM's connector does (three
	// per lease): a registration waiting for a queued prefill must not expire for want of
	// a heartbeat, which frees nothing for a TTL and starves the queue behind it.
	hctx, stopHeartbeats := context.WithCancel(ctx)
	defer stopHeartbeats()
	go heartbeat(hctx, rk, sc.Lease)
	one := func(req string, arrival time.Time, t turn) outcome {
		if m.agent == agentv1.Mode_MODE_PUSH {
			return pushRequest(ctx, rk, pf, req, arrival, blocks, t)
		}
		return pullRequest(ctx, rk, pf, req, arrival, blocks, t)
	}
	// Warm-up: the first transfer on a connection pays for forming it (docs/design.md, libfabric pitfall 3).
	for i := range 2 {
		if o := one(fmt.Sprintf("warmup-%d", i), time.Now(), first()); o.err != nil {
			sc.Logf("%s: warm-up request failed: %v", m.name, o.err)
		}
	}
	// Both modes get the same arrival sequence: their TTFTs compare like with like.
	rng := rand.New(rand.NewPCG(sc.Seed, 0))
	var wg sync.WaitGroup
	var mu sync.Mutex
	var outs []outcome
	start := time.Now()
	next := start
	t := first()
	for i := 0; ; i++ {
		next = next.Add(time.Duration(rng.ExpFloat64() / sc.QPS * float64(time.Second)))
		if next.Sub(start) > sc.Duration {
			break
		}
		time.Sleep(time.Until(next)) // open-loop Poisson arrivals
		wg.Add(1)
		go func(req string, arrival time.Time, t turn) {
			defer wg.Done()
			o := one(req, arrival, t)
			mu.Lock()
			outs = append(outs, o)
			mu.Unlock()
		}(fmt.Sprintf("req-%05d", i), next, t)
		t = t.next()
	}
	wg.Wait()
	// Every request has waited for its prefill's blocks to be returned (or counted leaked).
	res := &Result{Mode: m.name, QPS: sc.QPS, PromptTokens: sc.PromptTokens, Arrivals: len(outs)}
	for _, e := range append(rk.P, rk.D...) {
		res.UnreturnedBlocks += l.Blocks - e.FreeBlocks()
	}
	var ttfts, spread []float64
	var desc uint64
	for _, o := range outs {
		if o.err != nil {
			res.FailedRequests++
			sc.Logf("%s failed: %v", res.Mode, o.err)
			continue
		}
		res.VerifiedRequests++
		ttfts = append(ttfts, ms(o.ttft))
		res.handoffs = append(res.handoffs, ms(o.to.Sub(o.from)))
		res.spans = append(res.spans, [2]time.Time{o.from, o.to})
		spread = append(spread, ms(o.to.Sub(o.firstRank)))
		desc += o.descriptors
	}
	res.TTFT, res.Handoff, res.RankSpread = report.Of(ttfts), report.Of(res.handoffs), report.Of(spread)
	if res.VerifiedRequests > 0 {
		res.DescriptorsPerRequest = float64(desc) / float64(res.VerifiedRequests)
	}
	sc.Logf("%s: %d verified, %d failed; handoff p50 %.1f ms", res.Mode, res.VerifiedRequests, res.FailedRequests, res.Handoff.P50)
	return res, pf.leaked.Load(), nil
}

// heartbeat renews every decode rank's leases three times per lease (the agents' 30 s
// default when the scenario sets none) until ctx ends.
func heartbeat(ctx context.Context, rk *ranks, lease time.Duration) {
	if lease <= 0 {
		lease = 30 * time.Second
	}
	t := time.NewTicker(lease / 3)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, d := range rk.D {
			_ = d.Heartbeat(ctx) // a failed beat is the lease's business
		}
	}
}
