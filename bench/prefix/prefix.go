// Package prefix is the prefix-aware routing benchmark (make bench-prefix): multi-turn
// conversations that share a system prompt, through the router binary to simulated
// engines with vLLM-like prefix caches whose KV moves through two real transfer agents,
// load-only against prefix-aware routing on the same conversations.
package prefix

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/bench/report"
	"github.com/kvhandoff/kvhandoff/bench/routerproc"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/test/agentproc"
	"github.com/kvhandoff/kvhandoff/test/simengine"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// Model is the name the simulated engines serve.
const Model = "sim"

// Scenario is the conversations and the engines every configuration runs.
type Scenario struct {
	// Conversations start at Poisson times, Rate a second; each has Turns turns, sent
	// one after the other: the next once the last answer is in, after a think time
	// (exponential, Think on average).
	Conversations, Turns int
	Rate                 float64
	Think                time.Duration
	// SystemTokens open every conversation (the same in all); each turn adds the last
	// answer (MaxTokens tokens) and a user message of UserTokens, or ShortTokens on the
	// even turns (a follow-up: "and then?").
	SystemTokens, UserTokens, ShortTokens, MaxTokens int
	// Prefills and Decodes are the engines; CacheBlocks each one's prefix cache, in blocks
	// of 16 tokens; PrefillPerToken the compute time of a prompt token (on either pool),
	// TPOT the time per output token.
	Prefills, Decodes, CacheBlocks int
	PrefillPerToken, TPOT          time.Duration
	// MinPrefillTokens is the prefix-aware configurations' threshold.
	MinPrefillTokens int
	Seed             uint64
	AgentBin         string
	RouterBin        string
	WorkDir          string
	Log              io.Writer
}

// Default is the report's workload: 200 conversations of 5 turns over a 2048-token
// system prompt, on 2 prefill and 4 decode engines.
func Default() Scenario {
	return Scenario{Conversations: 200, Turns: 5, Rate: 4, Think: time.Second, SystemTokens: 2048, UserTokens: 256, ShortTokens: 16,
		MaxTokens: 32, Prefills: 2, Decodes: 4, CacheBlocks: 4096, PrefillPerToken: 50 * time.Microsecond, TPOT: 10 * time.Millisecond,
		MinPrefillTokens: 128, Seed: 1}
}

func (sc Scenario) logf(format string, args ...any) {
	if sc.Log != nil {
		fmt.Fprintf(sc.Log, format+"\n", args...)
	}
}

// Config is one routing configuration.
type Config struct {
	Name    string            `json:"name"`
	Mode    kvv1.TransferMode `json:"mode"`
	Routing kvv1.RoutingSpec  `json:"routing"`
}

// Configs are the configurations the report compares, in both modes.
func (sc Scenario) Configs() []Config {
	var out []Config
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		out = append(out,
			Config{"load only", mode, kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoiceLoadOnly, LoadWeight: 1}},
			Config{"prefix-aware", mode, kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoicePrefixAware, OverlapWeight: 4, LoadWeight: 1}},
			Config{fmt.Sprintf("prefix-aware, decode alone under %d", sc.MinPrefillTokens), mode, kvv1.RoutingSpec{
				DecodeChoice: kvv1.DecodeChoicePrefixAware, OverlapWeight: 4, LoadWeight: 1, MinPrefillTokens: int32(sc.MinPrefillTokens)}},
		)
	}
	return out
}

// Result is one configuration's outcome.
type Result struct {
	Config
	Requests int            `json:"requests"`
	Outcomes map[string]int `json:"outcomes"`
	// TTFT is the client's, send to first byte; FollowUps of the short turns, Long of the
	// others after the first.
	TTFT      report.Percentiles `json:"ttft_ms"`
	FollowUps report.Percentiles `json:"ttft_follow_ups_ms"`
	Long      report.Percentiles `json:"ttft_long_turns_ms"`
	// BytesPerRequest is the KV the agents moved (pull counted once) over all requests.
	BytesPerRequest float64 `json:"kv_bytes_per_request"`
	// PrefillLegs and DecodeOnly count requests that took a prefill leg and that did not.
	PrefillLegs int `json:"prefill_legs"`
	DecodeOnly  int `json:"decode_only"`
	// DecodeHitRate is the decode engines' prefix-cache hits over their queries, tokens.
	DecodeHitRate float64 `json:"decode_prefix_hit_rate"`
	// Moved counts conversations whose turns were served by more than one decode engine.
	Moved int `json:"conversations_moved"`
}

// Report is the whole run.
type Report struct {
	Machine  string   `json:"machine"`
	Scenario Scenario `json:"scenario"`
	// BytesPerToken is the simulated model's KV per token.
	BytesPerToken int      `json:"kv_bytes_per_token"`
	Results       []Result `json:"results"`
}

// turn is one request of a conversation.
type turn struct {
	conv, n int
	prompt  []int
}

// conversations builds every conversation's prompts: the shared system prompt, then
// each turn's answer stand-in and user message appended to the last prompt.
func (sc Scenario) conversations() (starts []time.Duration, convs [][]turn) {
	rng := rand.New(rand.NewPCG(sc.Seed, 0))
	system := make([]int, sc.SystemTokens)
	for i := range system {
		system[i] = rng.IntN(150000)
	}
	t := time.Duration(0)
	for c := range sc.Conversations {
		t += time.Duration(rng.ExpFloat64() / sc.Rate * float64(time.Second))
		starts = append(starts, t)
		prompt := append([]int(nil), system...)
		var turns []turn
		for n := range sc.Turns {
			add := sc.UserTokens
			if n > 0 {
				if n%2 == 1 {
					add = sc.ShortTokens
				}
				add += sc.MaxTokens // the last answer, as the client sends it back
			}
			for range add {
				prompt = append(prompt, rng.IntN(150000))
			}
			turns = append(turns, turn{conv: c, n: n, prompt: append([]int(nil), prompt...)})
		}
		convs = append(convs, turns)
	}
	return starts, convs
}

// layout is the simulated model: 2 KiB of KV a token in 16-token blocks.
func (sc Scenario) layout() simengine.Layout {
	return simengine.Layout{Layers: 4, BlockSize: 16, KVHeads: 8, HeadDim: 16, DTypeBytes: 2, TP: 1, Blocks: 8192}
}

// Run runs every configuration on the same conversations.
func Run(ctx context.Context, sc Scenario) (*Report, error) {
	rep := &Report{Machine: fmt.Sprintf("%d cores", runtime.NumCPU()), Scenario: sc, BytesPerToken: sc.layout().BytesPerToken()}
	starts, convs := sc.conversations()
	for _, cfg := range sc.Configs() {
		r, err := sc.runConfig(ctx, cfg, starts, convs)
		if err != nil {
			return nil, fmt.Errorf("%s, %s: %w", cfg.Mode, cfg.Name, err)
		}
		sc.logf("%s, %s: %v; TTFT p50 %.1f p90 %.1f ms; %.0f KV bytes a request; %d prefill legs, %d decode alone; decode hit rate %.2f; %d moved",
			cfg.Mode, cfg.Name, r.Outcomes, r.TTFT.P50, r.TTFT.P90, r.BytesPerRequest, r.PrefillLegs, r.DecodeOnly, r.DecodeHitRate, r.Moved)
		rep.Results = append(rep.Results, *r)
	}
	return rep, nil
}

func (sc Scenario) runConfig(ctx context.Context, cfg Config, starts []time.Duration, convs [][]turn) (*Result, error) {
	dir, err := os.MkdirTemp(sc.WorkDir, "config")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	a, b, err := agentproc.StartPair(sc.AgentBin, dir, "tcp;ofi_rxm")
	if err != nil {
		return nil, err
	}
	defer a.Stop()
	defer b.Stop()
	st, err := sc.startStack(ctx, cfg, a, b, dir)
	if err != nil {
		return nil, err
	}
	defer st.stop()
	res := &Result{Config: cfg, Outcomes: map[string]int{}}
	var ttfts, short, long []float64
	var mu sync.Mutex
	var wg sync.WaitGroup
	client := &http.Client{Timeout: 2 * time.Minute}
	rng := rand.New(rand.NewPCG(sc.Seed, 1))
	thinks := make([][]time.Duration, len(convs))
	for c := range convs {
		for range convs[c] {
			thinks[c] = append(thinks[c], time.Duration(rng.ExpFloat64()*float64(sc.Think)))
		}
	}
	start := time.Now()
	for c, turns := range convs {
		time.Sleep(time.Until(start.Add(starts[c]))) // open-loop conversation arrivals
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i, t := range turns {
				if i > 0 {
					time.Sleep(thinks[c][i]) // the user's think time, not a synchronisation
				}
				ttft, outcome := sc.send(client, st.url, t)
				mu.Lock()
				res.Requests++
				res.Outcomes[outcome]++
				if outcome == "ok" {
					ms := float64(ttft.Microseconds()) / 1e3
					ttfts = append(ttfts, ms)
					switch {
					case i%2 == 1:
						short = append(short, ms)
					case i > 0:
						long = append(long, ms)
					}
				}
				mu.Unlock()
				if outcome != "ok" {
					return
				}
			}
		}()
	}
	wg.Wait()
	res.TTFT, res.FollowUps, res.Long = report.Of(ttfts), report.Of(short), report.Of(long)
	decodes, err := st.decodeEngines()
	if err != nil {
		return nil, err
	}
	for _, engines := range decodes {
		if len(engines) > 1 {
			res.Moved++
		}
	}
	// The agents' counters: the prefill side writes (push) or is read (pull).
	moved, err := a.Metric(fmt.Sprintf(`kvhandoff_agent_transferred_bytes_total{mode="%s"}`, strings.ToLower(string(cfg.Mode))))
	if err != nil {
		return nil, err
	}
	res.BytesPerRequest = report.Round(moved / float64(max(res.Requests, 1)))
	var q, h int64
	for _, e := range st.decodes {
		mq, mh := e.PrefixCache()
		q, h = q+mq, h+mh
	}
	res.DecodeHitRate = report.Round(float64(h) / float64(max(q, 1)))
	for _, e := range st.prefills {
		res.PrefillLegs += len(e.Seen())
	}
	res.DecodeOnly = res.Requests - res.PrefillLegs
	return res, nil
}

// send posts one streamed completion, its request id naming the conversation, and
// returns its time to first byte and its outcome.
func (sc Scenario) send(c *http.Client, url string, t turn) (time.Duration, string) {
	body, _ := json.Marshal(map[string]any{"model": Model, "prompt": t.prompt, "max_tokens": sc.MaxTokens, "stream": true})
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", fmt.Sprintf("c%04d-t%d", t.conv, t.n))
	start := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		return 0, "error: " + err.Error()
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return 0, fmt.Sprintf("status %d: %s", resp.StatusCode, msg)
	}
	rd := bufio.NewReader(resp.Body)
	if _, err := rd.ReadByte(); err != nil {
		return 0, "no first byte: " + err.Error()
	}
	ttft := time.Since(start)
	if _, err := io.Copy(io.Discard, rd); err != nil {
		return 0, "broken stream: " + err.Error()
	}
	return ttft, "ok"
}

// decodeEngines reads the router's log: the decode engines that served each conversation.
func (s *stack) decodeEngines() (map[string]map[string]bool, error) {
	f, err := os.Open(s.router.Log)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]map[string]bool{}
	lines := bufio.NewScanner(f)
	lines.Buffer(make([]byte, 1<<20), 1<<20)
	for lines.Scan() {
		var l struct {
			Msg, Outcome, Decode string
			ClientID             string `json:"client_request_id"`
		}
		if json.Unmarshal(lines.Bytes(), &l) != nil || l.Msg != "request" || l.Outcome != "ok" {
			continue
		}
		conv, _, _ := strings.Cut(l.ClientID, "-")
		if out[conv] == nil {
			out[conv] = map[string]bool{}
		}
		out[conv][l.Decode] = true
	}
	return out, lines.Err()
}

// stack is one configuration's engines and router.
type stack struct {
	url               string
	router            *routerproc.Proc
	servers           []*http.Server
	kvs               []*vllmserver.AgentKV
	prefills, decodes []*vllmserver.Server
}

func (s *stack) serve(h http.Handler) (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	s.servers = append(s.servers, hs)
	go func() { _ = hs.Serve(l) }()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func (sc Scenario) startStack(ctx context.Context, cfg Config, a, b *agentproc.Proc, dir string) (*stack, error) {
	s := &stack{}
	mode := map[kvv1.TransferMode]agentv1.Mode{kvv1.TransferPush: agentv1.Mode_MODE_PUSH, kvv1.TransferPull: agentv1.Mode_MODE_PULL}[cfg.Mode]
	routing := cfg.Routing
	set := discovery.Set{Mode: cfg.Mode, Routing: &routing, BlockSize: 16, Source: "bench"}
	l := sc.layout()
	prefill := func(tokens int) time.Duration { return time.Duration(tokens) * sc.PrefillPerToken }
	for i := range sc.Prefills + sc.Decodes {
		role, agent, id := agentv1.Role_ROLE_PREFILL, a, fmt.Sprintf("prefill-%d", i)
		if i >= sc.Prefills {
			role, agent, id = agentv1.Role_ROLE_DECODE, b, fmt.Sprintf("decode-%d", i-sc.Prefills)
		}
		kv, err := vllmserver.StartAgentKV(ctx, simengine.Config{ID: id, Role: role, Mode: mode, Layout: l, Socket: agent.Socket})
		if err != nil {
			s.stop()
			return nil, err
		}
		s.kvs = append(s.kvs, kv)
		side, err := s.serve(vllmserver.SideChannel(vllmserver.SideChannelInfo{EngineID: id, Agent: kv.Agent(), TP: 1}))
		if err != nil {
			s.stop()
			return nil, err
		}
		// Both pools compute prompts at one speed: a decode engine serving a request alone
		// computes its uncached tail as a prefill engine would.
		e := vllmserver.New(vllmserver.Config{EngineID: id, Model: Model, SideChannelHost: "127.0.0.1", SideChannelPort: side, TP: 1, KV: kv,
			PrefillTime: prefill, TPOT: sc.TPOT, PrefixCacheBlocks: sc.CacheBlocks, BlockSize: 16})
		port, err := s.serve(e)
		if err != nil {
			s.stop()
			return nil, err
		}
		ep := discovery.Engine{URL: "http://127.0.0.1:" + strconv.Itoa(port), EngineID: id, Host: "127.0.0.1", SideChannelPort: int32(side), TensorParallelSize: 1}
		if role == agentv1.Role_ROLE_PREFILL {
			set.Prefill, s.prefills = append(set.Prefill, ep), append(s.prefills, e)
		} else {
			set.Decode, s.decodes = append(set.Decode, ep), append(s.decodes, e)
		}
	}
	endpoints := filepath.Join(dir, "endpoints.json")
	data, _ := json.MarshalIndent(set, "", "  ")
	if err := os.WriteFile(endpoints, data, 0o644); err != nil {
		s.stop()
		return nil, err
	}
	var err error
	if s.router, err = routerproc.Start(sc.RouterBin, endpoints, filepath.Join(dir, "router.log")); err != nil {
		s.stop()
		return nil, err
	}
	s.url = s.router.URL
	return s, nil
}

func (s *stack) stop() {
	if s.router != nil {
		s.router.Stop()
	}
	for _, hs := range s.servers {
		_ = hs.Close()
	}
	for _, kv := range s.kvs {
		kv.Stop()
	}
}

// Markdown writes the report's table.
func (r *Report) Markdown(w io.Writer) {
	sc := r.Scenario
	fmt.Fprintf(w, "%d conversations × %d turns over a %d-token shared system prompt (user turns %d tokens, follow-ups %d, answers %d); "+
		"%d prefill and %d decode simulated engines, prefix caches of %d blocks of 16 tokens, %d bytes of KV a token; %s.\n\n",
		sc.Conversations, sc.Turns, sc.SystemTokens, sc.UserTokens, sc.ShortTokens, sc.MaxTokens, sc.Prefills, sc.Decodes, sc.CacheBlocks,
		r.BytesPerToken, r.Machine)
	fmt.Fprintln(w, "| mode | routing | TTFT p50 / p90 (ms) | follow-ups | long turns after the first | KV moved a request | prefill legs | decode alone | decode hit rate | conversations moved | failed |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|")
	for _, x := range r.Results {
		failed := x.Requests - x.Outcomes["ok"]
		fmt.Fprintf(w, "| %s | %s | %.1f / %.1f | %.1f / %.1f | %.1f / %.1f | %.2f MB | %d | %d | %.0f%% | %d | %d |\n", strings.ToLower(string(x.Mode)), x.Name,
			x.TTFT.P50, x.TTFT.P90, x.FollowUps.P50, x.FollowUps.P90, x.Long.P50, x.Long.P90, x.BytesPerRequest/1e6, x.PrefillLegs, x.DecodeOnly,
			100*x.DecodeHitRate, x.Moved, failed)
	}
}

// Write saves the report as prefix.json and prefix.md in out.
func (r *Report) Write(out string) error {
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	if err := report.SaveJSON(out, "prefix.json", r); err != nil {
		return err
	}
	var b strings.Builder
	r.Markdown(&b)
	return os.WriteFile(filepath.Join(out, "prefix.md"), []byte(b.String()), 0o644)
}
