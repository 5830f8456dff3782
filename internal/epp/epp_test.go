package epp_test

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/epp"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

func engine(id, host, hash string) discovery.Engine {
	return discovery.Engine{URL: "http://" + host + ":8000", EngineID: id, Host: host, SideChannelPort: 5600, TensorParallelSize: 1, CompatHash: hash}
}

// serve runs the picker on a loopback gRPC server and returns a client connection.
func serve(t *testing.T, cfg epp.Config) (*epp.Server, *grpc.ClientConn) {
	t.Helper()
	s := epp.New(cfg)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	s.Register(g)
	go func() { _ = g.Serve(l) }()
	t.Cleanup(g.Stop)
	conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return s, conn
}

// The EPP protocol's health services: liveness at once, readiness and the ext_proc
// service only while a prefill and a decode engine can be paired.
func TestHealthFollowsWhetherAPairExists(t *testing.T) {
	s, conn := serve(t, epp.Defaults())
	h := healthpb.NewHealthClient(conn)
	check := func(svc string) healthpb.HealthCheckResponse_ServingStatus {
		r, err := h.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil {
			t.Fatal(err)
		}
		return r.Status
	}
	extproc := extprocv3.ExternalProcessor_ServiceDesc.ServiceName
	if check(epp.Liveness) != healthpb.HealthCheckResponse_SERVING || check(epp.Readiness) != healthpb.HealthCheckResponse_NOT_SERVING ||
		check(extproc) != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatal("before any engines: want liveness SERVING, readiness and ext_proc NOT_SERVING")
	}
	set := &discovery.Set{Mode: kvv1.TransferPush, Prefill: []discovery.Engine{engine("p", "198.18.0.1", "a")},
		Decode: []discovery.Engine{engine("d", "198.18.0.2", "b")}, Source: "test"}
	s.Update(set)
	if check(epp.Readiness) != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatal("engines of different compat-hashes cannot be paired: want readiness NOT_SERVING")
	}
	set.Decode[0].CompatHash = "a"
	s.Update(set)
	if check(epp.Readiness) != healthpb.HealthCheckResponse_SERVING || check(extproc) != healthpb.HealthCheckResponse_SERVING {
		t.Fatal("with a pair: want readiness and ext_proc SERVING")
	}
}

// A request without a body is routed on its headers; the destination lists the fallbacks
// asked for, each a decode engine of the first one's compat-hash, and the prefill engine
// pairs with them all. The header and the metadata carry the same list.
func TestFallbacksAreDecodeEnginesOfTheFirstsCompatHash(t *testing.T) {
	cfg := epp.Defaults()
	cfg.Fallbacks, cfg.LegRunnerPorts, cfg.ScrapeInterval = 2, []int32{8100}, 0
	s, conn := serve(t, cfg)
	s.Update(&discovery.Set{Mode: kvv1.TransferPush, Source: "test",
		Prefill: []discovery.Engine{engine("p", "198.18.0.1", "a")},
		Decode:  []discovery.Engine{engine("d1", "198.18.0.2", "a"), engine("d2", "198.18.0.3", "a"), engine("other", "198.18.0.4", "b")}})
	stream, err := extprocv3.NewExternalProcessorClient(conn).Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{EndOfStream: true, Headers: &corev3.HeaderMap{}}}}); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	headers := map[string]string{}
	for _, h := range resp.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		headers[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
	}
	dest := headers[protocol.DestinationHeader]
	if dest != "198.18.0.2:8100,198.18.0.3:8100" && dest != "198.18.0.3:8100,198.18.0.2:8100" {
		t.Fatalf("destination %q: want both engines of compat-hash a on the leg-runner port, and not the other", dest)
	}
	if headers[protocol.PrefillHeader] != "198.18.0.1:8000" {
		t.Fatalf("prefill %q", headers[protocol.PrefillHeader])
	}
	md := resp.GetDynamicMetadata().GetFields()[protocol.MetadataNamespace].GetStructValue().GetFields()[protocol.DestinationHeader].GetStringValue()
	if md != dest {
		t.Fatalf("metadata %q differs from the header %q", md, dest)
	}
	_ = stream.CloseSend()
}

// The picker plans as the router does: a conversation's next turn to the decode endpoint
// that holds its first, and a turn with a short new part marked for decode alone (the
// prefill header removed, whatever the client sent).
func TestThePickerRoutesByPrefixAndMarksDecodeOnlyTurns(t *testing.T) {
	cfg := epp.Defaults()
	cfg.ScrapeInterval = 0
	s, conn := serve(t, cfg)
	s.Update(&discovery.Set{Mode: kvv1.TransferPush, Source: "test", BlockSize: 16,
		Routing: &kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoicePrefixAware, OverlapWeight: 4, LoadWeight: 1, MinPrefillTokens: 64},
		Prefill: []discovery.Engine{engine("p", "198.18.0.1", "a")},
		Decode:  []discovery.Engine{engine("d1", "198.18.0.2", "a"), engine("d2", "198.18.0.3", "a")}})
	pick := func(prompt string) (set map[string]string, removed []string) {
		stream, err := extprocv3.NewExternalProcessorClient(conn).Process(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = stream.CloseSend() }()
		for _, req := range []*extprocv3.ProcessingRequest{
			{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{
				Headers: []*corev3.HeaderValue{{Key: protocol.PrefillHeader, RawValue: []byte("198.18.0.99:8000")}}}}}},
			{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
				Body: []byte(fmt.Sprintf(`{"model":"m","prompt":%q}`, prompt)), EndOfStream: true}}},
		} {
			if err := stream.Send(req); err != nil {
				t.Fatal(err)
			}
		}
		resp, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		m := resp.GetRequestHeaders().GetResponse().GetHeaderMutation()
		set = map[string]string{}
		for _, h := range m.GetSetHeaders() {
			set[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
		}
		return set, m.GetRemoveHeaders()
	}
	opening := map[int]string{0: strings.Repeat("conversation zero opens. ", 40), 1: strings.Repeat("conversation one opens. ", 40)}
	first := map[int]string{}
	for c, prompt := range opening {
		h, removed := pick(prompt)
		first[c] = h[protocol.DestinationHeader]
		if h[protocol.PrefillHeader] != "198.18.0.1:8000" || h[protocol.DecodeOnlyHeader] != "" || !slices.Equal(removed, []string{protocol.DecodeOnlyHeader}) {
			t.Errorf("first turn of %d: %v, removed %v: want prefill p and the decode-only mark removed", c, h, removed)
		}
	}
	if first[0] == first[1] {
		t.Fatalf("both first turns to %s", first[0])
	}
	for c, prompt := range opening {
		h, removed := pick(prompt + " thanks")
		if h[protocol.DestinationHeader] != first[c] || h[protocol.DecodeOnlyHeader] != "prefix_cached" || h[protocol.PrefillHeader] != "" ||
			!slices.Equal(removed, []string{protocol.PrefillHeader}) {
			t.Errorf("a short second turn of %d: %v, removed %v: want %s alone, the client's prefill header removed", c, h, removed, first[c])
		}
		h, _ = pick(prompt + strings.Repeat(" and a long question", 30))
		if h[protocol.DestinationHeader] != first[c] || h[protocol.PrefillHeader] != "198.18.0.1:8000" {
			t.Errorf("a long turn of %d: %v: want %s with prefill p", c, h, first[c])
		}
	}
}
