package choice

import (
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvhandoff/kvhandoff/internal/router/balance"
	"github.com/kvhandoff/kvhandoff/internal/router/kvfollow"
	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
)

// Config is what a program's engine choice is made of: the router's and the endpoint
// picker's are the same but for the name their metrics go by.
type Config struct {
	// Metrics prefixes the metrics' names: kvhandoff_router or kvhandoff_epp.
	Metrics string
	// ScrapeInterval is how often engines' /metrics are read for their load.
	ScrapeInterval time.Duration
	// PrefixIndexBlocks bounds the prefix index per engine.
	PrefixIndexBlocks int
	// KVEventsTokenFile, when set, follows the engines' kv-events sidecars with it.
	KVEventsTokenFile string
	Registry          prometheus.Registerer
	// InFlight is the program's gauge of legs in flight (labels role and engine).
	InFlight *prometheus.GaugeVec
	Log      *slog.Logger
}

// Assembly is a program's engine choice: the balancer (whose loads the program feeds),
// the KV events follower (nil without a token) and the chooser over them.
type Assembly struct {
	Balancer *balance.Balancer
	Events   *kvfollow.Follower
	Chooser  *Chooser
}

// Assemble makes the engine choice c describes, its metrics named from one table.
func Assemble(c Config) *Assembly {
	a := &Assembly{Balancer: balance.New(5 * max(c.ScrapeInterval, time.Second))}
	ix := prefix.NewIndex(c.PrefixIndexBlocks)
	if c.KVEventsTokenFile != "" {
		a.Events = kvfollow.NewFollower(c.PrefixIndexBlocks, c.KVEventsTokenFile, ix, c.Registry, kvfollow.Names{
			Live: c.Metrics + "_kv_events_live_engines", Blocks: c.Metrics + "_kv_events_blocks", Resets: c.Metrics + "_kv_events_resets_total"}, c.Log)
	}
	a.Chooser = New(a.Balancer, ix, a.Events, NewMetrics(c.Registry, Names{Choices: c.Metrics + "_decode_choices_total",
		DecodeOnly: c.Metrics + "_decode_only_total", Tokens: c.Metrics + "_prefix_tokens_total", IndexBlocks: c.Metrics + "_prefix_index_blocks",
		Lookups: c.Metrics + "_prefix_lookups_total"}, ix), c.InFlight)
	return a
}
