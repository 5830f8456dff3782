package engineapi_test

import (
	"errors"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/engineapi"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/session"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// serveAPI runs the engine API over a session table (libfabric's tcp provider) in this
// process, on a socket in the test's folder, and returns a client of it; ready is what
// the agent says of its readiness.
func serveAPI(t *testing.T, ready func() error) agentv1.AgentClient {
	t.Helper()
	metrics := session.NewMetrics(prometheus.NewRegistry())
	log := slog.New(slog.DiscardHandler)
	table := session.NewTable(session.Config{Provider: "tcp;ofi_rxm", Rails: 1, Timeouts: session.DefaultTimeouts(), EventsDeadline: time.Minute,
		Epoch: 7, Self: "127.0.0.1:1", Log: log, Metrics: metrics})
	sock := filepath.Join(t.TempDir(), "agent", "agent.sock")
	srv, err := engineapi.New(engineapi.Config{Socket: sock, Sessions: table, Timeouts: session.DefaultTimeouts(), Ready: ready,
		Provider: "tcp;ofi_rxm", Self: "127.0.0.1:1", Log: log, Metrics: metrics})
	if err != nil {
		t.Fatal(err)
	}
	srv.Serve()
	t.Cleanup(func() { srv.Stop(); srv.Wait(); table.Close() })
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return agentv1.NewAgentClient(conn)
}

func engine(id string, rank, size uint32) *agentv1.RegisterEngineRequest {
	return &agentv1.RegisterEngineRequest{EngineId: id, TpRank: rank, TpSize: size, Role: agentv1.Role_ROLE_PREFILL, Mode: agentv1.Mode_MODE_PUSH,
		Layout: &agentv1.KVLayout{Layers: 2, BlockSize: 16, KvHeads: 8, HeadDim: 64, DtypeBytes: 2}}
}

// A registration that breaks a rule is refused naming the field and the rule, and opens
// no session; a good one gets a session with the agent's provider and its own address.
func TestRegistrationsAreCheckedFieldByField(t *testing.T) {
	api := serveAPI(t, func() error { return nil })
	for _, c := range []struct {
		tune func(*agentv1.RegisterEngineRequest)
		want string
	}{
		{func(r *agentv1.RegisterEngineRequest) { r.EngineId = "a/b" }, "engine_id: must be 1 to 253 bytes without '/'"},
		{func(r *agentv1.RegisterEngineRequest) { r.TpRank = 2 }, "tp_rank: 2 must be below tp_size 2"},
		{func(r *agentv1.RegisterEngineRequest) { r.Layout.KvHeads = 3 }, "layout.kv_heads: 3 KV heads neither split over nor replicate across tensor-parallel size 2"},
		{func(r *agentv1.RegisterEngineRequest) { r.Role = 0 }, "role: must be ROLE_PREFILL or ROLE_DECODE"},
		{func(r *agentv1.RegisterEngineRequest) { r.LeaseMillis, r.RegistrationTimeoutMillis = 60000, 1000 }, "registration_timeout_millis: 1s is shorter than the lease 1m0s"},
	} {
		r := engine("p-0.ns", 0, 2)
		c.tune(r)
		_, err := api.RegisterEngine(t.Context(), r)
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v; want InvalidArgument %q", err, c.want)
		}
	}
	resp, err := api.RegisterEngine(t.Context(), engine("p-0.ns", 1, 2))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Session == "" || resp.Epoch <= 7 || resp.Provider != "tcp;ofi_rxm" || resp.Self.GetEngineId() != "p-0.ns" || resp.Self.GetTpRank() != 1 {
		t.Errorf("response %+v", resp)
	}
	if _, err := api.Heartbeat(t.Context(), &agentv1.HeartbeatRequest{Session: resp.Session}); err != nil {
		t.Errorf("the session's own heartbeat: %v", err)
	}
	if _, err := api.Heartbeat(t.Context(), &agentv1.HeartbeatRequest{Session: "0123"}); err == nil || !strings.Contains(err.Error(), "no such session") {
		t.Errorf("a heartbeat naming no session: %v", err)
	}
}

// While the agent is not ready (its provider did not open), registrations are refused
// as Unavailable, saying why.
func TestAnAgentNotReadyRefusesRegistrations(t *testing.T) {
	api := serveAPI(t, func() error { return errors.New(`libfabric provider "efa" unavailable`) })
	_, err := api.RegisterEngine(t.Context(), engine("p-0.ns", 0, 2))
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), `provider "efa" unavailable`) {
		t.Errorf("%v; want Unavailable naming the provider", err)
	}
}
