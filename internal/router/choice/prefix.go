package choice

import (
	"slices"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/router/balance"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

// Routing is the policy's routing as the chooser applies it.
type Routing struct {
	// PrefixAware weighs what each decode engine holds of the prompt against its load.
	PrefixAware bool
	// OverlapWeight is a whole prompt's worth, in LoadWeight units per request in flight.
	OverlapWeight, LoadWeight float64
	// MinPrefillTokens: a request whose uncached tail is shorter skips prefill (0: none).
	MinPrefillTokens int
	// BlockTokens is the engines' KV block size.
	BlockTokens int
}

// RoutingOf is the routing of set's policy, defaults filled in.
func RoutingOf(set *discovery.Set) Routing {
	r := Routing{OverlapWeight: kvv1.DefaultOverlapWeight, LoadWeight: kvv1.DefaultLoadWeight, BlockTokens: 16}
	if set.BlockSize > 0 {
		r.BlockTokens = set.BlockSize
	}
	if p := set.Routing; p != nil {
		r.PrefixAware = p.DecodeChoice == kvv1.DecodeChoicePrefixAware
		r.OverlapWeight, r.LoadWeight = float64(p.OverlapWeight), float64(max(p.LoadWeight, 1))
		r.MinPrefillTokens = int(p.MinPrefillTokens)
	}
	return r
}

// Planned reports whether requests are planned before their legs: their decode engine
// chosen first, and whether they take a prefill leg decided.
func (r Routing) Planned() bool { return r.PrefixAware || r.MinPrefillTokens > 0 }

// Request is what engine choice reads of a request.
type Request struct {
	// Tokens is the prompt's length (estimated for text).
	Tokens int
	// Prompt is the prompt cut into blocks (PrefixAware only).
	Prompt prefix.Prompt
}

// NewRequest reads body under routing r.
func NewRequest(r Routing, body protocol.Body, tokens int) Request {
	req := Request{Tokens: tokens}
	if r.PrefixAware {
		req.Prompt = prefix.Cut(body, r.BlockTokens)
	}
	return req
}

// Plan is a request's decode choice and whether it takes a prefill leg.
type Plan struct {
	// Cached is how many of the prompt's tokens the decode engine holds, by the index.
	Cached int
	// DecodeOnly names why the request is served on its decode engine alone; "" when it
	// takes a prefill leg.
	DecodeOnly string
	// Basis is what the decode choice rested on (Basis*).
	Basis string
}

// Reasons a request is served on decode alone.
const (
	// DecodeOnlyShortPrompt: the whole prompt is shorter than minPrefillTokens.
	DecodeOnlyShortPrompt = "short_prompt"
	// DecodeOnlyPrefixCached: what the decode engine does not hold of the prompt is.
	DecodeOnlyPrefixCached = "prefix_cached"
)

// What a decode choice rested on.
const (
	// BasisLoad: load alone (LoadOnly).
	BasisLoad = "load"
	// BasisPrefix: the prefix each engine holds, and load.
	BasisPrefix = "prefix"
	// BasisNoPrefix: PrefixAware, but the prompt has no block to match (shorter than a
	// block, or a form with no prefix: a batch), so load alone.
	BasisNoPrefix = "no_prefix"
)

// Decode picks a request's decode engine among decodes and plans its legs. Under
// PrefixAware an engine's load score is lowered by OverlapWeight × the share it holds of
// the prompt beyond what every candidate holds (in LoadWeight units): a system prompt all
// engines hold does not tell them apart, so a conversation's own turns weigh in full. The
// chosen engine is recorded as holding the prompt from now on: it will, once it served
// the request, whether its KV came from a prefill engine or it computed the tail itself.
func (c *Chooser) Decode(r Routing, decodes []discovery.Engine, req Request) (Pick, Plan) {
	plan := Plan{Basis: BasisLoad}
	var adjust func(int, float64) float64
	var cached []int
	if r.PrefixAware {
		plan.Basis = BasisNoPrefix
		if len(req.Prompt.Keys) > 0 && req.Prompt.Tokens > 0 && len(decodes) > 0 {
			plan.Basis = BasisPrefix
			cached = c.held(r, decodes, req)
			common := slices.Min(cached)
			adjust = func(i int, load float64) float64 {
				if common == req.Prompt.Tokens { // every engine holds all of it
					return r.LoadWeight * load
				}
				return r.LoadWeight*load - r.OverlapWeight*float64(cached[i]-common)/float64(req.Prompt.Tokens-common)
			}
		}
	}
	e, release, _ := c.bal.TakeScored(balance.Decode, decodes, req.Tokens, adjust)
	pick := Pick{Engine: e, Release: c.gauge(balance.Decode, e.EngineID, release)}
	if cached != nil {
		plan.Cached = cached[slices.IndexFunc(decodes, func(d discovery.Engine) bool { return d.EngineID == e.EngineID })]
		c.ix.Add(e.EngineID, req.Prompt.Keys)
	}
	plan.DecodeOnly = decodeOnly(req.Tokens, plan.Cached, r.MinPrefillTokens)
	c.m.count(req, plan)
	return pick, plan
}

// Prefill picks a request's prefill engine among prefills (of its decode engine's
// compat-hash). Prefill engines cache prefixes too, and what one holds it does not compute:
// under PrefixAware an engine's score, the prompt tokens of its legs in flight (the queue
// a new leg waits behind), is lowered by the tokens of this prompt it holds, so the choice
// is the least work before this request's first token — no weight is needed, both are
// tokens. The chosen engine counts as holding the prompt from then on.
func (c *Chooser) Prefill(r Routing, prefills []discovery.Engine, req Request) Pick {
	if !r.PrefixAware || len(req.Prompt.Keys) == 0 || len(prefills) == 0 {
		return c.Take(balance.Prefill, prefills, req.Tokens)
	}
	cached := c.held(r, prefills, req)
	e, release, _ := c.bal.TakeScored(balance.Prefill, prefills, req.Tokens, func(i int, queued float64) float64 { return queued - float64(cached[i]) })
	i := slices.IndexFunc(prefills, func(p discovery.Engine) bool { return p.EngineID == e.EngineID })
	c.m.tokens.WithLabelValues("prefill_cached").Add(float64(cached[i]))
	c.ix.Add(e.EngineID, req.Prompt.Keys)
	return Pick{Engine: e, Release: c.gauge(balance.Prefill, e.EngineID, release)}
}

// held is, per engine, how many of the request's prompt tokens it holds by the index
// and could reuse (whole blocks, and not a prompt's last, as vLLM). A token-id prompt is
// matched against the engine's own KV events where they are followed live; anything
// else against routing history (a text prompt's keys are not vLLM's blocks).
func (c *Chooser) held(r Routing, engines []discovery.Engine, req Request) []int {
	cached := make([]int, len(engines))
	for i, e := range engines {
		matched, ok := 0, false
		if req.Prompt.Exact && c.ev != nil {
			matched, ok = c.ev.Match(e.EngineID, req.Prompt.Keys)
		}
		if ok {
			c.m.lookupEvents.Inc()
		} else {
			matched = c.ix.Match(e.EngineID, req.Prompt.Keys)
			c.m.lookupHistory.Inc()
		}
		n := req.Prompt.Usable(matched, r.BlockTokens)
		cached[i] = min(n*r.BlockTokens, req.Prompt.Tokens)
	}
	return cached
}

// decodeOnly is why a request of tokens, cached of them on its decode engine, skips
// prefill under minPrefill, or "".
func decodeOnly(tokens, cached, minPrefill int) string {
	switch {
	case tokens < minPrefill:
		return DecodeOnlyShortPrompt
	case tokens-cached < minPrefill:
		return DecodeOnlyPrefixCached
	}
	return ""
}
