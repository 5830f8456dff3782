// Package choice picks the engines of a request's legs: which prefill and decode engines
// can be paired at all (a compat-hash both pools share: the same model, KV layout and
// connector), and among those the least loaded (package balance) or, under PrefixAware
// routing, the decode engine that holds most of the prompt for its load (package prefix);
// and whether a request takes a prefill leg at all. Each pick counts as a leg in flight
// until it is released. It is the router's one seam for engine choice: its modes call
// it, and so does the gateway's endpoint picker.
package choice

import (
	"fmt"
	"slices"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvhandoff/kvhandoff/internal/router/balance"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/kvfollow"
	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
)

// Chooser picks engines and keeps the count of legs in flight on each, in the balancer
// (for the next choice) and in the inflight gauge (for operators).
type Chooser struct {
	bal      *balance.Balancer
	ix       *prefix.Index      // routing history
	ev       *kvfollow.Follower // the engines' own KV events; nil for none
	m        *Metrics
	inflight *prometheus.GaugeVec // labels: role, engine

	mu     sync.Mutex
	gauged map[[2]string]bool // inflight series in use, to delete when engines go
}

// New returns a Chooser over bal and the prefix indexes: ix from routing history, ev
// from the engines' KV events where they publish them (nil: none), counting its choices
// in m and legs into inflight (labels role and engine). The balancer's scrapes bound each
// engine's history at its KV capacity.
func New(bal *balance.Balancer, ix *prefix.Index, ev *kvfollow.Follower, m *Metrics, inflight *prometheus.GaugeVec) *Chooser {
	bal.OnLoad = func(_ balance.Role, id string, l balance.Load) {
		if l.Blocks > 0 {
			ix.SetCapacity(id, l.Blocks)
		}
	}
	return &Chooser{bal: bal, ix: ix, ev: ev, m: m, inflight: inflight, gauged: map[[2]string]bool{}}
}

// Pick is a chosen engine, counted as one leg in flight until Release (idempotent).
type Pick struct {
	discovery.Engine
	Release func()
}

// Take picks the engine of role among candidates that suits a request of tokens best.
func (c *Chooser) Take(role balance.Role, candidates []discovery.Engine, tokens int) Pick {
	e, release, _ := c.bal.Take(role, candidates, tokens)
	return Pick{Engine: e, Release: c.gauge(role, e.EngineID, release)}
}

// Push picks a push request's pair at its arrival: the decode engine first (it holds the
// request's blocks until the end), then a prefill engine of its compat-hash, unless the
// plan serves the request on decode alone (prefill is then no engine). prefills and
// decodes are Pairable's, so each decode engine has one.
func (c *Chooser) Push(r Routing, prefills, decodes []discovery.Engine, req Request) (prefill, decode Pick, plan Plan) {
	decode, plan = c.Decode(r, decodes, req)
	if plan.DecodeOnly != "" {
		return Pick{Release: func() {}}, decode, plan
	}
	return c.Prefill(r, SameHash(prefills, decode.CompatHash), req), decode, plan
}

// PullDecode picks a pull request's decode engine once its prefill leg returned: one of
// prefill's compat-hash in set and not in exclude, or why there is none.
func (c *Chooser) PullDecode(set *discovery.Set, prefill discovery.Engine, tokens int, exclude map[string]bool) (Pick, string) {
	_, decodes, _ := Pairable(set, exclude)
	decodes = SameHash(decodes, prefill.CompatHash)
	if len(decodes) == 0 {
		return Pick{}, fmt.Sprintf("no ready decode engine with prefill engine %s's compat-hash %q (%s)", prefill.EngineID, prefill.CompatHash, set.Source)
	}
	c.m.choices.WithLabelValues(BasisLoad).Inc()
	return c.Take(balance.Decode, decodes, tokens), ""
}

// gauge adds a leg to the inflight gauge of an engine until release.
func (c *Chooser) gauge(role balance.Role, id string, release func()) func() {
	g := c.inflight.WithLabelValues(string(role), id)
	g.Inc()
	c.mu.Lock()
	c.gauged[[2]string{string(role), id}] = true
	c.mu.Unlock()
	var once sync.Once
	return func() { once.Do(func() { release(); g.Dec() }) }
}

// Forget drops what the balancer knows of engines that left set, and the inflight series
// of those with no leg in flight, so a churning pool does not grow the exposition forever.
func (c *Chooser) Forget(set *discovery.Set) {
	c.bal.Forget(set)
	// An engine that restarted left the set while it was not ready: its cache is empty.
	alive := map[string]bool{}
	for _, e := range append(slices.Clone(set.Prefill), set.Decode...) {
		alive[e.EngineID] = true
	}
	c.ix.Keep(alive)
	if c.ev != nil {
		c.ev.Sync(append(slices.Clone(set.Prefill), set.Decode...))
	}
	keep := map[[2]string]bool{}
	for _, e := range set.Prefill {
		keep[[2]string{string(balance.Prefill), e.EngineID}] = true
	}
	for _, e := range set.Decode {
		keep[[2]string{string(balance.Decode), e.EngineID}] = true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for k := range c.gauged {
		if n, _ := c.bal.Outstanding(balance.Role(k[0]), k[1]); !keep[k] && n == 0 {
			c.inflight.DeleteLabelValues(k[0], k[1])
			delete(c.gauged, k)
		}
	}
}
