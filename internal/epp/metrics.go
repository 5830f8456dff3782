package epp

import "github.com/prometheus/client_golang/prometheus"

// Outcomes of a request at the picker, the outcome label of kvhandoff_epp_requests_total.
const (
	// OutcomePicked: a decode endpoint and a prefill engine were picked.
	OutcomePicked = "picked"
	// OutcomeNoEngine: no ready pair, or none in the gateway's subset hint (503).
	OutcomeNoEngine = "no_engine"
	// OutcomeShed: the picker was at MaxInFlight (429).
	OutcomeShed = "shed"
	// OutcomeBadRequest: the body was not a JSON object or too large (400, 413).
	OutcomeBadRequest = "bad_request"
	// OutcomeTimeout: the request did not arrive whole within the body timeout (408), or
	// the stream outlived its longest duration.
	OutcomeTimeout = "timeout"
	// OutcomeProtocolError: the gateway's stream broke the ext_proc protocol (a second
	// headers message, a body after its end, ...); it was ended.
	OutcomeProtocolError = "protocol_error"
)

type metrics struct {
	requests *prometheus.CounterVec
	pick     prometheus.Histogram
	served   *prometheus.CounterVec
	inflight *prometheus.GaugeVec
	// unobserved counts routed requests whose stream the gateway closed without their
	// response (finish).
	unobserved prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_epp_requests_total", Help: "Requests the endpoint picker saw, by outcome.",
		}, []string{"outcome"}),
		pick: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvhandoff_epp_pick_seconds", Help: "From a request's headers at the picker to its routing answer (includes receiving the body).",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16),
		}),
		served: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_epp_served_total", Help: "Responses whose serving endpoint the gateway reported, by whether it was the first picked (first) or another (fallback).",
		}, []string{"by"}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvhandoff_epp_inflight", Help: "Requests picked for and not yet finished, by role and engine.",
		}, []string{"role", "engine"}),
		unobserved: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvhandoff_epp_unobserved_requests_total", Help: "Routed requests whose ext_proc stream the gateway closed without their response: the picker cannot count them past their pick (configure response processing).",
		}),
	}
	reg.MustRegister(m.requests, m.pick, m.served, m.inflight, m.unobserved)
	return m
}
