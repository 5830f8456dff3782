package cli

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/test/gobin"
)

// picker is a running endpoint-picker binary: a gateway's connection to it, and its
// operators' address.
type picker struct {
	conn  *grpc.ClientConn
	admin string
}

// pickerProc runs the endpoint-picker binary over a pair of engines (never dialled: the
// picker picks by its own counts with --scrape-interval 0) until the test ends.
func pickerProc(t *testing.T, flags ...string) picker {
	t.Helper()
	dir := t.TempDir()
	bin, err := gobin.Build(dir, "endpoint-picker")
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "endpoints.json")
	_ = os.WriteFile(file, []byte(`{"mode":"Pull","prefill":[{"url":"http://127.0.0.1:1","engineID":"p"}],"decode":[{"url":"http://127.0.0.1:2","engineID":"d"}]}`), 0o644)
	m := gobin.Start(t, bin, `"msg":"endpoint picker serving","listen":"([^"]+)","admin-listen":"([^"]+)"`,
		append([]string{"--endpoints", file, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--scrape-interval", "0", "--drain", "1s"}, flags...)...)
	conn, err := grpc.NewClient(m[1], grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return picker{conn: conn, admin: m[2]}
}

// stream opens an ext_proc stream as the gateway does, ended with the test.
func (p picker) stream(t *testing.T) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	t.Cleanup(cancel)
	s, err := extprocv3.NewExternalProcessorClient(p.conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func headers(endOfStream bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":path", RawValue: []byte("/v1/completions")}}}, EndOfStream: endOfStream}}}
}

func body(b []byte, endOfStream bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: endOfStream}}}
}

// routed: the answer routes the request (not an immediate response).
func routed(t *testing.T, s extprocv3.ExternalProcessor_ProcessClient) bool {
	t.Helper()
	resp, err := s.Recv()
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	if ir := resp.GetImmediateResponse(); ir != nil {
		t.Logf("refused: %d %s", ir.GetStatus().GetCode(), ir.GetBody())
		return false
	}
	return resp.GetRequestHeaders().GetResponse().GetHeaderMutation() != nil
}

// The attack: 4,095 headers messages on one stream took 4,094 of 4,096 slots for good.
// A stream routes once; a second headers message, or a body after the route, ends the
// stream as a protocol error, and every slot comes back.
func TestOneStreamRoutesOnceAndHoldsOneSlot(t *testing.T) {
	const limit = 8
	p := pickerProc(t, "--max-in-flight", "8")
	for _, second := range []*extprocv3.ProcessingRequest{headers(true), body([]byte(`{}`), true)} {
		for range 4 * limit {
			s := p.stream(t)
			if err := s.Send(headers(true)); err != nil {
				t.Fatal(err)
			}
			if !routed(t, s) {
				t.Fatal("the first headers were not routed")
			}
			_ = s.Send(second)
			_, err := s.Recv()
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("after %T: %v, want the stream ended InvalidArgument", second.Request, err)
			}
		}
	}
	if got := gobin.Metric(t, p.admin, `kvhandoff_epp_requests_total{outcome="protocol_error"}`); got != 8*limit {
		t.Errorf("protocol errors counted %v, want %d", got, 8*limit)
	}
	// Every slot is free: limit requests at once all route.
	for range limit {
		s := p.stream(t)
		if err := s.Send(headers(true)); err != nil {
			t.Fatal(err)
		}
		if !routed(t, s) {
			t.Fatal("a slot was kept by a stream that ended")
		}
	}
}

// The attack: 1,100 streams that sent headers and stopped got every real request 429,
// still after 30 s. Past --max-in-flight a stream is refused at once (429); one that
// does not bring its body within --body-timeout is answered 408 and gives its slot back.
func TestStalledStreamsAreRefusedAndTimedOut(t *testing.T) {
	p := pickerProc(t, "--max-in-flight", "8", "--body-timeout", "5s")
	const streams = 1100
	answers := make(chan int, streams)
	for range streams {
		s := p.stream(t)
		if err := s.Send(headers(false)); err != nil {
			t.Fatal(err)
		}
		go func() {
			resp, err := s.Recv()
			if err != nil {
				answers <- -1
				return
			}
			answers <- int(resp.GetImmediateResponse().GetStatus().GetCode())
		}()
	}
	got := map[int]int{}
	for range streams {
		got[<-answers]++
	}
	if got[429] != streams-8 || got[408] != 8 {
		t.Errorf("answers by status %v, want %d × 429 (past --max-in-flight) and 8 × 408 (--body-timeout)", got, streams-8)
	}
	s := p.stream(t)
	if err := s.Send(headers(true)); err != nil {
		t.Fatal(err)
	}
	if !routed(t, s) {
		t.Error("a request after the stalled streams timed out was not routed")
	}
	if got := gobin.Metric(t, p.admin, `kvhandoff_epp_requests_total{outcome="timeout"}`); got != 8 {
		t.Errorf("timeouts counted %v, want 8", got)
	}
}

// The attack: 8 streams of 32 MB bodies without their end took the picker from 33 to 636
// MB of RSS (its limit is 512 Mi). The bytes all streams hold are bounded
// (--max-buffered-bytes, 64 MiB): past them a stream is refused (429) and lets go of what
// it held; with GOMEMLIMIT at the container's limit, as rendered, 16 such streams leave
// the picker far below it.
func TestBodiesHeldAtOnceAreBoundedInBytes(t *testing.T) {
	t.Setenv("GOMEMLIMIT", "512MiB") // the rendered picker's: its memory limit
	p := pickerProc(t)
	chunk := make([]byte, 1<<20)
	const streams = 16
	for range streams {
		s := p.stream(t)
		if err := s.Send(headers(false)); err != nil {
			t.Fatal(err)
		}
		for range 32 {
			if err := s.Send(body(chunk, false)); err != nil {
				if !errors.Is(err, io.EOF) { // refused: the picker ended the stream
					t.Fatal(err)
				}
				break
			}
		}
	}
	// 64 MiB held at most: two whole bodies, so at least 14 streams refused once the
	// picker has read what was sent.
	for deadline := time.Now().Add(30 * time.Second); gobin.Metric(t, p.admin, `kvhandoff_epp_requests_total{outcome="shed"}`) < streams-2; {
		if time.Now().After(deadline) {
			t.Fatalf("streams refused for bytes: %v, want %d", gobin.Metric(t, p.admin, `kvhandoff_epp_requests_total{outcome="shed"}`), streams-2)
		}
		time.Sleep(10 * time.Millisecond) // polling the picker's count
	}
	rss := gobin.Metric(t, p.admin, "process_resident_memory_bytes")
	t.Logf("RSS %.0f MB after %d bodies of 32 MB", rss/1e6, streams)
	if rss > 320<<20 {
		t.Errorf("the picker's RSS is %.0f MB after %d bodies of 32 MB, with 64 MiB to hold", rss/1e6, streams)
	}
}

// A gateway that closes the stream once the request is routed (no response processing)
// is counted and named, not taken for a finished request.
func TestAStreamClosedAtRoutingIsCountedUnobserved(t *testing.T) {
	p := pickerProc(t)
	s := p.stream(t)
	if err := s.Send(headers(true)); err != nil {
		t.Fatal(err)
	}
	if !routed(t, s) {
		t.Fatal("not routed")
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); err != io.EOF {
		t.Fatalf("after the gateway closed its side: %v, want the stream's end", err)
	}
	if got := gobin.Metric(t, p.admin, "kvhandoff_epp_unobserved_requests_total"); got != 1 {
		t.Errorf("unobserved requests %v, want 1", got)
	}
}
