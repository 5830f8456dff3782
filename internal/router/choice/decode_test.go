package choice

import (
	"fmt"
	"strings"
	"testing"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/router/balance"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

// ids is a token-id prompt body of n tokens, the first shared of them common to every
// conversation and the rest the conversation's own.
func ids(conversation, shared, n int) protocol.Body {
	parts := make([]string, n)
	for i := range parts {
		v := 1000 + i
		if i >= shared {
			v = 100000*conversation + i
		}
		parts[i] = fmt.Sprint(v)
	}
	b, err := protocol.Parse([]byte(`{"model":"m","prompt":[` + strings.Join(parts, ",") + `]}`))
	if err != nil {
		panic(err)
	}
	return b
}

func prefixAware(minPrefill int) Routing {
	return RoutingOf(&discovery.Set{BlockSize: 16, Routing: &kvv1.RoutingSpec{
		DecodeChoice: kvv1.DecodeChoicePrefixAware, OverlapWeight: 4, LoadWeight: 1, MinPrefillTokens: int32(minPrefill)}})
}

// The decider, case by case: which decode engine a request gets and whether it takes a
// prefill leg, from what each engine holds (d1 holds conversation 1's first 320 tokens, of
// which the first 80 every conversation shares)
// and its load (legs already in flight).
func TestDecodeWeighsThePrefixHeldAgainstLoad(t *testing.T) {
	for _, tc := range []struct {
		name     string
		routing  Routing
		body     protocol.Body
		inflight map[string]int // legs in flight per decode engine before the request
		shared   bool           // d2 holds the 80 tokens every conversation shares
		want     string
		cached   int
		only     string
		basis    string
	}{
		{name: "the engine holding the prefix", routing: prefixAware(0), body: ids(1, 80, 400), want: "d1", cached: 320, basis: BasisPrefix},
		{name: "held 80% is worth 3.2 requests: chosen over an idle engine with 3 more in flight", routing: prefixAware(0), body: ids(1, 80, 400),
			inflight: map[string]int{"d1": 3}, want: "d1", cached: 320, basis: BasisPrefix},
		{name: "but not with 4 more", routing: prefixAware(0), body: ids(1, 80, 400), inflight: map[string]int{"d1": 4}, want: "d2", basis: BasisPrefix},
		{name: "a prefix both hold does not count: 240 of the other 320 held is worth 3 requests", routing: prefixAware(0), body: ids(1, 80, 400),
			shared: true, inflight: map[string]int{"d1": 2}, want: "d1", cached: 320, basis: BasisPrefix},
		{name: "but not 4", routing: prefixAware(0), body: ids(1, 80, 400), shared: true, inflight: map[string]int{"d1": 4}, want: "d2", cached: 80,
			basis: BasisPrefix},
		{name: "a weight of 0 chooses by load", routing: func() Routing { r := prefixAware(0); r.OverlapWeight = 0; return r }(), body: ids(1, 80, 400),
			inflight: map[string]int{"d1": 1}, want: "d2", basis: BasisPrefix},
		{name: "another conversation with the shared start only: d1 holds its first 5 blocks", routing: prefixAware(0), body: ids(2, 80, 400),
			want: "d1", cached: 80, basis: BasisPrefix},
		{name: "load only ignores the prefix", routing: RoutingOf(&discovery.Set{}), body: ids(1, 80, 400), inflight: map[string]int{"d1": 1},
			want: "d2", basis: BasisLoad},
		{name: "a tail under minPrefillTokens is served on decode alone", routing: prefixAware(100), body: ids(1, 80, 400), want: "d1", cached: 320,
			only: DecodeOnlyPrefixCached, basis: BasisPrefix},
		{name: "a tail of minPrefillTokens takes prefill", routing: prefixAware(80), body: ids(1, 80, 400), want: "d1", cached: 320, basis: BasisPrefix},
		{name: "a short prompt, held or not", routing: prefixAware(500), body: ids(3, 0, 400), want: "d1", only: DecodeOnlyShortPrompt, basis: BasisPrefix},
		{name: "short prompts skip prefill under LoadOnly too", routing: func() Routing { r := RoutingOf(&discovery.Set{}); r.MinPrefillTokens = 500; return r }(),
			body: ids(1, 80, 400), want: "d1", only: DecodeOnlyShortPrompt, basis: BasisLoad},
		{name: "a prompt shorter than a block has nothing to match", routing: prefixAware(0), body: ids(1, 80, 15), inflight: map[string]int{"d1": 1},
			want: "d2", basis: BasisNoPrefix},
		{name: "a whole prompt of whole blocks held: vLLM recomputes its last block", routing: prefixAware(0), body: ids(1, 80, 320), want: "d1",
			cached: 304, basis: BasisPrefix},
		{name: "a batch of prompts has no prefix", routing: prefixAware(0), body: protocol.Body{"prompt": []byte(`["a","b"]`)},
			inflight: map[string]int{"d1": 1}, want: "d2", basis: BasisNoPrefix},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, _ := newChooser()
			decodes := []discovery.Engine{engine("d1", "a"), engine("d2", "a")}
			c.ix.Add("d1", prefix.Cut(ids(1, 80, 320), 16).Keys)
			if tc.shared {
				c.ix.Add("d2", prefix.Cut(ids(2, 80, 80), 16).Keys)
			}
			for id, n := range tc.inflight {
				for range n {
					c.bal.Acquire(balance.Decode, id, 10)
				}
			}
			body := tc.body
			pick, plan := c.Decode(tc.routing, decodes, NewRequest(tc.routing, body, protocol.PromptTokens(body)))
			if pick.EngineID != tc.want || plan.Cached != tc.cached || plan.DecodeOnly != tc.only || plan.Basis != tc.basis {
				t.Errorf("chose %s %+v, want %s with %d cached, decode only %q, basis %s", pick.EngineID, plan, tc.want, tc.cached, tc.only, tc.basis)
			}
		})
	}
}

// The chosen engine holds the prompt from then on: the conversation's next turn goes
// there, and Push pairs it with a prefill engine unless the plan is decode only.
func TestAConversationStaysOnItsDecodeEngine(t *testing.T) {
	c, _ := newChooser()
	r := prefixAware(64)
	prefills := []discovery.Engine{engine("p1", "a")}
	decodes := []discovery.Engine{engine("d1", "a"), engine("d2", "a"), engine("d3", "a")}
	first := map[int]string{}
	for turn := 1; turn <= 3; turn++ {
		for conv := 1; conv <= 3; conv++ {
			body := ids(conv, 0, 200*turn)
			p, d, plan := c.Push(r, prefills, decodes, NewRequest(r, body, protocol.PromptTokens(body)))
			if turn == 1 {
				first[conv] = d.EngineID
			} else if d.EngineID != first[conv] || plan.Cached != 200*(turn-1)/16*16 {
				t.Errorf("turn %d of conversation %d: %s with %d cached, want %s with %d", turn, conv, d.EngineID, plan.Cached, first[conv], 200*(turn-1)/16*16)
			}
			if p.EngineID != "p1" || plan.DecodeOnly != "" {
				t.Errorf("turn %d of conversation %d: prefill %q, decode only %q: a 200-token tail takes prefill", turn, conv, p.EngineID, plan.DecodeOnly)
			}
			p.Release()
			d.Release()
		}
	}
	if len(map[string]bool{first[1]: true, first[2]: true, first[3]: true}) != 3 {
		t.Errorf("the first turns went to %v: with nothing held, load spreads them", first)
	}
	// A turn that adds less than 64 tokens is served where the rest is.
	body := ids(2, 0, 640)
	p, d, plan := c.Push(r, prefills, decodes, NewRequest(r, body, protocol.PromptTokens(body)))
	if d.EngineID != first[2] || plan.DecodeOnly != DecodeOnlyPrefixCached || p.EngineID != "" {
		t.Errorf("a 40-token tail: %s, plan %+v, prefill %q; want %s, decode only, no prefill", d.EngineID, plan, p.EngineID, first[2])
	}
	p.Release() // a no-op
}

// A prefill engine is chosen by the least work before the request's first token: the
// tokens of legs queued there plus those of this prompt it does not hold.
func TestPrefillWeighsWhatItHoldsAgainstItsQueue(t *testing.T) {
	for _, tc := range []struct {
		name   string
		r      Routing
		queued int // prompt tokens of legs in flight on p1, which holds 320 of the 400
		want   string
	}{
		{"holding 320 tokens beats an idle engine with 300 queued", prefixAware(0), 300, "p1"},
		{"but not with 330 queued", prefixAware(0), 330, "p2"},
		{"load only takes the idle engine", RoutingOf(&discovery.Set{}), 10, "p2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, _ := newChooser()
			c.ix.Add("p1", prefix.Cut(ids(1, 80, 320), 16).Keys)
			c.bal.Acquire(balance.Prefill, "p1", tc.queued)
			body := ids(1, 80, 400)
			p := c.Prefill(tc.r, []discovery.Engine{engine("p1", "a"), engine("p2", "a")}, NewRequest(tc.r, body, protocol.PromptTokens(body)))
			if p.EngineID != tc.want {
				t.Errorf("chose %s, want %s", p.EngineID, tc.want)
			}
			if tc.r.PrefixAware && c.ix.Match(tc.want, prefix.Cut(body, 16).Keys) != 25 {
				t.Errorf("%s does not hold the prompt's 25 blocks after serving it", tc.want)
			}
		})
	}
}
