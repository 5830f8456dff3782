package realnode_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs/sysfstest"
	"github.com/kvhandoff/kvhandoff/internal/render"
	"github.com/kvhandoff/kvhandoff/test/builder"
	"github.com/kvhandoff/kvhandoff/test/envtest"
	"github.com/kvhandoff/kvhandoff/test/realnode"
)

// p5enFixture writes the p5en sysfs fixture under dir with its device nodes as character
// devices (the numbers of /dev/null: a container opens them and nothing happens), which
// CDI hands a container by the host's node; it returns the fixture's inventory.
func p5enFixture(t *testing.T, dir string) inventory.Inventory {
	t.Helper()
	if err := sysfstest.P5en().Write(dir, filepath.Join(dir, "dev")); err != nil {
		t.Fatal(err)
	}
	err := filepath.Walk(filepath.Join(dir, "dev"), func(path string, fi os.FileInfo, err error) error {
		if err != nil || !fi.Mode().IsRegular() {
			return err
		}
		if err := os.Remove(path); err != nil {
			return err
		}
		return syscall.Mknod(path, syscall.S_IFCHR|0o666, 1<<8|3)
	})
	if err != nil {
		t.Fatal(err)
	}
	return inventory.Discover(inventory.Options{Root: dir, DevRoot: filepath.Join(dir, "dev"), NVMLStatus: "disabled"})
}

// runDRADriver runs config/dra on the node, reading the fixture: its sysfs as the host's
// /sys, its device nodes at the same path inside as outside (CDI specs name host paths),
// publishing the accelerators too.
func runDRADriver(t *testing.T, n *realnode.Node, fixture string) {
	t.Helper()
	for _, f := range []string{"namespace.yaml", "deviceclasses.yaml", "rbac.yaml", "daemonset.yaml"} {
		objs, err := envtest.ReadObjects(filepath.Join(envtest.RepoRoot(), "config", "dra", f))
		if err != nil {
			t.Fatal(err)
		}
		for _, u := range objs {
			if u.GetKind() != "DaemonSet" {
				// The node components' namespace is the chart's already.
				if err := n.Client.Create(bg, u); err != nil && !apierrors.IsAlreadyExists(err) {
					t.Fatal(err)
				}
				continue
			}
			ds := &appsv1.DaemonSet{}
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, ds); err != nil {
				t.Fatal(err)
			}
			c := &ds.Spec.Template.Spec.Containers[0]
			c.Image, c.ImagePullPolicy = realnode.Registry+"/device-plugin:"+realnode.Tag, corev1.PullNever
			c.Args = []string{"dra", "--sysfs-root=/host", "--dev-root=" + filepath.Join(fixture, "dev"), "--nvml=false", "--accelerators",
				"--health-interval=1s", "--recover-after=3s", "--conflict-recheck=2s"}
			for i, v := range ds.Spec.Template.Spec.Volumes {
				switch v.Name {
				case "sys", "proc-driver":
					ds.Spec.Template.Spec.Volumes[i].HostPath.Path = filepath.Join(fixture, strings.TrimPrefix(v.HostPath.Path, "/"))
				case "dev":
					ds.Spec.Template.Spec.Volumes[i].HostPath.Path = filepath.Join(fixture, "dev")
				}
			}
			for i, m := range c.VolumeMounts {
				if m.Name == "dev" {
					c.VolumeMounts[i].MountPath = filepath.Join(fixture, "dev")
				}
			}
			if err := n.Client.Create(bg, ds); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// draEngine is the engine pod of a TP8 executor-Agent DRA pool on p5en as the manager
// renders it (its claims, templates created here), with the probe in the engine's place
// running args; the host's EFA libfabric, which this machine lacks, is left out.
func draEngine(t *testing.T, n *realnode.Node, name string, args ...string) *corev1.Pod {
	t.Helper()
	pool := builder.PrefillPool(name).Image("vllm/vllm-openai:v0.33.0").Policy("agent").
		DRA(&kvv1.DRASpec{DeviceClassName: "gpu.kvhandoff.io"}).Obj()
	pol := builder.Policy("agent").Executor(kvv1.ExecutorAgent).SameNode(kvv1.SameNodeAllow).Obj()
	w, err := render.Engines(render.Input{Role: kvv1.RolePrefill, Name: name, Namespace: "default", Spec: &pool.Spec.EngineSpec,
		Policy: &pol.Spec, ConnectorImage: realnode.Registry + "/vllm-connector:" + realnode.Tag})
	if err != nil {
		t.Fatal(err)
	}
	for _, tmpl := range w.DeviceClaims {
		if err := n.Client.Create(bg, tmpl); err != nil {
			t.Fatal(err)
		}
	}
	spec := w.StatefulSet.Spec.Template.Spec
	spec.NodeSelector, spec.Affinity, spec.RestartPolicy = nil, nil, corev1.RestartPolicyNever
	spec.Volumes = slicesDelete(spec.Volumes, func(v corev1.Volume) bool { return v.Name == "efa" })
	e := &spec.Containers[0]
	e.VolumeMounts = slicesDelete(e.VolumeMounts, func(m corev1.VolumeMount) bool { return m.Name == "efa" })
	e.Image, e.ImagePullPolicy = realnode.Registry+"/engineprobe:"+realnode.Tag, corev1.PullNever
	e.Command, e.Args = []string{"/engineprobe"}, append([]string{"--socket", render.AgentSocket}, args...)
	e.StartupProbe, e.ReadinessProbe, e.LivenessProbe, e.Lifecycle = nil, nil, nil, nil
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Labels: w.StatefulSet.Spec.Template.Labels}, Spec: spec}
}

func slicesDelete[T any](s []T, del func(T) bool) []T {
	var out []T
	for _, x := range s {
		if !del(x) {
			out = append(out, x)
		}
	}
	return out
}

// TestTheDRADriverHandsAnEngineItsDevicesThroughCDI runs kvhandoff's DRA driver
// (config/dra, the device-plugin image) on the p5en fixture beside a real kubelet and
// containerd 2: it registers, publishes the node's 8 GPUs and 16 EFAs (an EFA whose port
// goes down leaves the slice until it is back up), and an engine pod
// whose claims ask for 8 GPUs each with its own EFAs is prepared through CDI: it sees
// exactly its device nodes, the GPU variable and each GPU's EFAs as the bundles pair
// them. A second such pod finds no devices left and stays Pending with the scheduler's
// reason; deleting the first unprepares its claim (its CDI spec goes) and the second
// runs. The agent holds the engine to its allocated EFAs: the first accelerator's are
// let through to the provider, an EFA of no accelerator of the pod is refused.
func TestTheDRADriverHandsAnEngineItsDevicesThroughCDI(t *testing.T) {
	onThisMachine(t)
	n, cs := startNodeWith(t, realnode.Options{CDI: true}, "manager", "transfer-agent", "device-plugin", "vllm-connector", "engineprobe")
	fixture := filepath.Join(n.Dir, "p5en")
	inv := p5enFixture(t, fixture)
	node := &corev1.Node{}
	if err := n.Client.Get(bg, client.ObjectKey{Name: realnode.Name}, node); err != nil {
		t.Fatal(err)
	}
	patch := client.MergeFrom(node.DeepCopy())
	node.Labels["node.kubernetes.io/instance-type"] = "p5en.48xlarge" // where config/dra's DaemonSet runs
	if err := n.Client.Patch(bg, node, patch); err != nil {
		t.Fatal(err)
	}
	if err := n.InstallChart(n.ChartValues()...); err != nil {
		t.Fatal(err)
	}
	runDRADriver(t, n, fixture)
	published := func(want int) func() bool {
		return func() bool {
			list := &resourceapi.ResourceSliceList{}
			if n.Client.List(bg, list, client.MatchingFields{"spec.driver": "dra.kvhandoff.io"}) != nil || len(list.Items) != 1 {
				return false
			}
			return len(list.Items[0].Spec.Devices) == want
		}
	}
	until(t, "the driver to publish the node's 24 devices", 3*time.Minute, published(24))
	// An EFA whose port goes down leaves the slice, and comes back once it has been up
	// for --recover-after.
	port := filepath.Join(fixture, "sys", "class", "infiniband", "rdmap5s0", "ports", "1", "state")
	if err := os.WriteFile(port, []byte("1: DOWN\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	until(t, "the EFA whose port is down to leave the slice", time.Minute, published(23))
	if err := os.WriteFile(port, []byte("4: ACTIVE\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	until(t, "the EFA to come back", time.Minute, published(24))
	until(t, "the agent to label its node ready", 3*time.Minute, func() bool {
		return n.Client.Get(bg, client.ObjectKey{Name: realnode.Name}, node) == nil && node.Labels[kvv1.LabelAgentReady] == "true"
	})

	// The agent: the first GPU's EFAs are let through to the provider (tcp here, which
	// has no such NIC: InvalidArgument); an EFA the pod was not allocated is refused.
	// Each holds every device of the node: it is deleted once done.
	probe := func(name string, args ...string) string {
		pod := draEngine(t, n, name, args...)
		got := runPod(t, n, cs, pod)
		if err := n.Client.Delete(bg, pod); err != nil {
			t.Fatal(err)
		}
		return got
	}
	if got := probe("engine-b", "register-rails", "engine-b.default", "0"); !strings.HasPrefix(got, "InvalidArgument") ||
		!strings.Contains(got, "is not a domain of provider tcp;ofi_rxm") {
		t.Errorf("engine-b naming its first GPU's EFAs: %q; want them let through to the provider", got)
	}
	if got := probe("engine-x", "register-on", "engine-x.default", "rdmap999s0"); !strings.HasPrefix(got, "PermissionDenied") ||
		!strings.Contains(got, "are not the EFAs of one of this pod's accelerators") {
		t.Errorf("engine-x naming an EFA it was not allocated: %q", got)
	}

	first := draEngine(t, n, "engine-a", "devices")
	if err := n.Client.Create(bg, first); err != nil {
		t.Fatal(err)
	}
	until(t, "engine-a to run with its devices", 3*time.Minute, func() bool {
		p := &corev1.Pod{}
		return n.Client.Get(bg, client.ObjectKeyFromObject(first), p) == nil && p.Status.Phase == corev1.PodRunning
	})
	var nodes, groups, gpus []string
	for _, b := range inv.Bundles {
		acc, _ := inv.Lookup(b.Accelerator)
		gpus = append(gpus, fmt.Sprint(acc.Index))
		groups = append(groups, fmt.Sprintf("%d=%s", acc.Index, strings.Join(b.EFAs, ",")))
		nodes = append(nodes, acc.DeviceNodes...)
		for _, e := range b.EFAs {
			efa, _ := inv.Lookup(e)
			nodes = append(nodes, efa.DeviceNodes...)
		}
	}
	got := logs(t, cs, "default", first.Name)
	for _, want := range append(nodes, "KVHANDOFF_ACCELERATOR_EFAS="+strings.Join(groups, ";"), "NVIDIA_VISIBLE_DEVICES="+strings.Join(gpus, ",")) {
		if !slices.Contains(strings.Fields(got), want) {
			t.Errorf("engine-a lacks %s: %s", want, got)
		}
	}
	if strings.Contains(got, "mlx5") {
		t.Errorf("engine-a got a ConnectX device: %s", got)
	}

	second := draEngine(t, n, "engine-c", "devices")
	if err := n.Client.Create(bg, second); err != nil {
		t.Fatal(err)
	}
	until(t, "engine-c to stay Pending for want of devices", time.Minute, func() bool {
		p := &corev1.Pod{}
		if n.Client.Get(bg, client.ObjectKeyFromObject(second), p) != nil {
			return false
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Reason == corev1.PodReasonUnschedulable && strings.Contains(c.Message, "cannot allocate all claims") {
				return true
			}
		}
		return false
	})
	specs, _ := filepath.Glob(filepath.Join(realnode.CDIDir, "kvhandoff.io-claim_*.json"))
	if len(specs) != 1 {
		t.Fatalf("CDI specs while engine-a runs: %v, want its claim's alone", specs)
	}
	if err := n.Client.Delete(bg, first, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	until(t, "engine-c to run on the devices engine-a held", 3*time.Minute, func() bool {
		p := &corev1.Pod{}
		return n.Client.Get(bg, client.ObjectKeyFromObject(second), p) == nil && p.Status.Phase == corev1.PodRunning
	})
	if _, err := os.Stat(specs[0]); !os.IsNotExist(err) {
		t.Errorf("engine-a's claim's CDI spec after engine-a went: %v", err)
	}
	if got := logs(t, cs, "default", second.Name); !strings.Contains(got, "KVHANDOFF_ACCELERATOR_EFAS="+strings.Join(groups, ";")) {
		t.Errorf("engine-c: %s", got)
	}

	// Another driver starts publishing one of these EFAs (DRANET's attribute): the driver
	// withdraws its slice rather than let the scheduler hand the EFA out twice.
	efa := inv.OfKind(inventory.EFA)[0]
	if err := n.Client.Create(bg, &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: "dranet"}, Spec: resourceapi.ResourceSliceSpec{
		Driver: "dra.net", NodeName: &node.Name, Pool: resourceapi.ResourcePool{Name: node.Name, ResourceSliceCount: 1},
		Devices: []resourceapi.Device{{Name: "eth1", Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"dra.net/rdmaDevice": {StringValue: &efa.RDMA}}}}}}); err != nil {
		t.Fatal(err)
	}
	until(t, "the driver to withdraw its slice", time.Minute, func() bool {
		list := &resourceapi.ResourceSliceList{}
		return n.Client.List(bg, list, client.MatchingFields{"spec.driver": "dra.kvhandoff.io"}) == nil && len(list.Items) == 0
	})
}
