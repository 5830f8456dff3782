package kubelet

import (
	"context"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/cli"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/server"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs/sysfstest"
)

// servePodResources serves the kubelet's PodResources API (its own v1 server) over this
// kubelet's device manager and pods, and returns the socket.
func (k *kubelet) servePodResources(t *testing.T) string {
	t.Helper()
	socket := filepath.Join(t.TempDir(), "kubelet.sock")
	l, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	podresourcesapi.RegisterPodResourcesListerServer(s, podresources.NewV1PodResourcesServer(context.Background(), podresources.PodResourcesProviders{
		Pods: pods{k}, Devices: devices{k.ManagerImpl}, Cpus: none{}, Memory: none{}, DynamicResources: none{},
	}))
	go func() { _ = s.Serve(l) }()
	t.Cleanup(s.Stop)
	return socket
}

// pods are the kubelet's admitted pods.
type pods struct{ k *kubelet }

func (p pods) GetActivePods() []*v1.Pod { return p.k.pods }
func (p pods) GetPods() []*v1.Pod       { return p.k.pods }
func (p pods) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	for _, pod := range p.k.pods {
		if pod.Namespace == namespace && pod.Name == name {
			return pod, true
		}
	}
	return nil, false
}

// devices is the device manager as the kubelet's container manager hands it to the
// PodResources server (containerDevicesFromResourceDeviceInstances, unexported there).
type devices struct{ m *devicemanager.ManagerImpl }

func (d devices) UpdateAllocatedDevices(logger klog.Logger) { d.m.UpdateAllocatedDevices(logger) }
func (d devices) GetDevices(podUID, container string) []*podresourcesapi.ContainerDevices {
	return containerDevices(d.m.GetDevices(podUID, container))
}
func (d devices) GetAllocatableDevices(logger klog.Logger) []*podresourcesapi.ContainerDevices {
	return containerDevices(d.m.GetAllocatableDevices(logger))
}

func containerDevices(devs devicemanager.ResourceDeviceInstances) []*podresourcesapi.ContainerDevices {
	var out []*podresourcesapi.ContainerDevices
	for resource, ds := range devs {
		for id := range ds {
			out = append(out, &podresourcesapi.ContainerDevices{ResourceName: resource, DeviceIds: []string{id}})
		}
	}
	return out
}

// none is a kubelet without CPU, memory or DRA managers.
type none struct{}

func (none) GetCPUs(*v1.Pod, *v1.Container) []int64 { return nil }
func (none) GetPodCPUs(string) []int64              { return nil }
func (none) GetAllocatableCPUs() []int64            { return nil }
func (none) GetMemory(klog.Logger, *v1.Pod, *v1.Container) []*podresourcesapi.ContainerMemory {
	return nil
}
func (none) GetPodMemory(klog.Logger, string) []*podresourcesapi.ContainerMemory { return nil }
func (none) GetAllocatableMemory(klog.Logger) []*podresourcesapi.ContainerMemory { return nil }
func (none) GetDynamicResources(klog.Logger, *v1.Pod, *v1.Container) []*podresourcesapi.DynamicResource {
	return nil
}

// runPlugin runs the device plugin's serve command (cli.Run) on the fixture at root until
// the returned stop is called.
func runPlugin(t *testing.T, root string, bundles bool, podResources string) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- cli.Run(ctx, cli.Options{
			Inventory: inventory.Options{Root: root, DevRoot: filepath.Join(root, "dev")},
			PluginDir: filepath.Dir(pluginapi.KubeletSocket), PodResources: podResources, Bundles: bundles,
			Interval: time.Hour, RecoverAfter: time.Minute, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		})
	}()
	stopped := false
	stop = func() {
		if !stopped {
			stopped = true
			cancel()
			<-done
		}
	}
	t.Cleanup(stop)
	return stop
}

// allocatable waits until the device manager's allocatable count of resource is want.
func (k *kubelet) allocatable(t *testing.T, resource string, want int64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, alloc, _ := k.GetCapacity(klog.Background())
		q := alloc[v1.ResourceName(resource)]
		if q.Value() == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the kubelet's allocatable %s is %d, want %d", resource, q.Value(), want)
		}
		time.Sleep(20 * time.Millisecond) // polling the device manager, which has no watch
	}
}

// A pod holds EFAs it got as vpc.amazonaws.com/efa; then the plugin restarts with
// bundles, which advertise the same EFAs again inside GPU bundles. The plugin reads the
// kubelet's PodResources API before it registers, and advertises every bundle with a
// held EFA unhealthy: the kubelet hands out only the other bundles, and no EFA twice.
// (Before, all 8 bundles were allocatable, and a pod asking for 8 got the trainer's NICs.)
func TestDevicesAnotherResourceHoldsAreNotHandedOutAgain(t *testing.T) {
	k := startKubelet(t)
	socket := k.servePodResources(t)
	root := t.TempDir()
	f := sysfstest.P5en()
	if err := f.Write(root, filepath.Join(root, "dev")); err != nil {
		t.Fatal(err)
	}
	stop := runPlugin(t, root, false, socket)
	k.allocatable(t, server.ResourceEFA, 16)
	trainer, err := k.admit(t, "trainer", server.ResourceEFA, 5)
	if err != nil {
		t.Fatal(err)
	}
	held := sets.New(uverbs(trainer)...)
	stop()

	// Which bundles the trainer's EFAs fall in, from the inventory the plugin sees.
	inv := inventory.Discover(inventory.Options{Root: root, DevRoot: filepath.Join(root, "dev")})
	touched := 0
	for _, b := range inv.Bundles {
		for _, e := range b.EFAs {
			d, _ := inv.Lookup(e)
			if held.HasAny(d.DeviceNodes...) {
				touched++
				break
			}
		}
	}
	if touched < 3 {
		t.Fatalf("5 EFAs fall in %d bundles; the test needs at least 3", touched)
	}

	runPlugin(t, root, true, socket)
	k.allocatable(t, server.ResourceGPUEFA, int64(8-touched))
	if _, err := k.admit(t, "greedy", server.ResourceGPUEFA, 8); err == nil {
		t.Error("8 bundles were allocated while a pod holds EFAs of some")
	}
	engine, err := k.admit(t, "engine", server.ResourceGPUEFA, int64(8-touched))
	if err != nil {
		t.Fatal(err)
	}
	if got := uverbs(engine); held.HasAny(got...) {
		overlap := sets.List(held.Intersection(sets.New(got...)))
		sort.Strings(overlap)
		t.Errorf("the engine got EFAs the trainer holds: %v", overlap)
	}
}
