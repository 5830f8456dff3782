package choice

import (
	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
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
