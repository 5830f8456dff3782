// Command simvllm is the simulated engine as the real-node tier runs it: an image whose
// `vllm serve` takes the command line kvhandoff renders (the model, parallelism, block
// size, port and --kv-transfer-config of the kvhandoff connector) and serves vLLM's
// OpenAI endpoints with test/simengine/vllmserver, moving each request's KV through the
// node's transfer agent as the connector does, every byte verified before the first
// token. Flags it does not know (a pool's engineArgs) are accepted and ignored.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvhandoff/kvhandoff/test/simengine"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// kvConfig is the part of --kv-transfer-config the simulated engine reads.
type kvConfig struct {
	EngineID string `json:"engine_id"`
	Extra    struct {
		Mode   string `json:"mode"`
		Role   string `json:"role"`
		Socket string `json:"socket"`
		// The policy's timeouts in seconds, sent to the agent as the connector sends them
		// (0: the agent's own).
		Lease               int `json:"kv_lease_duration"`
		RegistrationTimeout int `json:"push_registration_timeout"`
		BlocksTTL           int `json:"decoder_kv_blocks_ttl"`
	} `json:"kv_connector_extra_config"`
}

type options struct {
	model, kvConfig     string
	tp, blockSize, port int
	// The simulated engine's speed, in flags of its own (a pool's engineArgs): prefill
	// time per 1000 prompt tokens, and the gap between output tokens, which grows with
	// the streams the engine generates for.
	prefillPer1k, tpot, tpotPerStream time.Duration
}

func parse(args []string) (options, error) {
	o := options{tp: 1, blockSize: 16, port: 8000, tpot: time.Millisecond}
	if len(args) < 2 || args[0] != "serve" {
		return o, errors.New("usage: vllm serve MODEL [--tensor-parallel-size N] [--block-size B] [--port P] --kv-transfer-config JSON")
	}
	o.model = args[1]
	for i := 2; i < len(args); i++ {
		name, value, inline := strings.Cut(args[i], "=")
		if !inline && i+1 < len(args) && !strings.HasPrefix(args[i+1], "--") {
			value = args[i+1]
		}
		var err error
		switch name {
		case "--tensor-parallel-size":
			o.tp, err = strconv.Atoi(value)
		case "--block-size":
			o.blockSize, err = strconv.Atoi(value)
		case "--port":
			o.port, err = strconv.Atoi(value)
		case "--kv-transfer-config":
			o.kvConfig = value
		case "--sim-prefill-per-1k-tokens":
			o.prefillPer1k, err = time.ParseDuration(value)
		case "--sim-tpot":
			o.tpot, err = time.ParseDuration(value)
		case "--sim-tpot-per-stream":
			o.tpotPerStream, err = time.ParseDuration(value)
		}
		if err != nil {
			return o, fmt.Errorf("%s: %w", name, err)
		}
	}
	return o, nil
}

func main() {
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	if err := run(log, os.Args[1:]); err != nil {
		log.Error("simvllm", "err", err)
		os.Exit(1)
	}
}

func run(log *slog.Logger, args []string) error {
	o, err := parse(args)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ec, err := engineConfig(o)
	if err != nil {
		return err
	}
	kv, err := vllmserver.StartAgentKV(ctx, ec)
	if err != nil {
		return fmt.Errorf("registering with the agent at %s: %w", ec.Socket, err)
	}
	defer kv.Stop()
	// As kvhandoff's connector: a prefill leg names this engine's agent as its remote_host
	// and remote_port, and a decode leg's are the prefill engine's agent.
	kv.AgentAddressed = true
	// As the connector: the drain hook of a terminating engine waits for held blocks.
	kv.HeldFile = os.Getenv("KVHANDOFF_HELD_FILE")
	host, port, err := net.SplitHostPort(kv.Agent())
	if err != nil {
		return fmt.Errorf("the agent's address %q: %w", kv.Agent(), err)
	}
	agentPort, _ := strconv.Atoi(port)
	cfg := vllmserver.Config{EngineID: ec.ID, Model: o.model, SideChannelHost: host, SideChannelPort: agentPort, TP: o.tp, KV: kv,
		TPOT: o.tpot, TPOTPerStream: o.tpotPerStream, Log: log}
	if o.prefillPer1k > 0 {
		cfg.PrefillTime = func(tokens int) time.Duration { return o.prefillPer1k * time.Duration(tokens) / 1000 }
	}
	server := &http.Server{Addr: ":" + strconv.Itoa(o.port), Handler: vllmserver.New(cfg), ReadHeaderTimeout: 10 * time.Second}
	errs := make(chan error, 1)
	go func() { errs <- server.ListenAndServe() }()
	log.Info("serving", "engine", ec.ID, "role", ec.Role, "mode", ec.Mode, "model", o.model, "port", o.port, "agent", kv.Agent())
	// A session the agent ended (it restarted, or was deleted) cannot be resumed: exit, and
	// the kubelet restarts the engine, which registers again.
	ended := make(chan struct{}, len(kv.Ranks))
	for _, r := range kv.Ranks {
		go func() {
			select {
			case <-r.Done():
				ended <- struct{}{}
			case <-ctx.Done():
			}
		}()
	}
	select {
	case err := <-errs:
		return err
	case <-ended:
		return errors.New("the agent ended the engine's session; exiting so that the engine restarts and registers again")
	case <-ctx.Done():
		// As vLLM's API server: on SIGTERM it cancels uvicorn's serve task
		// (vllm/entrypoints/launcher.py), dropping the requests in flight, and the engine
		// exits, ending its agent session. Waiting for them is the pod's preStop hook's job.
		return server.Close()
	}
}

// engineConfig is what the engine registers with its agent, read from its
// --kv-transfer-config as kvhandoff's connector reads it: the policy's timeouts included,
// else a stranded request would be held for the agent's defaults (minutes), not the
// policy's.
func engineConfig(o options) (simengine.Config, error) {
	var kc kvConfig
	if err := json.Unmarshal([]byte(o.kvConfig), &kc); err != nil {
		return simengine.Config{}, fmt.Errorf("--kv-transfer-config: %w", err)
	}
	role := map[string]agentv1.Role{"prefill": agentv1.Role_ROLE_PREFILL, "decode": agentv1.Role_ROLE_DECODE}[kc.Extra.Role]
	mode := map[string]agentv1.Mode{"push": agentv1.Mode_MODE_PUSH, "pull": agentv1.Mode_MODE_PULL}[kc.Extra.Mode]
	if kc.EngineID == "" || role == agentv1.Role_ROLE_UNSPECIFIED || mode == agentv1.Mode_MODE_UNSPECIFIED || kc.Extra.Socket == "" {
		return simengine.Config{}, fmt.Errorf("--kv-transfer-config names no engine_id, role, mode or socket: %s (kvhandoff's connector with executor Agent renders them)", o.kvConfig)
	}
	seconds := func(n int) time.Duration { return time.Duration(n) * time.Second }
	return simengine.Config{ID: kc.EngineID, Role: role, Mode: mode, Socket: kc.Extra.Socket,
		Layout: simengine.Layout{Layers: 2, BlockSize: o.blockSize, KVHeads: 8, HeadDim: 16, DTypeBytes: 2, TP: o.tp, Blocks: 512},
		Lease:  seconds(kc.Extra.Lease), RegistrationTimeout: seconds(kc.Extra.RegistrationTimeout), BlocksTTL: seconds(kc.Extra.BlocksTTL)}, nil
}
