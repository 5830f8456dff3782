package client

import (
	"context"
	"net"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// startingAgent answers Unavailable (not ready yet) to its first registrations, as a
// restarted agent does before its provider and pod cache are up, then registers.
type startingAgent struct {
	agentv1.UnimplementedAgentServer
	refuse int32
	calls  atomic.Int32
}

func (a *startingAgent) RegisterEngine(context.Context, *agentv1.RegisterEngineRequest) (*agentv1.RegisterEngineResponse, error) {
	if a.calls.Add(1) <= a.refuse {
		return nil, status.Error(codes.Unavailable, "agent not ready: no provider yet")
	}
	return &agentv1.RegisterEngineResponse{Session: "s"}, nil
}

func (a *startingAgent) Events(_ *agentv1.EventsRequest, s grpc.ServerStreamingServer[agentv1.Event]) error {
	<-s.Context().Done()
	return nil
}

func serve(t *testing.T, a agentv1.AgentServer) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	agentv1.RegisterAgentServer(srv, a)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	return sock
}

// An engine registering with an agent that is up but not ready yet waits for it instead
// of failing (and being restarted into the kubelet's back-off); ctx bounds the wait and
// the agent's own reason comes back when it runs out.
func TestRegisterWaitsForAnAgentThatIsNotReadyYet(t *testing.T) {
	a := &startingAgent{refuse: 3}
	c, err := Dial(serve(t, a))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	e, err := c.RegisterEngine(context.Background(), &agentv1.RegisterEngineRequest{EngineId: "e"})
	if err != nil {
		t.Fatalf("registration with an agent that became ready: %v", err)
	}
	defer e.Close()
	if got := a.calls.Load(); got != 4 {
		t.Errorf("%d registrations, want 3 refused and 1 admitted", got)
	}

	never := &startingAgent{refuse: 1 << 30}
	c2, err := Dial(serve(t, never))
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if _, err := c2.RegisterEngine(ctx, &agentv1.RegisterEngineRequest{EngineId: "e"}); status.Code(err) != codes.Unavailable || status.Convert(err).Message() != "agent not ready: no provider yet" {
		t.Errorf("registration with an agent never ready: %v, want its Unavailable", err)
	}
}
