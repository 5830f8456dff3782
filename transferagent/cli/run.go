// Package cli is the transfer agent's command line: flags, logging, the health and
// metrics endpoint, the node label, and signal handling around package agent.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvhandoff/kvhandoff/transferagent/agent"
	"github.com/kvhandoff/kvhandoff/transferagent/client"
	"github.com/kvhandoff/kvhandoff/transferagent/nodelabel"
)

// Run runs the agent until SIGINT or SIGTERM and returns the exit status.
func Run(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("transfer-agent", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cfg agent.Config
	fs.StringVar(&cfg.Provider, "provider", "efa", `libfabric provider: "efa" on AWS; "tcp;ofi_rxm" or "shm" for development. Never falls back to another.`)
	fs.StringVar(&cfg.Socket, "socket", client.DefaultSocket, "the engine API's Unix socket (created 0660)")
	socketGID := fs.Int("socket-gid", -1, "group to own the socket and the memory folder; engines run in it (the manager adds it to engine pods' supplementalGroups); -1 keeps the agent's")
	fs.StringVar(&cfg.MemoryDir, "memory-dir", "/var/run/kvhandoff/memory", "the only folder engines may name host-memory files in")
	fs.StringVar(&cfg.PeerListen, "peer-listen", ":7470", "TCP address other agents connect to (the agent runs with hostNetwork)")
	fs.StringVar(&cfg.Advertise, "advertise", "", "host:port peers use to reach this agent (default: the listener's address; in a pod: $(NODE_IP):7470)")
	tokenFile := fs.String("peer-token-file", "", "file holding the secret every agent of the cluster shares; peers prove they hold it")
	def := agent.DefaultTimeouts()
	fs.DurationVar(&cfg.Lease, "lease", def.Lease, "registration and pull lease (KVTransferPolicy spec.leaseSeconds) for engines that send none in RegisterEngine")
	fs.DurationVar(&cfg.EventsDeadline, "events-deadline", 30*time.Second, "how long a registered engine rank has to open its event stream before its session is closed")
	fs.DurationVar(&cfg.RegistrationTimeout, "registration-timeout", def.RegistrationTimeout, "how long a push registration waits for its source (spec.registrationTimeoutSeconds), for engines that send none")
	fs.DurationVar(&cfg.BlocksTTL, "blocks-ttl", def.BlocksTTL, "how long ready source blocks wait for a registration or pull (spec.blocksTTLSeconds), for engines that send none")
	httpAddr := fs.String("http", ":9470", "address of /metrics, /healthz and /readyz")
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
	if err := os.MkdirAll(cfg.MemoryDir, 0o770); err != nil {
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
	// (libinfinipath's made SIGTERM exit 1; LIBFABRIC-NOTES 9).
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
		// Engines run as any non-root user in this group: they may use the socket and put
		// their KV files in the memory folder (setgid, so the files stay in the group).
		if err := os.Chown(cfg.Socket, -1, *socketGID); err != nil {
			return fail(err)
		}
		if err := os.Chown(cfg.MemoryDir, -1, *socketGID); err != nil {
			return fail(err)
		}
		if err := os.Chmod(cfg.MemoryDir, 0o2770|os.ModeSetgid); err != nil {
			return fail(err)
		}
	}

	ln, err := net.Listen("tcp", *httpAddr)
	if err != nil {
		return fail(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := a.Ready(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintf(w, "ok: provider %s\n", a.Provider())
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	log.Info("http", "addr", ln.Addr().String())

	var kube kubernetes.Interface
	if *node != "" {
		if kube, err = kubeClient(*kubeconfig); err != nil {
			return fail(err)
		}
		if a.Ready() == nil {
			if err := nodelabel.Set(ctx, kube, *node, true); err != nil {
				return fail(err)
			}
			log.Info("node labelled ready", "node", *node)
		}
	}

	err = a.Serve(ctx)
	if kube != nil {
		// Clear the label even though ctx has ended: engines must not be placed here.
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := nodelabel.Set(cctx, kube, *node, false); err != nil {
			log.Error("clearing the node label", "err", err)
		}
		cancel()
	}
	_ = srv.Close()
	if err != nil {
		return fail(err)
	}
	return 0
}

func kubeClient(kubeconfig string) (kubernetes.Interface, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes client for the node label: %w", err)
	}
	return kubernetes.NewForConfig(cfg)
}
