package choice

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
