package session

import (
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// Metrics are the agent's Prometheus series. Label values are bounded: modes, stages,
// failure codes and refused call names are fixed sets. The exported ones are those the
// engine API and the peer mesh count into too.
type Metrics struct {
	stage       *prometheus.HistogramVec
	bytes       *prometheus.CounterVec
	descriptors *prometheus.CounterVec
	expiries    *prometheus.CounterVec
	cancels     prometheus.Counter
	declines    prometheus.Counter
	BellRecords *prometheus.CounterVec
	pullWaits   prometheus.Counter
	failures    *prometheus.CounterVec
	Refused     *prometheus.CounterVec
	parts       *prometheus.CounterVec
	rails       *prometheus.CounterVec
	sessions    prometheus.Gauge
	held        *prometheus.GaugeVec
	Peers       prometheus.Gauge
	Provider    *prometheus.GaugeVec
	resignals   *prometheus.CounterVec
}

// failureReasons are the reason label's values of kvhandoff_agent_failures_total
// (docs/operations.md says what each means).
var failureReasons = []string{
	"acquire_refused", "acquire_timeout", "bad_blocks", "blocks_ttl", "engine_gone", "engine_restarted", "lease_expired", "no_outcome", "peer_lost",
	"peer_unreachable", "pull_failed", "pull_late", "registration_timeout", "session_closed", "signal_error", "source_cancelled", "write_error",
}

// NewMetrics makes the agent's series and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		stage: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvhandoff_agent_handoff_stage_seconds",
			Help: "Handoff latency by stage: rendezvous_wait (push: source ready until paired with a registration; pull: acquire round trip), post " +
				"(paired until the last write was posted), wire (last write posted until every write completed; pull: the reads), notify " +
				"(decode: signal received until the engine was told).",
			// 10 µs to ~40 s.
			Buckets: prometheus.ExponentialBuckets(10e-6, 2.5, 17),
		}, []string{"mode", "stage"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_agent_transferred_bytes_total", Help: "KV bytes moved into decode memory.",
		}, []string{"mode"}),
		descriptors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_agent_descriptors_total", Help: "RMA operations posted, after merging contiguous blocks.",
		}, []string{"mode"}),
		expiries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_agent_lease_expiries_total", Help: "Leases and TTLs that ran out: push registrations, push sources, pull holds, pulls.",
		}, []string{"kind"}),
		cancels: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvhandoff_agent_cancels_total", Help: "Attempts cancelled by engines.",
		}),
		declines: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvhandoff_agent_declines_total", Help: "Push sources freed at once because the decode engine computed the request " +
				"itself (its prefix cache held part of the prompt).",
		}),
		BellRecords: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_agent_doorbell_records_total", Help: "Records that crossed engines' doorbells instead of RPCs: " +
				"reports drained from submit rings, and events written into events rings, by direction.",
		}, []string{"direction"}),
		pullWaits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvhandoff_agent_pull_waits_total", Help: "Pulls that reached this prefill agent before their blocks were reported ready, and " +
				"waited for them (up to half the lease).",
		}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_agent_failures_total", Help: "Attempts that ended without delivery, by reason.",
		}, []string{"reason"}),
		Refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_agent_refused_total", Help: "Refused engine calls and peer messages, by call and code.",
		}, []string{"call", "code"}),
		parts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_agent_source_parts_total", Help: "SourceReady parts accepted: layer_group (a span of regions, layer-streamed push) or " +
				"blocks (runs of whole blocks).",
		}, []string{"kind"}),
		rails: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_agent_rail_bytes_total", Help: "Bytes of RMA writes and reads completed, by rail (--rails): how a rank's transfers " +
				"split over its endpoints.",
		}, []string{"rail"}),
		sessions: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvhandoff_agent_engine_sessions", Help: "Engine ranks registered."}),
		held: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvhandoff_agent_held_requests", Help: "Requests the agent keeps transfer state for, by engine role (prefill: held " +
				"sources, push rendezvous, waiting pulls; decode: push destinations and pulls), counted on each session's tick. An idle " +
				"agent holds none: a count that stays is a leak.",
		}, []string{"role"}),
		Peers: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvhandoff_agent_peer_connections", Help: "Connections to other agents."}),
		Provider: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvhandoff_agent_provider_info", Help: "1 for the libfabric provider the agent runs on.",
		}, []string{"provider"}),
		resignals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_agent_delivery_resignals_total", Help: "Delivery signals asked for again by a decode agent that heard one was " +
				"posted but saw none arrive within a grace (asked), and posted again by a prefill agent (sent).",
		}, []string{"side"}),
	}
	// Every known reason and kind starts at zero: Prometheus' rate() sees no increase in a
	// series' first sample, so a burst of failures on a reason never seen before would
	// otherwise pass without an alert.
	for _, reason := range failureReasons {
		m.failures.WithLabelValues(reason)
	}
	for _, role := range []agentv1.Role{agentv1.Role_ROLE_PREFILL, agentv1.Role_ROLE_DECODE} {
		m.held.WithLabelValues(roleLabel(role))
	}
	for _, kind := range []string{"push", "source", "hold", "pull"} {
		m.expiries.WithLabelValues(kind)
	}
	reg.MustRegister(m.stage, m.bytes, m.descriptors, m.expiries, m.cancels, m.declines, m.BellRecords, m.pullWaits, m.failures, m.Refused, m.parts, m.rails, m.sessions, m.held, m.Peers, m.Provider, m.resignals)
	return m
}

// roleLabel is a role as a label value: prefill, decode.
func roleLabel(r agentv1.Role) string {
	return strings.ToLower(strings.TrimPrefix(r.String(), "ROLE_"))
}
