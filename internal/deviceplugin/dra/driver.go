package dra

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
)

// Driver is the DRA plugin of one node.
type Driver struct {
	Inv inventory.Inventory
	// SysRoot holds sys/ (the standard attributes are read there); DevRoot the host's
	// device nodes; CDIDir where spec files go (/var/run/cdi).
	SysRoot, DevRoot, CDIDir string
	// Accelerators publishes GPUs and Neuron devices too, not only EFAs.
	Accelerators bool
	Node         string
	Client       kubernetes.Interface
	Log          *slog.Logger

	mu sync.Mutex
	// held is what is prepared: pool/device → claim UID.
	held map[string]string
	// healthy is each inventory device's health, by id.
	healthy map[string]bool
	changed chan struct{}
	helper  *kubeletplugin.Helper
	fatal   context.CancelCauseFunc
}

var _ kubeletplugin.DRAPlugin = (*Driver)(nil)

// Start loads what earlier runs prepared, registers with the kubelet and publishes the
// node's devices. The driver runs until ctx ends or a fatal error (a slice the API
// server refuses), which cancels ctx's child returned.
func (d *Driver) Start(ctx context.Context, opts ...kubeletplugin.Option) (context.Context, error) {
	held, err := loadPrepared(d.CDIDir)
	if err != nil {
		return nil, err
	}
	d.held, d.healthy, d.changed = held, map[string]bool{}, make(chan struct{}, 1)
	for _, dev := range d.Inv.Devices {
		d.healthy[dev.ID] = dev.Healthy
	}
	ctx, d.fatal = context.WithCancelCause(ctx)
	opts = append([]kubeletplugin.Option{kubeletplugin.DriverName(DriverName), kubeletplugin.KubeClient(d.Client),
		kubeletplugin.NodeName(d.Node), kubeletplugin.CDIDirectory(d.CDIDir)}, opts...)
	if d.helper, err = kubeletplugin.Start(ctx, d, opts...); err != nil {
		return nil, err
	}
	return ctx, d.publish(ctx)
}

// Stop unregisters from the kubelet; the published slices stay for a restart to take on.
// Stopping twice is stopping once.
func (d *Driver) Stop() {
	if d.helper != nil {
		d.helper.Stop()
		d.helper = nil
	}
}

// SetHealth takes the health monitor's report and republishes what changed: a failed
// device leaves the slices.
func (d *Driver) SetHealth(ctx context.Context, health map[string]bool) {
	d.mu.Lock()
	changed := false
	for id, h := range health {
		if old, ok := d.healthy[id]; !ok || old != h {
			d.healthy[id], changed = h, true
		}
	}
	d.mu.Unlock()
	if !changed {
		return
	}
	select {
	case d.changed <- struct{}{}:
	default:
	}
	if err := d.publish(ctx); err != nil {
		d.Log.Error("republishing after a health change", "err", err)
	}
}

func (d *Driver) publish(ctx context.Context) error {
	d.mu.Lock()
	devices, problems := Devices(d.Inv, d.SysRoot, d.Accelerators, func(dev inventory.Device) bool { return d.healthy[dev.ID] })
	d.mu.Unlock()
	for _, p := range problems {
		d.Log.Warn("device attribute", "problem", p)
	}
	d.Log.Info("publishing", "devices", len(devices))
	return d.helper.PublishResources(ctx, resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		d.Node: {Slices: []resourceslice.Slice{{Devices: devices}}},
	}})
}

// PrepareResourceClaims writes each claim's CDI spec and returns its device ID. A device
// already prepared for another claim is refused: the scheduler should never allocate
// one twice, and this is the last place that can stop it.
func (d *Driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := map[types.UID]kubeletplugin.PrepareResult{}
	foreign := d.foreignDevices(ctx)
	for _, c := range claims {
		out[c.UID] = d.prepare(c, foreign)
	}
	return out, nil
}

func (d *Driver) prepare(claim *resourceapi.ResourceClaim, foreign Foreign) kubeletplugin.PrepareResult {
	uid := string(claim.UID)
	byName := map[string]inventory.Device{}
	for _, dev := range d.Inv.Devices {
		byName[Name(dev)] = dev
	}
	results := ours(claim)
	var devices []inventory.Device
	var keys []string
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, r := range results {
		dev, ok := byName[r.Device]
		if !ok || r.Pool != d.Node {
			return kubeletplugin.PrepareResult{Err: fmt.Errorf("claim %s/%s: device %s/%s is not one of node %s's", claim.Namespace, claim.Name, r.Pool, r.Device, d.Node)}
		}
		if other, ok := d.held[deviceKey(r)]; ok && other != uid {
			return kubeletplugin.PrepareResult{Err: fmt.Errorf("claim %s/%s: device %s is prepared for claim %s already; refusing to hand it to two claims",
				claim.Namespace, claim.Name, r.Device, other)}
		}
		devices, keys = append(devices, dev), append(keys, deviceKey(r))
	}
	rails, problems := Rails(claim, d.Inv, foreign)
	for _, p := range problems {
		d.Log.Warn("rails", "claim", claim.Namespace+"/"+claim.Name, "problem", p)
	}
	if err := writeSpec(d.CDIDir, Spec(uid, devices, keys, rails, d.DevRoot)); err != nil {
		return kubeletplugin.PrepareResult{Err: err}
	}
	for _, k := range keys {
		d.held[k] = uid
	}
	d.Log.Info("prepared", "claim", claim.Namespace+"/"+claim.Name, "uid", uid, "devices", keys, "rails", Env(rails))
	// One CDI device carries the whole claim's edits; the kubelet gives it to every
	// container that uses the claim, once.
	var res kubeletplugin.PrepareResult
	for i, r := range results {
		dev := kubeletplugin.Device{Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device}
		if i == 0 {
			dev.CDIDeviceIDs = []string{CDIDeviceID(uid)}
		}
		res.Devices = append(res.Devices, dev)
	}
	return res
}

// UnprepareResourceClaims removes each claim's spec and frees its devices.
func (d *Driver) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := map[types.UID]error{}
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range claims {
		uid := string(c.UID)
		err := os.Remove(specFile(d.CDIDir, uid))
		if errors.Is(err, os.ErrNotExist) {
			err = nil
		}
		if err == nil {
			for k, v := range d.held {
				if v == uid {
					delete(d.held, k)
				}
			}
			d.Log.Info("unprepared", "claim", c.Namespace+"/"+c.Name, "uid", uid)
		}
		out[c.UID] = err
	}
	return out, nil
}

// HandleError logs background errors; a slice the API server refuses is fatal.
func (d *Driver) HandleError(ctx context.Context, err error, msg string) {
	if errors.Is(err, kubeletplugin.ErrRecoverable) {
		d.Log.Warn(msg, "err", err)
		return
	}
	d.Log.Error(msg, "err", err)
	d.fatal(fmt.Errorf("%s: %w", msg, err))
}

// WatchHealthStatus reports each published device's health to the kubelet, which shows
// it in the status of the pods that hold it: at once, on every change, and every 10 s
// (the kubelet takes a device not reported within 30 s as unknown).
func (d *Driver) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	tick := time.NewTicker(10 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case reports <- d.healthReport():
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		case <-d.changed:
		}
	}
}

func (d *Driver) healthReport() kubeletplugin.DeviceHealthReport {
	d.mu.Lock()
	defer d.mu.Unlock()
	var r kubeletplugin.DeviceHealthReport
	now := time.Now()
	for _, dev := range d.Inv.Devices {
		if !Published(dev, d.Accelerators) {
			continue
		}
		h := kubeletplugin.HealthStatusHealthy
		if !d.healthy[dev.ID] {
			h = kubeletplugin.HealthStatusUnhealthy
		}
		r.Devices = append(r.Devices, kubeletplugin.DeviceHealth{PoolName: d.Node, DeviceName: Name(dev), Health: h, LastUpdated: now})
	}
	return r
}

// foreignDevices reads the node's ResourceSlices of other drivers once per Prepare
// call, for Rails: the accelerators NVIDIA's or AWS's driver publishes and the EFAs of
// an EFA DRA driver.
func (d *Driver) foreignDevices(ctx context.Context) Foreign {
	var once sync.Once
	index := map[string]map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{}
	return func(driver, pool, device string) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
		once.Do(func() {
			list, err := d.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + d.Node})
			if err != nil {
				d.Log.Warn("reading the node's ResourceSlices", "err", err)
				return
			}
			for _, s := range list.Items {
				for _, dev := range s.Spec.Devices {
					index[s.Spec.Driver+"/"+s.Spec.Pool.Name+"/"+dev.Name] = dev.Attributes
				}
			}
		})
		return index[driver+"/"+pool+"/"+device]
	}
}
