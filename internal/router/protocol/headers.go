package protocol

import "net/url"

// The P/D header contract between the endpoint picker, the gateway and the leg runner:
// the EPP protocol's names (GIE docs/proposals/004-endpoint-picker-protocol) and llm-d's
// prefill header (llm-d-router pkg/common/routing).
const (
	// DestinationHeader and the envoy.lb metadata key of the same name carry the picked
	// decode endpoints, "ip:port[,ip:port…]", in order of preference.
	DestinationHeader = "x-gateway-destination-endpoint"
	// MetadataNamespace wraps the destination in the response's dynamic metadata and the
	// served endpoint in the request's metadata context.
	MetadataNamespace = "envoy.lb"
	// ServedKey is the endpoint that served the request, reported back by the gateway.
	ServedKey = "x-gateway-destination-endpoint-served"
	// SubsetNamespace and SubsetKey carry the gateway's subset hint: the endpoints the
	// EPP must pick from.
	SubsetNamespace = "envoy.lb.subset_hint"
	SubsetKey       = "x-gateway-destination-endpoint-subset"
	// PrefillHeader is the prefill engine's "ip:port" (its OpenAI API), llm-d's header.
	PrefillHeader = "x-prefiller-host-port"
	// DecodeOnlyHeader, in place of PrefillHeader, tells the leg runner to serve the
	// request on its decode engine alone, and why (routing.minPrefillTokens: a short
	// prompt, or one the engine holds most of). Routers send it back to clients too.
	DecodeOnlyHeader = "x-kvhandoff-decode-only"
)

// RoutingHeaders are the headers only the endpoint picker may set: a gateway removes
// them from every client request before its ext_proc filter, so that no client routes
// itself, also when the picker is down and the gateway fails open.
var RoutingHeaders = []string{DestinationHeader, PrefillHeader, DecodeOnlyHeader}

// PrefillAddress is what PrefillHeader holds for a prefill engine of API URL engineURL:
// its host:port, which the leg runner matches by host ("" for a URL that does not parse).
func PrefillAddress(engineURL string) string {
	u, err := url.Parse(engineURL)
	if err != nil {
		return ""
	}
	return u.Host
}
