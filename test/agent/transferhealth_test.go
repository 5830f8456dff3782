package agent_test

import (
	"context"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/controller"
	"github.com/kvhandoff/kvhandoff/internal/render"
	"github.com/kvhandoff/kvhandoff/internal/router"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/test/builder"
	"github.com/kvhandoff/kvhandoff/test/prometheus"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// healthFlags make the agents' health report look back 8 s and be computed every 250 ms,
// so that a fault shows, and clears, in seconds.
var healthFlags = []string{"--health-window", "8s", "--health-interval", "250ms"}

// Faults injected into real agents, seen the way an operator sees them: the manager (in
// this process, against a real API server) turns the agents' reports on their nodes into
// the pools' TransferHealthy condition, Degraded and Ready, with one Warning event; the
// agents' counters grow; a real Prometheus, scraping the agents and the manager with the
// chart's alert rules (windows shortened), fires the alert; and all of it clears once
// the fault is gone. The faults: an agent that cannot open its provider, an agent on
// another provider than the policy's, a prefill engine killed mid-push, decode
// registrations whose leases run out, and a router serving on decode alone for want of
// a prefill engine. The router runs here too, and Prometheus scrapes it.
func TestTransferFaultsReachTheConditionEventsMetricsAndAlerts(t *testing.T) {
	k := newCluster(t)
	k.node("node-a")
	k.node("node-b")
	managerMetrics := k.startManager()
	httpA, httpB := freeAddr(t), freeAddr(t)

	pol := builder.Policy("tcp").Mode(kvv1.TransferPush).Executor(kvv1.ExecutorAgent).Provider(kvv1.ProviderTCP).Obj()
	prefill := builder.PrefillPool("p").Image("vllm/vllm-openai:v0.32.0").TP(1).InstanceType("").Accelerator(kvv1.AcceleratorCPU, 0).Policy("tcp").Obj()
	decode := builder.DecodePool("d", "p").Image("vllm/vllm-openai:v0.32.0").TP(1).InstanceType("").Accelerator(kvv1.AcceleratorCPU, 0).Policy("tcp").Obj()
	for _, o := range []client.Object{pol, prefill, decode} {
		o.SetNamespace("default")
		if err := k.env.Client.Create(bg, o); err != nil {
			t.Fatal(err)
		}
	}
	prefillPod, decodePod := k.enginePod("p", "node-a"), k.enginePod("d", "node-b")

	// Fault 1: node-a's agent is asked for EFA, which this machine lacks.
	a := k.agent("a", "node-a", append([]string{"--provider", "efa", "--http", httpA}, healthFlags...)...)
	b := k.agent("b", "node-b", append([]string{"--http", httpB}, healthFlags...)...)
	routerAddr, routerAdmin := k.startRouter("d", "d-router-6b7f9-x2x1")
	prom := prometheus.Start(t, prometheus.Rules(t, "4s", "1s"),
		prometheus.Target{Address: httpA, Labels: map[string]string{"namespace": "kvhandoff-node", "pod": "agent-a"}},
		prometheus.Target{Address: httpB, Labels: map[string]string{"namespace": "kvhandoff-node", "pod": "agent-b"}},
		prometheus.Target{Address: routerAdmin, Labels: map[string]string{"namespace": "default", "pod": "d-router-6b7f9-x2x1"}},
		prometheus.Target{Address: managerMetrics, HonorLabels: true})

	k.expectTransfer("p", kvv1.ReasonAgentNotReady, `libfabric provider "efa" unavailable`)
	k.expectTransfer("d", kvv1.ReasonTransfersHealthy, "1 transfer agent(s) and 1 router(s)")
	firing(t, prom, "KvhandoffAgentNotReady", map[string]string{"pool": "p", "reason": kvv1.ReasonAgentNotReady})
	// The fault is removed: the agent restarts on the provider this machine has.
	a.Stop()
	a = k.agent("a", "node-a", append([]string{"--http", httpA}, healthFlags...)...)
	k.expectTransfer("p", kvv1.ReasonTransfersHealthy, "1 transfer agent(s)")
	resolved(t, prom, "KvhandoffAgentNotReady")
	k.expectOneWarning("p", kvv1.ReasonAgentNotReady)

	// Fault 2: node-b's agent runs libfabric's sockets provider, not the policy's tcp.
	b.Stop()
	b = k.agent("b", "node-b", append([]string{"--provider", "sockets", "--http", httpB}, healthFlags...)...)
	k.expectTransfer("d", kvv1.ReasonProviderFallback, "the policy asks for provider tcp, and the agents of node(s) node-b opened sockets")
	firing(t, prom, "KvhandoffProviderFallback", map[string]string{"pool": "d", "reason": kvv1.ReasonProviderFallback})
	b.Stop()
	b = k.agent("b", "node-b", append([]string{"--http", httpB}, healthFlags...)...)
	k.expectTransfer("d", kvv1.ReasonTransfersHealthy, "1 transfer agent(s)")
	resolved(t, prom, "KvhandoffProviderFallback")
	k.expectOneWarning("d", kvv1.ReasonProviderFallback)

	// Fault 3: the prefill engine dies while decode's registrations wait for its KV.
	layout := testLayout(1, 64)
	k.standIn(systemdCgroup(prefillPod))
	p := engine(t, a, "p-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PUSH, 0, layout)
	k.standIn(systemdCgroup(decodePod))
	d := engine(t, b, "d-0.default", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH, 0, layout)
	k.expectSessions("p", "d")
	for i := range 4 {
		if err := d.RegisterDestination(bg, fmt.Sprintf("orphaned-%d", i), 1, alloc(t, d, 4), p.Self); err != nil {
			t.Fatal(err)
		}
	}
	// A fifth request goes through: the peer connection delivers registrations in order,
	// so once it is delivered, prefill's agent holds the four before it.
	src := alloc(t, p, 4)
	p.Cache.Fill("probe", src)
	if err := d.RegisterDestination(bg, "probe", 1, alloc(t, d, 4), p.Self); err != nil {
		t.Fatal(err)
	}
	if err := p.SourceReady(bg, "probe", 0, src, true); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, d, "probe", 1), agentv1.Event_DELIVERED)
	p.Stop()
	for i := range 4 {
		expect(t, wait(t, d, fmt.Sprintf("orphaned-%d", i), 1), agentv1.Event_FAILED)
	}
	if n := a.Metric(t, `kvhandoff_agent_failures_total{reason="session_closed"}`); n != 4 {
		t.Errorf("prefill's agent counted %v session_closed failures, want 4", n)
	}
	k.expectTransfer("p", kvv1.ReasonTransferFailures, "node(s) node-a: more than 5% of transfers failed in the last 8s (reasons: session_closed)")
	firing(t, prom, "KvhandoffTransferFailures", map[string]string{"pod": "agent-a", "reason": "session_closed"})
	// The dashboard's queries run on these series: every one is valid, and the failures
	// panel shows this one's reason.
	for panel, expr := range prometheus.DashboardQueries(t, "4s") {
		series, err := prom.Query(expr)
		if err != nil {
			t.Errorf("dashboard panel %q: %v", panel, err)
		}
		if strings.Contains(expr, "kvhandoff_agent_failures_total") && !slices.ContainsFunc(series, func(l map[string]string) bool {
			return l["reason"] == "session_closed"
		}) {
			t.Errorf("dashboard panel %q shows no session_closed failures: %v", panel, series)
		}
	}
	firing(t, prom, "KvhandoffTransferUnhealthy", map[string]string{"pool": "p", "reason": kvv1.ReasonTransferFailures})
	k.expectTransfer("p", kvv1.ReasonTransfersHealthy, "") // the window passes with no new failure
	resolved(t, prom, "KvhandoffTransferUnhealthy")
	k.expectOneWarning("p", kvv1.ReasonTransferFailures)

	// Fault 4: decode registers and stops heartbeating, with half-second leases.
	d.Stop()
	b.Stop()
	a.Stop()
	short := append([]string{"--lease", "500ms"}, healthFlags...)
	a = k.agent("a", "node-a", append([]string{"--http", httpA}, short...)...)
	b = k.agent("b", "node-b", append([]string{"--http", httpB}, short...)...)
	k.standIn(systemdCgroup(prefillPod))
	p = engine(t, a, "p-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PUSH, 0, layout)
	k.standIn(systemdCgroup(decodePod))
	d = engine(t, b, "d-0.default", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH, 0, layout)
	for i := range 3 {
		req := fmt.Sprintf("silent-%d", i)
		if err := d.RegisterDestination(bg, req, 1, alloc(t, d, 4), p.Self); err != nil {
			t.Fatal(err)
		}
		expect(t, wait(t, d, req, 1), agentv1.Event_FAILED)
	}
	if n := a.Metric(t, `kvhandoff_agent_lease_expiries_total{kind="push"}`); n != 3 {
		t.Errorf("prefill's agent counted %v push lease expiries, want 3", n)
	}
	k.expectTransfer("p", kvv1.ReasonLeasesExpiring, "3 or more leases expired in the last 8s (kinds: push)")
	firing(t, prom, "KvhandoffLeaseExpiries", map[string]string{"pod": "agent-a", "kind": "push"})
	k.expectTransfer("p", kvv1.ReasonTransfersHealthy, "")
	resolved(t, prom, "KvhandoffLeaseExpiries")
	k.expectOneWarning("p", kvv1.ReasonLeasesExpiring)

	// Fault 5: the PrefillPool has no ready engine, and the policy serves on decode alone:
	// every client gets its answer, each fallback is counted, and past the policy's 5% the
	// DecodePool says so.
	for range 4 {
		resp, err := http.Post("http://"+routerAddr+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"tiny","prompt":"one two three","max_tokens":3}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Kvhandoff-Fallback") != "no_prefill_engine" {
			t.Fatalf("a request with no prefill engine: %s, fallback %q", resp.Status, resp.Header.Get("X-Kvhandoff-Fallback"))
		}
	}
	k.expectTransfer("d", kvv1.ReasonHandoffFailures, "router pod(s) d-router-6b7f9-x2x1: more than 5% of requests failed before decode or "+
		"were served on decode alone in the last 8s (no_prefill_engine)")
	firing(t, prom, "KvhandoffServingOnDecode", map[string]string{"pod": "d-router-6b7f9-x2x1", "reason": "no_prefill_engine"})
	firing(t, prom, "KvhandoffTransferUnhealthy", map[string]string{"pool": "d", "reason": kvv1.ReasonHandoffFailures})
	k.expectTransfer("d", kvv1.ReasonTransfersHealthy, "")
	resolved(t, prom, "KvhandoffServingOnDecode")
	k.expectOneWarning("d", kvv1.ReasonHandoffFailures)
}

// startRouter runs a real router for DecodePool pool in this process, as router pod name
// of a ReplicaSet of the router Deployment the manager made (which the test creates, as
// the Deployment controller would: the manager believes only pods of its own Deployment),
// with ServeOnDecode and no prefill engine: every request it gets is served by a
// simulated decode engine alone. It returns the router's client and admin addresses.
func (k *cluster) startRouter(pool, name string) (addr, admin string) {
	t := k.t
	d := httptest.NewServer(vllmserver.New(vllmserver.Config{EngineID: "d-0.default", Model: "tiny", SideChannelHost: "127.0.0.1",
		SideChannelPort: 5600, TP: 1, KV: vllmserver.NewLocalKV()}))
	t.Cleanup(d.Close)
	cfg := router.Defaults()
	cfg.ScrapeInterval, cfg.HealthWindow, cfg.HealthInterval = 0, 8*time.Second, 250*time.Millisecond
	r := router.New(cfg)
	srv, adm := httptest.NewServer(r), httptest.NewServer(r.Admin())
	t.Cleanup(srv.Close)
	t.Cleanup(adm.Close)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	set := &discovery.Set{Mode: kvv1.TransferPull, HandoffFailurePolicy: kvv1.HandoffFailureServeOnDecode,
		Decode: []discovery.Engine{{URL: d.URL, EngineID: "d-0.default", Host: "127.0.0.1", SideChannelPort: 5600, TensorParallelSize: 1}}}
	go func() { defer close(done); _ = r.Run(ctx, discovery.Static{Set: set}) }()

	dep := &appsv1.Deployment{}
	deadline := time.Now().Add(30 * time.Second)
	for k.env.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: render.RouterName(pool)}, dep) != nil {
		if time.Now().After(deadline) {
			t.Fatalf("the manager made no router Deployment for %s within 30s", pool)
		}
		time.Sleep(50 * time.Millisecond) // polling the API server for the manager's Deployment
	}
	rs := &appsv1.ReplicaSet{
		ObjectMeta: metav1.ObjectMeta{Name: name[:strings.LastIndexByte(name, '-')], Namespace: "default",
			// As the Deployment controller labels them: the pod template's labels.
			Labels: maps.Clone(dep.Spec.Template.Labels), OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(dep, appsv1.SchemeGroupVersion.WithKind("Deployment"))}},
		Spec: appsv1.ReplicaSetSpec{Selector: dep.Spec.Selector, Template: dep.Spec.Template},
	}
	if err := k.env.Client.Create(bg, rs); err != nil {
		t.Fatal(err)
	}
	addr, admin = strings.TrimPrefix(srv.URL, "http://"), strings.TrimPrefix(adm.URL, "http://")
	port := func(a string) int32 { _, p, _ := net.SplitHostPort(a); n, _ := strconv.Atoi(p); return int32(n) }
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Labels: map[string]string{kvv1.LabelRouter: pool, kvv1.LabelPool: pool},
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(rs, appsv1.SchemeGroupVersion.WithKind("ReplicaSet"))}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "router", Image: "router",
			Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: port(addr)}, {Name: "admin", ContainerPort: port(admin)}}}}},
	}
	if err := k.env.Client.Create(bg, pod); err != nil {
		t.Fatal(err)
	}
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "127.0.0.1"}
	if err := k.env.Client.Status().Update(bg, pod); err != nil {
		t.Fatal(err)
	}
	return addr, admin
}

// startManager runs the manager against the cluster's API server, and serves its metrics
// (controller-runtime's registry, where the pool metrics are) for Prometheus.
func (k *cluster) startManager() string {
	t := k.t
	mgr, err := ctrl.NewManager(k.env.Config, ctrl.Options{
		Scheme: k.env.Scheme, Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0",
		Cache: controller.CacheOptions(),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := controller.Setup(mgr, controller.Options{RouterHealthInterval: 250 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("manager: %v", err)
		}
	})
	srv := httptest.NewServer(promhttp.HandlerFor(ctrlmetrics.Registry, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// enginePod plays the StatefulSet controller and the kubelet: pool's engine 0 runs on
// node (hostIP loopback, where the agents are), and its UID is returned.
func (k *cluster) enginePod(pool, node string) string {
	t := k.t
	sts := &appsv1.StatefulSet{}
	deadline := time.Now().Add(30 * time.Second)
	for k.env.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: pool}, sts) != nil {
		if time.Now().After(deadline) {
			st, _ := k.pool(pool)
			t.Fatalf("the manager created no StatefulSet %s; pool status %+v", pool, st)
		}
		time.Sleep(50 * time.Millisecond) // polling the API server for the manager's work
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: pool + "-0", Namespace: "default", Labels: sts.Spec.Template.Labels,
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(sts, appsv1.SchemeGroupVersion.WithKind("StatefulSet"))}},
		Spec: *sts.Spec.Template.Spec.DeepCopy(),
	}
	pod.Spec.NodeName = node
	if err := k.env.Client.Create(bg, pod); err != nil {
		t.Fatal(err)
	}
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "127.0.0.1", HostIP: "127.0.0.1"}
	if err := k.env.Client.Status().Update(bg, pod); err != nil {
		t.Fatal(err)
	}
	return string(pod.UID)
}

// pool reads a PrefillPool or DecodePool (by its name here: p or d).
func (k *cluster) pool(name string) (kvv1.PoolStatus, client.Object) {
	var o interface {
		client.Object
	}
	var st *kvv1.PoolStatus
	if name == "p" {
		p := &kvv1.PrefillPool{}
		o, st = p, &p.Status
	} else {
		d := &kvv1.DecodePool{}
		o, st = d, &d.Status
	}
	if err := k.env.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: name}, o); err != nil {
		k.t.Fatal(err)
	}
	return *st, o
}

// expectTransfer waits up to 30 s (the bound) for the pool's TransferHealthy
// reason and a message containing says; an unhealthy one must make the pool Degraded and
// not Ready, for the same reason.
func (k *cluster) expectTransfer(pool, reason, says string) {
	k.t.Helper()
	start := time.Now()
	var last string
	deadline := start.Add(30 * time.Second)
	for {
		st, _ := k.pool(pool)
		c := meta.FindStatusCondition(st.Conditions, kvv1.ConditionTransferHealthy)
		if c != nil && c.Reason == reason && strings.Contains(c.Message, says) {
			ready, degraded := meta.FindStatusCondition(st.Conditions, kvv1.ConditionReady), meta.FindStatusCondition(st.Conditions, kvv1.ConditionDegraded)
			if reason != kvv1.ReasonTransfersHealthy && (ready.Reason != reason || ready.Status != metav1.ConditionFalse ||
				degraded.Reason != reason || degraded.Status != metav1.ConditionTrue) {
				k.t.Fatalf("pool %s: TransferHealthy=False (%s) but Ready=%s (%s), Degraded=%s (%s)", pool, reason, ready.Status, ready.Reason,
					degraded.Status, degraded.Reason)
			}
			k.t.Logf("pool %s: TransferHealthy %s after %v: %s", pool, reason, time.Since(start).Round(100*time.Millisecond), c.Message)
			return
		}
		if c != nil {
			last = c.Reason + ": " + c.Message
		}
		if time.Now().After(deadline) {
			k.t.Fatalf("pool %s: no TransferHealthy %s saying %q within 30s; last %q", pool, reason, says, last)
		}
		time.Sleep(100 * time.Millisecond) // polling the API server, as kubectl get -w would
	}
}

// expectSessions waits until each pool's engine entries say their agent has its session,
// and which fabric it uses.
func (k *cluster) expectSessions(pools ...string) {
	k.t.Helper()
	for _, pool := range pools {
		until(k.t, "pool "+pool+"'s engines report their agent session", func() bool {
			st, _ := k.pool(pool)
			return len(st.Engines) == 1 && st.Engines[0].AgentSession && st.Engines[0].Fabric == provider()
		})
	}
}

// expectOneWarning checks that the pool got exactly one Warning event of reason.
func (k *cluster) expectOneWarning(pool, reason string) {
	k.t.Helper()
	_, o := k.pool(pool)
	events, err := k.c.EventsV1().Events("default").List(bg, metav1.ListOptions{})
	if err != nil {
		k.t.Fatal(err)
	}
	n := 0
	for _, e := range events.Items {
		if e.Regarding.UID == o.GetUID() && e.Reason == reason && e.Type == corev1.EventTypeWarning {
			n++
			if e.Series != nil {
				n += int(e.Series.Count) - 1
			}
		}
	}
	if n != 1 {
		k.t.Errorf("pool %s: %d Warning events %s, want 1", pool, n, reason)
	}
}

func firing(t *testing.T, prom *prometheus.Server, alert string, labels map[string]string) {
	t.Helper()
	start := time.Now()
	until(t, fmt.Sprintf("alert %s%v fires", alert, labels), func() bool {
		a, err := prom.Firing(alert, labels)
		return err == nil && len(a) > 0
	})
	t.Logf("alert %s firing after %v", alert, time.Since(start).Round(100*time.Millisecond))
}

func resolved(t *testing.T, prom *prometheus.Server, alert string) {
	t.Helper()
	until(t, "alert "+alert+" resolves", func() bool {
		a, err := prom.Firing(alert, nil)
		return err == nil && len(a) == 0
	})
}

func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}
