package choice

import (
	"slices"

	"github.com/kvhandoff/kvhandoff/internal/router/balance"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
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
