// Package realnode runs a real Kubernetes node on this machine for the real-node tier:
// etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd with runc,
// the kubelet, kube-proxy and the CNI bridge, all from Debian's archive or built from Go
// modules (hack/control-plane-bins.sh, hack/cni-plugins.sh). Pods run for real, from
// images built here (hack/images) and imported into containerd.
//
// Everything runs in a network and mount namespace of the test's own (Main): pods get
// addresses from 198.18.0.0/24 on a bridge whose gateway, 198.18.0.1, is the node and
// the API server's address; Services get 198.19.0.0/24. Nothing routes off the machine.
// The kubelet changes three host sysctls and makes cgroups, under a cgroup root of the
// run's own so that it never meets another kubelet's; Stop restores and removes them.
package realnode

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/kvhandoff/kvhandoff/internal/controller"
	"github.com/kvhandoff/kvhandoff/test/cluster"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// Addresses of the node's networks (RFC 2544's benchmarking range).
const (
	NodeIP      = "198.18.0.1"
	PodCIDR     = "198.18.0.0/24"
	ServiceCIDR = "198.19.0.0/24"
	// APIServiceIP is the kubernetes Service's address: the first of ServiceCIDR.
	APIServiceIP = "198.19.0.1"
	// Name is the node's name.
	Name = "realnode"
)

const inNamespaces = "KVHANDOFF_REALNODE_IN_NAMESPACES"

// TierImages are the images the real-node tier's tests run.
var TierImages = []string{"pause", "manager", "router", "transfer-agent", "device-plugin", "vllm-connector", "engineprobe",
	SimEngines.Image, VLLMImage}

// Main is a TestMain for the real-node tier: Run(m.Run, TierImages...).
func Main(m *testing.M) int { return Run(m.Run, TierImages...) }

// Run runs this program again in a network and mount namespace of its own, with loopback
// up and tmpfs over the host folders the node's pods mount (/var/run/kvhandoff), so
// nothing of the host is used or touched, and there calls f; it returns the exit code.
// Before it enters the namespace, where no name resolves, it prepares everything that
// downloads: the node's binaries, the CNI plugins, helm, and the Debian bases (and, for
// VLLMImage, the Python environment) of images. With $KVHANDOFF_TEST_KUBECONFIG set
// (External) it calls f as it is: the cluster is elsewhere.
func Run(f func() int, images ...string) int {
	if External() != "" {
		return f()
	}
	if os.Getenv(inNamespaces) == "" {
		if missing := prerequisites(); len(missing) > 0 {
			fmt.Fprintf(os.Stderr, "real-node tier: missing %s; hack/install-deps.sh installs them\n", strings.Join(missing, ", "))
			return 1
		}
		if err := prepare(images); err != nil {
			fmt.Fprintln(os.Stderr, "real-node tier: preparing, before entering a network namespace without a network:", err)
			return 1
		}
		cmd := exec.Command("unshare", append([]string{"--net", "--mount", "--propagation", "private", "--fork", os.Args[0]}, os.Args[1:]...)...)
		cmd.Env = append(os.Environ(), inNamespaces+"=1")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Run(); err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				return ee.ExitCode()
			}
			fmt.Fprintln(os.Stderr, "real-node tier: unshare --net --mount (needs root, as the kubelet does):", err)
			return 1
		}
		return 0
	}
	for _, c := range [][]string{{"ip", "link", "set", "lo", "up"}} {
		if out, err := exec.Command(c[0], c[1:]...).CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "real-node tier: %v: %v %s\n", c, err, out)
			return 1
		}
	}
	// What the node's pods mount from the host, and the places the kubelet and containerd
	// write to whatever their configuration says.
	for _, dir := range []string{"/var/run/kvhandoff", "/var/lib/kubelet", "/var/log/pods", "/var/log/containers", "/run/containerd", "/var/run/netns",
		CDIDir} {
		err := os.MkdirAll(dir, 0o755)
		if err == nil {
			// 0755 as the folders they stand for (tmpfs defaults to 1777).
			err = syscall.Mount("tmpfs", dir, "tmpfs", 0, "mode=0755")
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "real-node tier: tmpfs over %s: %v\n", dir, err)
			return 1
		}
	}
	return f()
}

// nodeBinaries are the Kubernetes binaries a node runs (hack/control-plane-bins.sh).
var nodeBinaries = []string{"kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler", "kubectl", "kubelet", "kube-proxy"}

// prepare builds or downloads, once and cached, all that Start and BuildImages need from
// the network, so that they run inside the tier's namespace offline.
func prepare(images []string) error {
	if _, err := envtest.Binaries(nodeBinaries...); err != nil {
		return err
	}
	if _, err := cniPlugins(); err != nil {
		return err
	}
	if _, err := containerd2(); err != nil {
		return err
	}
	if _, err := helmPath(); err != nil {
		return err
	}
	if slices.Contains(images, VLLMImage) {
		if _, err := VLLMVenv(); err != nil {
			return err
		}
	}
	// go run compiles hack/images now (its modules downloaded), and it makes the bases.
	cmd := exec.Command("go", append([]string{"run", "./hack/images", "-bases"}, images...)...)
	cmd.Dir = envtest.RepoRoot()
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("making the images' Debian bases with hack/images -bases: %w", err)
	}
	return nil
}

// cniPlugins builds the CNI plugins (hack/cni-plugins.sh, cached) and returns their folder.
func cniPlugins() (string, error) {
	out, err := exec.Command(filepath.Join(envtest.RepoRoot(), "hack", "cni-plugins.sh")).Output()
	if err != nil {
		return "", fmt.Errorf("building the CNI plugins with hack/cni-plugins.sh: %w", err)
	}
	return strings.TrimSpace(string(out)), nil
}

// CDIDir is where a node with Options.CDI reads CDI specs: the DRA drivers' folder (a
// tmpfs of the tier's mount namespace, see Run).
const CDIDir = "/var/run/cdi"

// containerd2 builds containerd 2 and its shim (hack/containerd.sh, cached) and returns
// their folder.
func containerd2() (string, error) {
	out, err := exec.Command(filepath.Join(envtest.RepoRoot(), "hack", "containerd.sh")).Output()
	if err != nil {
		return "", fmt.Errorf("building containerd 2 with hack/containerd.sh: %w", err)
	}
	return strings.TrimSpace(string(out)), nil
}

// prerequisites are the programs the node needs that are not built here, by package.
func prerequisites() []string {
	var missing []string
	for bin, pkg := range map[string]string{"containerd": "containerd", "runc": "runc", "ctr": "containerd", "ip": "iproute2",
		"iptables-restore": "iptables", "unshare": "util-linux", "mmdebstrap": "mmdebstrap"} {
		if _, err := exec.LookPath(bin); err != nil {
			missing = append(missing, fmt.Sprintf("%s (Debian package %s)", bin, pkg))
		}
	}
	return missing
}

// Node is a running real node with its control plane.
type Node struct {
	// Kubeconfig is an admin kubeconfig; Client an admin client.
	Kubeconfig string
	Client     client.Client
	// Dir holds the node's state and one log per process (logs/).
	Dir string

	bins string
	// api is the admin's REST configuration; http carries requests through the API
	// server's proxy with its credentials.
	api      *rest.Config
	http     http.RoundTripper
	external bool
	procs    []*proc
	sysctls  map[string]string
	socket   string
	// cgroupRoot is the kubelet's cgroup root (kubepods lives below it), one per node,
	// in every hierarchy.
	cgroupRoot string
	stopping   bool
	// env is the environment of the node's processes (nil: this one's).
	env []string
}

// globalSysctls are the host settings the kubelet changes (they are not per network
// namespace); Stop puts back what they were.
var globalSysctls = []string{"vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops"}

// Options are how a node differs from the tier's default.
type Options struct {
	// CDI runs containerd 2 (hack/containerd.sh) with CDI on, reading specs from
	// /var/run/cdi, for DRA drivers: Debian 12's containerd 1.6 has no CDI.
	CDI bool
}

// Start brings up the node in dir and imports the image archives into its containerd.
// On error, whatever started is stopped.
func Start(ctx context.Context, dir string, images ...string) (*Node, error) {
	return StartWith(ctx, dir, Options{}, images...)
}

// StartWith is Start with options.
func StartWith(ctx context.Context, dir string, o Options, images ...string) (_ *Node, err error) {
	if os.Getenv(inNamespaces) == "" {
		return nil, errors.New("realnode: Start outside the tier's namespaces (use realnode.Main as TestMain)")
	}
	n := &Node{Dir: dir, sysctls: map[string]string{}, socket: filepath.Join(dir, "containerd.sock"),
		cgroupRoot: fmt.Sprintf("%s%d", cgroupRootPrefix, time.Now().UnixNano())}
	defer func() {
		if err != nil {
			err = fmt.Errorf("%w\n%s", err, n.LogTail(15))
			_ = n.Stop()
		}
	}()
	for _, s := range globalSysctls {
		b, err := os.ReadFile("/proc/sys/" + s)
		if err != nil {
			return nil, err
		}
		n.sysctls[s] = strings.TrimSpace(string(b))
	}
	removeStaleCgroups()
	if err := makeCgroupRoot(n.cgroupRoot); err != nil {
		return nil, err
	}
	for _, d := range []string{"logs", "etcd", "containerd", "containerd-state", "cni/net.d", "cni/ipam"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	if n.bins, err = envtest.Binaries(nodeBinaries...); err != nil {
		return nil, err
	}
	cni, err := cniPlugins()
	if err != nil {
		return nil, err
	}
	if err := n.network(); err != nil {
		return nil, err
	}
	p, err := n.credentials()
	if err != nil {
		return nil, err
	}
	if err := n.controlPlane(ctx, p); err != nil {
		return nil, err
	}
	if err := n.runtime(ctx, cni, o, images); err != nil {
		return nil, err
	}
	if err := n.kubelet(ctx, p); err != nil {
		return nil, err
	}
	return n, nil
}

// network makes the pods' bridge with the node's address on it, and lets bridged and
// routed traffic through the node's iptables (kube-proxy's Services), in this namespace.
func (n *Node) network() error {
	for _, c := range [][]string{
		{"ip", "link", "add", "cni0", "type", "bridge"},
		{"ip", "addr", "add", NodeIP + "/24", "dev", "cni0"},
		{"ip", "link", "set", "cni0", "up"},
		// Services are reached through the node's routes, as a default route does on a
		// real node: host-network pods (the agent) connect to them from here.
		{"ip", "route", "add", ServiceCIDR, "dev", "cni0"},
	} {
		if out, err := exec.Command(c[0], c[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("%v: %v %s", c, err, out)
		}
	}
	for s, v := range map[string]string{"net/ipv4/ip_forward": "1", "net/bridge/bridge-nf-call-iptables": "1"} {
		if err := os.WriteFile("/proc/sys/"+s, []byte(v), 0o644); err != nil {
			return fmt.Errorf("sysctl %s in the node's network namespace: %w", s, err)
		}
	}
	return nil
}

func (n *Node) credentials() (*pki, error) {
	p, err := newPKI(filepath.Join(n.Dir, "pki"))
	if err != nil {
		return nil, err
	}
	ips := []net.IP{net.ParseIP(NodeIP), net.ParseIP("127.0.0.1"), net.ParseIP(APIServiceIP)}
	dns := []string{"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local", "localhost"}
	for _, c := range []struct {
		file, cn string
		groups   []string
	}{
		{"admin", "kvhandoff-admin", []string{"system:masters"}},
		{"node", "system:node:" + Name, []string{"system:nodes"}},
		{"kube-proxy", "system:kube-proxy", nil},
		{"controller-manager", "system:kube-controller-manager", nil},
		{"scheduler", "system:kube-scheduler", nil},
		{"apiserver-kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"}},
	} {
		if err := p.issue(c.file, c.cn, c.groups, nil, nil); err != nil {
			return nil, err
		}
	}
	if err := p.issue("apiserver", "kube-apiserver", nil, ips, dns); err != nil {
		return nil, err
	}
	return p, p.serviceAccountKeys()
}

func (n *Node) controlPlane(ctx context.Context, p *pki) error {
	server := "https://" + NodeIP + ":6443"
	if err := n.run("etcd", filepath.Join(n.bins, "etcd"), "--data-dir", filepath.Join(n.Dir, "etcd"),
		"--listen-client-urls", "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
		"--listen-peer-urls", "http://127.0.0.1:2380"); err != nil {
		return err
	}
	if err := n.run("kube-apiserver", filepath.Join(n.bins, "kube-apiserver"), "--etcd-servers", "http://127.0.0.1:2379",
		"--bind-address", "0.0.0.0", "--advertise-address", NodeIP, "--secure-port", "6443",
		"--tls-cert-file", p.path("apiserver.crt"), "--tls-private-key-file", p.path("apiserver.key"), "--client-ca-file", p.path("ca.crt"),
		"--kubelet-client-certificate", p.path("apiserver-kubelet-client.crt"), "--kubelet-client-key", p.path("apiserver-kubelet-client.key"),
		"--service-account-key-file", p.path("sa.pub"), "--service-account-signing-key-file", p.path("sa.key"),
		"--service-account-issuer", "https://kubernetes.default.svc", "--service-cluster-ip-range", ServiceCIDR,
		"--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction", "--allow-privileged=true",
		// There is no DNS here: reach the kubelet (logs, exec) at its address.
		"--kubelet-preferred-address-types", "InternalIP"); err != nil {
		return err
	}
	var err error
	if n.Kubeconfig, err = p.kubeconfig("admin", server); err != nil {
		return err
	}
	if err := n.connect(); err != nil {
		return err
	}
	if err := n.until(ctx, "the API server to serve", func(ctx context.Context) bool {
		return n.Client.List(ctx, &corev1.NamespaceList{}) == nil
	}); err != nil {
		return err
	}
	for _, c := range []struct{ name, file string }{{"kube-controller-manager", "controller-manager"}, {"kube-scheduler", "scheduler"}} {
		kc, err := p.kubeconfig(c.file, server)
		if err != nil {
			return err
		}
		args := []string{"--kubeconfig", kc, "--secure-port", "0", "--leader-elect=false"}
		if c.name == "kube-controller-manager" {
			args = append(args, "--service-account-private-key-file", p.path("sa.key"), "--root-ca-file", p.path("ca.crt"),
				"--use-service-account-credentials", "--cluster-cidr", PodCIDR, "--cluster-name", "kvhandoff-realnode")
		}
		if err := n.run(c.name, filepath.Join(n.bins, c.name), args...); err != nil {
			return err
		}
	}
	return nil
}

func (n *Node) runtime(ctx context.Context, cni string, o Options, images []string) error {
	d := n.Dir
	bin, cdi := "containerd", ""
	if o.CDI {
		dir, err := containerd2()
		if err != nil {
			return err
		}
		// containerd finds its shim on PATH: containerd 2's beside it.
		bin = filepath.Join(dir, "containerd")
		n.env = append(os.Environ(), "PATH="+dir+":"+os.Getenv("PATH"))
		cdi = fmt.Sprintf("  enable_cdi = true\n  cdi_spec_dirs = [%q]\n", CDIDir)
	}
	containerd := fmt.Sprintf(`version = 2
root = %q
state = %q
[grpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "ghcr.io/kvhandoff/pause:dev"
  # This machine's sandbox lacks CAP_SYS_RESOURCE: without this every pod sandbox fails
  # ("can't get final child's PID from pipe").
  restrict_oom_score_adj = true
%s  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
`, filepath.Join(d, "containerd"), filepath.Join(d, "containerd-state"), n.socket, cdi, cni, filepath.Join(d, "cni", "net.d"))
	if err := os.WriteFile(filepath.Join(d, "containerd.toml"), []byte(containerd), 0o644); err != nil {
		return err
	}
	conflist := fmt.Sprintf(`{"cniVersion": "1.0.0", "name": "kvhandoff", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "isDefaultGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": %q, "gateway": %q}]], "dataDir": %q}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}`, PodCIDR, NodeIP, filepath.Join(d, "cni", "ipam"))
	if err := os.WriteFile(filepath.Join(d, "cni", "net.d", "10-kvhandoff.conflist"), []byte(conflist), 0o644); err != nil {
		return err
	}
	if err := n.run("containerd", bin, "--config", filepath.Join(d, "containerd.toml")); err != nil {
		return err
	}
	if err := n.until(ctx, "containerd to serve", func(context.Context) bool { _, err := os.Stat(n.socket); return err == nil }); err != nil {
		return err
	}
	return n.Import(images...)
}

// Kubectl is the path of the kubectl of the node's version.
func (n *Node) Kubectl() string { return filepath.Join(n.bins, "kubectl") }

// Import imports image archives (docker-archive tarballs) into the node's containerd.
func (n *Node) Import(archives ...string) error {
	for _, a := range archives {
		if out, err := exec.Command("ctr", "--address", n.socket, "-n", "k8s.io", "images", "import", a).CombinedOutput(); err != nil {
			return fmt.Errorf("importing %s: %v %s", a, err, out)
		}
	}
	return nil
}

func (n *Node) kubelet(ctx context.Context, p *pki) error {
	d := n.Dir
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine mounts cgroup v1 beside v2 (hybrid), which the kubelet refuses by default.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /%s
containerRuntimeEndpoint: unix://%s
authentication: {anonymous: {enabled: false}, webhook: {enabled: true}, x509: {clientCAFile: %q}}
authorization: {mode: Webhook}
address: %s
readOnlyPort: 0
resolvConf: ""
podLogsDir: %q
# The node is this machine's disk and memory, shared with everything else it runs: never evict.
evictionHard: {memory.available: "1Mi", nodefs.available: "1%%", imagefs.available: "1%%", nodefs.inodesFree: "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
`, n.cgroupRoot, n.socket, p.path("ca.crt"), NodeIP, filepath.Join(d, "pod-logs"))
	if err := os.WriteFile(filepath.Join(d, "kubelet.yaml"), []byte(cfg), 0o644); err != nil {
		return err
	}
	server := "https://" + NodeIP + ":6443"
	kc, err := p.kubeconfig("node", server)
	if err != nil {
		return err
	}
	if err := n.run("kubelet", filepath.Join(n.bins, "kubelet"), "--config", filepath.Join(d, "kubelet.yaml"), "--kubeconfig", kc,
		// The default root (a tmpfs of the tier's mount namespace, see Main): the device
		// plugin's DaemonSet mounts its device-plugins and pod-resources folders from there.
		"--hostname-override", Name,
		"--node-ip", NodeIP); err != nil {
		return err
	}
	proxy, err := p.kubeconfig("kube-proxy", server)
	if err != nil {
		return err
	}
	if err := n.run("kube-proxy", filepath.Join(n.bins, "kube-proxy"), "--kubeconfig", proxy, "--hostname-override", Name,
		"--cluster-cidr", PodCIDR, "--proxy-mode", "iptables", "--metrics-bind-address", "127.0.0.1:10249",
		"--healthz-bind-address", "127.0.0.1:10256"); err != nil {
		return err
	}
	return n.until(ctx, "the node to be Ready and the default service account to exist", func(ctx context.Context) bool {
		node := &corev1.Node{}
		if n.Client.Get(ctx, client.ObjectKey{Name: Name}, node) != nil {
			return false
		}
		sa := &corev1.ServiceAccount{}
		if n.Client.Get(ctx, client.ObjectKey{Namespace: "default", Name: "default"}, sa) != nil {
			return false
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				return c.Status == corev1.ConditionTrue
			}
		}
		return false
	})
}

// run starts a process of the node with its output in Dir/logs/name.log.
func (n *Node) run(name, bin string, args ...string) error {
	log, err := os.OpenFile(filepath.Join(n.Dir, "logs", name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr, cmd.Env = log, log, n.env
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, exited: make(chan struct{})}
	n.procs = append(n.procs, p)
	go func() { _ = cmd.Wait(); log.Close(); close(p.exited) }()
	return nil
}

// proc is a process of the node; exited closes when it has.
type proc struct {
	name   string
	cmd    *exec.Cmd
	exited chan struct{}
}

func (p *proc) done() bool {
	select {
	case <-p.exited:
		return true
	default:
		return false
	}
}

// until polls cond until it holds, failing when a process of the node exits or after two
// minutes.
func (n *Node) until(ctx context.Context, what string, cond func(context.Context) bool) error {
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		for _, p := range n.procs {
			if p.done() {
				return false, fmt.Errorf("%s exited", p.name)
			}
		}
		return cond(ctx), nil
	})
	if err != nil {
		return fmt.Errorf("waiting for %s: %w", what, err)
	}
	return nil
}

// connect makes the node's client and API transport from its kubeconfig.
func (n *Node) connect() error {
	var err error
	if n.api, err = clientcmd.BuildConfigFromFlags("", n.Kubeconfig); err != nil {
		return err
	}
	if n.Client, err = client.New(n.api, client.Options{Scheme: controller.NewScheme()}); err != nil {
		return err
	}
	n.http, err = rest.TransportFor(n.api)
	return err
}

// LogTail returns every pod's state and the last lines of every process's and every
// container's log, for failure reports.
func (n *Node) LogTail(lines int) string {
	var b strings.Builder
	pods := &corev1.PodList{}
	if n.Client != nil && n.Client.List(context.Background(), pods) == nil {
		for _, p := range pods.Items {
			fmt.Fprintf(&b, "pod %s/%s: %s on %q", p.Namespace, p.Name, p.Status.Phase, p.Spec.NodeName)
			for _, c := range p.Status.Conditions {
				if c.Status != corev1.ConditionTrue && c.Message != "" {
					fmt.Fprintf(&b, "; %s: %s", c.Type, c.Message)
				}
			}
			for _, c := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
				if w := c.State.Waiting; w != nil {
					fmt.Fprintf(&b, "; %s waiting: %s %s", c.Name, w.Reason, w.Message)
				}
				if x := c.LastTerminationState.Terminated; x != nil {
					fmt.Fprintf(&b, "; %s last exited %d: %s", c.Name, x.ExitCode, x.Reason)
				}
			}
			b.WriteString("\n")
		}
	}
	files, _ := filepath.Glob(filepath.Join(n.Dir, "logs", "*.log"))
	containers, _ := filepath.Glob(filepath.Join(n.Dir, "pod-logs", "*", "*", "*.log"))
	b.WriteString(cluster.TailFiles(append(files, containers...), lines))
	return b.String()
}

// Stop stops the node: its processes in reverse order, then every container process the
// kubelet's cgroups still hold; it removes those cgroups, the mounts, the bridge and the
// rules kube-proxy wrote, and restores the host sysctls. The test's namespaces are then
// as Main made them, ready for the next node.
func (n *Node) Stop() error {
	if n.external {
		return n.reset()
	}
	var errs []error
	for i := len(n.procs) - 1; i >= 0; i-- {
		if p := n.procs[i]; !p.done() {
			_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
		}
	}
	grace, expired := time.NewTimer(10*time.Second), false
	defer grace.Stop()
	for _, p := range n.procs {
		if !expired {
			select {
			case <-p.exited:
				continue
			case <-grace.C:
				expired = true
			}
		}
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.exited
	}
	killMatching(n.socket) // containerd's shims, which outlive it
	errs = append(errs, removeCgroups(n.cgroupRoot))
	errs = append(errs, unmountUnder(n.Dir), unmountUnder("/var/lib/kubelet"))
	// The network namespace is the tier's own: nothing else's rules are in it.
	for _, c := range [][]string{{"ip", "link", "del", "cni0"}, {"iptables", "-t", "nat", "-F"}, {"iptables", "-t", "nat", "-X"},
		{"iptables", "-t", "filter", "-F"}, {"iptables", "-t", "filter", "-X"}, {"iptables", "-t", "mangle", "-F"}, {"iptables", "-t", "mangle", "-X"}} {
		if out, err := exec.Command(c[0], c[1:]...).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("%v: %v %s", c, err, out))
		}
	}
	for s, v := range n.sysctls {
		if err := os.WriteFile("/proc/sys/"+s, []byte(v), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("restoring %s=%s: %w", s, v, err))
		}
	}
	return errors.Join(errs...)
}

// killMatching kills every process whose command line holds s.
func killMatching(s string) {
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		var pid int
		if _, err := fmt.Sscan(e.Name(), &pid); err != nil || pid == os.Getpid() {
			continue
		}
		if cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline")); err == nil && strings.Contains(string(cmdline), s) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// unmountUnder detaches every mount below dir (volumes, container root filesystems), the
// deepest first, so that dir can be removed.
func unmountUnder(dir string) error {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	var points []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			points = append(points, f[4])
		}
	}
	var errs []error
	for i := len(points) - 1; i >= 0; i-- {
		if err := syscall.Unmount(points[i], syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) {
			errs = append(errs, fmt.Errorf("unmounting %s: %w", points[i], err))
		}
	}
	return errors.Join(errs...)
}

// cgroupRootPrefix names the nodes' cgroup roots; a root that holds no process and is
// older than any run (staleCgroup) was left by a run that was killed before its Stop.
const (
	cgroupRootPrefix = "kvhandoff-realnode-"
	staleCgroup      = 2 * time.Hour
)

// hierarchies are the mounted cgroup hierarchies: /sys/fs/cgroup itself where it is
// cgroup v2 alone, else each controller's (and the v2 one a hybrid machine has beside).
func hierarchies() []string {
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.procs"); err == nil {
		return []string{"/sys/fs/cgroup"}
	}
	procs, _ := filepath.Glob("/sys/fs/cgroup/*/cgroup.procs")
	dirs := make([]string, len(procs))
	for i, p := range procs {
		dirs[i] = filepath.Dir(p)
	}
	return dirs
}

// makeCgroupRoot makes the cgroup name in every hierarchy, as the kubelet wants its root
// to exist. cpuset's cpus and mems start empty in cgroup v1 and are copied from the
// parent, or no process could join it.
func makeCgroupRoot(name string) error {
	for _, h := range hierarchies() {
		root := filepath.Join(h, name)
		if err := os.Mkdir(root, 0o755); err != nil {
			return fmt.Errorf("realnode: making the kubelet's cgroup root: %w", err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if b, err := os.ReadFile(filepath.Join(h, f)); err == nil && len(b) > 0 {
				if err := os.WriteFile(filepath.Join(root, f), b, 0o644); err != nil {
					return fmt.Errorf("realnode: %s of the kubelet's cgroup root: %w", f, err)
				}
			}
		}
	}
	return nil
}

// removeStaleCgroups removes the cgroup roots that runs killed before their Stop left
// behind: those that hold no process in any hierarchy and are older than staleCgroup.
// Roots of runs in progress beside this one are left alone. A root has the same name in
// every hierarchy, so the first one lists them.
func removeStaleCgroups() {
	hs := hierarchies()
	if len(hs) == 0 {
		return
	}
	roots, _ := filepath.Glob(filepath.Join(hs[0], cgroupRootPrefix+"*"))
	for _, root := range roots {
		name := filepath.Base(root)
		if fi, err := os.Stat(root); err == nil && time.Since(fi.ModTime()) > staleCgroup && !holdsProcesses(hs, name) {
			_ = removeCgroups(name)
		}
	}
}

// holdsProcesses says whether any cgroup in the trees named name has a process.
func holdsProcesses(hierarchies []string, name string) bool {
	found := false
	for _, h := range hierarchies {
		_ = filepath.WalkDir(filepath.Join(h, name), func(path string, d os.DirEntry, err error) error {
			if err == nil && d.Name() == "cgroup.procs" {
				if b, _ := os.ReadFile(path); len(strings.TrimSpace(string(b))) > 0 {
					found = true
					return filepath.SkipAll
				}
			}
			return nil
		})
	}
	return found
}

// removeCgroups kills every process in the cgroup name of every hierarchy (container
// processes outlive containerd's shims) and removes the cgroups, deepest first.
func removeCgroups(name string) error {
	var errs []error
	for _, h := range hierarchies() {
		root := filepath.Join(h, name)
		var dirs []string
		_ = filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, path)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			for attempt := 0; ; attempt++ {
				procs, _ := os.ReadFile(filepath.Join(dirs[i], "cgroup.procs"))
				for _, pid := range strings.Fields(string(procs)) {
					var p int
					fmt.Sscan(pid, &p)
					_ = syscall.Kill(p, syscall.SIGKILL)
				}
				err := syscall.Rmdir(dirs[i])
				if err == nil || errors.Is(err, syscall.ENOENT) {
					break
				}
				if attempt == 100 {
					errs = append(errs, fmt.Errorf("removing cgroup %s: %w", dirs[i], err))
					break
				}
				time.Sleep(20 * time.Millisecond) // killed processes leave their cgroup as they exit
			}
		}
	}
	return errors.Join(errs...)
}
