package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/dra"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/kubeconfig"
)

// DRAOptions are the dra command's settings.
type DRAOptions struct {
	Inventory inventory.Options
	// CDIDir is where claims' CDI specs go; RegistryDir and PluginDir the kubelet's
	// plugin registration folder and its folder for DRA plugins' sockets.
	CDIDir, RegistryDir, PluginDir string
	Accelerators                   bool
	Node                           string
	Client                         kubernetes.Interface
	Interval, RecoverAfter         time.Duration
	// Recheck is how often a running driver looks for a device plugin or driver that
	// started after it and serves the same devices.
	Recheck time.Duration
	Log     *slog.Logger
}

// DRA runs the kubelet DRA plugin until SIGINT or SIGTERM.
func DRA(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("dra", flag.ContinueOnError)
	fs.SetOutput(stderr)
	nf := addNodeFlags(fs)
	kubeconfigPath := fs.String("kubeconfig", "", "kubeconfig of the API server (default: the pod's service account)")
	o := DRAOptions{}
	fs.StringVar(&o.CDIDir, "cdi-dir", "/var/run/cdi", "where claims' CDI specs are written for the container runtime")
	fs.StringVar(&o.RegistryDir, "plugin-registry", kubeletplugin.KubeletRegistryDir, "the kubelet's plugin registration folder")
	fs.StringVar(&o.PluginDir, "plugin-dir", filepath.Join(kubeletplugin.KubeletPluginsDir, dra.DriverName), "the folder of this driver's socket")
	fs.BoolVar(&o.Accelerators, "accelerators", false, "publish GPUs and Neuron devices too, not only EFAs: only where no other driver "+
		"(NVIDIA's, AWS's Neuron driver) or device plugin serves them")
	fs.StringVar(&o.Node, "node-name", os.Getenv("NODE_NAME"), "this node's name (the DaemonSet sets NODE_NAME)")
	fs.DurationVar(&o.Recheck, "conflict-recheck", time.Minute, "how often to look for a device plugin or driver that started later and serves "+
		"the same devices (this driver then withdraws its slices and exits)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if o.Node == "" {
		fmt.Fprintln(stderr, "device-plugin dra: --node-name (or NODE_NAME) is required")
		return 2
	}
	cfg, err := kubeconfig.Load(*kubeconfigPath)
	if err == nil {
		o.Client, err = kubernetes.NewForConfig(cfg)
	}
	if err != nil {
		fmt.Fprintln(stderr, "device-plugin dra:", err)
		return 1
	}
	return nf.run(stderr, "device-plugin dra", func(ctx context.Context, inv inventory.Options, log *slog.Logger) error {
		o.Inventory, o.Interval, o.RecoverAfter, o.Log = inv, *nf.interval, *nf.recoverAfter, log
		return RunDRA(ctx, o)
	})
}

// RunDRA discovers the node's devices, refuses to publish any that a device plugin or
// another driver already serves there, then registers with the kubelet and publishes
// them until ctx ends. Health checks republish: a failed device leaves the slices.
func RunDRA(ctx context.Context, o DRAOptions) error {
	inv := discoverLogged(o.Inventory, o.Log)
	if err := checkConflicts(ctx, o, inv); err != nil {
		return err
	}
	// The kubelet makes its registration folder; this driver's own socket folder is its to make.
	if err := os.MkdirAll(o.PluginDir, 0o750); err != nil {
		return err
	}
	d := &dra.Driver{Inv: inv, SysRoot: filepath.Join(o.Inventory.Root, "sys"), DevRoot: o.Inventory.DevRoot, CDIDir: o.CDIDir,
		Accelerators: o.Accelerators, Node: o.Node, Client: o.Client, Log: o.Log}
	ctx, err := d.Start(ctx, kubeletplugin.RegistrarDirectoryPath(o.RegistryDir), kubeletplugin.PluginDataDirectoryPath(o.PluginDir))
	if err != nil {
		return err
	}
	defer d.Stop()
	go monitor(ctx, o.Inventory, o.Interval, o.RecoverAfter, func(h map[string]bool) { d.SetHealth(ctx, h) }, o.Log).Run(ctx, inv)
	ctx, conflict := context.WithCancelCause(ctx)
	go recheckConflicts(ctx, o, inv, conflict)
	<-ctx.Done()
	cause := context.Cause(ctx)
	if errors.Is(cause, errConflict) {
		d.Stop()
		// A device plugin or driver that came after this one: nothing stays offered twice.
		return errors.Join(cause, withdraw(o))
	}
	if cause != nil && !errors.Is(cause, context.Canceled) {
		return cause
	}
	return nil
}

// errConflict is what stops a driver that another plugin or driver on its node competes
// with for its devices.
var errConflict = errors.New("refusing to publish devices another plugin or driver serves on this node")

// checkConflicts refuses, and withdraws what an earlier run published, where another
// plugin or driver serves the devices this one would publish (dra.Conflicts).
func checkConflicts(ctx context.Context, o DRAOptions, inv inventory.Inventory) error {
	node, err := o.Client.CoreV1().Nodes().Get(ctx, o.Node, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("reading node %s: %w", o.Node, err)
	}
	slices, err := o.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + o.Node})
	if err != nil {
		return fmt.Errorf("reading node %s's ResourceSlices (resource.k8s.io/v1, Kubernetes 1.34 and later): %w", o.Node, err)
	}
	if c := dra.Conflicts(node, slices.Items, inv, o.Accelerators); len(c) > 0 {
		return errors.Join(fmt.Errorf("%w:\n  %s", errConflict, strings.Join(c, "\n  ")), withdraw(o))
	}
	return nil
}

// recheckConflicts stops the driver (stop) when a conflict appears while it runs.
func recheckConflicts(ctx context.Context, o DRAOptions, inv inventory.Inventory, stop context.CancelCauseFunc) {
	tick := time.NewTicker(o.Recheck)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if err := checkConflicts(ctx, o, inv); errors.Is(err, errConflict) {
			stop(err)
			return
		} else if err != nil {
			o.Log.Warn("rechecking for devices served twice", "err", err)
		}
	}
}

// withdraw deletes this driver's slices of the node.
func withdraw(o DRAOptions) error {
	err := o.Client.ResourceV1().ResourceSlices().DeleteCollection(context.Background(), metav1.DeleteOptions{},
		metav1.ListOptions{FieldSelector: "spec.nodeName=" + o.Node + ",spec.driver=" + dra.DriverName})
	if err != nil {
		return fmt.Errorf("withdrawing this driver's ResourceSlices of node %s: %w", o.Node, err)
	}
	return nil
}
