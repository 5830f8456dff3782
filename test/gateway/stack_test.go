package gateway

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/epp"
	"github.com/kvhandoff/kvhandoff/internal/router"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/test/loopback"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
)

// engine is a simulated vLLM engine on a loopback address of its own, as pods have.
type engine struct {
	*vllmserver.Server
	discovery.Engine
	host string
}

func serve(t testing.TB, host string, port int, h http.Handler) string {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, itoa(port)))
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = hs.Serve(l) }()
	t.Cleanup(func() { _ = hs.Close() })
	return "http://" + l.Addr().String()
}

func startEngine(t testing.TB, id, host string, kv vllmserver.KV, tpot time.Duration) *engine {
	t.Helper()
	s := vllmserver.New(vllmserver.Config{EngineID: id, Model: "tiny", SideChannelHost: "127.0.0.1", SideChannelPort: 5600, TP: 1, KV: kv, TPOT: tpot})
	u := serve(t, host, 0, s)
	return &engine{Server: s, host: host, Engine: discovery.Engine{URL: u, EngineID: id, Host: "127.0.0.1", SideChannelPort: 5600, TensorParallelSize: 1}}
}

type options struct {
	mode     kvv1.TransferMode
	policy   kvv1.HandoffFailurePolicy
	failOpen bool
	bodyMode string        // ext_proc's request body mode (default FULL_DUPLEX_STREAMED)
	inFlight int           // the EPP's MaxInFlight (0: its default)
	ranks    int           // leg-runner ports per decode pod, as data-parallel ranks (0: 1)
	tpot     time.Duration // decode engines' time per token
}

// stack is two prefill and two decode engines, a leg runner beside each decode engine,
// the endpoint picker, Envoy in front, and the standalone router over the same engines
// for comparison.
type stack struct {
	prefill, decode []*engine
	legPort         int   // the first of legPorts
	legPorts        []int // the InferencePool's target ports
	// legRunners and legRegs: each decode engine's leg runner on each port, reached
	// directly (decode engine by decode engine).
	legRunners []string
	legRegs    []*prometheus.Registry
	epp        *epp.Server
	eppReg     *prometheus.Registry
	eppGRPC    *grpc.Server
	gateway    string // Envoy
	router     string // the standalone router
	set        *discovery.Set
}

func startStack(t testing.TB, o options) *stack {
	t.Helper()
	kv := vllmserver.NewLocalKV()
	st := &stack{}
	for i := range 2 {
		st.prefill = append(st.prefill, startEngine(t, fmt.Sprintf("prefill-%d", i), loopback.New(t), kv, 0))
		st.decode = append(st.decode, startEngine(t, fmt.Sprintf("decode-%d", i), loopback.New(t), kv, o.tpot))
	}
	st.set = &discovery.Set{Mode: o.mode, HandoffFailurePolicy: o.policy, Source: "test"}
	for i := range 2 {
		st.set.Prefill = append(st.set.Prefill, st.prefill[i].Engine)
		st.set.Decode = append(st.set.Decode, st.decode[i].Engine)
	}

	// The same leg-runner ports on every decode pod, as the InferencePool's target ports:
	// one per data-parallel rank, each its own leg runner (here in front of the pod's one
	// engine). The pods' hosts are the test's own, so are their ports.
	for i := range max(o.ranks, 1) {
		st.legPorts = append(st.legPorts, 8200+i)
	}
	st.legPort = st.legPorts[0]
	var pool []HostPort
	for _, d := range st.decode {
		for _, port := range st.legPorts {
			cfg := router.Defaults()
			cfg.ScrapeInterval, cfg.Local = 0, d.URL
			reg := prometheus.NewRegistry()
			cfg.Registry, cfg.Gatherer = reg, reg
			r := router.New(cfg)
			r.Update(st.set)
			st.legRunners = append(st.legRunners, serve(t, d.host, port, r))
			st.legRegs = append(st.legRegs, reg)
			pool = append(pool, HostPort{d.host, port})
		}
	}
	rcfg := router.Defaults()
	rcfg.ScrapeInterval = 0
	r := router.New(rcfg)
	r.Update(st.set)
	st.router = serve(t, "127.0.0.1", 0, r)

	cfg := epp.Defaults()
	cfg.LegRunnerPorts, cfg.ScrapeInterval = nil, 0
	for _, p := range st.legPorts {
		cfg.LegRunnerPorts = append(cfg.LegRunnerPorts, int32(p))
	}
	if o.inFlight > 0 {
		cfg.MaxInFlight = o.inFlight
	}
	st.eppReg = prometheus.NewRegistry()
	cfg.Registry = st.eppReg
	st.epp = epp.New(cfg)
	st.epp.Update(st.set)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	st.eppGRPC = grpc.NewServer()
	st.epp.Register(st.eppGRPC)
	go func() { _ = st.eppGRPC.Serve(l) }()
	t.Cleanup(st.eppGRPC.Stop)

	st.gateway = startEnvoy(t, envoyBinary(t), EnvoyParams{EPP: l.Addr().(*net.TCPAddr).Port, FailOpen: o.failOpen, BodyMode: o.bodyMode, Pool: pool})
	return st
}

// post sends a completion and returns the status, the response headers and the text.
func post(t *testing.T, url, prompt string, headers map[string]string) (int, http.Header, string) {
	t.Helper()
	body := fmt.Sprintf(`{"model":"tiny","prompt":%q,"max_tokens":8}`, prompt)
	req, err := http.NewRequest(http.MethodPost, url+"/v1/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	c := &http.Client{Timeout: 60 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		return resp.StatusCode, resp.Header, string(data)
	}
	var out struct {
		Choices []struct{ Text string } `json:"choices"`
	}
	if err := json.Unmarshal(data, &out); err != nil || len(out.Choices) != 1 {
		t.Fatalf("not a completion: %s", data)
	}
	return resp.StatusCode, resp.Header, out.Choices[0].Text
}

// decodeLegs is how many completions each decode engine received.
func (st *stack) decodeLegs() []int {
	out := make([]int, len(st.decode))
	for i, d := range st.decode {
		out[i] = len(d.Seen())
	}
	return out
}

func (st *stack) eppCount(outcome string) float64 {
	return counter(st.eppReg, "kvhandoff_epp_requests_total", outcome)
}

// counter sums a counter's series in reg that have a label of value label ("": all).
func counter(reg *prometheus.Registry, name, label string) float64 {
	mfs, _ := reg.Gather()
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if label == "" || slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetValue() == label }) {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// listener is an address no request should reach, and a check of whether one did.
func listener(t testing.TB, host string) (string, func() bool) {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l.Addr().String(), func() bool { return dialled(t, l.(*net.TCPListener)) }
}

// dialled reports whether a connection waits in l's backlog: a dial completes in the
// kernel before the dialler goes on, so once a request's answer is in, a leg sent to l
// is there. The deadline only bounds the wait for none.
func dialled(t testing.TB, l *net.TCPListener) bool {
	t.Helper()
	if err := l.SetDeadline(time.Now().Add(50 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	c, err := l.Accept()
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// waitFor polls cond until it holds (Eventually), failing the test after 30 s.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
