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
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/server"
)

// Serve runs the kubelet device plugin until SIGINT or SIGTERM.
func Serve(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	root := fs.String("sysfs-root", "/", "folder holding sys/ and proc/")
	devRoot := fs.String("dev-root", "/dev", "folder holding the device nodes")
	pluginDir := fs.String("plugin-dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin folder")
	useNVML := fs.Bool("nvml", true, "ask NVML about GPUs and watch their XID events")
	bundles := fs.Bool("bundles", false,
		"advertise "+server.ResourceGPUEFA+" and "+server.ResourceNeuronEFA+", and "+server.ResourceEFA+" only for EFAs outside every bundle "+
			"(replaces the stock GPU/Neuron and EFA plugins on the node)")
	interval := fs.Duration("health-interval", 5*time.Second, "how often device nodes and EFA ports are checked")
	recoverAfter := fs.Duration("recover-after", 2*time.Minute, "how long a failed device must pass every check before it is healthy again")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log := slog.New(slog.NewJSONHandler(stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	o := options(*root, *devRoot, *useNVML)
	if o.NVML != nil {
		defer o.NVML.Shutdown()
	}
	inv := inventory.Discover(o)
	log.Info("discovered", "gpus", len(inv.OfKind(inventory.GPU)), "efas", len(inv.OfKind(inventory.EFA)),
		"neuron", len(inv.OfKind(inventory.Neuron)), "nvml", inv.NVML, "problems", inv.Problems)
	if len(inv.Devices) == 0 {
		log.Warn("no EFA, GPU or Neuron device found; serving empty resources")
	}
	state := server.NewState(inv)
	mon := &health.Monitor{Root: *root, DevRoot: *devRoot, Interval: *interval, Tracker: health.NewTracker(*recoverAfter), Report: state.SetHealth}
	if o.NVML != nil {
		events, err := o.NVML.Events(ctx)
		if err != nil {
			log.Warn("NVML events unavailable; GPU health from device nodes only", "err", err)
		}
		mon.Events, mon.NVML = events, o.NVML
	}
	go mon.Run(ctx, inv)
	if err := server.Serve(ctx, server.Config{PluginDir: *pluginDir, Resources: server.Resources(inv, *bundles), State: state, Log: log}); err != nil {
		fmt.Fprintln(stderr, "device-plugin:", err)
		return 1
	}
	return 0
}
