package router_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/health"
	"github.com/kvhandoff/kvhandoff/internal/router"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
	"github.com/kvhandoff/kvhandoff/internal/router/routertest"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
)

const small = `{"model":"tiny","prompt":"one two three","max_tokens":3}`

func TestNoEligibleEngineAnswers503NamingWhatIsMissing(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	d := routertest.StartEngine(t, "d-0", kv, 0)
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		r := routertest.StartRouter(t, mode, nil, routertest.Engines(d))
		resp, body := routertest.Post(t, r.URL, "/v1/completions", small)
		if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "no ready prefill engine") {
			t.Errorf("%s: %s %s, want 503 naming the missing prefill engine", mode, resp.Status, body)
		}
		if got := r.Metric(t, "kvhandoff_router_requests_total", map[string]string{"outcome": router.OutcomeNoEngine}); got != 1 {
			t.Errorf("%s: no_engine counted %v times", mode, got)
		}
	}
	// Engines of different configurations are never paired.
	p := routertest.StartEngine(t, "p-0", kv, 0)
	pe, de := p.Engine, d.Engine
	pe.CompatHash, de.CompatHash = "aaa", "bbb"
	r := routertest.StartRouter(t, kvv1.TransferPush, []discovery.Engine{pe}, []discovery.Engine{de})
	resp, body := routertest.Post(t, r.URL, "/v1/completions", small)
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "compat-hash") {
		t.Errorf("mismatched hashes: %s %s, want 503 naming the compat-hash", resp.Status, body)
	}
	if len(p.Seen())+len(d.Seen()) != 0 {
		t.Error("a leg was sent to engines that cannot be paired")
	}
}

func TestPullRetriesARefusedPrefillOnAnotherEngine(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	good, d := routertest.StartEngine(t, "p-good", kv, 0), routertest.StartEngine(t, "d-0", kv, 0)
	// The dead engine is first: with equal load the router tries it first.
	r := routertest.StartRouter(t, kvv1.TransferPull, []discovery.Engine{routertest.DeadEngine(t, "p-dead"), good.Engine}, routertest.Engines(d))
	resp, body := routertest.Post(t, r.URL, "/v1/completions", small)
	if resp.StatusCode != http.StatusOK || routertest.CompletionText(t, body) != routertest.Want("one two three", 3) {
		t.Fatalf("%s: %s", resp.Status, body)
	}
	if got := r.Metric(t, "kvhandoff_router_leg_failures_total", map[string]string{"leg": "prefill", "engine": "p-dead", "reason": "refused"}); got != 1 {
		t.Errorf("refused prefill leg counted %v times", got)
	}
	if got := r.Metric(t, "kvhandoff_router_retries_total", map[string]string{"mode": "pull"}); got != 1 {
		t.Errorf("retries = %v, want 1", got)
	}
}

func TestPushAbortsTheDecodeLegAndRetriesThePairWhenPrefillFails(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	// p-bad fails after 100 ms, when the decode leg is surely waiting for its KV.
	bad, good := routertest.StartEngine(t, "p-bad", kv, 100*time.Millisecond), routertest.StartEngine(t, "p-good", kv, 0)
	bad.Fail.Store(http.StatusInternalServerError)
	d := routertest.StartEngine(t, "d-0", kv, 0)
	r := routertest.StartRouter(t, kvv1.TransferPush, routertest.Engines(bad, good), routertest.Engines(d))

	resp, body := routertest.Post(t, r.URL, "/v1/completions", small)
	if resp.StatusCode != http.StatusOK || routertest.CompletionText(t, body) != routertest.Want("one two three", 3) {
		t.Fatalf("%s: %s", resp.Status, body)
	}
	ds := d.Seen()
	if len(ds) != 2 {
		t.Fatalf("decode saw %d legs, want 2 (the aborted one and the retry)", len(ds))
	}
	// The first decode leg waited for KV that never came: the router closed it.
	routertest.Eventually(t, "the first decode leg is aborted", 5*time.Second, func() bool { return d.Seen()[0].Cancelled })
	if params(t, ds[0].Body)["remote_engine_id"] != "p-bad" || params(t, ds[1].Body)["remote_engine_id"] != "p-good" {
		t.Errorf("decode legs named %v then %v", params(t, ds[0].Body)["remote_engine_id"], params(t, ds[1].Body)["remote_engine_id"])
	}
	if params(t, ds[0].Body)["transfer_id"] == params(t, ds[1].Body)["transfer_id"] {
		t.Error("the retried pair reused the transfer id of the aborted one")
	}
	// Each attempt's legs carry a request id of their own (vLLM's NIXL connectors pair
	// legs by it): the client's on the first, a new one on the retry.
	first, retry := bad.Seen()[0].RequestID, good.Seen()[0].RequestID
	if first != resp.Header.Get("X-Request-Id") || retry == first || ds[0].RequestID != first || ds[1].RequestID != retry {
		t.Errorf("request ids: client %q; prefill legs %q, %q; decode legs %q, %q", resp.Header.Get("X-Request-Id"), first, retry, ds[0].RequestID, ds[1].RequestID)
	}
	if params(t, ds[0].Body)["remote_request_id"] != first || params(t, ds[1].Body)["remote_request_id"] != retry {
		t.Errorf("decode legs named prefill requests %v and %v, want %q and %q", params(t, ds[0].Body)["remote_request_id"], params(t, ds[1].Body)["remote_request_id"], first, retry)
	}
	if got := r.Metric(t, "kvhandoff_router_leg_failures_total", map[string]string{"engine": "p-bad", "reason": "status_5xx"}); got != 1 {
		t.Errorf("5xx prefill leg counted %v times", got)
	}
}

func TestAPrefillLegPastItsTimeoutIsRetried(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	slow, fast := routertest.StartEngine(t, "p-slow", kv, time.Hour), routertest.StartEngine(t, "p-fast", kv, 0)
	d := routertest.StartEngine(t, "d-0", kv, 0)
	r := routertest.StartRouter(t, kvv1.TransferPull, routertest.Engines(slow, fast), routertest.Engines(d), func(c *router.Config) { c.PrefillTimeout = 300 * time.Millisecond })
	resp, body := routertest.Post(t, r.URL, "/v1/completions", small)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %s", resp.Status, body)
	}
	if got := r.Metric(t, "kvhandoff_router_leg_failures_total", map[string]string{"engine": "p-slow", "reason": "timeout"}); got != 1 {
		t.Errorf("timed-out prefill leg counted %v times", got)
	}
	routertest.Eventually(t, "the timed-out leg is closed", 5*time.Second, func() bool { return slow.Seen()[0].Cancelled })
}

func TestEveryPrefillFailingAnswers502NamingTheEngine(t *testing.T) {
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		kv := vllmserver.NewLocalKV()
		a, b := routertest.StartEngine(t, "p-a", kv, 0), routertest.StartEngine(t, "p-b", kv, 0)
		a.Fail.Store(http.StatusServiceUnavailable)
		b.Fail.Store(http.StatusInternalServerError)
		d := routertest.StartEngine(t, "d-0", kv, 0)
		r := routertest.StartRouter(t, mode, routertest.Engines(a, b), routertest.Engines(d))
		resp, body := routertest.Post(t, r.URL, "/v1/completions", small)
		if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(body), "prefill engine p-b") {
			t.Errorf("%s: %s %s, want 502 naming the last prefill engine tried", mode, resp.Status, body)
		}
		if len(a.Seen()) != 1 || len(b.Seen()) != 1 {
			t.Errorf("%s: prefill legs %d and %d, want one each (one retry)", mode, len(a.Seen()), len(b.Seen()))
		}
	}
}

// A decode engine whose process is gone (killed, crashed) refuses connections until its
// pod leaves the router's set, which takes the kubelet and the manager a second or two.
// Nothing reached it, so the request goes to another decode engine: in pull the decode
// leg alone (the prefill engine's blocks wait for any reader), in push the pair (its
// prefill leg aborted first). Before, every request routed there in that time failed;
// the fleet's fault test (test/realnode) found it when a decode engine was killed.
func TestADecodeEngineThatRefusesIsRetriedOnAnother(t *testing.T) {
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		m := strings.ToLower(string(mode))
		kv := vllmserver.NewLocalKV()
		p, good := routertest.StartEngine(t, "p-0", kv, 0), routertest.StartEngine(t, "d-good", kv, 0)
		// One that accepts and hangs up without an answer (a killed engine's reset
		// connection, seen in the fault suite) is retried the same way.
		r := routertest.StartRouter(t, mode, routertest.Engines(p), []discovery.Engine{routertest.HangUpEngine(t, "d-gone"), good.Engine})
		if resp, body := routertest.Post(t, r.URL, "/v1/completions", small); resp.StatusCode != http.StatusOK {
			t.Fatalf("%s, a decode engine hanging up: %s %s", mode, resp.Status, body)
		}
		if got := r.Metric(t, "kvhandoff_router_leg_failures_total", map[string]string{"leg": "decode", "engine": "d-gone", "reason": "broken"}); got != 1 {
			t.Errorf("%s: decode legs hung up on %v, want 1", mode, got)
		}
		prefills := len(p.Seen())
		// The dead engine is first: with equal load the router tries it first.
		r = routertest.StartRouter(t, mode, routertest.Engines(p), []discovery.Engine{routertest.DeadEngine(t, "d-dead"), good.Engine})
		resp, body := routertest.Post(t, r.URL, "/v1/completions", small)
		if resp.StatusCode != http.StatusOK || routertest.CompletionText(t, body) != routertest.Want("one two three", 3) {
			t.Fatalf("%s: %s %s", mode, resp.Status, body)
		}
		if got := r.Metric(t, "kvhandoff_router_retries_total", map[string]string{"mode": m, "leg": "decode"}); got != 1 {
			t.Errorf("%s: decode retries %v, want 1", mode, got)
		}
		if got := r.Metric(t, "kvhandoff_router_leg_failures_total", map[string]string{"leg": "decode", "engine": "d-dead", "reason": "refused"}); got != 1 {
			t.Errorf("%s: refused decode legs %v, want 1", mode, got)
		}
		// Pull does not send the prefill leg again: its blocks wait for any reader.
		if mode == kvv1.TransferPull && (prefills != 1 || len(p.Seen()) != 2) {
			t.Errorf("%s: %d and %d prefill legs, want 1 each", mode, prefills, len(p.Seen())-prefills)
		}

		// With no other decode engine, the request fails naming the one that refused.
		r = routertest.StartRouter(t, mode, routertest.Engines(p), []discovery.Engine{routertest.DeadEngine(t, "d-dead")})
		resp, body = routertest.Post(t, r.URL, "/v1/completions", small)
		if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(body), "decode engine d-dead") {
			t.Errorf("%s, the only decode engine refusing: %s %s, want 502 naming it", mode, resp.Status, body)
		}
	}
}

func TestADecodeFailureAnswers502NamingTheEngine(t *testing.T) {
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		kv := vllmserver.NewLocalKV()
		p, d := routertest.StartEngine(t, "p-0", kv, 0), routertest.StartEngine(t, "d-broken", kv, 0)
		d.Fail.Store(http.StatusInternalServerError)
		r := routertest.StartRouter(t, mode, routertest.Engines(p), routertest.Engines(d))
		resp, body := routertest.Post(t, r.URL, "/v1/completions", small)
		if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(body), "decode engine d-broken") {
			t.Errorf("%s: %s %s, want 502 naming the decode engine", mode, resp.Status, body)
		}
		if got := r.Metric(t, "kvhandoff_router_requests_total", map[string]string{"mode": strings.ToLower(string(mode)),
			"outcome": router.OutcomeDecodeFailed, "engine": "d-broken"}); got != 1 {
			t.Errorf("%s: decode_failed counted %v times", mode, got)
		}
	}
}

// A decode engine that dies mid-stream (its process killed): the client's stream ends in
// an error event naming the engine and is cut (no [DONE]: nothing looks complete), and
// the router counts and logs it as stream_broken. Before, the router cut the connection
// without recording the request: the failures of a decode engine killed under load
// reached neither kvhandoff_router_requests_total nor the alert on it.
func TestADecodeStreamThatBreaksIsNamedAndCounted(t *testing.T) {
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		p := routertest.StartEngine(t, "p-0", vllmserver.NewLocalKV(), 0)
		dying := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "data: {\"choices\":[{\"index\":0,\"text\":\" one\"}]}\n\n")
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler) // the engine's process is gone
		}))
		t.Cleanup(dying.Close)
		d := discovery.Engine{URL: dying.URL, EngineID: "d-dying", Host: "127.0.0.1", SideChannelPort: 5600, TensorParallelSize: 1}
		logs := &routertest.RequestLogs{}
		r := routertest.StartRouter(t, mode, routertest.Engines(p), []discovery.Engine{d}, routertest.LogTo(logs))

		resp, err := (&http.Client{Timeout: 30 * time.Second}).Post(r.URL+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"tiny","prompt":"one two three","max_tokens":3,"stream":true}`))
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err == nil || strings.Contains(string(body), "[DONE]") {
			t.Errorf("%s: the broken stream reached the client whole (read error %v):\n%s", mode, err, body)
		}
		if !strings.Contains(string(body), `data: {"error":`) || !strings.Contains(string(body), "decode engine d-dying: the stream broke") {
			t.Errorf("%s: no error event naming the decode engine:\n%s", mode, body)
		}
		if got := r.Metric(t, "kvhandoff_router_requests_total", map[string]string{"mode": strings.ToLower(string(mode)),
			"outcome": router.OutcomeStreamBroken, "engine": "d-dying"}); got != 1 {
			t.Errorf("%s: stream_broken counted %v times, want 1", mode, got)
		}
		if lines := logs.Lines(); len(lines) != 1 || lines[0]["outcome"] != router.OutcomeStreamBroken {
			t.Errorf("%s: request log %v, want one line with outcome stream_broken", mode, lines)
		}
	}
}

func TestAnEngineRefusingTheRequestIsAnsweredAsItSaid(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	p, d := routertest.StartEngine(t, "p-0", kv, 0), routertest.StartEngine(t, "d-0", kv, 0)
	r := routertest.StartRouter(t, kvv1.TransferPull, routertest.Engines(p), routertest.Engines(d))
	resp, body := routertest.Post(t, r.URL, "/v1/completions", `{"model":"other","prompt":"x"}`)
	if resp.StatusCode != http.StatusNotFound || !strings.Contains(string(body), "does not exist") {
		t.Errorf("%s %s, want the engine's 404", resp.Status, body)
	}
	if len(p.Seen()) != 1 {
		t.Errorf("a refused request was retried: %d prefill legs", len(p.Seen()))
	}
	resp, body = routertest.Post(t, r.URL, "/v1/completions", `{"model":"tiny",`)
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "JSON object") {
		t.Errorf("malformed body: %s %s", resp.Status, body)
	}
}

func TestAClientThatDisconnectsCancelsBothLegs(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	p, d := routertest.StartEngine(t, "p-0", kv, time.Hour), routertest.StartEngine(t, "d-0", kv, 0)
	r := routertest.StartRouter(t, kvv1.TransferPush, routertest.Engines(p), routertest.Engines(d))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.URL+"/v1/completions", strings.NewReader(small))
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	routertest.Eventually(t, "both legs reach their engines", 5*time.Second, func() bool { return len(p.Seen()) == 1 && len(d.Seen()) == 1 })
	cancel()
	<-done
	routertest.Eventually(t, "both legs are cancelled", 5*time.Second, func() bool { return p.Seen()[0].Cancelled && d.Seen()[0].Cancelled })
	routertest.Eventually(t, "the request is counted as the client's", 5*time.Second, func() bool {
		return r.Metric(t, "kvhandoff_router_requests_total", map[string]string{"outcome": router.OutcomeClientGone}) == 1
	})
	if n := r.Metric(t, "kvhandoff_router_inflight", map[string]string{"engine": "d-0"}); n != 0 {
		t.Errorf("%v decode legs still counted in flight", n)
	}
}

func TestStreamsPassThroughByteForByteAndAsTheyCome(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	p := routertest.StartEngine(t, "p-0", kv, 0)
	// A decode engine that writes the stream in odd pieces and waits for the client to
	// have each piece before writing the next: a router that buffered would hang.
	pieces := []string{"data: {\"choices\":[{\"text\":\" a\"}]}\n", "\ndata: {\"choices\":[{\"text\":\" b\"", "}]}\n\ndata: [DONE]\n\n"}
	gotPiece := make(chan struct{})
	decode := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Cache-Control", "no-cache")
		for _, piece := range pieces {
			_, _ = w.Write([]byte(piece))
			w.(http.Flusher).Flush()
			select {
			case <-gotPiece:
			case <-time.After(10 * time.Second):
				return
			}
		}
	}))
	defer decode.Close()
	d := discovery.Engine{URL: decode.URL, EngineID: "d-0"}
	r := routertest.StartRouter(t, kvv1.TransferPull, routertest.Engines(p), []discovery.Engine{d})

	resp, err := http.Post(r.URL+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"tiny","prompt":"x y","stream":true,"stream_options":{"include_usage":true}}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.Header.Get("Content-Type") != "text/event-stream" || resp.Header.Get("Cache-Control") != "no-cache" {
		t.Errorf("headers not passed through: %v", resp.Header)
	}
	var got []byte
	buf := make([]byte, 4096)
	for _, piece := range pieces {
		for len(got) < len(strings.Join(pieces[:indexOf(pieces, piece)+1], "")) {
			n, err := resp.Body.Read(buf)
			got = append(got, buf[:n]...)
			if err != nil {
				t.Fatalf("after %q: %v", got, err)
			}
		}
		gotPiece <- struct{}{}
	}
	if string(got) != strings.Join(pieces, "") {
		t.Errorf("client got %q, the engine sent %q", got, strings.Join(pieces, ""))
	}
	if string(routertest.Field(t, p.Seen()[0].Body, "stream")) != "false" || routertest.Field(t, p.Seen()[0].Body, "stream_options") != nil {
		t.Errorf("the prefill leg must not stream: %s", p.Seen()[0].Body)
	}
}

func indexOf(s []string, x string) int {
	for i, v := range s {
		if v == x {
			return i
		}
	}
	return -1
}

func TestStreamedCompletionsThroughBothModes(t *testing.T) {
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		kv := vllmserver.NewLocalKV()
		p, d := routertest.StartEngine(t, "p-0", kv, 0), routertest.StartEngine(t, "d-0", kv, 0)
		r := routertest.StartRouter(t, mode, routertest.Engines(p), routertest.Engines(d))
		resp, body := routertest.Post(t, r.URL, "/v1/chat/completions", `{"model":"tiny","messages":[{"role":"user","content":"a b c"}],"max_tokens":6,"stream":true}`)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %s %s", mode, resp.Status, body)
		}
		if got, w := routertest.SSEText(t, body), strings.Join(vllmserver.Output([]string{"<user>", "a", "b", "c"}, 6), ""); got != w {
			t.Errorf("%s: streamed %q, want %q", mode, got, w)
		}
		if r.Metric(t, "kvhandoff_router_ttft_seconds", map[string]string{"mode": strings.ToLower(string(mode))}) != 1 ||
			r.Metric(t, "kvhandoff_router_added_seconds", map[string]string{"mode": strings.ToLower(string(mode))}) != 1 {
			t.Errorf("%s: TTFT and router-added latency not observed", mode)
		}
	}
}

// An engine's server may close a kept-alive connection just as the router writes the
// next leg on it (uvicorn closes idle connections after its keep-alive, 5 s in vLLM):
// the engine never answered, nor acted on, that leg. The router sends the leg again on a
// new connection instead of failing the request with a 502; nothing counts as a failed
// leg or a retry on another engine. Both legs, in both modes.
func TestALegOnAConnectionTheEngineClosedIsSentAgainOnANewOne(t *testing.T) {
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		kv := vllmserver.NewLocalKV()
		p, d := startClosingEngine(t, "p-0", kv), startClosingEngine(t, "d-0", kv)
		r := routertest.StartRouter(t, mode, routertest.Engines(p.Engine), routertest.Engines(d.Engine))
		// Until each engine has closed a kept-alive connection under a leg: in push, a
		// request answered before its prefill response was read tears that connection
		// down, and the next leg gets a new one.
		for i := 0; i < 3 || (i < 50 && (p.closed.Load() == 0 || d.closed.Load() == 0)); i++ {
			resp, body := routertest.Post(t, r.URL, "/v1/completions", small)
			if resp.StatusCode != http.StatusOK || routertest.CompletionText(t, body) != routertest.Want("one two three", 3) {
				t.Fatalf("%s: request %d: %s %s", mode, i, resp.Status, body)
			}
		}
		if p.closed.Load() == 0 || d.closed.Load() == 0 {
			t.Fatalf("%s: the engines closed %d and %d kept-alive connections; the test needs both to", mode, p.closed.Load(), d.closed.Load())
		}
		for _, leg := range []string{"prefill", "decode"} {
			if got := r.Metric(t, "kvhandoff_router_leg_failures_total", map[string]string{"leg": leg}); got != 0 {
				t.Errorf("%s: %v %s legs counted as failed", mode, got, leg)
			}
		}
		if got := r.Metric(t, "kvhandoff_router_retries_total", nil); got != 0 {
			t.Errorf("%s: %v retries on another engine", mode, got)
		}
	}
}

// closingEngine is a simulated engine whose server closes each connection the moment a
// second request arrives on it, without a byte of answer: a keep-alive timeout met by a
// request, every time.
type closingEngine struct {
	*routertest.Engine
	closed atomic.Int32
}

type connRequests struct{}

func startClosingEngine(t *testing.T, id string, kv vllmserver.KV) *closingEngine {
	t.Helper()
	e := &closingEngine{}
	s := vllmserver.New(vllmserver.Config{EngineID: id, Model: routertest.Model, SideChannelHost: "127.0.0.1", SideChannelPort: 5600, TP: 1, KV: kv})
	hs := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Context().Value(connRequests{}).(*atomic.Int32).Add(1) > 1 {
			conn, _, err := http.NewResponseController(w).Hijack()
			if err != nil {
				t.Error(err)
				return
			}
			conn.Close()
			e.closed.Add(1)
			return
		}
		s.ServeHTTP(w, r)
	}))
	hs.Config.ConnContext = func(ctx context.Context, _ net.Conn) context.Context {
		return context.WithValue(ctx, connRequests{}, new(atomic.Int32))
	}
	hs.Start()
	t.Cleanup(hs.Close)
	e.Engine = &routertest.Engine{Server: s, Engine: discovery.Engine{URL: hs.URL, EngineID: id, Host: "127.0.0.1", SideChannelPort: 5600, TensorParallelSize: 1}}
	return e
}

// handoffFailurePolicy ServeOnDecode: a request whose prefill side cannot serve it (its
// prefill leg failed on every engine tried, or no prefill engine is ready) is served on
// a decode engine alone, from the client's own body, which the engine prefills itself.
// The client gets one answer, told in X-Kvhandoff-Fallback; the fallback is counted by
// reason; in push the first attempt's decode leg was aborted before. Under Fail, the
// default, the same requests fail by name and nothing falls back.
func TestServeOnDecodeServesWhatThePrefillSideCannotAndFailDoesNot(t *testing.T) {
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		for _, c := range []struct {
			what   string
			bad    bool // a prefill engine that fails; none at all otherwise
			reason string
			status int
		}{
			{"the prefill leg fails", true, router.FallbackPrefillFailed, http.StatusBadGateway},
			{"no prefill engine is ready", false, router.FallbackNoPrefillEngine, http.StatusServiceUnavailable},
		} {
			for _, policy := range []kvv1.HandoffFailurePolicy{kvv1.HandoffFailureServeOnDecode, kvv1.HandoffFailureFail} {
				kv := vllmserver.NewLocalKV()
				d := routertest.StartEngine(t, "d-0", kv, 0)
				var prefill []discovery.Engine
				if c.bad {
					bad := routertest.StartEngine(t, "p-bad", kv, 0)
					bad.Fail.Store(http.StatusInternalServerError)
					prefill = routertest.Engines(bad)
				}
				r := routertest.StartRouter(t, mode, prefill, routertest.Engines(d))
				r.Update(&discovery.Set{Mode: mode, HandoffFailurePolicy: policy, Prefill: prefill, Decode: routertest.Engines(d), Source: "test"})
				resp, body := routertest.Post(t, r.URL, "/v1/completions", small)
				fallbacks := r.Metric(t, "kvhandoff_router_fallbacks_total", map[string]string{"reason": c.reason})
				name := fmt.Sprintf("%s, %s, %s", mode, c.what, policy)
				if policy == kvv1.HandoffFailureFail {
					if resp.StatusCode != c.status || fallbacks != 0 || resp.Header.Get("X-Kvhandoff-Fallback") != "" {
						t.Errorf("%s: %s %s, %v fallbacks; want %d and none", name, resp.Status, body, fallbacks, c.status)
					}
					continue
				}
				if resp.StatusCode != http.StatusOK || routertest.CompletionText(t, body) != routertest.Want("one two three", 3) {
					t.Fatalf("%s: %s %s", name, resp.Status, body)
				}
				if got := resp.Header.Get("X-Kvhandoff-Fallback"); got != c.reason || fallbacks != 1 {
					t.Errorf("%s: X-Kvhandoff-Fallback %q, %v fallbacks counted; want %q and 1", name, got, fallbacks, c.reason)
				}
				seen := d.Seen()
				last := seen[len(seen)-1]
				if bytes.Contains(last.Body, []byte(protocol.KVTransferParams)) {
					t.Errorf("%s: the decode engine alone got kv_transfer_params: %s", name, last.Body)
				}
				// Push sent a decode leg with the first attempt: it was aborted.
				for i := range len(seen) - 1 {
					routertest.Eventually(t, name+": the failed attempt's decode leg is aborted", 5*time.Second, func() bool { return d.Seen()[i].Cancelled })
				}
			}
		}
	}
}

// The router's health report (GET /health/transfer, which the manager reads into the
// DecodePool's TransferHealthy condition): requests served on decode alone count against
// the policy's handoffFailureLimitPercent over the window. Under the limit, or with fewer
// than three, nothing is reported; over it, HandoffFailures naming the reason.
func TestTheHealthReportCountsFallbacksAgainstThePolicysLimit(t *testing.T) {
	for _, c := range []struct {
		limit, good, fallbacks int
		want                   string
	}{
		{limit: 5, good: 0, fallbacks: 2, want: ""},                         // too few to judge
		{limit: 5, good: 3, fallbacks: 3, want: kvv1.ReasonHandoffFailures}, // 50%
		{limit: 60, good: 3, fallbacks: 3, want: ""},                        // 50% is within 60%
		{limit: 0, good: 0, fallbacks: 3, want: kvv1.ReasonHandoffFailures}, // none allowed
		{limit: 100, good: 0, fallbacks: 4, want: ""},                       // all allowed
	} {
		kv := vllmserver.NewLocalKV()
		d, p := routertest.StartEngine(t, "d-0", kv, 0), routertest.StartEngine(t, "p-0", kv, 0)
		r := routertest.StartRouter(t, kvv1.TransferPull, routertest.Engines(p), routertest.Engines(d))
		limit := int32(c.limit)
		set := func(prefill []discovery.Engine) {
			r.Update(&discovery.Set{Mode: kvv1.TransferPull, HandoffFailurePolicy: kvv1.HandoffFailureServeOnDecode,
				HandoffFailureLimitPercent: &limit, Prefill: prefill, Decode: routertest.Engines(d), Source: "test"})
		}
		w := &health.Window{Gatherer: r.Reg, Span: time.Hour}
		if err := w.Observe(time.Now()); err != nil {
			t.Fatal(err)
		}
		set(routertest.Engines(p))
		for range c.good {
			if resp, body := routertest.Post(t, r.URL, "/v1/completions", small); resp.StatusCode != http.StatusOK {
				t.Fatalf("%s %s", resp.Status, body)
			}
		}
		set(nil) // no prefill engine: each request is served on decode alone
		for range c.fallbacks {
			if resp, body := routertest.Post(t, r.URL, "/v1/completions", small); resp.StatusCode != http.StatusOK || resp.Header.Get("X-Kvhandoff-Fallback") == "" {
				t.Fatalf("%s %s", resp.Status, body)
			}
		}
		if err := w.Observe(time.Now()); err != nil {
			t.Fatal(err)
		}
		rep := r.Health(w)
		if rep.Problem != c.want || (c.want != "" && !strings.Contains(rep.Message, "no_prefill_engine")) {
			t.Errorf("limit %d%%, %d served, %d on decode alone: report %+v, want problem %q", c.limit, c.good, c.fallbacks, rep, c.want)
		}
	}
}

// The policy's healthWindowSeconds, carried in the route set, is the window the health
// report the router serves looks over, not the router's own --health-window.
func TestTheHealthReportLooksOverThePolicysWindow(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	d := routertest.StartEngine(t, "d-0", kv, 0)
	r := routertest.StartRouter(t, kvv1.TransferPull, nil, routertest.Engines(d), func(c *router.Config) {
		c.HealthWindow, c.HealthInterval = time.Hour, 10*time.Millisecond
	})
	admin := httptest.NewServer(r.Admin())
	defer admin.Close()
	limit := int32(5)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	set := &discovery.Set{Mode: kvv1.TransferPull, HandoffFailurePolicy: kvv1.HandoffFailureServeOnDecode,
		HandoffFailureLimitPercent: &limit, HealthWindowSeconds: 15, Decode: routertest.Engines(d), Source: "test"}
	go func() { _ = r.Run(ctx, staticSource{set}) }()
	routertest.Eventually(t, "the router to take the set", 5*time.Second, func() bool { return r.HealthWindow() == 15*time.Second })
	for range 3 { // no prefill engine: each is served on decode alone
		if resp, body := routertest.Post(t, r.URL, "/v1/completions", small); resp.StatusCode != http.StatusOK {
			t.Fatalf("%s %s", resp.Status, body)
		}
	}
	var rep health.Report
	routertest.Eventually(t, "the report to name the failures", 5*time.Second, func() bool {
		resp, err := http.Get(admin.URL + "/health/transfer")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		return json.NewDecoder(resp.Body).Decode(&rep) == nil && rep.Problem == kvv1.ReasonHandoffFailures
	})
	if !strings.Contains(rep.Message, "in the last 15s") {
		t.Errorf("report %q: want it over the policy's 15 s window", rep.Message)
	}
}

// Push: when decode answers before the prefill engine's response is read (its response
// late, or its leg sent again on a new connection), the client has its answer and the
// prefill leg still in flight is cancelled — as answered, not as a failed leg (before, it
// counted as kvhandoff_router_leg_failures_total{leg="prefill",reason="cancelled"}).
func TestAPrefillLegCancelledAfterTheAnswerIsNoFailure(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	p, d := routertest.StartEngine(t, "p-0", kv, 0), routertest.StartEngine(t, "d-0", kv, 0)
	// The prefill engine does its work (the KV reaches decode) and then holds its
	// response until the router gives up on it.
	late := routertest.StartHTTP(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.Server.ServeHTTP(httptest.NewRecorder(), r)
		<-r.Context().Done()
	}))
	prefill := p.Engine
	prefill.URL = late
	r := routertest.StartRouter(t, kvv1.TransferPush, []discovery.Engine{prefill}, routertest.Engines(d))
	resp, body := routertest.Post(t, r.URL, "/v1/completions", small)
	if resp.StatusCode != http.StatusOK || routertest.CompletionText(t, body) != routertest.Want("one two three", 3) {
		t.Fatalf("%s %s", resp.Status, body)
	}
	routertest.Eventually(t, "the prefill leg ends", 10*time.Second, func() bool {
		return r.Metric(t, "kvhandoff_router_inflight", map[string]string{"role": "prefill"}) == 0
	})
	if n := r.Metric(t, "kvhandoff_router_leg_failures_total", map[string]string{"leg": "prefill"}); n != 0 {
		t.Errorf("%v prefill legs counted as failed after the client had its answer", n)
	}
}
