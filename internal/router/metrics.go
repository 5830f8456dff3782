package router

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Outcomes of a client request, the outcome label of kvhandoff_router_requests_total.
const (
	// OutcomeOK: the client got the decode engine's response.
	OutcomeOK = "ok"
	// OutcomeEngineRefused: an engine answered 4xx (a bad request); passed to the client.
	OutcomeEngineRefused = "engine_refused"
	// OutcomeNoEngine: no eligible engine for a leg (503).
	OutcomeNoEngine = "no_engine"
	// OutcomePrefillFailed: the prefill leg failed on every engine tried (502).
	OutcomePrefillFailed = "prefill_failed"
	// OutcomeDecodeFailed: the decode leg failed before its first byte (502).
	OutcomeDecodeFailed = "decode_failed"
	// OutcomeStreamBroken: the decode leg broke after its first byte reached the client.
	OutcomeStreamBroken = "stream_broken"
	// OutcomeClientGone: the client disconnected; both legs were cancelled.
	OutcomeClientGone = "client_cancelled"
	// OutcomeBadRequest: the client's body was not a JSON object, too large, or too slow
	// to arrive (408).
	OutcomeBadRequest = "bad_request"
	// OutcomeOverloaded: the router was serving MaxInFlight requests already (429).
	OutcomeOverloaded = "overloaded"
)

// Why a request was served on a decode engine alone (handoffFailurePolicy ServeOnDecode),
// the reason label of kvhandoff_router_fallbacks_total.
const (
	// FallbackPrefillFailed: its prefill leg failed on every engine tried.
	FallbackPrefillFailed = "prefill_failed"
	// FallbackNoPrefillEngine: the PrefillPool had no ready engine.
	FallbackNoPrefillEngine = "no_prefill_engine"
	// FallbackNoPrefillHeader: a leg runner got a request without the endpoint picker's
	// prefill choice (a gateway that failed open).
	FallbackNoPrefillHeader = "no_prefill_header"
)

type metrics struct {
	requests  *prometheus.CounterVec
	fallbacks *prometheus.CounterVec
	retries   *prometheus.CounterVec
	legFails  *prometheus.CounterVec
	ttft      *prometheus.HistogramVec
	leg       *prometheus.HistogramVec
	added     *prometheus.HistogramVec
	inflight  *prometheus.GaugeVec
	endpoints *prometheus.GaugeVec

	unknownPrefill prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_router_requests_total",
			Help: "Client requests by mode, outcome and engine (the decode engine, or the engine that failed).",
		}, []string{"mode", "outcome", "engine"}),
		fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_router_fallbacks_total",
			Help: "Requests served on a decode engine alone because their prefill side could not serve them (handoffFailurePolicy ServeOnDecode), by reason.",
		}, []string{"mode", "reason"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_router_retries_total",
			Help: "Legs sent again without the engine that failed them, by the leg that failed: prefill (any failure; push: the pair again) " +
				"or decode (the engine refused the connection, nothing reached it; push: the pair again).",
		}, []string{"mode", "leg"}),
		legFails: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_router_leg_failures_total",
			Help: "Failed legs by leg, engine and reason (refused, timeout, status_5xx, no_kv_transfer_params, broken).",
		}, []string{"leg", "engine", "reason"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvhandoff_router_ttft_seconds",
			Help:    "Time to first byte as the client sees it: from the request's arrival to the first byte of the decode response written back.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 17),
		}, []string{"mode"}),
		leg: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvhandoff_router_leg_seconds",
			Help:    "Time per leg: prefill from send to its whole response, decode from send to its first byte.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 17),
		}, []string{"mode", "leg"}),
		added: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvhandoff_router_added_seconds",
			Help: "Latency the router adds to a request's first byte: its own time before sending legs, between legs (pull) and before relaying " +
				"the first byte.",
			Buckets: prometheus.ExponentialBuckets(0.00005, 2, 16),
		}, []string{"mode"}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvhandoff_router_inflight",
			Help: "Legs in flight per engine.",
		}, []string{"role", "engine"}),
		endpoints: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvhandoff_router_eligible_engines",
			Help: "Engines the router may send legs to (Ready), per role.",
		}, []string{"role"}),
		unknownPrefill: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvhandoff_router_unknown_prefill_named_total",
			Help: "Leg runner: requests whose endpoint picker named a prefill engine that was not a ready engine of the PrefillPool (another was chosen).",
		}),
	}
	// Fallbacks start at zero, so the first ones show in rate() (an alert) at once.
	for _, mode := range []string{"push", "pull"} {
		for _, reason := range []string{FallbackPrefillFailed, FallbackNoPrefillEngine, FallbackNoPrefillHeader} {
			m.fallbacks.WithLabelValues(mode, reason)
		}
	}
	reg.MustRegister(m.requests, m.fallbacks, m.retries, m.legFails, m.ttft, m.leg, m.added, m.inflight, m.endpoints, m.unknownPrefill)
	return m
}
