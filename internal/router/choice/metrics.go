package choice

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
)

// Metrics are what the chooser counts of its decode choices, under a component's name
// (kvhandoff_router, kvhandoff_epp).
type Metrics struct {
	choices    *prometheus.CounterVec // basis
	decodeOnly *prometheus.CounterVec // reason
	tokens     *prometheus.CounterVec // kind: prompt, cached
}

// NewMetrics registers the chooser's metrics as component_… with reg, and the size of
// index.
func NewMetrics(reg prometheus.Registerer, component string, index *prefix.Index) *Metrics {
	m := &Metrics{
		choices: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: component + "_decode_choices_total",
			Help: "Decode engines chosen, by what the choice rested on: load (routing LoadOnly), prefix (the prefix each engine holds, and load), " +
				"no_prefix (PrefixAware, but the prompt had no whole block to match, so load alone).",
		}, []string{"basis"}),
		decodeOnly: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: component + "_decode_only_total",
			Help: "Requests served on their decode engine alone, with no prefill leg, by reason: short_prompt (shorter than routing.minPrefillTokens), " +
				"prefix_cached (what the engine lacks of it is).",
		}, []string{"reason"}),
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: component + "_prefix_tokens_total",
			Help: "Prompt tokens of requests chosen by prefix (kind prompt) and of those the chosen decode engine held by the index (kind cached): " +
				"their ratio is the index's hit rate.",
		}, []string{"kind"}),
	}
	for _, b := range []string{BasisLoad, BasisPrefix, BasisNoPrefix} {
		m.choices.WithLabelValues(b)
	}
	for _, r := range []string{DecodeOnlyShortPrompt, DecodeOnlyPrefixCached} {
		m.decodeOnly.WithLabelValues(r)
	}
	blocks := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: component + "_prefix_index_blocks",
		Help: "Blocks the prefix index holds, all decode engines together (its memory: about 40 bytes a block).",
	}, func() float64 { return float64(index.Total()) })
	reg.MustRegister(m.choices, m.decodeOnly, m.tokens, blocks)
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
