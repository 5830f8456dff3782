// Package cli is the transfer agent's command line: flags, logging, the node label,
// and signal handling around package agent (endpoints: package monitoring).
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/agent"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/monitoring"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/nodelabel"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/client"
)

// Run runs the agent until SIGINT or SIGTERM and returns the exit status.
func Run(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("transfer-agent", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cfg agent.Config
	fs.StringVar(&cfg.Provider, "provider", "efa", `libfabric provider: "efa" on AWS; "tcp;ofi_rxm" or "shm" for development. Never falls back to another.`)
	fs.IntVar(&cfg.Rails, "rails", 1, "endpoints per engine rank, each a rail its writes and reads are split over (one per EFA NIC: 2 on P5en). Above 1 every agent of the cluster must know the rails message (this release and later)")
	fs.StringVar(&cfg.Socket, "socket", client.DefaultSocket, "the engine API's Unix socket (created 0660)")
	socketGID := fs.Int("socket-gid", -1, "group to own the engine and memory sockets and their folder; engines run in it (the manager adds it to engine pods' supplementalGroups); -1 keeps the agent's")
	fs.StringVar(&cfg.PeerListen, "peer-listen", ":7470", "TCP address other agents connect to (the agent runs with hostNetwork)")
	fs.StringVar(&cfg.Advertise, "advertise", "", "host:port peers use to reach this agent (default: the listener's address; in a pod: $(NODE_IP):7470)")
	tokenFile := fs.String("peer-token-file", "", "file holding the secret every agent of the cluster shares; peers prove they hold it")
	def := agent.DefaultTimeouts()
	fs.DurationVar(&cfg.Lease, "lease", def.Lease, "registration and pull lease (KVTransferPolicy spec.leaseSeconds) for engines that send none in RegisterEngine")
	fs.DurationVar(&cfg.EventsDeadline, "events-deadline", 30*time.Second, "how long a registered engine rank has to open its event stream before its session is closed")
	fs.DurationVar(&cfg.RegistrationTimeout, "registration-timeout", def.RegistrationTimeout, "how long a push registration waits for its source (spec.registrationTimeoutSeconds), for engines that send none")
	fs.DurationVar(&cfg.BlocksTTL, "blocks-ttl", def.BlocksTTL, "how long ready source blocks wait for a registration or pull (spec.blocksTTLSeconds), for engines that send none")
	httpAddr := fs.String("http", ":9470", "address of /metrics, /healthz and /readyz")
	mon := monitoring.Options{}
	fs.BoolVar(&mon.Secure, "metrics-secure", false, "serve --http over HTTPS and /metrics only to callers the API server authenticates and authorizes for it (config/rbac's kvhandoff-metrics-reader); the probes stay open")
	fs.StringVar(&mon.CertDir, "metrics-cert-dir", "", "folder with tls.crt and tls.key for --metrics-secure, reloaded on change (empty: self-signed)")
	node := fs.String("node-name", os.Getenv("NODE_NAME"), "node to label "+`kvhandoff.io/agent-ready=true`+" while ready (empty: no label)")
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig for labelling the node (default: in-cluster)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log := slog.New(slog.NewJSONHandler(stderr, nil))
	fail := func(err error) int { log.Error("transfer-agent", "err", err); return 1 }
	if *tokenFile == "" {
		return fail(errors.New("--peer-token-file is required: agents accept only peers that hold the cluster's token"))
	}
	token, err := os.ReadFile(*tokenFile)
	if err != nil {
		return fail(err)
	}
	if cfg.Token = []byte(strings.TrimSpace(string(token))); len(cfg.Token) < 16 {
		return fail(fmt.Errorf("--peer-token-file %s: the token must be at least 16 bytes", *tokenFile))
	}
	if os.Getenv("GOMAXPROCS") == "" {
		// Each engine rank's pump spends its idle time blocked inside the provider's wait,
		// a cgo call that keeps its P until the runtime's monitor takes it back (up to
		// 10 ms later); without spare Ps, engine calls queue behind sleeping pumps. A P
		// whose goroutine sleeps in the kernel costs nothing. 32: two roles × 8 ranks on a
		// p5en node, twice over.
		runtime.GOMAXPROCS(runtime.NumCPU() + 32)
	}

	// Notify before the first libfabric call: Go then handles these signals itself
	// instead of forwarding them to handlers some providers' libraries install
	// (libinfinipath's made SIGTERM exit 1; docs/design.md, libfabric pitfall 9).
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	cfg.Registry, cfg.Log = reg, log
	a, err := agent.New(cfg)
	if err != nil {
		return fail(err)
	}
	if *socketGID >= 0 {
		// Engines run as any non-root user in this group: they may use both sockets, and
		// may list the folder but neither create nor remove anything in it, so no engine
		// can replace a socket or leave files there.
		dir := filepath.Dir(cfg.Socket)
		for _, path := range []string{cfg.Socket, agentv1.MemorySocket(cfg.Socket), dir} {
			if err := os.Chown(path, -1, *socketGID); err != nil {
				return fail(err)
			}
		}
		if err := os.Chmod(dir, 0o750); err != nil {
			return fail(err)
		}
	}

	var kube *rest.Config
	if *node != "" || mon.Secure {
		if kube, err = kubeConfig(*kubeconfig); err != nil {
			return fail(err)
		}
	}
	mon.Addr, mon.Gatherer, mon.Kube = *httpAddr, reg, kube
	mon.Ready = func() (string, error) { return "provider " + a.Provider(), a.Ready() }
	// The endpoints outlive ctx: they keep answering while the agent drains after SIGTERM.
	httpCtx, stopHTTP := context.WithCancel(context.Background())
	defer stopHTTP()
	addr, err := monitoring.Start(httpCtx, mon, log)
	if err != nil {
		return fail(fmt.Errorf("--http %s: %w", *httpAddr, err))
	}
	log.Info("http", "addr", addr, "secure", mon.Secure)

	var nodes kubernetes.Interface
	if *node != "" {
		if nodes, err = kubernetes.NewForConfig(kube); err != nil {
			return fail(err)
		}
		if a.Ready() == nil {
			if err := nodelabel.Set(ctx, nodes, *node, true); err != nil {
				return fail(err)
			}
			log.Info("node labelled ready", "node", *node)
		}
	}

	err = a.Serve(ctx)
	if nodes != nil {
		// Clear the label even though ctx has ended: engines must not be placed here.
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := nodelabel.Set(cctx, nodes, *node, false); err != nil {
			log.Error("clearing the node label", "err", err)
		}
		cancel()
	}
	if err != nil {
		return fail(err)
	}
	return 0
}

func kubeConfig(kubeconfig string) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes client for the node label and secure metrics: %w", err)
	}
	return cfg, nil
}
