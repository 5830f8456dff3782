// Package kubelet drives kvhandoff's device plugin with the kubelet's own device manager
// (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager, the version the control-plane binaries
// are built from), not a stand-in. It is a separate module because k8s.io/kubernetes is
// not meant to be imported by the main one.
package kubelet

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/server"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs/sysfstest"
)

// The device manager serves only on /var/lib/kubelet/device-plugins/kubelet.sock, so the
// test runs itself again in a private mount namespace with a tmpfs over /var/lib: the
// host's folder is neither used nor touched.
const inNamespace = "KVHANDOFF_KUBELET_TEST_IN_NAMESPACE"

func TestMain(m *testing.M) {
	if os.Getenv(inNamespace) == "" {
		args := append([]string{"--mount", "--propagation", "private", os.Args[0]}, os.Args[1:]...)
		cmd := exec.Command("unshare", args...)
		cmd.Env = append(os.Environ(), inNamespace+"=1")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Run(); err != nil {
			if ee, ok := err.(*exec.ExitError); ok {
				os.Exit(ee.ExitCode())
			}
			fmt.Fprintln(os.Stderr, "kubelet test: unshare --mount (needs root, as the kubelet does):", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if err := syscall.Mount("tmpfs", "/var/lib", "tmpfs", 0, ""); err != nil {
		fmt.Fprintln(os.Stderr, "kubelet test: tmpfs over /var/lib:", err)
		os.Exit(1)
	}
	if err := os.MkdirAll(filepath.Dir(pluginapi.KubeletSocket), 0o755); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// kubelet is the device manager of a kubelet, started as the kubelet starts it.
type kubelet struct {
	*devicemanager.ManagerImpl
	pods []*v1.Pod
}

func startKubelet(t *testing.T) *kubelet {
	t.Helper()
	logger := klog.Background()
	m, err := devicemanager.NewManagerImpl(logger, nil, topologymanager.NewFakeManager(logger))
	if err != nil {
		t.Fatal(err)
	}
	k := &kubelet{ManagerImpl: m}
	if err := m.Start(logger, func() []*v1.Pod { return k.pods }, sourcesReady{}, containermap.NewContainerMap(), sets.New[string]()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Stop(logger) })
	return k
}

type sourcesReady struct{}

func (sourcesReady) AddSource(string) {}
func (sourcesReady) AllReady() bool   { return true }

// admit allocates a one-container pod asking for count of resource, as the kubelet's
// admission does, and returns the device nodes its container would get.
func (k *kubelet) admit(t *testing.T, name, res string, count int64) ([]string, error) {
	t.Helper()
	q := *resource.NewQuantity(count, resource.DecimalSI)
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID(name)},
		Spec: v1.PodSpec{Containers: []v1.Container{{Name: "engine", Resources: v1.ResourceRequirements{
			Requests: v1.ResourceList{v1.ResourceName(res): q}, Limits: v1.ResourceList{v1.ResourceName(res): q}}}}}}
	k.pods = append(k.pods, pod)
	c := &pod.Spec.Containers[0]
	if err := k.Allocate(context.Background(), pod, c, lifecycle.AddOperation); err != nil {
		return nil, err
	}
	opts, err := k.GetDeviceRunContainerOptions(context.Background(), pod, c)
	if err != nil {
		return nil, err
	}
	var nodes []string
	if opts != nil {
		for _, d := range opts.Devices {
			nodes = append(nodes, d.PathOnHost)
		}
	}
	return nodes, nil
}

// serve runs kvhandoff's plugin on the fixture and waits until the device manager
// reports want devices of every resource in it.
func serve(t *testing.T, k *kubelet, f sysfstest.Fixture, bundles bool, want map[string]int64) inventory.Inventory {
	t.Helper()
	dir := t.TempDir()
	root, dev := filepath.Join(dir, "root"), filepath.Join(dir, "root", "dev")
	if err := f.Write(root, dev); err != nil {
		t.Fatal(err)
	}
	inv := inventory.Discover(inventory.Options{Root: root, DevRoot: dev})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- server.Serve(ctx, server.Config{PluginDir: filepath.Dir(pluginapi.KubeletSocket), Resources: server.Resources(inv,
			bundles), State: server.NewState(inv)})
	}()
	t.Cleanup(func() { cancel(); <-done })
	deadline := time.Now().Add(30 * time.Second)
	for {
		capacity, _, _ := k.GetCapacity(klog.Background())
		got := map[string]int64{}
		for name, q := range capacity {
			if q.Value() > 0 {
				got[string(name)] = q.Value()
			}
		}
		if fmt.Sprint(got) == fmt.Sprint(want) {
			return inv
		}
		if time.Now().After(deadline) {
			t.Fatalf("the kubelet's capacity is %v, want %v", got, want)
		}
		time.Sleep(20 * time.Millisecond) // polling the device manager, which has no watch
	}
}

// uverbs is the EFA device nodes among a container's (rdma_cm is shared by design).
func uverbs(nodes []string) []string {
	var out []string
	for _, p := range nodes {
		if strings.HasPrefix(p, "/dev/infiniband/uverbs") {
			out = append(out, p)
		}
	}
	return out
}

// The finding that opened this test: on a p5en with bundles, a pod asking for 16 EFAs and
// one asking for 8 GPU+EFA bundles each got all 16 EFA device nodes. Now the node has one
// view: bundles only, so the EFA pod is refused and the bundle pod gets every NIC.
func TestTheKubeletHandsNoEFAToTwoPods(t *testing.T) {
	k := startKubelet(t)
	serve(t, k, sysfstest.P5en(), true, map[string]int64{server.ResourceGPUEFA: 8})
	bundles, err := k.admit(t, "bundles", server.ResourceGPUEFA, 8)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(uverbs(bundles)); n != 16 {
		t.Fatalf("8 GPU bundles got %d EFA device nodes, want 16", n)
	}
	// The node's capacity has no vpc.amazonaws.com/efa (serve checked it), so the scheduler
	// places no such pod here; one that arrives anyway gets no NIC from the device manager.
	nodes, err := k.admit(t, "efas", server.ResourceEFA, 16)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(uverbs(nodes)); n != 0 {
		t.Fatalf("a pod asking for 16 EFAs got %d of the EFA device nodes the 8 bundles hold", n)
	}
}

// Without bundles the node offers EFAs alone, and the kubelet gives them out once.
func TestTheKubeletAllocatesEachEFAOnce(t *testing.T) {
	k := startKubelet(t)
	serve(t, k, sysfstest.P5en(), false, map[string]int64{server.ResourceEFA: 16})
	first, err := k.admit(t, "first", server.ResourceEFA, 8)
	if err != nil {
		t.Fatal(err)
	}
	second, err := k.admit(t, "second", server.ResourceEFA, 8)
	if err != nil {
		t.Fatal(err)
	}
	a, b := uverbs(first), uverbs(second)
	if len(a) != 8 || len(b) != 8 || sets.New(a...).HasAny(b...) {
		t.Fatalf("two pods of 8 EFAs got %v and %v", first, second)
	}
	if _, err := k.admit(t, "third", server.ResourceEFA, 1); err == nil {
		t.Fatal("a 17th EFA was allocated")
	}
}
