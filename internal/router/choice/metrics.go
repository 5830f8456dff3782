package choice

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
)

// Names are the chooser's metrics' names in one component (the router, the endpoint
// picker), each spelled out where the component is, so a rule or dashboard can be checked
// against them.
type Names struct{ Choices, DecodeOnly, Tokens, IndexBlocks, Lookups string }

// Metrics are what the chooser counts of its choices.
type Metrics struct {
	choices    *prometheus.CounterVec // basis
	decodeOnly *prometheus.CounterVec // reason
	tokens     *prometheus.CounterVec // kind: prompt, cached, prefill_cached

	lookupEvents, lookupHistory prometheus.Counter
}

// NewMetrics registers the chooser's metrics under names with reg, and the size of index.
func NewMetrics(reg prometheus.Registerer, names Names, index *prefix.Index) *Metrics {
	m := &Metrics{
		choices: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: names.Choices,
			Help: "Decode engines chosen, by what the choice rested on: load (routing LoadOnly), prefix (the prefix each engine holds, and load), " +
				"no_prefix (PrefixAware, but the prompt had no whole block to match, so load alone).",
		}, []string{"basis"}),
		decodeOnly: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: names.DecodeOnly,
			Help: "Requests served on their decode engine alone, with no prefill leg, by reason: short_prompt (shorter than routing.minPrefillTokens), " +
				"prefix_cached (what the engine lacks of it is).",
		}, []string{"reason"}),
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: names.Tokens,
			Help: "Prompt tokens of requests chosen by prefix (kind prompt), of those the chosen decode engine held by the index (kind cached): " +
				"their ratio is the index's hit rate; and of those their prefill engine held (kind prefill_cached).",
		}, []string{"kind"}),
	}
	lookups := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: names.Lookups,
		Help: "Candidate engines matched against a prompt, by the source of what the engine holds: events (its own KV cache events, token-id " +
			"prompts of engines whose stream is live) or history (the prompts routed to it).",
	}, []string{"source"})
	m.lookupEvents, m.lookupHistory = lookups.WithLabelValues("events"), lookups.WithLabelValues("history")
	for _, b := range []string{BasisLoad, BasisPrefix, BasisNoPrefix} {
		m.choices.WithLabelValues(b)
	}
	for _, r := range []string{DecodeOnlyShortPrompt, DecodeOnlyPrefixCached} {
		m.decodeOnly.WithLabelValues(r)
	}
	blocks := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: names.IndexBlocks,
		Help: "Blocks the prefix index holds, all engines together (its memory: about 40 bytes a block).",
	}, func() float64 { return float64(index.Total()) })
	reg.MustRegister(m.choices, m.decodeOnly, m.tokens, lookups, blocks)
	return m
}

func (m *Metrics) count(req Request, plan Plan) {
	m.choices.WithLabelValues(plan.Basis).Inc()
	if plan.DecodeOnly != "" {
		m.decodeOnly.WithLabelValues(plan.DecodeOnly).Inc()
	}
	if plan.Basis == BasisPrefix {
		m.tokens.WithLabelValues("prompt").Add(float64(req.Prompt.Tokens))
		m.tokens.WithLabelValues("cached").Add(float64(plan.Cached))
	}
}
