package agent_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	ctrlenvtest "sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/kvhandoff/kvhandoff/internal/controller"
	"github.com/kvhandoff/kvhandoff/test/envtest"
	"github.com/kvhandoff/kvhandoff/test/gobin"
	"github.com/kvhandoff/kvhandoff/test/loopback"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/client"
)

// The hostile engine runs as this user, in the agent's socket group, as a non-root
// engine of another pool would.
const (
	strangerUID = 1001
	socketGID   = 7470
)

// hostile is an engineprobe (test/engineprobe) built for one test, in a folder any user
// may read.
type hostile struct {
	t   *testing.T
	bin string
}

func buildProbe(t *testing.T) hostile {
	t.Helper()
	dir, err := os.MkdirTemp("", "engineprobe")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	bin, err := gobin.BuildPackage(dir, "test/engineprobe")
	if err != nil {
		t.Fatal(err)
	}
	return hostile{t, bin}
}

// run runs the probe as the stranger and returns its answer; the probe keeps what it
// holds until release is called (or the test ends).
func (h hostile) run(socket string, args ...string) (answer string, release func()) {
	h.t.Helper()
	cmd := exec.Command(h.bin, append([]string{"--socket", socket}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: strangerUID, Gid: socketGID}}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		h.t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		h.t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		h.t.Fatal(err)
	}
	release = func() { stdin.Close(); _ = cmd.Wait() }
	h.t.Cleanup(release)
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		release()
		h.t.Fatalf("engineprobe %v: %v (stderr: %s)", args, err, stderr.String())
	}
	go func() { _, _ = io.Copy(io.Discard, stdout) }()
	return strings.TrimSpace(line), release
}

// socketFolder is a folder for an agent's sockets that the stranger can reach through
// the socket group (t.TempDir's parents are closed to other users).
func socketFolder(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "agent-sockets")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func wantAnswer(t *testing.T, what, got, prefix, saying string) {
	t.Helper()
	if !strings.HasPrefix(got, prefix) || !strings.Contains(got, saying) {
		t.Errorf("%s: the agent answered %q, want %s saying %q", what, got, prefix, saying)
	}
}

// A session belongs to whoever registered it: another user of the socket group, even
// one that learned the session id, can neither act for it, nor pass memory into it, nor
// take its engine rank over. Each owner gets its own share of calls and memory socket
// connections: a stranger holding every call and connection it can (the flood that took
// the agent's RSS from 0.88 to 1.61 GB, the 64 memory connections that reset a
// legitimate PassMemory for 25 s) leaves the victim's untouched.
func TestAnotherUserCannotActForAnEngineNorCrowdItOut(t *testing.T) {
	a := startAgent(t, "owners", socketFolder(t), "--socket-gid", fmt.Sprint(socketGID))
	probe := buildProbe(t)
	cl, err := client.Dial(a.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	victim, err := cl.RegisterEngine(bg, decodeEngine("victim"))
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close()

	got, _ := probe.run(a.Socket, "heartbeat", victim.Session)
	wantAnswer(t, "a heartbeat for the victim's session", got, "PermissionDenied", "belongs to uid 0")
	got, _ = probe.run(a.Socket, "deposit", victim.Session)
	wantAnswer(t, "memory passed into the victim's session", got, "Error", "belongs to uid 0")
	got, _ = probe.run(a.Socket, "register", "victim", victim.Session)
	wantAnswer(t, "the victim's rank, taken over with its session id", got, "PermissionDenied", "is held by uid 0")
	if _, err := cl.API.Heartbeat(bg, &agentv1.HeartbeatRequest{Session: victim.Session}); err != nil {
		t.Fatalf("the victim's own heartbeat: %v", err)
	}

	got, releaseCalls := probe.run(a.Socket, "hold-calls", "40")
	wantAnswer(t, "a call beyond the stranger's share", got, "ResourceExhausted", "uid 1001 has 32 calls in flight")
	if _, err := cl.API.Heartbeat(bg, &agentv1.HeartbeatRequest{Session: victim.Session}); err != nil {
		t.Errorf("the victim's heartbeat while the stranger holds its calls: %v", err)
	}
	releaseCalls()

	got, releaseMemory := probe.run(a.Socket, "hold-memory", "300")
	wantAnswer(t, "memory socket connections", got, "OK", "held 16 of 300")
	fd, _, err := client.NewMemory("victim", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fd)
	if _, err := client.PassMemory(agentv1.MemorySocket(a.Socket), victim.Session, fd); err != nil {
		t.Errorf("the victim's PassMemory while the stranger holds connections: %v", err)
	}
	releaseMemory()
	if n := a.Metric(t, `kvhandoff_agent_refused_total{call="memory",code="ResourceExhausted"}`); n < 300-16 {
		t.Errorf("refused memory connections counted: %v, want at least %d", n, 300-16)
	}
}

// The attack: one owner, on one connection, registered 100 of 100 sessions (the agent's
// limit is 256). An owner holds at most 16, one per engine rank twice over, and the
// refusal says why; another owner still registers.
func TestOneOwnerHoldsAtMostItsShareOfSessions(t *testing.T) {
	a := startAgent(t, "owners", socketFolder(t), "--socket-gid", fmt.Sprint(socketGID))
	got, release := buildProbe(t).run(a.Socket, "hold-sessions", "100")
	defer release()
	wantAnswer(t, "a stranger registering 100 sessions", got, "OK", "held 16 of 100; the last refusal: uid 1001 holds 16 engine sessions, its limit")
	if n := a.Metric(t, "kvhandoff_agent_engine_sessions"); n != 16 {
		t.Errorf("%v sessions; want the stranger's 16", n)
	}
	cl, err := client.Dial(a.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	e, err := cl.RegisterEngine(bg, decodeEngine("victim"))
	if err != nil {
		t.Fatalf("another owner's registration while the stranger holds its share: %v", err)
	}
	e.Close()
}

func decodeEngine(id string) *agentv1.RegisterEngineRequest {
	return &agentv1.RegisterEngineRequest{EngineId: id, Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PUSH, TpSize: 1,
		Layout: &agentv1.KVLayout{Layers: 1, BlockSize: 16, KvHeads: 8, HeadDim: 16, DtypeBytes: 2}}
}

// cluster is a real API server with the agent's RBAC (config/agent/rbac.yaml), and a
// /proc for the agents that this test process writes, so that it can stand in for a
// process of any pod: the agent reads a caller's pod when it connects.
type cluster struct {
	t          *testing.T
	env        *envtest.Env
	c          kubernetes.Interface
	kubeconfig string
	procRoot   string
}

func newCluster(t *testing.T) *cluster {
	t.Helper()
	env, err := envtest.Start(controller.NewScheme())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	k := &cluster{t: t, env: env, c: kubernetes.NewForConfigOrDie(env.Config), procRoot: t.TempDir()}
	k.kubeconfig = agentUser(t, env, k.c)
	if err := os.Mkdir(filepath.Join(k.procRoot, fmt.Sprint(os.Getpid())), 0o755); err != nil {
		t.Fatal(err)
	}
	return k
}

func (k *cluster) node(name string) {
	k.t.Helper()
	if _, err := k.c.CoreV1().Nodes().Create(bg, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		k.t.Fatal(err)
	}
}

// pod creates pod name of namespace default on node and returns its UID.
func (k *cluster) pod(name, node string) string {
	k.t.Helper()
	p, err := k.c.CoreV1().Pods("default").Create(bg, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "engine", Image: "vllm"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		k.t.Fatal(err)
	}
	return string(p.UID)
}

// standIn places this process in cgroup until the next call: connections it opens from
// then on are a process of that cgroup's pod to the agents.
func (k *cluster) standIn(cgroup string) {
	k.t.Helper()
	if err := os.WriteFile(filepath.Join(k.procRoot, fmt.Sprint(os.Getpid()), "cgroup"), []byte(cgroup), 0o644); err != nil {
		k.t.Fatal(err)
	}
}

// As the kubelet's two cgroup drivers name a pod's container.
func systemdCgroup(uid string) string {
	return "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + strings.ReplaceAll(uid, "-", "_") + ".slice/cri-containerd-1f2e.scope\n"
}
func cgroupfsCgroup(uid string) string { return "0::/kubepods/besteffort/pod" + uid + "/1f2e\n" }

// agent starts the agent of node, in the cluster.
func (k *cluster) agent(name, node string, flags ...string) *agentProc {
	k.t.Helper()
	return startAgent(k.t, name, k.t.TempDir(), append([]string{"--node-name", node, "--kubeconfig", k.kubeconfig, "--proc-root", k.procRoot}, flags...)...)
}

// In a cluster, an engine_id is its pod's name.namespace, and only a process in that pod
// may register it: a process of another pod on the node cannot take it, not even while
// the real engine restarts and holds no session.
func TestOnlyThePodAnEngineIDNamesMayRegisterIt(t *testing.T) {
	k := newCluster(t)
	k.node("p5en-a")
	engine, intruder := k.pod("decode-0", "p5en-a"), k.pod("intruder", "p5en-a")
	a := k.agent("pods", "p5en-a")
	register := func(cgroup, id string) error {
		t.Helper()
		k.standIn(cgroup)
		cl, err := client.Dial(a.Socket)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cl.Close() })
		e, err := cl.RegisterEngine(bg, decodeEngine(id))
		if err == nil {
			t.Cleanup(e.Close)
		}
		return err
	}

	err := register(systemdCgroup(intruder), "decode-0.default")
	wantErr(t, "the intruder pod registering decode-0's engine_id", err, "PermissionDenied", "names pod default/decode-0, and the caller")
	err = register("0::/user.slice/user-0.slice/session-1.scope\n", "decode-0.default")
	wantErr(t, "a process outside pods", err, "PermissionDenied", "runs in no pod")
	err = register(cgroupfsCgroup(engine), "nosuchpod.default")
	wantErr(t, "an engine_id naming no pod", err, "PermissionDenied", "looking up pod default/nosuchpod")
	if err := register(systemdCgroup(intruder), "intruder.default"); err != nil {
		t.Errorf("the intruder registering its own engine_id: %v", err)
	}
	if err := register(cgroupfsCgroup(engine), "decode-0.default"); err != nil {
		t.Errorf("decode-0 registering its own engine_id: %v", err)
	}
}

// In a cluster, an agent dials only the peer addresses ready agents publish on their
// nodes. Two agents find each other and move KV; a request naming any other address, an
// open port (the API server's) or a closed one, fails at once with the same reason and
// nothing is dialled, so an engine can use its agent neither as a relay nor to scan the
// node network (before: a refused port failed at once, an open one hung).
func TestAgentsDialOnlyTheAddressesReadyAgentsPublish(t *testing.T) {
	k := newCluster(t)
	k.node("node-a")
	k.node("node-b")
	prefillPod, decodePod := k.pod("prefill-0", "node-a"), k.pod("decode-0", "node-b")
	a, b := k.agent("a", "node-a"), k.agent("b", "node-b")
	layout := testLayout(1, 64)
	k.standIn(systemdCgroup(prefillPod))
	p := engine(t, a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PUSH, 0, layout)
	k.standIn(systemdCgroup(decodePod))
	d := engine(t, b, "decode-0.default", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH, 0, layout)

	src, dst := alloc(t, p, 8), alloc(t, d, 8)
	p.Cache.Fill("published", src)
	if err := d.RegisterDestination(bg, "published", 1, dst, p.Self); err != nil {
		t.Fatal(err)
	}
	if err := p.SourceReady(bg, "published", 0, src, true); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, d, "published", 1), agentv1.Event_DELIVERED)
	if err := d.Cache.Verify("published", dst); err != nil {
		t.Fatal(err)
	}

	closed := loopback.Refusing(t)
	open, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close()
	accepted := make(chan struct{}, 1)
	go func() {
		if c, err := open.Accept(); err == nil {
			accepted <- struct{}{}
			c.Close()
		}
	}()
	for req, addr := range map[string]string{"open-port": open.Addr().String(), "closed-port": closed} {
		dst := alloc(t, d, 4)
		if err := d.RegisterDestination(bg, req, 1, dst, &agentv1.EngineRef{Agent: addr, EngineId: "prefill-0.default"}); err != nil {
			t.Fatal(err)
		}
		ev := wait(t, d, req, 1)
		expect(t, ev, agentv1.Event_FAILED)
		if !strings.Contains(ev.Reason, "is not the address of a ready agent") {
			t.Errorf("%s: reason %q", req, ev.Reason)
		}
	}
	select {
	case <-accepted:
		t.Error("the agent connected to the open port")
	default:
	}
	if n := b.Metric(t, `kvhandoff_agent_refused_total{call="peer",code="PermissionDenied"}`); n != 2 {
		t.Errorf("refused dials counted: %v, want 2", n)
	}
}
func wantErr(t *testing.T, what string, err error, code, saying string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: let through", what)
		return
	}
	st := status.Convert(err)
	wantAnswer(t, what, st.Code().String()+" "+st.Message(), code, saying)
}

// agentUser is a user of the API server with exactly the agent's ClusterRole; it returns
// the path of its kubeconfig.
func agentUser(t *testing.T, env *envtest.Env, c kubernetes.Interface) string {
	t.Helper()
	objs, err := envtest.ReadObjects(filepath.Join(envtest.RepoRoot(), "config", "agent", "rbac.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	role := ""
	for _, u := range objs {
		if u.GetKind() == "ClusterRole" {
			if err := env.Client.Create(bg, u); err != nil {
				t.Fatal(err)
			}
			role = u.GetName()
		}
	}
	if _, err := c.RbacV1().ClusterRoleBindings().Create(bg, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "transfer-agent"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: "transfer-agent"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	user, err := env.AddUser(ctrlenvtest.User{Name: "transfer-agent"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := user.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, kubeconfig, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
