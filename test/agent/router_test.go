package agent_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/routertest"
	"github.com/kvhandoff/kvhandoff/test/simengine"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// These tests send requests through the router to simulated engines whose KV moves
// through two real transfer agents over real libfabric (tcp;ofi_rxm on loopback), every
// byte verified by the decode engine before its first token.

// agentEngine is a simulated engine of TP ranks whose KV moves through agent a.
func agentEngine(t *testing.T, a *agentProc, id string, role agentv1.Role, mode agentv1.Mode, l simengine.Layout) *routertest.Engine {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kv, err := vllmserver.StartAgentKV(ctx, simengine.Config{ID: id, Role: role, Mode: mode, Layout: l, Socket: a.Socket})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kv.Stop)
	// The side channel tells decode engines where this engine's agent is.
	sc := httptest.NewServer(vllmserver.SideChannel(vllmserver.SideChannelInfo{EngineID: id, Agent: kv.Agent(), TP: l.TP}))
	t.Cleanup(sc.Close)
	port, _ := strconv.Atoi(sc.URL[strings.LastIndexByte(sc.URL, ':')+1:])
	s := vllmserver.New(vllmserver.Config{EngineID: id, Model: routertest.Model, SideChannelHost: "127.0.0.1", SideChannelPort: port, TP: l.TP, KV: kv,
		PrefillTime: func(tokens int) time.Duration {
			if tokens > 1000 {
				return time.Hour // a prompt this engine hangs on, for abort tests
			}
			return 20 * time.Millisecond
		}})
	hs := httptest.NewServer(s)
	t.Cleanup(hs.Close)
	return &routertest.Engine{Server: s, Engine: discovery.Engine{URL: hs.URL, EngineID: id, Host: "127.0.0.1", SideChannelPort: int32(port),
		TensorParallelSize: int32(l.TP)}, KV: kv}
}

func TestKVMovesThroughTheAgentsInBothModes(t *testing.T) {
	l := simengine.Layout{Layers: 2, BlockSize: 16, KVHeads: 8, HeadDim: 16, DTypeBytes: 2, TP: 2, Blocks: 256}
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		t.Run(string(mode), func(t *testing.T) {
			am := map[kvv1.TransferMode]agentv1.Mode{kvv1.TransferPush: agentv1.Mode_MODE_PUSH, kvv1.TransferPull: agentv1.Mode_MODE_PULL}[mode]
			pa, da := startAgent(t, "prefill-node", t.TempDir()), startAgent(t, "decode-node", t.TempDir())
			p := agentEngine(t, pa, "p-0.ns", agentv1.Role_ROLE_PREFILL, am, l)
			d := agentEngine(t, da, "d-0.ns", agentv1.Role_ROLE_DECODE, am, l)
			r := routertest.StartRouter(t, mode, routertest.Engines(p), routertest.Engines(d))

			// 600 words: 38 blocks per rank, streamed and not.
			prompt := strings.TrimSpace(strings.Repeat("kv moves through agents ", 150))
			for i, stream := range []bool{false, true} {
				body := fmt.Sprintf(`{"model":"tiny","messages":[{"role":"user","content":%q}],"max_tokens":8,"stream":%t}`, prompt, stream)
				resp, out := routertest.Post(t, r.URL, "/v1/chat/completions", body)
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("%s: %s", resp.Status, out)
				}
				got := ""
				if stream {
					got = routertest.SSEText(t, out)
				} else {
					got = routertest.CompletionText(t, out)
				}
				if w := strings.Join(vllmserver.Output(append([]string{"<user>"}, strings.Fields(prompt)...), 8), ""); got != w {
					t.Errorf("request %d: got %q, want %q", i, got, w)
				}
			}
			// Two requests' KV landed in the decode engine's memory, verified there.
			tokens := 1 + 600
			blocks := (tokens + l.BlockSize - 1) / l.BlockSize
			want := float64(2 * blocks * l.BlockBytes() * l.Regions() * l.TP)
			// Push counts on the writing (prefill) agent, pull on the reading (decode) one.
			counting := map[kvv1.TransferMode]*agentProc{kvv1.TransferPush: pa, kvv1.TransferPull: da}[mode]
			series := fmt.Sprintf("kvhandoff_agent_transferred_bytes_total{mode=%q}", strings.ToLower(string(mode)))
			if got := counting.Metric(t, series); got != want {
				t.Errorf("%s = %v, want %v", series, got, want)
			}
		})
	}
}

func TestADisconnectedPushRequestFreesItsDecodeBlocksAfterTheAgentsAcknowledgement(t *testing.T) {
	// The decode cache holds one long request: if the aborted one's blocks leaked, the
	// next request could never allocate.
	l := simengine.Layout{Layers: 2, BlockSize: 16, KVHeads: 8, HeadDim: 16, DTypeBytes: 2, TP: 2, Blocks: 80}
	pa, da := startAgent(t, "prefill-node", t.TempDir()), startAgent(t, "decode-node", t.TempDir())
	p := agentEngine(t, pa, "p-0.ns", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PUSH, l)
	d := agentEngine(t, da, "d-0.ns", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH, l)
	r := routertest.StartRouter(t, kvv1.TransferPush, routertest.Engines(p), routertest.Engines(d))

	long := strings.TrimSpace(strings.Repeat("w ", 1200)) // 76 blocks
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		// The prefill of a hung engine never ends; the client gives up.
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.URL+"/v1/completions",
			strings.NewReader(fmt.Sprintf(`{"model":"tiny","prompt":%q,"max_tokens":2}`, long)))
		req.Header.Set("Content-Type", "application/json")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	// Both legs are in their engines and both decode ranks' agents hold the registration
	// (before that, an abort fences nothing in the agents); hang up.
	routertest.Eventually(t, "both legs reach their engines", 10*time.Second, func() bool { return len(p.Seen()) == 1 && d.KV.Accepted.Load() == 1 })
	cancel()
	<-done
	routertest.Eventually(t, "the decode agent fences the aborted attempt on both ranks", 10*time.Second, func() bool {
		return da.Metric(t, "kvhandoff_agent_cancels_total") >= 2
	})
	resp, out := routertest.Post(t, r.URL, "/v1/completions", `{"model":"tiny","prompt":"short prompt after the abort","max_tokens":3}`)
	if resp.StatusCode != http.StatusOK || routertest.CompletionText(t, out) != routertest.Want("short prompt after the abort", 3) {
		t.Fatalf("after the abort: %s %s", resp.Status, out)
	}
}
