package choice

import (
	"slices"

	"github.com/kvhandoff/kvhandoff/internal/router/balance"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
)

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
