package server

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/health"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/nvml"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs/sysfstest"
)

// kubelet is the kubelet's side of registration: a Registration server on kubelet.sock.
type kubelet struct {
	pluginapi.UnimplementedRegistrationServer
	requests chan *pluginapi.RegisterRequest
	server   *grpc.Server
}

func startKubelet(t *testing.T, dir string) *kubelet {
	t.Helper()
	k := &kubelet{requests: make(chan *pluginapi.RegisterRequest, 10), server: grpc.NewServer()}
	pluginapi.RegisterRegistrationServer(k.server, k)
	l, err := net.Listen("unix", filepath.Join(dir, "kubelet.sock"))
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = k.server.Serve(l) }()
	return k
}

func (k *kubelet) Register(_ context.Context, r *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	k.requests <- r
	return &pluginapi.Empty{}, nil
}

// restart plays a kubelet restart: it goes away, removing every socket in the folder
// (as the kubelet does), and comes back with a new kubelet.sock.
func (k *kubelet) restart(t *testing.T, dir string) *kubelet {
	k.server.Stop()
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		_ = os.Remove(filepath.Join(dir, e.Name()))
	}
	return startKubelet(t, dir)
}

func (k *kubelet) expectRegistered(t *testing.T, resources ...string) {
	t.Helper()
	var got []string
	timeout := time.After(20 * time.Second)
	for len(got) < len(resources) {
		select {
		case r := <-k.requests:
			if r.Version != pluginapi.Version || !r.Options.GetPreferredAllocationAvailable {
				t.Errorf("registration %+v", r)
			}
			got = append(got, r.ResourceName)
		case <-timeout:
			t.Fatalf("registered %v, want %v", got, resources)
		}
	}
	slices.Sort(got)
	slices.Sort(resources)
	if !slices.Equal(got, resources) {
		t.Fatalf("registered %v, want %v", got, resources)
	}
}

type fixture struct {
	dir, root, dev string
	inv            inventory.Inventory
	state          *State
}

func newFixture(t *testing.T, f sysfstest.Fixture, n nvml.Interface) *fixture {
	t.Helper()
	dir, err := os.MkdirTemp("", "dp") // short: Unix socket paths are limited to 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	fx := &fixture{dir: filepath.Join(dir, "plugins"), root: filepath.Join(dir, "root"), dev: filepath.Join(dir, "root", "dev")}
	if err := os.MkdirAll(fx.dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := f.Write(fx.root, fx.dev); err != nil {
		t.Fatal(err)
	}
	fx.inv = inventory.Discover(inventory.Options{Root: fx.root, DevRoot: fx.dev, NVML: n})
	fx.state = NewState(fx.inv)
	return fx
}

func (fx *fixture) serve(t *testing.T, resources []Resource) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- Serve(ctx, Config{PluginDir: fx.dir, Resources: resources, State: fx.state}) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
		// A clean shutdown leaves no plugin socket for the kubelet to dial.
		for _, r := range resources {
			if _, err := os.Stat(filepath.Join(fx.dir, socketName(r.Name))); !os.IsNotExist(err) {
				t.Errorf("socket of %s still there after shutdown: %v", r.Name, err)
			}
		}
	})
}

// client connects to a plugin's socket as the kubelet does.
func (fx *fixture) client(t *testing.T, resource string) pluginapi.DevicePluginClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+filepath.Join(fx.dir, socketName(resource)), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return pluginapi.NewDevicePluginClient(conn)
}

func TestEFAPluginOverTheKubeletAPI(t *testing.T) {
	fx := newFixture(t, sysfstest.P5en(), nil)
	k := startKubelet(t, fx.dir)
	fx.serve(t, Resources(fx.inv, false))
	k.expectRegistered(t, ResourceEFA)
	c := fx.client(t, ResourceEFA)
	ctx := context.Background()

	stream, err := c.ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	first, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if len(first.Devices) != 16 {
		t.Fatalf("%d EFA devices, want 16", len(first.Devices))
	}
	numa := map[int64]int{}
	for _, d := range first.Devices {
		if d.Health != pluginapi.Healthy || d.Topology == nil || len(d.Topology.Nodes) != 1 {
			t.Fatalf("device %+v", d)
		}
		numa[d.Topology.Nodes[0].ID]++
	}
	if numa[0] != 8 || numa[1] != 8 {
		t.Errorf("NUMA spread %v, want 8 and 8", numa)
	}

	ids := []string{first.Devices[0].ID, first.Devices[1].ID}
	resp, err := c.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}}})
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, d := range resp.ContainerResponses[0].Devices {
		paths = append(paths, d.ContainerPath)
		if !strings.HasPrefix(d.HostPath, "/dev/infiniband/") {
			t.Errorf("device node %s outside /dev/infiniband", d.HostPath)
		}
	}
	if len(paths) != 3 || !slices.Contains(paths, "/dev/infiniband/rdma_cm") {
		t.Errorf("allocated device nodes %v: want two uverbs and rdma_cm once", paths)
	}
	if _, err := c.Allocate(ctx,
		&pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{"mlx5_0"}}}}); err == nil || !strings.Contains(err.Error(), `unknown device "mlx5_0"`) {
		t.Errorf("allocating a non-EFA device: %v", err)
	}

	var all []string
	for _, d := range first.Devices {
		all = append(all, d.ID)
	}
	pref, err := c.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{
		{AvailableDeviceIDs: all, MustIncludeDeviceIDs: []string{all[5]}, AllocationSize: 2},
	}})
	if err != nil {
		t.Fatal(err)
	}
	got := pref.ContainerResponses[0].DeviceIDs
	a, _ := fx.inv.Lookup(got[0])
	b, _ := fx.inv.Lookup(got[1])
	if got[0] != all[5] || a.Switch != b.Switch {
		t.Errorf("preferred %v: want %s and the NIC on its switch", got, all[5])
	}

	By(t, "re-registering when the kubelet restarts")
	k = k.restart(t, fx.dir)
	k.expectRegistered(t, ResourceEFA)
	c = fx.client(t, ResourceEFA)
	if _, err := c.GetDevicePluginOptions(ctx, &pluginapi.Empty{}); err != nil {
		t.Fatalf("plugin not serving after the kubelet restarted: %v", err)
	}
}

func By(t *testing.T, step string) { t.Log(step) }

type fakeNVML struct {
	gpus   []nvml.GPU
	events chan nvml.Event
	lost   atomic.Bool // the driver says no GPU is usable
}

func (f *fakeNVML) GPUs() ([]nvml.GPU, error) { return f.gpus, nil }
func (f *fakeNVML) Usable(string) (bool, string) {
	if f.lost.Load() {
		return false, "GPU is lost"
	}
	return true, ""
}
func (f *fakeNVML) Events(context.Context) (<-chan nvml.Event, error) {
	return f.events, nil
}
func (f *fakeNVML) Shutdown() {}

// p5enNVML is NVML for the P5en fixture: GPU i at the fixture's address of GPU i.
func p5enNVML() *fakeNVML {
	f := &fakeNVML{events: make(chan nvml.Event)}
	for i, fn := range sysfstest.P5en().Functions {
		if fn.NvidiaMinor >= 0 {
			f.gpus = append(f.gpus, nvml.GPU{UUID: "GPU-" + string(rune('a'+i)), Minor: fn.NvidiaMinor, PCIBusID: fn.Chain[len(fn.Chain)-1]})
		}
	}
	return f
}

func TestGPUBundlesAllocateAGPUWithItsLocalEFAs(t *testing.T) {
	fx := newFixture(t, sysfstest.P5en(), p5enNVML())
	k := startKubelet(t, fx.dir)
	fx.serve(t, Resources(fx.inv, true))
	// Every EFA of a p5en belongs to a GPU's bundle, and there is no Neuron device.
	k.expectRegistered(t, ResourceGPUEFA)
	c := fx.client(t, ResourceGPUEFA)
	ctx := context.Background()
	stream, err := c.ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	list, err := stream.Recv()
	if err != nil || len(list.Devices) != 8 {
		t.Fatalf("%v: %d bundles, want 8", err, len(list.Devices))
	}
	var ids []string
	for _, d := range list.Devices {
		ids = append(ids, d.ID)
	}
	resp, err := c.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}}})
	if err != nil {
		t.Fatal(err)
	}
	r := resp.ContainerResponses[0]
	uverbs, nvidia := 0, 0
	for _, d := range r.Devices {
		switch {
		case strings.HasPrefix(d.HostPath, "/dev/infiniband/uverbs"):
			uverbs++
		case strings.HasPrefix(d.HostPath, "/dev/nvidia") && d.HostPath[len("/dev/nvidia")] >= '0' && d.HostPath[len("/dev/nvidia")] <= '9':
			nvidia++
		}
	}
	if uverbs != 16 || nvidia != 8 {
		t.Errorf("8 bundles gave %d uverbs and %d GPU nodes, want 16 and 8", uverbs, nvidia)
	}
	gpus := strings.Split(r.Envs["NVIDIA_VISIBLE_DEVICES"], ",")
	if len(gpus) != 8 || !strings.HasPrefix(gpus[0], "GPU-") {
		t.Errorf("NVIDIA_VISIBLE_DEVICES = %q", r.Envs["NVIDIA_VISIBLE_DEVICES"])
	}
	// Each GPU with its own two EFAs, in the same order, every EFA once.
	groups := strings.Split(r.Envs[EnvAcceleratorEFAs], ";")
	seen := map[string]bool{}
	for i, g := range groups {
		gpu, nics, _ := strings.Cut(g, "=")
		if i >= len(gpus) || gpu != gpus[i] || len(strings.Split(nics, ",")) != 2 {
			t.Fatalf("%s group %d is %q, want GPU %s with two EFAs", EnvAcceleratorEFAs, i, g, gpus[min(i, len(gpus)-1)])
		}
		for _, nic := range strings.Split(nics, ",") {
			if seen[nic] || !strings.HasPrefix(nic, "rdmap") {
				t.Fatalf("%s names %q twice or not as an EFA: %q", EnvAcceleratorEFAs, nic, r.Envs[EnvAcceleratorEFAs])
			}
			seen[nic] = true
		}
	}
	if len(groups) != 8 {
		t.Errorf("%s = %q, want 8 groups", EnvAcceleratorEFAs, r.Envs[EnvAcceleratorEFAs])
	}
	for _, b := range fx.inv.Bundles {
		acc, _ := fx.inv.Lookup(b.Accelerator)
		if want := acc.UUID + "=" + strings.Join(b.EFAs, ","); !slices.Contains(groups, want) {
			t.Errorf("%s lacks %q: the bundle's own EFAs", EnvAcceleratorEFAs, want)
		}
	}
}

func TestHealthFollowsDeviceNodesPortsAndXIDsAndRecovers(t *testing.T) {
	n := p5enNVML()
	fx := newFixture(t, sysfstest.P5en(), n)
	k := startKubelet(t, fx.dir)
	fx.serve(t, Resources(fx.inv, true))
	k.expectRegistered(t, ResourceGPUEFA)

	tracker := health.NewTracker(300 * time.Millisecond)
	// Every wait below ends in a failure, not a hang, if the transition never comes.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	mon := &health.Monitor{Root: fx.root, DevRoot: fx.dev, Interval: 20 * time.Millisecond, Tracker: tracker, Events: n.events,
		NVML: n, Report: fx.state.SetHealth}
	go mon.Run(ctx, fx.inv)

	gpuStream, err := fx.client(t, ResourceGPUEFA).ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	// The EFA's health shows in its GPU's bundle, the only resource it is advertised under.
	efa := fx.inv.OfKind(inventory.EFA)[0]
	var bundle string
	for _, b := range fx.inv.Bundles {
		if slices.Contains(b.EFAs, efa.ID) {
			bundle = b.ID
		}
	}
	health := func(s pluginapi.DevicePlugin_ListAndWatchClient, id string, want string) {
		t.Helper()
		for {
			resp, err := s.Recv()
			if err != nil {
				t.Fatal(err)
			}
			for _, d := range resp.Devices {
				if d.ID == id && d.Health == want {
					return
				}
			}
		}
	}

	By(t, "a vanished uverbs node makes its EFA's bundle unhealthy, and it recovers once back")
	node := filepath.Join(fx.dev, strings.TrimPrefix(efa.DeviceNodes[0], "/dev/"))
	if err := os.Remove(node); err != nil {
		t.Fatal(err)
	}
	health(gpuStream, bundle, pluginapi.Unhealthy)
	if err := os.WriteFile(node, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	health(gpuStream, bundle, pluginapi.Healthy)

	By(t, "a port going down makes its EFA's bundle unhealthy")
	state := filepath.Join(fx.root, "sys", "class", "infiniband", efa.RDMA, "ports", "1", "state")
	if err := os.WriteFile(state, []byte("1: DOWN\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	health(gpuStream, bundle, pluginapi.Unhealthy)
	if err := os.WriteFile(state, []byte("4: ACTIVE\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	health(gpuStream, bundle, pluginapi.Healthy)

	By(t, "a critical XID makes the GPU's bundle unhealthy; application XIDs do not")
	gpu := n.gpus[0].UUID
	n.events <- nvml.Event{UUID: gpu, XID: 13}
	if !tracker.Healthy(gpu) {
		t.Fatal("XID 13 (an application's error) made the GPU unhealthy")
	}
	// Fell off the bus: its device node stays, so only the driver can say it is back.
	n.lost.Store(true)
	n.events <- nvml.Event{UUID: gpu, XID: 79}
	health(gpuStream, gpu, pluginapi.Unhealthy)
	n.lost.Store(false) // the GPU was reset (health's unit tests cover staying down meanwhile)
	health(gpuStream, gpu, pluginapi.Healthy)
}

func TestVMDevicesCarryNoTopology(t *testing.T) {
	fx := newFixture(t, sysfstest.VM(), nil)
	for _, d := range Resources(fx.inv, false)[0].devices(fx.inv, func(inventory.Device) bool { return true }) {
		if d.Topology != nil {
			t.Fatalf("device %s has topology %v on a machine without NUMA", d.ID, d.Topology)
		}
	}
}

// The kubelet accounts for each resource apart: a device advertised under two resources
// can be handed to two pods at once (the old plugin gave a pod asking for 16 EFAs and one
// asking for 8 GPU+EFA bundles all 16 EFAs each). With or without bundles, on every
// machine, no device is advertised twice and no resource is advertised without devices.
func TestNoDeviceIsAdvertisedUnderTwoResources(t *testing.T) {
	for name, f := range map[string]sysfstest.Fixture{"p5en": sysfstest.P5en(), "p5": sysfstest.P5(), "trn2": sysfstest.Trn2(), "vm": sysfstest.VM()} {
		var n nvml.Interface
		if name == "p5en" {
			n = p5enNVML()
		}
		fx := newFixture(t, f, n)
		for _, bundles := range []bool{false, true} {
			owner := map[string]string{}
			var names []string
			for _, r := range Resources(fx.inv, bundles) {
				names = append(names, r.Name)
				ds := r.devices(fx.inv, func(inventory.Device) bool { return true })
				if len(ds) == 0 {
					t.Errorf("%s, bundles %v: %s advertised with no devices", name, bundles, r.Name)
				}
				for _, m := range r.members(fx.inv) {
					for _, d := range m {
						if o, ok := owner[d.ID]; ok {
							t.Errorf("%s, bundles %v: %s advertised under %s and %s", name, bundles, d.ID, o, r.Name)
						}
						owner[d.ID] = r.Name
					}
				}
			}
			if efas := len(fx.inv.OfKind(inventory.EFA)); efas > 0 && !bundles && !slices.Equal(names, []string{ResourceEFA}) {
				t.Errorf("%s without bundles serves %v, want only %s", name, names, ResourceEFA)
			}
			t.Logf("%s, bundles %v: %v", name, bundles, names)
		}
	}
}
