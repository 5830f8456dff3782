package router_test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/router"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
	"github.com/kvhandoff/kvhandoff/internal/router/routertest"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
)

// Prefix-aware routing through the router, in both modes: a conversation's later turns go
// to the decode engine that served its first (three conversations over two engines: by
// load alone they would move), a turn whose new part is short is served there alone with
// no prefill leg, and a long one takes its prefill leg as usual.
func TestAConversationsTurnsFollowItsPrefix(t *testing.T) {
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		t.Run(string(mode), func(t *testing.T) {
			kv := vllmserver.NewLocalKV()
			p := routertest.StartEngine(t, "p-0", kv, 0)
			d := []*routertest.Engine{routertest.StartEngine(t, "d-0", kv, 0), routertest.StartEngine(t, "d-1", kv, 0)}
			r := routertest.StartRouter(t, mode, routertest.Engines(p), routertest.Engines(d...))
			r.Update(&discovery.Set{Mode: mode, Prefill: routertest.Engines(p), Decode: routertest.Engines(d...), Source: "test", BlockSize: 16,
				Routing: &kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoicePrefixAware, OverlapWeight: 4, LoadWeight: 1, MinPrefillTokens: 64}})
			served := func() []int { return []int{len(d[0].Seen()), len(d[1].Seen())} }
			prompts := map[int]string{}
			home := map[int]int{}
			for turn, add := range []func(c int) string{
				func(c int) string { return strings.Repeat(fmt.Sprintf("conversation %d opens. ", c), 40) },
				func(c int) string { return " thanks" },                                          // ~2 tokens: served on decode alone
				func(c int) string { return strings.Repeat(fmt.Sprintf(" and %d more", c), 60) }, // ~180 tokens: prefill pays
			} {
				for c := range 3 {
					prompts[c] += add(c)
					before, prefilled := served(), len(p.Seen())
					resp, body := routertest.Post(t, r.URL, "/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, routertest.Model, prompts[c]))
					if resp.StatusCode != http.StatusOK {
						t.Fatalf("turn %d, conversation %d: %s: %s", turn, c, resp.Status, body)
					}
					after := served()
					on := 0
					if after[1] > before[1] {
						on = 1
					}
					if turn == 0 {
						home[c] = on
					} else if on != home[c] {
						t.Errorf("turn %d of conversation %d went to d-%d, its first to d-%d", turn, c, on, home[c])
					}
					only := resp.Header.Get(protocol.DecodeOnlyHeader)
					if short := turn == 1; short != (only == "prefix_cached") || short != (len(p.Seen()) == prefilled) {
						t.Errorf("turn %d of conversation %d: decode only %q, prefill legs %d → %d", turn, c, only, prefilled, len(p.Seen()))
					}
				}
			}
			if home[0] == home[1] && home[1] == home[2] {
				t.Errorf("every first turn went to d-%d: load did not spread them", home[0])
			}
			if got := r.Metric(t, "kvhandoff_router_decode_only_total", map[string]string{"reason": "prefix_cached"}); got != 3 {
				t.Errorf("decode only (prefix_cached): %v, want 3", got)
			}
			if got := r.Metric(t, "kvhandoff_router_decode_choices_total", map[string]string{"basis": "prefix"}); got != 9 {
				t.Errorf("decode choices by prefix: %v, want 9", got)
			}
			if got := r.Metric(t, "kvhandoff_router_fallbacks_total", nil); got != 0 {
				t.Errorf("a planned decode-only request counted as a fallback (%v): it is not a failure", got)
			}
			if r.Metric(t, "kvhandoff_router_prefix_tokens_total", map[string]string{"kind": "cached"}) == 0 ||
				r.Metric(t, "kvhandoff_router_prefix_index_blocks", nil) == 0 {
				t.Error("no cached tokens or index blocks counted")
			}
		})
	}
}

// A prompt shorter than minPrefillTokens skips prefill under LoadOnly too, and a leg
// runner serves what the endpoint picker marked decode-only on its engine alone.
func TestShortPromptsAndThePickersMarkSkipPrefill(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	p, d := routertest.StartEngine(t, "p-0", kv, 0), routertest.StartEngine(t, "d-0", kv, 0)
	r := routertest.StartRouter(t, kvv1.TransferPush, routertest.Engines(p), routertest.Engines(d))
	r.Update(&discovery.Set{Mode: kvv1.TransferPush, Prefill: routertest.Engines(p), Decode: routertest.Engines(d), Source: "test",
		Routing: &kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoiceLoadOnly, LoadWeight: 1, MinPrefillTokens: 100}})
	resp, body := routertest.Post(t, r.URL, "/v1/completions", `{"model":"tiny","prompt":"the quick brown fox","max_tokens":3}`)
	if resp.StatusCode != http.StatusOK || resp.Header.Get(protocol.DecodeOnlyHeader) != "short_prompt" || len(p.Seen()) != 0 ||
		routertest.CompletionText(t, body) != routertest.Want("the quick brown fox", 3) {
		t.Errorf("a short prompt: %s, decode only %q, %d prefill legs, %s", resp.Status, resp.Header.Get(protocol.DecodeOnlyHeader), len(p.Seen()), body)
	}

	runner := routertest.StartRouter(t, kvv1.TransferPush, routertest.Engines(p), routertest.Engines(d), func(c *router.Config) { c.Local = d.URL })
	for _, tc := range []struct {
		mark    string
		prefill int // prefill legs it takes
	}{{"prefix_cached", 0}, {"short_prompt", 0}, {"made-up", 1}} {
		before := len(p.Seen())
		req, _ := http.NewRequest(http.MethodPost, runner.URL+"/v1/completions", strings.NewReader(`{"model":"tiny","prompt":"a long prompt","max_tokens":3}`))
		req.Header.Set(protocol.DecodeOnlyHeader, tc.mark)
		req.Header.Set(protocol.PrefillHeader, "")
		if tc.prefill > 0 {
			req.Header.Set(protocol.PrefillHeader, strings.TrimPrefix(p.URL, "http://"))
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || len(p.Seen())-before != tc.prefill {
			t.Errorf("leg runner, mark %q: %s, %d prefill legs, want %d", tc.mark, resp.Status, len(p.Seen())-before, tc.prefill)
		}
	}
}
