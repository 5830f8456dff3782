package v1alpha1

// DecodeChoice says how the routers (and the gateway's endpoint picker) choose a
// request's decode engine.
// +kubebuilder:validation:Enum=LoadOnly;PrefixAware
type DecodeChoice string

const (
	// DecodeChoiceLoadOnly chooses the decode engine with the least load.
	DecodeChoiceLoadOnly DecodeChoice = "LoadOnly"
	// DecodeChoicePrefixAware chooses by the share of the prompt an engine holds in its
	// prefix cache against its load: the engine holding a conversation's earlier turns
	// gets its next one, and only the blocks it lacks are moved. The prefill engine is then
	// the one with the least work before the first token: its queued prompt tokens plus
	// this prompt's tokens it does not hold.
	DecodeChoicePrefixAware DecodeChoice = "PrefixAware"
)

// PrefixSource says where the routers learn which prompt blocks each engine holds.
// +kubebuilder:validation:Enum=KVEvents;RoutingHistory
type PrefixSource string

const (
	// PrefixSourceKVEvents: from vLLM's own KV cache events (blocks stored and evicted),
	// which a kv-events sidecar in each engine pod relays, for prompts of token ids; text
	// and chat prompts, and engines whose stream is down, fall back to RoutingHistory.
	PrefixSourceKVEvents PrefixSource = "KVEvents"
	// PrefixSourceRoutingHistory: from the prompts the routers sent each engine alone.
	PrefixSourceRoutingHistory PrefixSource = "RoutingHistory"
)

// RoutingSpec is how a request's engines are chosen, and when it skips prefill.
type RoutingSpec struct {
	// decodeChoice is LoadOnly, the default, or PrefixAware: by the share of the prompt
	// a decode engine holds in its prefix cache (overlapWeight) against its load
	// (loadWeight). The routers learn what each engine holds from its own KV cache events
	// or from the prompts they sent it (prefixSource; docs/router.md says how exact each
	// is).
	// +kubebuilder:default=LoadOnly
	// +optional
	DecodeChoice DecodeChoice `json:"decodeChoice,omitempty"`

	// prefixSource is where the routers learn what each engine holds, under PrefixAware.
	// KVEvents, the default, runs a kv-events sidecar in every engine pod that relays
	// vLLM's own KV cache events (blocks stored and evicted, whoever sent the request) as
	// keys of the blocks, never their tokens: exact for prompts of token ids (the routers
	// do not tokenize, so text and chat prompts match by routing history). An engine whose
	// stream is down falls back to RoutingHistory: what the routers sent it. Turning
	// PrefixAware with KVEvents on or off rolls the engines (the sidecar comes or goes).
	// +kubebuilder:default=KVEvents
	// +optional
	PrefixSource PrefixSource `json:"prefixSource,omitempty"`

	// overlapWeight is what a decode engine holding a whole prompt is worth, in units of
	// loadWeight per request in flight on it: with 4 and 1, an engine holding the prompt
	// is chosen over an idle one until it has 4 more requests in flight than that one,
	// and one holding half of it until 2. What every candidate holds (a shared system
	// prompt) does not count: the share is of the rest of the prompt. PrefixAware only.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1000
	// +kubebuilder:default=4
	// +optional
	OverlapWeight int32 `json:"overlapWeight,omitempty"`

	// loadWeight is the weight of a request in flight on a decode engine (see
	// overlapWeight). A full KV cache steers away from an engine whatever the weights.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000
	// +kubebuilder:default=1
	// +optional
	LoadWeight int32 `json:"loadWeight,omitempty"`

	// minPrefillTokens: a request whose prompt, less what the chosen decode engine holds
	// of it, is shorter than this many tokens is served on that decode engine alone,
	// with no prefill leg (counted in kvhandoff_router_decode_only_total by reason):
	// computing a short tail costs the decode engine less than a handoff costs the
	// request. 0, the default, sends every request through prefill. Under LoadOnly only
	// the prompt's length counts.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1048576
	// +kubebuilder:default=0
	// +optional
	MinPrefillTokens int32 `json:"minPrefillTokens,omitempty"`
}

// KVEvents reports whether engines under this routing publish their KV cache events to
// the routers (PrefixAware with prefixSource KVEvents, its default).
func (r *RoutingSpec) KVEvents() bool {
	return r != nil && r.DecodeChoice == DecodeChoicePrefixAware && r.PrefixSource != PrefixSourceRoutingHistory
}
