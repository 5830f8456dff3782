package cli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os/signal"
	"syscall"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/health"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/podresources"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/server"
)

// Options are the serve command's settings.
type Options struct {
	// Inventory is where devices are found (sysfs and /dev roots, NVML).
	Inventory inventory.Options
	// PluginDir is the kubelet's device-plugin folder; PodResources its PodResources
	// socket ("" reads none: every device is taken to be free).
	PluginDir, PodResources string
	Bundles                 bool
	// Interval is the health check's period; RecoverAfter how long a failed device must
	// pass every check before it is healthy again.
	Interval, RecoverAfter time.Duration
	Log                    *slog.Logger
}

// Serve runs the kubelet device plugin until SIGINT or SIGTERM.
func Serve(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	nf := addNodeFlags(fs)
	o := Options{}
	fs.StringVar(&o.PluginDir, "plugin-dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin folder")
	fs.StringVar(&o.PodResources, "pod-resources-socket", podresources.DefaultSocket, "the kubelet's PodResources API: devices it gave pods "+
		"under another resource (another plugin's, or this one's before --bundles changed) are advertised unhealthy until released (empty: not read)")
	fs.BoolVar(&o.Bundles, "bundles", false,
		"advertise "+server.ResourceGPUEFA+" and "+server.ResourceNeuronEFA+", and "+server.ResourceEFA+" only for EFAs outside every bundle "+
			"(replaces the stock GPU/Neuron and EFA plugins on the node)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	return nf.run(stderr, "device-plugin", func(ctx context.Context, inv inventory.Options, log *slog.Logger) error {
		o.Inventory, o.Interval, o.RecoverAfter, o.Log = inv, *nf.interval, *nf.recoverAfter, log
		return Run(ctx, o)
	})
}

// nodeFlags are the flags of both modes: where the devices are found and how their
// health is checked.
type nodeFlags struct {
	root, devRoot          *string
	nvml                   *bool
	interval, recoverAfter *time.Duration
}

func addNodeFlags(fs *flag.FlagSet) nodeFlags {
	return nodeFlags{
		root:         fs.String("sysfs-root", "/", "folder holding sys/ and proc/"),
		devRoot:      fs.String("dev-root", "/dev", "folder holding the device nodes"),
		nvml:         fs.Bool("nvml", true, "ask NVML about GPUs and watch their XID events"),
		interval:     fs.Duration("health-interval", 5*time.Second, "how often device nodes, EFA ports, GPUs (NVML) and other resources' allocations are checked"),
		recoverAfter: fs.Duration("recover-after", 2*time.Minute, "how long a failed device must pass every check before it is healthy again"),
	}
}

// run runs mode until SIGINT or SIGTERM with NVML opened (and shut down after) as the
// flags say, and returns the exit code, naming the program in an error.
func (nf nodeFlags) run(stderr io.Writer, name string, mode func(context.Context, inventory.Options, *slog.Logger) error) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	inv := options(*nf.root, *nf.devRoot, *nf.nvml)
	if inv.NVML != nil {
		defer inv.NVML.Shutdown()
	}
	if err := mode(ctx, inv, slog.New(slog.NewJSONHandler(stderr, nil))); err != nil {
		fmt.Fprintln(stderr, name+":", err)
		return 1
	}
	return 0
}

// Run discovers the node's devices and serves them to the kubelet until ctx ends. The
// first health check, which reads what other resources hold, is done before the plugin
// registers: nothing is advertised healthy that another pod holds.
func Run(ctx context.Context, o Options) error {
	log := o.Log
	inv := discoverLogged(o.Inventory, log)
	if len(inv.Devices) == 0 {
		log.Warn("no EFA, GPU or Neuron device found; serving empty resources")
	}
	resources := server.Resources(inv, o.Bundles)
	state := server.NewState(inv)
	mon := monitor(ctx, o.Inventory, o.Interval, o.RecoverAfter, state.SetHealth, log)
	if o.PodResources != "" {
		mon.Held = func() (map[string]string, error) {
			allocs, err := podresources.List(ctx, o.PodResources)
			if err != nil {
				return nil, err
			}
			return server.HeldElsewhere(inv, resources, allocs), nil
		}
	}
	mon.Check(inv)
	go mon.Run(ctx, inv)
	return server.Serve(ctx, server.Config{PluginDir: o.PluginDir, Resources: resources, State: state, Log: log})
}

// discoverLogged reads the machine and logs what it found.
func discoverLogged(o inventory.Options, log *slog.Logger) inventory.Inventory {
	inv := inventory.Discover(o)
	log.Info("discovered", "gpus", len(inv.OfKind(inventory.GPU)), "efas", len(inv.OfKind(inventory.EFA)),
		"neuron", len(inv.OfKind(inventory.Neuron)), "nvml", inv.NVML, "problems", inv.Problems)
	return inv
}

// monitor is the health monitor of both modes: device nodes, EFA ports and, with NVML,
// each GPU and its XID events, reported to report.
func monitor(ctx context.Context, o inventory.Options, interval, recoverAfter time.Duration, report func(map[string]bool),
	log *slog.Logger) *health.Monitor {
	mon := &health.Monitor{Root: o.Root, DevRoot: o.DevRoot, Interval: interval, Tracker: health.NewTracker(recoverAfter), Report: report, Log: log}
	if n := o.NVML; n != nil {
		events, err := n.Events(ctx)
		if err != nil {
			log.Warn("NVML events unavailable; GPU health from device nodes and NVML queries", "err", err)
		}
		mon.Events, mon.NVML = events, n
	}
	return mon
}
