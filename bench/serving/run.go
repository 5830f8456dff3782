package serving

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/bench/handoff"
	"github.com/kvhandoff/kvhandoff/bench/report"
	"github.com/kvhandoff/kvhandoff/bench/workload"
	"github.com/kvhandoff/kvhandoff/test/agentproc"
	"github.com/kvhandoff/kvhandoff/test/simengine"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
)

// Scenario is what the benchmark runs.
type Scenario struct {
	workload.Load
	workload.Env
	// KVBytesPerToken is the KV one token takes over all ranks: Qwen3-32B's shape with
	// the head dimension scaled down (the real model's is 256 KiB). Fixed rather than
	// derived from a bandwidth measurement, so every run and machine serves the same
	// workload; the report gives the offered load as a share of the measured bandwidth.
	KVBytesPerToken int
	// MaxTokens and TPOT are each request's output.
	MaxTokens int
	TPOT      time.Duration
	// Timeout bounds each request at the client: a run under overload reports failures
	// and finishes.
	Timeout   time.Duration
	RouterBin string
}

// Default is the reference load, each request answering 4 tokens.
func Default() Scenario {
	return Scenario{Load: workload.Default(), KVBytesPerToken: 4096, MaxTokens: 4, TPOT: 7 * time.Millisecond, Timeout: 60 * time.Second}
}

// Result is one mode's outcome.
type Result struct {
	Mode     string         `json:"mode"`
	Requests int            `json:"requests"`
	Outcomes map[string]int `json:"outcomes"`
	// TTFT is the client's: from the request's scheduled arrival to its first byte.
	TTFT report.Percentiles `json:"ttft_ms"`
	// RouterAdded is the router's own share of TTFT (its log, per request); RouterRelay
	// the part of it spent relaying the decode leg's first byte to the client.
	RouterAdded report.Percentiles `json:"router_added_ms"`
	RouterRelay report.Percentiles `json:"router_relay_ms"`
	// PrefillLeg is send to whole response; DecodeLeg is send to first byte.
	PrefillLeg report.Percentiles `json:"prefill_leg_ms"`
	DecodeLeg  report.Percentiles `json:"decode_leg_ms"`

	ttfts []float64
}

// Report is the whole run.
type Report struct {
	Machine         string  `json:"machine"`
	Provider        string  `json:"provider"`
	BandwidthGBps   float64 `json:"bandwidth_gb_per_s"`
	QPS             float64 `json:"qps"`
	PromptTokens    int     `json:"prompt_tokens"`
	TP              int     `json:"tp"`
	BytesPerRequest int     `json:"kv_bytes_per_request"`
	// OfferedLoad is QPS × bytes per request as a share of the measured bandwidth.
	OfferedLoad     float64  `json:"offered_load_fraction"`
	PrefillMs       float64  `json:"prefill_ms"`
	ArrivalsPerMode int      `json:"arrivals_per_mode"`
	Results         []Result `json:"results"`
	// PullMinusPushTTFTP50 is pull's TTFT p50 minus push's, on the same arrivals.
	PullMinusPushTTFTP50 float64 `json:"pull_minus_push_ttft_p50_ms"`
}

// arrival is one request of the seeded sequence both modes replay.
type arrival struct {
	id     string
	at     time.Duration // after the start
	prompt []int
}

func arrivals(sc Scenario) []arrival {
	rng := rand.New(rand.NewPCG(sc.Seed, 0))
	var out []arrival
	t := time.Duration(0)
	for i := 0; ; i++ {
		t += time.Duration(rng.ExpFloat64() / sc.QPS * float64(time.Second))
		if t > sc.Duration {
			return out
		}
		p := make([]int, sc.PromptTokens)
		for j := range p {
			p[j] = rng.IntN(150000)
		}
		out = append(out, arrival{id: fmt.Sprintf("req-%05d", i), at: t, prompt: p})
	}
}

// Run measures the wire, sizes the KV, and runs push then pull on the same arrivals.
func Run(ctx context.Context, sc Scenario) (*Report, error) {
	bw, err := handoff.MeasureBandwidth(sc.Provider, 1, 64<<20, nil)
	if err != nil {
		return nil, fmt.Errorf("measuring bandwidth: %w", err)
	}
	l := simengine.Qwen3_32B(sc.TP, 1)
	l.HeadDim = max(1, sc.KVBytesPerToken/(2*l.Layers*l.KVHeads*l.DTypeBytes))
	if err := l.Validate(); err != nil {
		return nil, fmt.Errorf("--kv-bytes-per-token %d: %w", sc.KVBytesPerToken, err)
	}
	blocks := (sc.PromptTokens + l.BlockSize - 1) / l.BlockSize
	l.Blocks = blocks * sc.CacheRequests
	prefill := simengine.Prefill{TP: sc.TP, Speedup: simengine.SpeedupFor(sc.TP, 1, sc.QPS, sc.PromptTokens, sc.Utilisation)}
	arr := arrivals(sc)
	rep := &Report{
		Machine:  fmt.Sprintf("%d cores", runtime.NumCPU()),
		Provider: sc.Provider, BandwidthGBps: report.Round(bw / 1e9), QPS: sc.QPS, PromptTokens: sc.PromptTokens, TP: sc.TP,
		BytesPerRequest: blocks * l.BlockSize * l.BytesPerToken(), PrefillMs: report.Round(float64(prefill.Time(sc.PromptTokens).Microseconds()) / 1e3),
		ArrivalsPerMode: len(arr),
	}
	rep.OfferedLoad = report.Round(sc.QPS * float64(rep.BytesPerRequest) / bw)
	sc.Logf("provider %s: %.2f GB/s; %d KV bytes per request; prefill %.1f ms; %d arrivals per mode", sc.Provider, bw/1e9,
		rep.BytesPerRequest, rep.PrefillMs, len(arr))

	a, b, err := agentproc.StartPair(sc.AgentBin, sc.WorkDir, sc.Provider)
	if err != nil {
		return nil, err
	}
	defer a.Stop()
	defer b.Stop()
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		st, err := startStack(ctx, mode, l, a, b, sc.RouterBin, sc.WorkDir, engineOpts{prefill: prefill.Time, tpot: sc.TPOT})
		if err != nil {
			return nil, fmt.Errorf("%s: %w", mode, err)
		}
		r, err := runMode(sc, st, mode, arr)
		st.stop()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", mode, err)
		}
		lines, err := st.requests()
		if err != nil {
			return nil, err
		}
		var added, relay, pre, dec []float64
		for _, x := range arr {
			if line, ok := lines[x.id]; ok && line.Outcome == "ok" {
				added, relay = append(added, line.AddedMs), append(relay, line.RelayMs)
				pre, dec = append(pre, line.PrefillMs), append(dec, line.DecodeMs)
			}
		}
		r.RouterAdded, r.RouterRelay, r.PrefillLeg, r.DecodeLeg = report.Of(added), report.Of(relay), report.Of(pre), report.Of(dec)
		sc.Logf("%s: %v; TTFT p50 %.1f ms; router-added p50 %.3f ms, p99 %.3f ms (relaying the first byte: p50 %.3f, p99 %.3f)",
			r.Mode, r.Outcomes, r.TTFT.P50, r.RouterAdded.P50, r.RouterAdded.P99, r.RouterRelay.P50, r.RouterRelay.P99)
		rep.Results = append(rep.Results, *r)
	}
	rep.PullMinusPushTTFTP50 = report.Round(rep.Results[1].TTFT.P50 - rep.Results[0].TTFT.P50)
	return rep, nil
}

// runMode replays the arrivals against one stack: open loop, streamed responses, every
// response's text checked against the prompt's tokens.
func runMode(sc Scenario, st *stack, mode kvv1.TransferMode, arr []arrival) (*Result, error) {
	client := &http.Client{Timeout: sc.Timeout}
	// Warm-up: connections between agents and engines form on first use.
	for i := range 2 {
		w := arrival{id: fmt.Sprintf("warmup-%d", i), prompt: arr[i%len(arr)].prompt}
		if _, outcome := send(client, st.URL, w, sc.MaxTokens); outcome != "ok" {
			return nil, fmt.Errorf("warm-up request: %s", outcome)
		}
	}
	res := &Result{Mode: strings.ToLower(string(mode)), Requests: len(arr), Outcomes: map[string]int{}}
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	for _, x := range arr {
		time.Sleep(time.Until(start.Add(x.at))) // open-loop arrivals on the shared schedule
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Counted from the scheduled arrival, so a late send is not hidden.
			late := time.Since(start.Add(x.at))
			ttft, outcome := send(client, st.URL, x, sc.MaxTokens)
			mu.Lock()
			defer mu.Unlock()
			res.Outcomes[outcome]++
			if outcome == "ok" {
				res.ttfts = append(res.ttfts, float64((late+ttft).Microseconds())/1e3)
			}
		}()
	}
	wg.Wait()
	res.TTFT = report.Of(res.ttfts)
	return res, nil
}

// send posts one streamed completion and returns its time to first byte (from the
// call) and its outcome: "ok", or why not.
func send(c *http.Client, url string, x arrival, maxTokens int) (time.Duration, string) {
	body, _ := json.Marshal(map[string]any{"model": Model, "prompt": x.prompt, "max_tokens": maxTokens, "stream": true})
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", x.id)
	start := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		return 0, "client_error"
	}
	defer resp.Body.Close()
	first := make([]byte, 1)
	if _, err := io.ReadFull(resp.Body, first); err != nil {
		return 0, "client_error"
	}
	ttft := time.Since(start)
	rest, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, "client_error"
	}
	if resp.StatusCode != http.StatusOK {
		return 0, "http_" + strconv.Itoa(resp.StatusCode)
	}
	words := make([]string, len(x.prompt))
	for i, t := range x.prompt {
		words[i] = strconv.Itoa(t)
	}
	if got, want := streamText(append(first, rest...)), strings.Join(vllmserver.Output(words, maxTokens), ""); got != want {
		return 0, "wrong_tokens"
	}
	return ttft, "ok"
}

// streamText joins the text of a completion stream's chunks.
func streamText(stream []byte) string {
	var out strings.Builder
	for _, ev := range bytes.Split(stream, []byte("\n\n")) {
		data, ok := bytes.CutPrefix(ev, []byte("data: "))
		if !ok || string(data) == "[DONE]" {
			continue
		}
		var c struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if json.Unmarshal(data, &c) == nil {
			for _, ch := range c.Choices {
				out.WriteString(ch.Text)
			}
		}
	}
	return out.String()
}
