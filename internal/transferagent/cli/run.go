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

	"github.com/kvhandoff/kvhandoff/internal/health"
	"github.com/kvhandoff/kvhandoff/internal/kubeconfig"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/agent"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/monitoring"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/nodelabel"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/peerset"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/session"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/client"
)

// options are the command line's settings beyond the agent's own Config.
type options struct {
	agent      agent.Config
	monitoring monitoring.Options
	socketGID  int
	tokenFile  string
	node       string
	kubeconfig string
	// health is the window of the node's health report, and how often it is computed.
	healthWindow, healthEvery time.Duration
}

// parse reads the command line.
func parse(args []string, stderr io.Writer) (*options, error) {
	fs := flag.NewFlagSet("transfer-agent", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := &options{}
	cfg := &o.agent
	fs.StringVar(&cfg.Provider, "provider", "efa", `libfabric provider: "efa" on AWS; "tcp;ofi_rxm" or "shm" for development. Never falls back to another.`)
	fs.IntVar(&cfg.Rails, "rails", 1, "endpoints per engine rank, each a rail its writes and reads are split over (one per EFA NIC: 2 on P5en); "+
		"above 1 every agent of the cluster must understand the rails message")
	fs.StringVar(&cfg.Socket, "socket", client.DefaultSocket, "the engine API's Unix socket (created 0660)")
	fs.IntVar(&o.socketGID, "socket-gid", -1, "group to own the engine and memory sockets and their folder; engines run in it "+
		"(the manager adds it to engine pods' supplementalGroups); -1 keeps the agent's")
	fs.StringVar(&cfg.PeerListen, "peer-listen", ":7470", "TCP address other agents connect to (the agent runs with hostNetwork)")
	fs.StringVar(&cfg.Advertise, "advertise", "", "host:port peers use to reach this agent (default: the listener's address; in a pod: $(NODE_IP):7470)")
	fs.StringVar(&o.tokenFile, "peer-token-file", "", "file holding the secret every agent of the cluster shares; peers prove they hold it")
	def := session.DefaultTimeouts()
	fs.DurationVar(&cfg.Lease, "lease", def.Lease, "registration and pull lease (KVTransferPolicy spec.leaseSeconds) for engines that send none in "+
		"RegisterEngine")
	fs.IntVar(&cfg.DropDeliverySignals, "test-drop-delivery-signals", 0, "fault injection, for tests only: post none of the first N "+
		"delivery signals, as if the provider lost them")
	fs.DurationVar(&cfg.EventsDeadline, "events-deadline", 30*time.Second, "how long a registered engine rank has to open its event stream before "+
		"its session is closed")
	fs.DurationVar(&cfg.RegistrationTimeout, "registration-timeout", def.RegistrationTimeout, "how long a push registration waits for its source "+
		"(spec.registrationTimeoutSeconds), for engines that send none")
	fs.DurationVar(&cfg.BlocksTTL, "blocks-ttl", def.BlocksTTL, "how long ready source blocks wait for a registration or pull "+
		"(spec.blocksTTLSeconds), for engines that send none")
	fs.StringVar(&o.monitoring.Addr, "http", ":9470", "address of /metrics, /healthz and /readyz")
	fs.BoolVar(&o.monitoring.Secure, "metrics-secure", false, "serve --http over HTTPS and /metrics only to callers the API server authenticates "+
		"and authorizes for it "+
		"(config/rbac's kvhandoff-metrics-reader); the probes stay open")
	fs.StringVar(&o.monitoring.CertDir, "metrics-cert-dir", "", "folder with tls.crt and tls.key for --metrics-secure, reloaded on change (empty: self-signed)")
	fs.StringVar(&o.node, "node-name", os.Getenv("NODE_NAME"), "the agent's node: labelled "+`kvhandoff.io/agent-ready=true`+" while ready, and engines must be pods their engine_id names (empty: outside a cluster, no label and no pod check)")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig for labelling the node and finding engine pods (default: in-cluster)")
	fs.DurationVar(&o.healthWindow, "health-window", time.Minute, "how far back the health report on the node (kvhandoff.io/agent-health) "+
		"looks for failures and lease expiries")
	fs.DurationVar(&o.healthEvery, "health-interval", 5*time.Second, "how often the health report is computed; it is written only when it changes")
	fs.StringVar(&cfg.ProcRoot, "proc-root", "/proc", "where engine processes' /proc entries are (the agent reads each caller's cgroup there to learn its pod)")
	return o, fs.Parse(args)
}

// Run runs the agent until SIGINT or SIGTERM and returns the exit status.
func Run(args []string, stderr io.Writer) int {
	o, err := parse(args, stderr)
	if err != nil {
		return 2
	}
	log := slog.New(slog.NewJSONHandler(stderr, nil))
	fail := func(err error) int { log.Error("transfer-agent", "err", err); return 1 }
	if o.agent.Token, err = readToken(o.tokenFile); err != nil {
		return fail(err)
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

	var kube *rest.Config
	if o.node != "" || o.monitoring.Secure {
		if kube, err = kubeconfig.Load(o.kubeconfig); err != nil {
			return fail(fmt.Errorf("kubernetes client for the node label, engine pods and secure metrics: %w", err))
		}
	}
	if o.node != "" {
		// In a cluster, each engine must be the pod its engine_id names, and the agent
		// dials only the addresses ready agents publish.
		c, err := kubernetes.NewForConfig(kube)
		if err != nil {
			return fail(err)
		}
		o.agent.Pods = enginePods{c}
		peers, err := peerset.Watch(ctx, c)
		if err != nil {
			return fail(err)
		}
		o.agent.KnownPeer = peers.Check
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	o.agent.Registry, o.agent.Log = reg, log
	a, err := agent.New(o.agent)
	if err != nil {
		return fail(err)
	}
	if o.socketGID >= 0 {
		if err := shareSockets(o.agent.Socket, o.socketGID); err != nil {
			return fail(err)
		}
	}
	// The endpoints outlive ctx: they keep answering while the agent drains after SIGTERM.
	httpCtx, stopHTTP := context.WithCancel(context.Background())
	defer stopHTTP()
	mon := o.monitoring
	mon.Gatherer, mon.Kube = reg, kube
	mon.Ready = func() (string, error) { return "provider " + a.Provider(), a.Ready() }
	addr, err := monitoring.Start(httpCtx, mon, log)
	if err != nil {
		return fail(fmt.Errorf("--http %s: %w", mon.Addr, err))
	}
	log.Info("http", "addr", addr, "secure", mon.Secure)

	label, err := labelNode(ctx, kube, o.node, a, log)
	if err != nil {
		return fail(err)
	}
	healthDone := label.publishHealth(ctx, a, reg, o.healthWindow, o.healthEvery)
	err = a.Serve(ctx)
	<-healthDone // its last write must not land after clear's
	label.clear()
	if err != nil {
		return fail(err)
	}
	return 0
}

// readToken reads the peer token: the secret every agent of the cluster shares.
func readToken(path string) ([]byte, error) {
	if path == "" {
		return nil, errors.New("--peer-token-file is required: agents accept only peers that hold the cluster's token")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	token := []byte(strings.TrimSpace(string(b)))
	if len(token) < 16 {
		return nil, fmt.Errorf("--peer-token-file %s: the token must be at least 16 bytes", path)
	}
	return token, nil
}

// shareSockets gives the sockets and their folder to group gid. Engines run as any
// non-root user in this group: they may use both sockets, and may list the folder but
// neither create nor remove anything in it, so no engine can replace a socket or leave
// files there.
func shareSockets(socket string, gid int) error {
	dir := filepath.Dir(socket)
	for _, path := range []string{socket, agentv1.MemorySocket(socket), dir} {
		if err := os.Chown(path, -1, gid); err != nil {
			return err
		}
	}
	return os.Chmod(dir, 0o750)
}

// nodeLabel is the agent-ready label the agent set on its node, if any.
type nodeLabel struct {
	nodes kubernetes.Interface
	node  string
	log   *slog.Logger
}

// labelNode labels node ready when the agent is (no node: nothing to label).
func labelNode(ctx context.Context, kube *rest.Config, node string, a *agent.Agent, log *slog.Logger) (*nodeLabel, error) {
	if node == "" {
		return &nodeLabel{}, nil
	}
	nodes, err := kubernetes.NewForConfig(kube)
	if err != nil {
		return nil, err
	}
	if a.Ready() == nil {
		if err := nodelabel.Set(ctx, nodes, node, true, a.Address()); err != nil {
			return nil, err
		}
		log.Info("node labelled ready", "node", node, "address", a.Address())
	}
	return &nodeLabel{nodes: nodes, node: node, log: log}, nil
}

// publishHealth writes the agent's health report on the node whenever it changes, until
// ctx ends; the channel closes when it has stopped. Even an agent that is not ready
// publishes it: its reason is what the pools with engines there report.
func (l *nodeLabel) publishHealth(ctx context.Context, a *agent.Agent, g prometheus.Gatherer, window, every time.Duration) <-chan struct{} {
	done := make(chan struct{})
	if l.nodes == nil {
		close(done)
		return done
	}
	w := &health.Window{Gatherer: g, Span: window}
	p := &health.Publisher{
		Write:       func(ctx context.Context, value string) error { return nodelabel.SetHealth(ctx, l.nodes, l.node, value) },
		Every:       every,
		MinInterval: every,
		Log:         l.log,
	}
	go func() {
		defer close(done)
		p.Run(ctx, func(now time.Time) health.Report {
			if err := w.Observe(now); err != nil {
				l.log.Error("reading the agent's metrics for its health report", "err", err)
			}
			return a.Health(w)
		})
	}()
	return done
}

// clear removes the label, with its own deadline since the agent's context has ended by
// then: engines must not be placed on a node whose agent stopped.
func (l *nodeLabel) clear() {
	if l.nodes == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := nodelabel.Set(ctx, l.nodes, l.node, false, ""); err != nil {
		l.log.Error("clearing the node label", "err", err)
	}
}
