package router_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
	"github.com/kvhandoff/kvhandoff/internal/router/routertest"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
)

// clientBody has fields the router does not own, in spellings a re-encoding would change.
const clientBody = `{"model":"tiny","prompt":"the quick brown fox","max_tokens":5,"min_tokens":2,` +
	`"temperature":0.50,"logit_bias":{"b":1, "a":2},"user":"u-1"}`

func params(t *testing.T, body []byte) map[string]any {
	t.Helper()
	var p map[string]any
	if err := json.Unmarshal(routertest.Field(t, body, protocol.KVTransferParams), &p); err != nil {
		t.Fatal(err)
	}
	return p
}

// sameFields checks that every field of the client's body except skip reached a leg
// byte for byte.
func sameFields(t *testing.T, leg string, got []byte, skip ...string) {
	t.Helper()
	var c, g map[string]json.RawMessage
	_ = json.Unmarshal([]byte(clientBody), &c)
	if err := json.Unmarshal(got, &g); err != nil {
		t.Fatal(err)
	}
outer:
	for k, v := range c {
		for _, s := range skip {
			if k == s {
				continue outer
			}
		}
		if string(g[k]) != string(v) {
			t.Errorf("%s leg: field %s is %s, the client sent %s", leg, k, g[k], v)
		}
	}
}

func TestPullSendsDecodeAfterPrefillWithExactlyWhatPrefillReturned(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	p, d := routertest.StartEngine(t, "p-0", kv, 0), routertest.StartEngine(t, "d-0", kv, 0)
	r := routertest.StartRouter(t, kvv1.TransferPull, routertest.Engines(p), routertest.Engines(d))

	resp, body := routertest.Post(t, r.URL, "/v1/completions", clientBody)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %s", resp.Status, body)
	}
	if got := routertest.CompletionText(t, body); got != routertest.Want("the quick brown fox", 5) {
		t.Errorf("client got %q, want the prompt's tokens %q", got, routertest.Want("the quick brown fox", 5))
	}
	ps, ds := p.Seen(), d.Seen()
	if len(ps) != 1 || len(ds) != 1 {
		t.Fatalf("prefill saw %d legs, decode %d; want 1 each", len(ps), len(ds))
	}
	pl, dl := ps[0], ds[0]

	// Leg 1: vLLM's prefill request.
	if got := params(t, pl.Body); len(got) != 6 || got["do_remote_decode"] != true || got["do_remote_prefill"] != false ||
		got["remote_engine_id"] != nil || got["remote_block_ids"] != nil || got["remote_host"] != nil || got["remote_port"] != nil {
		t.Errorf("prefill leg kv_transfer_params = %v", got)
	}
	for k, v := range map[string]string{"stream": "false", "max_tokens": "1"} {
		if got := string(routertest.Field(t, pl.Body, k)); got != v {
			t.Errorf("prefill leg %s = %s, want %s", k, got, v)
		}
	}
	if routertest.Field(t, pl.Body, "min_tokens") != nil {
		t.Error("prefill leg carries min_tokens; vLLM refuses it above max_tokens 1")
	}
	sameFields(t, "prefill", pl.Body, "max_tokens", "min_tokens")

	// Leg 2: the client's body with the params prefill returned, sent after prefill.
	returned := routertest.Field(t, pl.Response, protocol.KVTransferParams)
	if got := routertest.Field(t, dl.Body, protocol.KVTransferParams); len(returned) == 0 || string(got) != string(returned) {
		t.Errorf("decode leg kv_transfer_params = %s, want exactly what prefill returned: %s", got, returned)
	}
	if got := params(t, dl.Body); got["remote_engine_id"] != "p-0" || got["remote_request_id"] != pl.RequestID || got["remote_block_ids"] == nil {
		t.Errorf("prefill returned %v", got)
	}
	sameFields(t, "decode", dl.Body)
	if !dl.Arrived.After(pl.Answered) {
		t.Errorf("decode leg arrived at %v, before prefill answered at %v: pull chooses decode after prefill", dl.Arrived, pl.Answered)
	}
	if pl.RequestID == "" || pl.RequestID != dl.RequestID || resp.Header.Get("X-Request-Id") != pl.RequestID {
		t.Errorf("X-Request-Id: prefill %q, decode %q, client %q: both legs must carry the same", pl.RequestID, dl.RequestID, resp.Header.Get("X-Request-Id"))
	}
}

func TestPushSendsBothLegsAtOnceAndDecodeRegistersBeforePrefillEnds(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	p, d := routertest.StartEngine(t, "p-0", kv, 200*time.Millisecond), routertest.StartEngine(t, "d-0", kv, 0)
	logs := &routertest.RequestLogs{}
	r := routertest.StartRouter(t, kvv1.TransferPush, routertest.Engines(p), routertest.Engines(d), routertest.LogTo(logs))

	resp, body := routertest.Post(t, r.URL, "/v1/completions", clientBody)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %s", resp.Status, body)
	}
	if got := routertest.CompletionText(t, body); got != routertest.Want("the quick brown fox", 5) {
		t.Errorf("client got %q", got)
	}
	// The client's answer is decode's, which can come before the prefill leg's response
	// has been written: wait for that too.
	routertest.Eventually(t, "the prefill leg is answered", 5*time.Second, func() bool { return !p.Seen()[0].Answered.IsZero() })
	pl, dl := p.Seen()[0], d.Seen()[0]
	pp, dp := params(t, pl.Body), params(t, dl.Body)
	tid, _ := pp["transfer_id"].(string)
	if tid == "" || dp["transfer_id"] != tid {
		t.Fatalf("transfer_id: prefill %v, decode %v; both legs must carry the same", pp["transfer_id"], dp["transfer_id"])
	}
	// The request's log line names the key the agents and engines log the handoff under.
	routertest.Eventually(t, "the request is logged", 5*time.Second, func() bool { return len(logs.Lines()) == 1 })
	if got := logs.Lines()[0]["transfer_id"]; got != tid {
		t.Errorf("request log transfer_id = %v, want %s", got, tid)
	}
	wantDecode := map[string]any{"do_remote_decode": false, "do_remote_prefill": true, "remote_engine_id": "p-0",
		"remote_host": "127.0.0.1", "remote_port": 5600.0, "tp_size": 1.0, "pp_size": 1.0, "remote_request_id": pl.RequestID, "transfer_id": tid}
	if len(dp) != len(wantDecode) {
		t.Errorf("decode leg params %v, want exactly %v", dp, wantDecode)
	}
	for k, v := range wantDecode {
		if dp[k] != v {
			t.Errorf("decode leg %s = %v, want %v", k, dp[k], v)
		}
	}
	if pp["do_remote_decode"] != true || string(routertest.Field(t, pl.Body, "max_tokens")) != "1" || string(routertest.Field(t, pl.Body, "stream")) != "false" {
		t.Errorf("prefill leg %s", pl.Body)
	}
	sameFields(t, "prefill", pl.Body, "max_tokens", "min_tokens")
	sameFields(t, "decode", dl.Body)
	// Concurrency: decode was sent before prefill finished, and registered before the
	// prefill engine produced the KV.
	if !dl.Arrived.Before(pl.Answered) {
		t.Errorf("decode leg arrived %v after prefill answered: push sends both at once", dl.Arrived.Sub(pl.Answered))
	}
	reg, prod := kv.Times(tid)
	if reg.IsZero() || !reg.Before(prod) {
		t.Errorf("decode registered at %v, prefill produced at %v: decode must register while prefill runs", reg, prod)
	}
	if pl.RequestID != dl.RequestID || pl.RequestID == "" {
		t.Errorf("X-Request-Id differs: %q vs %q", pl.RequestID, dl.RequestID)
	}
}

func TestChatCompletionsTakeTheSamePath(t *testing.T) {
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		t.Run(string(mode), func(t *testing.T) {
			kv := vllmserver.NewLocalKV()
			p, d := routertest.StartEngine(t, "p-0", kv, 0), routertest.StartEngine(t, "d-0", kv, 0)
			r := routertest.StartRouter(t, mode, routertest.Engines(p), routertest.Engines(d))
			resp, body := routertest.Post(t, r.URL, "/v1/chat/completions", `{"model":"tiny","messages":[{"role":"user","content":"hi there"}],"max_completion_tokens":4}`)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("%s: %s", resp.Status, body)
			}
			if got, w := routertest.CompletionText(t, body), strings.Join(vllmserver.Output([]string{"<user>", "hi", "there"}, 4), ""); got != w {
				t.Errorf("got %q, want %q", got, w)
			}
			if got := string(routertest.Field(t, p.Seen()[0].Body, "max_completion_tokens")); got != "1" {
				t.Errorf("prefill leg max_completion_tokens = %s, want 1", got)
			}
			if got := string(routertest.Field(t, d.Seen()[0].Body, "max_completion_tokens")); got != "4" {
				t.Errorf("decode leg max_completion_tokens = %s, want the client's 4", got)
			}
		})
	}
}
