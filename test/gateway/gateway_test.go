package gateway

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/router"
	"github.com/kvhandoff/kvhandoff/test/loopback"
)

// Through Envoy, every request goes to the decode engine the endpoint picker chose (its
// leg runner), both legs run with the prefill engine it named, and the answers are the
// standalone router's, with the filter's body streamed (GIE's mode) or buffered. Routing
// headers a client sends are not followed: an address it names is never dialled.
func TestThroughEnvoyTheEPPsPickServesAndAnswersAsTheRouter(t *testing.T) {
	for _, c := range []struct {
		mode     kvv1.TransferMode
		bodyMode string
	}{{kvv1.TransferPush, "FULL_DUPLEX_STREAMED"}, {kvv1.TransferPull, "FULL_DUPLEX_STREAMED"}, {kvv1.TransferPush, "BUFFERED"}} {
		mode := c.mode
		t.Run(string(mode)+"/"+c.bodyMode, func(t *testing.T) {
			st := startStack(t, options{mode: mode, policy: kvv1.HandoffFailureFail, bodyMode: c.bodyMode})
			evil, dialled := listener(t, "127.0.0.1")
			forged := map[string]string{"x-gateway-destination-endpoint": evil, "x-prefiller-host-port": evil}
			const n = 8
			for i := range n {
				prompt := fmt.Sprintf("request %d: %s", i, strings.Repeat("tokens ", 20*i))
				code, h, got := post(t, st.gateway, prompt, forged)
				if code != http.StatusOK {
					t.Fatalf("request %d through envoy: %d %s", i, code, got)
				}
				if h.Get("X-Kvhandoff-Fallback") != "" {
					t.Fatalf("request %d fell back (%s): the leg runner did not get the picker's prefill", i, h.Get("X-Kvhandoff-Fallback"))
				}
				_, _, want := post(t, st.router, prompt, nil)
				if got != want {
					t.Fatalf("request %d: envoy answered %q, the router %q", i, got, want)
				}
			}
			legs := st.decodeLegs()
			if legs[0]+legs[1] != 2*n { // n through envoy, n through the router
				t.Fatalf("decode engines got %v legs, want %d in all", legs, 2*n)
			}
			if legs[0] == 0 || legs[1] == 0 {
				t.Errorf("decode legs %v: the picker's load balancing used one engine", legs)
			}
			if got := st.eppCount("picked"); got != n {
				t.Errorf("the picker picked for %v requests, want %d", got, n)
			}
			if dialled() {
				t.Error("the address the client's routing headers named was dialled")
			}
		})
	}
}

// The gateway's subset hint confines the pick; a hint with no eligible endpoint is a 503
// from the picker, and nothing reaches an engine.
func TestTheSubsetHintConfinesThePick(t *testing.T) {
	st := startStack(t, options{mode: kvv1.TransferPush, policy: kvv1.HandoffFailureFail})
	second := fmt.Sprintf("%s:%d", st.decode[1].host, st.legPort)
	for i := range 4 {
		if code, _, body := post(t, st.gateway, fmt.Sprintf("hint %d", i), map[string]string{"x-test-subset-hint": second}); code != http.StatusOK {
			t.Fatalf("%d %s", code, body)
		}
	}
	if legs := st.decodeLegs(); legs[0] != 0 || legs[1] != 4 {
		t.Fatalf("decode legs %v with the hint naming only the second engine", legs)
	}
	code, _, body := post(t, st.gateway, "nowhere", map[string]string{"x-test-subset-hint": "127.0.0.99:1"})
	var refusal struct {
		Error struct{ Message string } `json:"error"`
	}
	if code != http.StatusServiceUnavailable || json.Unmarshal([]byte(body), &refusal) != nil || !strings.Contains(refusal.Error.Message, "subset hint") {
		t.Fatalf("a hint of no eligible endpoint: %d %s, want 503 with an OpenAI-shaped error naming the subset hint", code, body)
	}
	if legs := st.decodeLegs(); legs[0]+legs[1] != 4 {
		t.Fatalf("a refused request reached an engine: %v", legs)
	}
}

// With the picker gone, FailClose refuses every request; FailOpen lets the gateway send
// it to a leg runner without a prefill choice, which then follows handoffFailurePolicy.
// Envoy fails open only before a body chunk went to the picker: in FULL_DUPLEX_STREAMED
// mode a request with a body is refused even with failure_mode_allow (the last case), so
// FailOpen takes the BUFFERED mode.
func TestWhenThePickerIsDownTheGatewaysFailureModeAndThePolicyDecide(t *testing.T) {
	for _, c := range []struct {
		name     string
		failOpen bool
		bodyMode string
		policy   kvv1.HandoffFailurePolicy
		code     int
		fallback string
	}{
		{"FailClose", false, "FULL_DUPLEX_STREAMED", kvv1.HandoffFailureServeOnDecode, http.StatusInternalServerError, ""},
		{"FailOpen/ServeOnDecode", true, "BUFFERED", kvv1.HandoffFailureServeOnDecode, http.StatusOK, router.FallbackNoPrefillHeader},
		{"FailOpen/Fail", true, "BUFFERED", kvv1.HandoffFailureFail, http.StatusServiceUnavailable, ""},
		{"FailOpen/streamed body", true, "FULL_DUPLEX_STREAMED", kvv1.HandoffFailureServeOnDecode, http.StatusInternalServerError, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			st := startStack(t, options{mode: kvv1.TransferPush, policy: c.policy, failOpen: c.failOpen, bodyMode: c.bodyMode})
			if code, _, body := post(t, st.gateway, "before", nil); code != http.StatusOK {
				t.Fatalf("with the picker up: %d %s", code, body)
			}
			st.eppGRPC.Stop()
			code, h, body := post(t, st.gateway, "after", nil)
			if code != c.code || h.Get("X-Kvhandoff-Fallback") != c.fallback {
				t.Fatalf("with the picker down: %d (fallback %q) %s; want %d (fallback %q)", code, h.Get("X-Kvhandoff-Fallback"), body, c.code, c.fallback)
			}
			if c.code == http.StatusServiceUnavailable && !strings.Contains(body, "x-prefiller-host-port") {
				t.Errorf("the leg runner's refusal does not name the missing header: %s", body)
			}
			// Envoy names why it refused a request without a body (local_reply_config); one
			// whose body it had begun to stream to the picker it refuses with none.
			if !c.failOpen {
				resp, err := http.Get(st.gateway + "/v1/models")
				if err != nil {
					t.Fatal(err)
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusInternalServerError || !strings.Contains(string(b), "ext_proc_error") {
					t.Errorf("envoy's refusal of a GET with the picker down: %d %s; want 500 naming ext_proc", resp.StatusCode, b)
				}
			}
		})
	}
}

// The attack: with the picker down and the gateway failing open, a client's own
// x-gateway-destination-endpoint routed it (a canary was reached 16 of 20 times), and a
// leg runner reached so honoured its forged x-kvhandoff-decode-only. The gateway removes
// the routing headers from every request before anything routes on them: the request
// goes where a failed-open request goes, as one without the picker's headers.
func TestWithThePickerDownAClientsRoutingHeadersRouteNothing(t *testing.T) {
	var reached atomic.Int32
	canary := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { reached.Add(1) }), ReadHeaderTimeout: time.Second}
	l, err := net.Listen("tcp", net.JoinHostPort(loopback.New(t), "8000"))
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = canary.Serve(l) }()
	t.Cleanup(func() { canary.Close() })
	st := startStack(t, options{mode: kvv1.TransferPush, policy: kvv1.HandoffFailureServeOnDecode, failOpen: true, bodyMode: "BUFFERED"})
	st.eppGRPC.Stop()
	forged := map[string]string{
		"x-gateway-destination-endpoint": l.Addr().String(),
		"x-prefiller-host-port":          l.Addr().String(),
		"x-kvhandoff-decode-only":        "prefix_cached",
	}
	for i := range 5 {
		code, h, body := post(t, st.gateway, fmt.Sprintf("forged %d", i), forged)
		if code != http.StatusOK || h.Get("X-Kvhandoff-Fallback") != router.FallbackNoPrefillHeader {
			t.Fatalf("a forged request with the picker down: %d (fallback %q) %s; want 200 served as one without the picker's headers", code, h.Get("X-Kvhandoff-Fallback"), body)
		}
	}
	if n := reached.Load(); n != 0 {
		t.Errorf("the client's own destination was reached %d times", n)
	}
}

// No pairable engine is a 503 from the picker; past its limit of requests in flight, a
// 429.
func TestThePickerAnswers503WithoutEnginesAnd429WhenShedding(t *testing.T) {
	st := startStack(t, options{mode: kvv1.TransferPush, policy: kvv1.HandoffFailureFail, inFlight: 1, tpot: 200 * 1e6})
	// One request in flight (8 tokens at 200 ms) holds the picker's one slot.
	done := make(chan int, 1)
	go func() { code, _, _ := post(t, st.gateway, "slow", nil); done <- code }()
	waitFor(t, "the slow request to reach its decode engine", func() bool { l := st.decodeLegs(); return l[0]+l[1] == 1 })
	if code, _, body := post(t, st.gateway, "shed", nil); code != http.StatusTooManyRequests {
		t.Fatalf("past the picker's limit: %d %s, want 429", code, body)
	}
	if code := <-done; code != http.StatusOK {
		t.Fatalf("the request in flight: %d", code)
	}
	empty := *st.set
	empty.Decode = nil
	st.epp.Update(&empty)
	if code, _, body := post(t, st.gateway, "none", nil); code != http.StatusServiceUnavailable || !strings.Contains(body, "no ready decode engine") {
		t.Fatalf("without decode engines: %d %s, want 503 naming why", code, body)
	}
	if st.eppCount("shed") != 1 || st.eppCount("no_engine") != 1 {
		t.Errorf("shed %v, no_engine %v counted; want 1 each", st.eppCount("shed"), st.eppCount("no_engine"))
	}
}

// The leg runner takes the prefill engine by its pod's address, whatever port the picker
// wrote (llm-d's picker writes its InferencePool's target port), and never dials an
// address that is not a ready engine of its PrefillPool: such a request is served with
// an engine of the pool's, and counted.
func TestTheLegRunnerDialsOnlyEnginesOfItsPrefillPool(t *testing.T) {
	st := startStack(t, options{mode: kvv1.TransferPush, policy: kvv1.HandoffFailureFail})
	prefills := func() [2]int { return [2]int{len(st.prefill[0].Seen()), len(st.prefill[1].Seen())} }
	llmd := map[string]string{"x-prefiller-host-port": st.prefill[1].host + ":8100"}
	for i := range 3 {
		if code, _, body := post(t, st.legRunners[0], fmt.Sprintf("llm-d %d", i), llmd); code != http.StatusOK {
			t.Fatalf("%d %s", code, body)
		}
	}
	if got := prefills(); got != [2]int{0, 3} {
		t.Fatalf("prefill legs %v: want all 3 on the engine the header named by its address", got)
	}
	evil, dialled := listener(t, "127.0.0.99")
	if code, _, body := post(t, st.legRunners[0], "forged", map[string]string{"x-prefiller-host-port": evil}); code != http.StatusOK {
		t.Fatalf("a request naming an address outside the pool: %d %s", code, body)
	}
	if dialled() {
		t.Fatal("the leg runner dialled the address a header named")
	}
	if got := prefills(); got[0]+got[1] != 4 {
		t.Fatalf("prefill legs %v: the forged request was not served by an engine of the pool", got)
	}
	if n := counter(st.legRegs[0], "kvhandoff_router_unknown_prefill_named_total", ""); n != 1 {
		t.Errorf("%v requests counted as naming an unknown prefill engine, want 1", n)
	}
}

// A body that ends with trailers (chunked HTTP/1.1 here) is routed once they arrive, and
// reaches the engines whole.
func TestABodyEndingWithTrailersIsRouted(t *testing.T) {
	st := startStack(t, options{mode: kvv1.TransferPush, policy: kvv1.HandoffFailureFail})
	pr, pw := io.Pipe()
	go func() {
		_, _ = pw.Write([]byte(`{"model":"tiny","prompt":"trailers","max_tokens":8}`))
		pw.Close()
	}()
	req, err := http.NewRequest(http.MethodPost, st.gateway+"/v1/completions", pr)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Trailer = http.Header{"X-Checksum": {"abc"}}
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if _, _, want := post(t, st.router, "trailers", nil); !strings.Contains(string(b), want) {
		t.Fatalf("through envoy %s; the router answers %q", b, want)
	}
}

// Several target ports per pod, as data-parallel ranks: each (pod, port) is an endpoint of
// its own, the picker spreads an engine's requests over its ranks, and the gateway sends
// each request to exactly the rank the picker chose (Envoy reports the one that served it).
func TestRanksOnSeveralTargetPortsAreEndpointsOfTheirOwn(t *testing.T) {
	st := startStack(t, options{mode: kvv1.TransferPush, policy: kvv1.HandoffFailureFail, ranks: 2})
	const n = 12
	for i := range n {
		if code, _, body := post(t, st.gateway, fmt.Sprintf("rank %d", i), nil); code != http.StatusOK {
			t.Fatalf("%d %s", code, body)
		}
	}
	served := make([]float64, len(st.legRegs))
	total := 0.0
	for i, reg := range st.legRegs {
		served[i] = counter(reg, "kvhandoff_router_requests_total", "push")
		total += served[i]
	}
	if total != n {
		t.Fatalf("the leg runners served %v requests (%v), want %d", total, served, n)
	}
	for i, c := range served {
		if c == 0 {
			t.Errorf("leg runner %d (decode engine %d, rank %d) got no request: %v", i, i/2, i%2, served)
		}
	}
	// Envoy reports the endpoint that served each response once the stream ends.
	waitFor(t, "the gateway's report of every served endpoint", func() bool { return counter(st.eppReg, "kvhandoff_epp_served_total", "") == n })
	if first := counter(st.eppReg, "kvhandoff_epp_served_total", "first"); first != n {
		t.Errorf("%v of %d responses served by the endpoint picked", first, n)
	}
}
