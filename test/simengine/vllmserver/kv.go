package vllmserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/drain"
	"github.com/kvhandoff/kvhandoff/test/simengine"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// AgentKV moves KV through the node's transfer agent, one simulated engine rank per TP
// rank, as the vLLM connector does: a prefill engine fills its blocks and reports them
// ready; a push decode engine registers its destination blocks as soon as the request
// arrives, a pull decode engine reads the blocks the prefill leg returned. Decode
// verifies every byte before its first token. Block ids are shared by all ranks (one
// scheduler allocates for every worker, as in vLLM), so rank 0's allocator serves all.
type AgentKV struct {
	Ranks []*simengine.Engine
	// Client reaches prefill engines' side channels (nil: http.DefaultClient).
	Client *http.Client
	// AgentAddressed: a prefill leg's remote_host and remote_port are its agent's address,
	// as kvhandoff's vLLM connector publishes them (and a router of executor-Agent pools
	// names them from the pool's status), not a side channel to ask for it.
	AgentAddressed bool
	// Accepted counts decode legs whose registration (push) or pull every rank's agent
	// accepted: from then on an abort fences them through the agents, so tests that
	// abort wait for it.
	Accepted atomic.Int64
	// HeldFile, when set, is kept with the number of published requests whose blocks
	// are held for a transfer, as kvhandoff's vLLM connector keeps KVHANDOFF_HELD_FILE
	// for the engine pod's drain hook (package drain).
	HeldFile string

	mu     sync.Mutex
	held   int64
	agents map[string]string // side channel host:port → the prefill engine's agent
}

// Usage is the share of the cache's blocks taken (rank 0's allocator serves all ranks),
// what vLLM exports as vllm:kv_cache_usage_perc: blocks a request never gives back show.
func (k *AgentKV) Usage() float64 {
	r := k.Ranks[0]
	return 1 - float64(r.FreeBlocks())/float64(r.Cache.Layout.Blocks)
}

func (k *AgentKV) blocks(tokens int) int {
	l := k.Ranks[0].Cache.Layout
	return (tokens + l.BlockSize - 1) / l.BlockSize
}

// Produce fills the request's blocks on every rank during the prefill; publish reports
// them ready. The blocks are freed when the agent says they were sent or expired, or at
// once if they were never published.
func (k *AgentKV) Produce(ctx context.Context, key string, tokens int, done time.Time) ([]uint32, func(context.Context) error, error) {
	alloc := k.Ranks[0]
	blocks, err := alloc.AllocateWait(ctx, k.blocks(tokens))
	if err != nil {
		return nil, nil, err
	}
	_ = parallel(len(k.Ranks), func(r int) error { k.Ranks[r].Cache.Fill(key, blocks); return nil })
	if err := sleepUntil(ctx, done); err != nil {
		alloc.Free(blocks)
		return nil, nil, err
	}
	publish := func(ctx context.Context) error {
		err := parallel(len(k.Ranks), func(r int) error { return k.Ranks[r].SourceReady(ctx, key, 0, blocks, true) })
		if err != nil {
			alloc.Free(blocks)
			return err
		}
		k.hold(1)
		go func() {
			k.freeWhenSent(key, blocks)
			k.hold(-1)
		}()
		return nil
	}
	return blocks, publish, nil
}

func (k *AgentKV) hold(n int64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.held += n
	if k.HeldFile != "" {
		_ = drain.WriteHeld(k.HeldFile, k.held)
	}
}

// freeWhenSent frees a published request's blocks once the agent is done with them. The
// agent answers SOURCE_DONE (or FAILED) with the decode's attempt, or FAILED with attempt
// 0 when no decode came within the blocks TTL.
func (k *AgentKV) freeWhenSent(key string, blocks []uint32) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	_ = parallel(len(k.Ranks), func(r int) error {
		first := make(chan struct{}, 2)
		for _, attempt := range []uint64{1, 0} {
			go func() {
				if _, err := k.Ranks[r].Wait(ctx, key, attempt); err == nil {
					first <- struct{}{}
				}
			}()
		}
		select {
		case <-first:
		case <-ctx.Done():
		}
		return nil
	})
	cancel()
	k.Ranks[0].Free(blocks)
}

// Receive takes the request's KV from block position first on into this engine's cache
// (a tail: a push registers, a pull reads, only those positions) and verifies it.
func (k *AgentKV) Receive(ctx context.Context, key string, tokens, first int, src Source) error {
	if src.TP != len(k.Ranks) {
		return fmt.Errorf("prefill engine %s runs TP %d and this engine TP %d: the simulated engine transfers only between equal TP",
			src.EngineID, src.TP, len(k.Ranks))
	}
	n := k.blocks(tokens)
	if src.Blocks != nil && len(src.Blocks) != n {
		return fmt.Errorf("remote_block_ids has %d blocks, the prompt needs %d", len(src.Blocks), n)
	}
	agent, err := k.resolve(ctx, src.Host, src.Port)
	if err != nil {
		return err
	}
	alloc := k.Ranks[0]
	dst, err := alloc.AllocateWait(ctx, n-first)
	if err != nil {
		return err
	}
	ref := func(r int) *agentv1.EngineRef {
		return &agentv1.EngineRef{Agent: agent, EngineId: src.EngineID, TpRank: uint32(r)}
	}
	err = parallel(len(k.Ranks), func(r int) error {
		if src.Blocks == nil {
			return k.Ranks[r].RegisterTail(ctx, key, 1, uint32(first), dst, ref(r))
		}
		return k.Ranks[r].Pull(ctx, key, 1, ref(r), src.Blocks[first:], dst)
	})
	if err == nil {
		k.Accepted.Add(1)
		err = parallel(len(k.Ranks), func(r int) error {
			ev, err := k.Ranks[r].Wait(ctx, key, 1)
			if err != nil {
				return err
			}
			if ev.Type != agentv1.Event_DELIVERED {
				return fmt.Errorf("rank %d: %s: %s", r, ev.Type, ev.Reason)
			}
			return k.Ranks[r].Cache.VerifyTail(key, first, dst)
		})
	}
	if err != nil && ctx.Err() != nil {
		// The request was aborted (the router closed the connection): fence the attempt
		// and free the blocks only once nothing can land in them any more.
		go k.abandon(key, dst)
		return err
	}
	alloc.Free(dst)
	return err
}

// abandon cancels an aborted request on every rank and frees its blocks after the
// agent's acknowledgement, as vLLM's scheduler must before it reuses them.
func (k *AgentKV) abandon(key string, dst []uint32) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_ = parallel(len(k.Ranks), func(r int) error {
		if err := k.Ranks[r].Cancel(ctx, key, 1); err != nil {
			return err
		}
		_, err := k.Ranks[r].Wait(ctx, key, 1)
		return err
	})
	k.Ranks[0].Free(dst)
}

// resolve asks a prefill engine's side channel for its agent, once per side channel.
func (k *AgentKV) resolve(ctx context.Context, host string, port int) (string, error) {
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	if k.AgentAddressed {
		return addr, nil
	}
	k.mu.Lock()
	agent, ok := k.agents[addr]
	k.mu.Unlock()
	if ok {
		return agent, nil
	}
	c := k.Client
	if c == nil {
		c = http.DefaultClient
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/", nil)
	if err != nil {
		return "", err
	}
	resp, err := c.Do(req)
	if err != nil {
		return "", fmt.Errorf("side channel %s: %w", addr, err)
	}
	defer resp.Body.Close()
	var sc SideChannelInfo
	if err := json.NewDecoder(resp.Body).Decode(&sc); err != nil || sc.Agent == "" {
		return "", fmt.Errorf("side channel %s: no agent address (%v)", addr, err)
	}
	k.mu.Lock()
	if k.agents == nil {
		k.agents = map[string]string{}
	}
	k.agents[addr] = sc.Agent
	k.mu.Unlock()
	return sc.Agent, nil
}

// SideChannelInfo is what a simulated prefill engine's side channel answers: where
// its ranks' agent is, so a decode engine can address them (the metadata NIXL's side
// channel exchanges before KV moves).
type SideChannelInfo struct {
	EngineID string `json:"engine_id"`
	Agent    string `json:"agent"`
	TP       int    `json:"tp_size"`
}

// SideChannel serves a prefill engine's SideChannelInfo.
func SideChannel(info SideChannelInfo) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, http.StatusOK, info) })
}

// LocalKV is an in-process stand-in for the KV path, for router tests that need no
// bytes moved: prefill marks a request's KV ready and a push decode leg waits for it
// (as a real one waits for the agent's writes), so aborts and retries behave as with
// agents. Engines of one test share one LocalKV.
type LocalKV struct {
	mu         sync.Mutex
	ready      map[string]chan struct{}
	Registered map[string]time.Time // push: when decode registered, by key
	Produced   map[string]time.Time // when prefill produced, by key
}

// NewLocalKV returns an empty exchange.
func NewLocalKV() *LocalKV {
	return &LocalKV{ready: map[string]chan struct{}{}, Registered: map[string]time.Time{}, Produced: map[string]time.Time{}}
}

func (x *LocalKV) ch(key string) chan struct{} {
	c, ok := x.ready[key]
	if !ok {
		c = make(chan struct{})
		x.ready[key] = c
	}
	return c
}

// Times returns when key's decode registered and its prefill produced (zero if never).
func (x *LocalKV) Times(key string) (registered, produced time.Time) {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.Registered[key], x.Produced[key]
}

func (x *LocalKV) Produce(ctx context.Context, key string, tokens int, done time.Time) ([]uint32, func(context.Context) error, error) {
	if err := sleepUntil(ctx, done); err != nil {
		return nil, nil, err
	}
	blocks := make([]uint32, (tokens+15)/16)
	for i := range blocks {
		blocks[i] = uint32(i)
	}
	return blocks, func(context.Context) error {
		x.mu.Lock()
		defer x.mu.Unlock()
		x.Produced[key] = time.Now()
		close(x.ch(key))
		return nil
	}, nil
}

func (x *LocalKV) Receive(ctx context.Context, key string, _, _ int, src Source) error {
	x.mu.Lock()
	c := x.ch(key)
	_, produced := x.Produced[key]
	if src.Blocks == nil {
		x.Registered[key] = time.Now()
	}
	x.mu.Unlock()
	if src.Blocks != nil {
		if !produced {
			return fmt.Errorf("no KV was produced for request %s", key)
		}
		return nil
	}
	select {
	case <-c:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// parallel runs fn for 0..n-1 concurrently and returns every error.
func parallel(n int, fn func(int) error) error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = fn(i) }()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// StartAgentKV registers one simulated engine rank per TP rank of cfg.Layout with the
// agent at cfg.Socket (cfg.Rank is each rank's own).
func StartAgentKV(ctx context.Context, cfg simengine.Config) (*AgentKV, error) {
	k := &AgentKV{Ranks: make([]*simengine.Engine, cfg.Layout.TP)}
	err := parallel(cfg.Layout.TP, func(r int) error {
		rc := cfg
		rc.Rank = r
		e, err := simengine.Start(ctx, rc)
		k.Ranks[r] = e
		return err
	})
	if err != nil {
		k.Stop()
		return nil, err
	}
	return k, nil
}

// Agent is the agent address peers reach this engine's ranks at.
func (k *AgentKV) Agent() string { return k.Ranks[0].Self.Agent }

// Stop ends every rank's session.
func (k *AgentKV) Stop() {
	for _, e := range k.Ranks {
		if e != nil {
			e.Stop()
		}
	}
}
