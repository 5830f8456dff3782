package epp

import (
	"encoding/json"
	"net/http"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilter "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

// chunk is the most body bytes one streamed body response carries (Envoy's ext_proc
// takes at most 64 KiB per message in FULL_DUPLEX_STREAMED mode).
const chunk = 62000

// stream is one request's ext_proc exchange. Its request side is a protocol: headers
// once, then the body (its last chunk marked, or trailers once), then the response's
// messages. A stream routes at most once; a request message out of that order is a
// protocol error that ends the stream (one stream once took a new --max-in-flight slot
// per headers message and kept them all).
type stream struct {
	s     *Server
	srv   extprocv3.ExternalProcessor_ProcessServer
	start time.Time

	headers, bodyDone, trailersSeen bool
	// responded: a response message came; a stream that ends without one was closed by
	// the gateway at routing, and the picker cannot tell when its request ended.
	responded bool
	// held is the bytes of body this stream holds of the picker's MaxBufferedBytes.
	held int64

	subset map[string]bool // the gateway's subset hint; nil: none
	// modes are the body modes the gateway runs this filter in (its first message says):
	// FULL_DUPLEX_STREAMED, where the picker answers the headers after the body and hands
	// the body back, or BUFFERED, where Envoy waits for each answer in turn and keeps the
	// body, so that it can still fail open when the picker is gone.
	modes *extprocv3.ProtocolConfiguration
	body  []byte
	// trailers: the request's body ends with trailers, not with a last chunk marked so.
	trailers bool
	slot     bool
	picked   *picked
	served   string
}

// handle answers one message from the gateway; done ends the stream (an immediate
// response was sent).
func (r *stream) handle(req *extprocv3.ProcessingRequest) (done bool, err error) {
	if r.subset == nil {
		r.subset = subsetHint(req.GetMetadataContext())
	}
	if r.modes == nil && req.GetProtocolConfig() != nil {
		r.modes = req.GetProtocolConfig()
	}
	switch v := req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return r.requestHeaders(v.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		return r.requestBody(v.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return r.requestTrailers()
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		r.responded = true
		r.served = served(req)
		return false, r.srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
			ResponseHeaders: &extprocv3.HeadersResponse{}}})
	case *extprocv3.ProcessingRequest_ResponseBody:
		// The response passes through as it came, chunk by chunk: streamed tokens are not
		// held back.
		r.responded = true
		b := v.ResponseBody
		resp := &extprocv3.CommonResponse{}
		if r.modes.GetResponseBodyMode() == extprocfilter.ProcessingMode_FULL_DUPLEX_STREAMED || r.modes == nil {
			resp = streamed(b.GetBody(), b.GetEndOfStream())
		}
		return false, r.srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
			ResponseBody: &extprocv3.BodyResponse{Response: resp}}})
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		r.responded = true
		return false, r.srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
			ResponseTrailers: &extprocv3.TrailersResponse{}}})
	}
	return false, nil
}

// requestHeaders takes the request's slot, before any body is held, and routes a
// request without a body at once.
func (r *stream) requestHeaders(h *extprocv3.HttpHeaders) (bool, error) {
	if r.headers {
		return false, protocolError("request headers a second time")
	}
	r.headers = true
	// The slot first, before any body is buffered: a request the picker cannot take
	// costs nothing more.
	select {
	case r.s.slots <- struct{}{}:
		r.slot = true
	default:
		return r.refuse(&refusal{http.StatusTooManyRequests, OutcomeShed, "the endpoint picker is serving its limit of requests (--max-in-flight); retry later"})
	}
	if h.GetEndOfStream() {
		r.bodyDone = true
		return r.route(nil, false) // no body (GET /v1/models): pick by load alone
	}
	if r.buffered() {
		// Envoy sends the body only once the headers are answered: route then, by
		// mutating the headers in the body's answer.
		return false, r.srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{}}})
	}
	return false, nil // answered once the body is in: its prompt weighs the choice
}

// requestBody holds the body's chunks, within the picker's bounds, and routes on the
// last.
func (r *stream) requestBody(b *extprocv3.HttpBody) (bool, error) {
	if !r.headers || r.bodyDone || r.trailersSeen {
		return false, protocolError("a request body chunk after the body ended, or before the headers")
	}
	if int64(len(r.body)+len(b.GetBody())) > r.s.cfg.MaxBodyBytes {
		return r.refuse(&refusal{http.StatusRequestEntityTooLarge, OutcomeBadRequest, "the request body exceeds the endpoint picker's limit"})
	}
	if !r.hold(int64(len(b.GetBody()))) {
		return r.refuse(&refusal{http.StatusTooManyRequests, OutcomeShed, "the endpoint picker is buffering its limit of request bytes (--max-buffered-bytes); retry later"})
	}
	r.body = append(r.body, b.GetBody()...)
	if !b.GetEndOfStream() {
		return false, nil
	}
	r.bodyDone = true
	parsed, err := protocol.Parse(r.body)
	if err != nil {
		return r.refuse(&refusal{http.StatusBadRequest, OutcomeBadRequest, err.Error()})
	}
	return r.route(parsed, true)
}

// requestTrailers routes a body that ended with trailers, then answers them.
func (r *stream) requestTrailers() (bool, error) {
	if !r.headers || r.trailersSeen || (r.bodyDone && !r.buffered()) {
		return false, protocolError("request trailers a second time, after a body that ended, or before the headers")
	}
	r.trailersSeen = true
	if r.picked == nil && !r.buffered() {
		r.trailers = true
		parsed, err := protocol.Parse(r.body)
		if err != nil {
			return r.refuse(&refusal{http.StatusBadRequest, OutcomeBadRequest, err.Error()})
		}
		if done, err := r.route(parsed, true); done || err != nil {
			return done, err
		}
	}
	return false, r.srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
		RequestTrailers: &extprocv3.TrailersResponse{}}})
}

// route picks the request's engines and answers its headers (routing headers set, the
// client's own removed), then gives its body back to the gateway unchanged.
func (r *stream) route(body protocol.Body, hasBody bool) (bool, error) {
	if r.picked != nil {
		return false, protocolError("a request routed a second time") // the states above never get here
	}
	p, err := r.s.pick(r.subset, body)
	if err != nil {
		return r.refuse(err.(*refusal))
	}
	r.picked = p
	r.s.m.requests.WithLabelValues(OutcomePicked).Inc()
	r.s.m.pick.Observe(time.Since(r.start).Seconds())
	dest := strings.Join(p.destinations, ",")
	set := func(k, v string) *corev3.HeaderValueOption {
		return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
			AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD}
	}
	// The prefill engine, or that there is none: never what the client sent.
	mutation := &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{set(protocol.DestinationHeader, dest), set(protocol.PrefillHeader, p.prefill)},
		RemoveHeaders: []string{protocol.DecodeOnlyHeader}}
	if p.decodeOnly != "" {
		mutation = &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{set(protocol.DestinationHeader, dest), set(protocol.DecodeOnlyHeader, p.decodeOnly)},
			RemoveHeaders: []string{protocol.PrefillHeader}}
	}
	routing := &extprocv3.CommonResponse{
		// The route is chosen again, by the headers set here.
		ClearRouteCache: true,
		HeaderMutation:  mutation,
	}
	md := &structpb.Struct{Fields: map[string]*structpb.Value{
		protocol.MetadataNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			protocol.DestinationHeader: structpb.NewStringValue(dest),
		}}),
	}}
	if hasBody && r.buffered() {
		// The headers were answered already; Envoy still holds them and the body.
		r.dropBody()
		return false, r.srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: &extprocv3.BodyResponse{Response: routing}}, DynamicMetadata: md})
	}
	if err := r.srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: routing}}, DynamicMetadata: md}); err != nil {
		return false, err
	}
	if !hasBody {
		return false, nil
	}
	for i := 0; ; i += chunk {
		end := min(i+chunk, len(r.body))
		resp := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: &extprocv3.BodyResponse{Response: streamed(r.body[i:end], end == len(r.body) && !r.trailers)}}}
		if err := r.srv.Send(resp); err != nil {
			return false, err
		}
		if end == len(r.body) {
			break
		}
	}
	r.dropBody()
	return false, nil
}

// hold takes n more bytes of the picker's MaxBufferedBytes for this stream's body; false
// when they are not there.
func (r *stream) hold(n int64) bool {
	if r.s.buffered.Add(n) > r.s.cfg.MaxBufferedBytes {
		r.s.buffered.Add(-n)
		return false
	}
	r.held += n
	return true
}

// dropBody lets go of the body once it went back to the gateway, and of its bytes.
func (r *stream) dropBody() {
	r.body = nil
	r.s.buffered.Add(-r.held)
	r.held = 0
}

// protocolError is a message the ext_proc protocol does not allow where it came: it ends
// the stream.
func protocolError(what string) error {
	return status.Errorf(codes.InvalidArgument, "ext_proc: %s", what)
}

// buffered: Envoy runs this filter's request body in BUFFERED mode.
func (r *stream) buffered() bool {
	return r.modes.GetRequestBodyMode() == extprocfilter.ProcessingMode_BUFFERED
}

func streamed(b []byte, eos bool) *extprocv3.CommonResponse {
	return &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
		StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b, EndOfStream: eos}}}}
}

// refuse answers the request itself with an OpenAI-shaped error, and ends the stream.
func (r *stream) refuse(rf *refusal) (bool, error) {
	r.s.m.requests.WithLabelValues(rf.outcome).Inc()
	r.s.cfg.Log.Warn("request refused", "status", rf.status, "outcome", rf.outcome, "err", rf.msg)
	body, _ := json.Marshal(map[string]any{"error": map[string]any{"message": rf.msg, "type": http.StatusText(rf.status), "code": rf.status}})
	return true, r.srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{
			Status:  &typev3.HttpStatus{Code: typev3.StatusCode(rf.status)},
			Body:    body,
			Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: "content-type", RawValue: []byte("application/json")}}}},
			Details: "kvhandoff_epp_" + rf.outcome,
		},
	}})
}

// finish gives back what the request held once its stream ends, and counts a response
// served by another endpoint than the first picked, and a request whose stream the
// gateway closed at routing (its response is not processed: the picker cannot know when
// it ends, so --max-in-flight bounds picks, not requests, for such a gateway).
func (r *stream) finish(err error) {
	r.dropBody()
	if r.picked != nil && !r.responded && err == nil {
		r.s.m.unobserved.Inc()
		r.s.warnUnobserved.Do(func() {
			r.s.cfg.Log.Warn("the gateway closed an ext_proc stream once its request was routed, without its response: configure the " +
				"ext_proc filter to send response headers and body (FULL_DUPLEX_STREAMED or STREAMED); until then --max-in-flight " +
				"bounds picks, not requests, and the engines' in-flight counts drop at routing")
		})
	}
	if r.picked != nil {
		r.picked.release()
		switch {
		case r.served == r.picked.destinations[0]:
			r.s.m.served.WithLabelValues("first").Inc()
		case r.served != "":
			r.s.m.served.WithLabelValues("fallback").Inc()
		}
	}
	if r.slot {
		<-r.s.slots
	}
}

// subsetHint reads the gateway's subset hint: nil when it sent none, else the set of
// endpoints (empty when the list is).
func subsetHint(md *corev3.Metadata) map[string]bool {
	ns := md.GetFilterMetadata()[protocol.SubsetNamespace]
	v, ok := ns.GetFields()[protocol.SubsetKey]
	if !ok {
		return nil
	}
	out := map[string]bool{}
	// A list of endpoints, as the protocol has it; a comma-separated string also serves (what
	// Envoy's header_to_metadata filter can set).
	values := v.GetListValue().GetValues()
	if values == nil {
		values = []*structpb.Value{v}
	}
	for _, e := range values {
		for _, ep := range strings.Split(e.GetStringValue(), ",") {
			if ep = strings.TrimSpace(ep); ep != "" {
				out[ep] = true
			}
		}
	}
	return out
}

// served is the endpoint the gateway reports as having served the request: the EPP
// protocol's metadata, or Envoy's upstream.address attribute (response_attributes).
func served(req *extprocv3.ProcessingRequest) string {
	if v := req.GetMetadataContext().GetFilterMetadata()[protocol.MetadataNamespace].GetFields()[protocol.ServedKey].GetStringValue(); v != "" {
		return v
	}
	return req.GetAttributes()["envoy.filters.http.ext_proc"].GetFields()["upstream.address"].GetStringValue()
}
