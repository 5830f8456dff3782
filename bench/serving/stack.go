// Package serving is the serving benchmark (make bench-serving) and the router part of
// make demo: requests over HTTP through the router binary to simulated engines whose KV
// moves through two real transfer agents, push and pull on the same seeded arrivals.
package serving

import (
	"bufio"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/bench/routerproc"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/test/agentproc"
	"github.com/kvhandoff/kvhandoff/test/simengine"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// Model is the name the simulated engines serve.
const Model = "Qwen/Qwen3-32B"

// stack is one mode's prefill and decode engine on two agents, and a router process
// in front of them.
type stack struct {
	URL     string
	router  *routerproc.Proc
	servers []*http.Server
	kvs     []*vllmserver.AgentKV
}

// engineOpts are the simulated engines' timing.
type engineOpts struct {
	prefill func(tokens int) time.Duration
	tpot    time.Duration
}

func listen() (net.Listener, int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, 0, err
	}
	return l, l.Addr().(*net.TCPAddr).Port, nil
}

func (s *stack) serve(h http.Handler) (int, error) {
	l, port, err := listen()
	if err != nil {
		return 0, err
	}
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	s.servers = append(s.servers, hs)
	go func() { _ = hs.Serve(l) }()
	return port, nil
}

// startStack starts, for mode, a prefill engine on agent a and a decode engine on agent
// b (one simulated rank per TP rank of l), and the router binary on an endpoints file.
func startStack(ctx context.Context, mode kvv1.TransferMode, l simengine.Layout, a, b *agentproc.Proc, routerBin, dir string, o engineOpts) (*stack, error) {
	s := &stack{}
	am := map[kvv1.TransferMode]agentv1.Mode{kvv1.TransferPush: agentv1.Mode_MODE_PUSH, kvv1.TransferPull: agentv1.Mode_MODE_PULL}[mode]
	name := strings.ToLower(string(mode))
	set := discovery.Set{Mode: mode}
	for _, side := range []struct {
		role  agentv1.Role
		agent *agentproc.Proc
		id    string
	}{
		{agentv1.Role_ROLE_PREFILL, a, "qwen3-32b-prefill-0." + name},
		{agentv1.Role_ROLE_DECODE, b, "qwen3-32b-decode-0." + name},
	} {
		kv, err := vllmserver.StartAgentKV(ctx, simengine.Config{ID: side.id, Role: side.role, Mode: am, Layout: l, Socket: side.agent.Socket})
		if err != nil {
			s.stop()
			return nil, err
		}
		s.kvs = append(s.kvs, kv)
		sc, err := s.serve(vllmserver.SideChannel(vllmserver.SideChannelInfo{EngineID: side.id, Agent: kv.Agent(), TP: l.TP}))
		if err != nil {
			s.stop()
			return nil, err
		}
		cfg := vllmserver.Config{EngineID: side.id, Model: Model, SideChannelHost: "127.0.0.1", SideChannelPort: sc, TP: l.TP, KV: kv, TPOT: o.tpot}
		if side.role == agentv1.Role_ROLE_PREFILL {
			cfg.PrefillTime = o.prefill
		}
		port, err := s.serve(vllmserver.New(cfg))
		if err != nil {
			s.stop()
			return nil, err
		}
		e := discovery.Engine{URL: "http://127.0.0.1:" + strconv.Itoa(port), EngineID: side.id, Host: "127.0.0.1",
			SideChannelPort: int32(sc), TensorParallelSize: int32(l.TP)}
		if side.role == agentv1.Role_ROLE_PREFILL {
			set.Prefill = append(set.Prefill, e)
		} else {
			set.Decode = append(set.Decode, e)
		}
	}
	endpoints := filepath.Join(dir, "endpoints-"+name+".json")
	data, _ := json.MarshalIndent(set, "", "  ")
	if err := os.WriteFile(endpoints, data, 0o644); err != nil {
		s.stop()
		return nil, err
	}
	var err error
	if s.router, err = routerproc.Start(routerBin, endpoints, filepath.Join(dir, "router-"+name+".log"), "--drain", "5s"); err != nil {
		s.stop()
		return nil, err
	}
	s.URL = s.router.URL
	return s, nil
}

// stop ends the router (SIGTERM: it drains), the engines' HTTP servers and their ranks.
func (s *stack) stop() {
	if s.router != nil {
		s.router.Stop()
	}
	var wg sync.WaitGroup
	for _, hs := range s.servers {
		wg.Add(1)
		go func() { defer wg.Done(); _ = hs.Close() }()
	}
	wg.Wait()
	for _, kv := range s.kvs {
		kv.Stop()
	}
}

// routerLine is one request as the router logged it.
type routerLine struct {
	Msg         string  `json:"msg"`
	ClientID    string  `json:"client_request_id"`
	Outcome     string  `json:"outcome"`
	TTFTMs      float64 `json:"ttft_ms"`
	AddedMs     float64 `json:"router_added_ms"`
	RelayMs     float64 `json:"router_relay_ms"`
	PrefillMs   float64 `json:"prefill_ms"`
	DecodeMs    float64 `json:"decode_ms"`
	Err         string  `json:"err"`
	RetriesDone int     `json:"retries"`
}

// requests reads the router's log: one line per request, by the client's request id.
func (s *stack) requests() (map[string]routerLine, error) {
	f, err := os.Open(s.router.Log)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]routerLine{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var l routerLine
		if json.Unmarshal(sc.Bytes(), &l) == nil && l.Msg == "request" && l.ClientID != "" {
			out[l.ClientID] = l
		}
	}
	return out, sc.Err()
}
