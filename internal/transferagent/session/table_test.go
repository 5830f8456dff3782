package session

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// newTestTable is an agent's session table over libfabric's tcp provider on loopback,
// in this process: the engine API and the mesh are the agent's, and not needed here.
func newTestTable(t *testing.T, eventsDeadline time.Duration) *Table {
	t.Helper()
	tb := NewTable(Config{Provider: "tcp;ofi_rxm", Rails: 1, Timeouts: DefaultTimeouts(), EventsDeadline: eventsDeadline, Epoch: 100,
		Self: "127.0.0.1:1", Log: slog.New(slog.DiscardHandler), Metrics: NewMetrics(prometheus.NewRegistry())})
	t.Cleanup(tb.Close)
	return tb
}

func registration(engine string, rank uint32) *agentv1.RegisterEngineRequest {
	return &agentv1.RegisterEngineRequest{EngineId: engine, TpRank: rank, TpSize: 2, Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PULL}
}

// An engine rank has one live session: another pod cannot take it, its own pod only by
// naming the session it replaces, and the replaced one ends saying why. Epochs count up.
func TestARankHasOneLiveSessionAndOnlyItsHolderHandsItOver(t *testing.T) {
	tb := newTestTable(t, time.Minute)
	first, err := tb.Register(registration("d-0.ns", 0), "pod-a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tb.Register(registration("d-0.ns", 0), "pod-b"); status.Code(err) != codes.PermissionDenied {
		t.Errorf("another pod registering the rank: %v, want PermissionDenied", err)
	}
	if _, err := tb.Register(registration("d-0.ns", 0), "pod-a"); status.Code(err) != codes.AlreadyExists {
		t.Errorf("the holder registering again without replaces_session: %v, want AlreadyExists", err)
	}
	r := registration("d-0.ns", 0)
	r.ReplacesSession = first.ID()
	second, err := tb.Register(r, "pod-a")
	if err != nil {
		t.Fatal(err)
	}
	<-first.Stopped()
	if got := first.CloseReason(); !strings.Contains(got, "replaced by a new incarnation") {
		t.Errorf("the replaced session's reason: %q", got)
	}
	if second.Epoch() <= first.Epoch() || first.Epoch() <= 100 {
		t.Errorf("epochs %d then %d: must count up from the agent's", first.Epoch(), second.Epoch())
	}
	if _, err := tb.Lookup(second.ID(), "pod-b"); err == nil {
		t.Error("another pod looked up the session")
	}
	if s, err := tb.Lookup(second.ID(), "pod-a"); err != nil || s != second {
		t.Errorf("the holder's lookup: %v", err)
	}
}

// A registered rank that never opens its event stream is closed once EventsDeadline
// passes: the stream is its liveness, and nothing else would end it.
func TestASessionWithoutItsEventStreamEnds(t *testing.T) {
	tb := newTestTable(t, 50*time.Millisecond)
	s, err := tb.Register(registration("d-0.ns", 0), "pod-a")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.Stopped():
	case <-time.After(10 * time.Second):
		t.Fatal("the session without a stream was not closed")
	}
	if !strings.Contains(s.CloseReason(), "no event stream within 50ms") {
		t.Errorf("reason %q", s.CloseReason())
	}
	if _, err := tb.Lookup(s.ID(), "pod-a"); err == nil {
		t.Error("the ended session is still found")
	}
}

// One pod holds at most maxSessionsPerOwner sessions; others still register.
func TestOnePodsShareOfSessionsIsBounded(t *testing.T) {
	tb := newTestTable(t, time.Minute)
	for rank := range uint32(maxSessionsPerOwner) {
		if _, err := tb.Register(registration("d-0.ns", rank), "pod-a"); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := tb.Register(registration("d-1.ns", 0), "pod-a"); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("the pod's 17th session: %v, want ResourceExhausted", err)
	}
	if _, err := tb.Register(registration("d-2.ns", 0), "pod-b"); err != nil {
		t.Errorf("another pod: %v", err)
	}
}
