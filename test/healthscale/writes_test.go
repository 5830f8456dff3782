// Package healthscale measures what transfer-health reporting costs the API server at
// the scale of a large P/D fleet: 100 nodes, each with 8 engine ranks (4 prefill and 4
// decode engines of TP 1), a real API server and the real manager. The agents' side is
// their real publisher (package health) with the report each node's agent would make;
// the end-to-end path from a real agent is tested in test/agent.
package healthscale

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/controller"
	"github.com/kvhandoff/kvhandoff/internal/health"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/nodelabel"
	"github.com/kvhandoff/kvhandoff/test/builder"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

const (
	nodes          = 100
	enginesPerNode = 4 // of each role: 8 ranks per node
	every          = 500 * time.Millisecond
)

// writes counts the requests that changed something (a write the API server accepted;
// a refused one, such as a patch on a stale copy that conflicts, changes nothing), by who
// sent them, and keeps the latest few for a failure to name.
type writes struct {
	n      atomic.Int64
	at     atomic.Int64 // when the latest was sent, in Unix nanoseconds
	mu     sync.Mutex
	latest []string
}

func (w *writes) wrap(cfg *rest.Config) *rest.Config {
	cfg = rest.CopyConfig(cfg)
	cfg.QPS, cfg.Burst = 1000, 2000
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		return roundTripper(func(r *http.Request) (*http.Response, error) {
			resp, err := rt.RoundTrip(r)
			if r.Method != http.MethodGet && err == nil && resp.StatusCode < 300 {
				w.n.Add(1)
				w.at.Store(time.Now().UnixNano())
				w.mu.Lock()
				w.latest = append(w.latest, r.Method+" "+r.URL.Path)
				if len(w.latest) > 5 {
					w.latest = w.latest[1:]
				}
				w.mu.Unlock()
			}
			return resp, err
		})
	}
	return cfg
}

// quietFor reports whether nothing was written for d.
func (w *writes) quietFor(d time.Duration) bool {
	return time.Since(time.Unix(0, w.at.Load())) >= d
}

func (w *writes) last() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.latest...)
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// The agents write their node's report when it changes, and the manager its pools'
// status when their condition changes: engines registering and a fault on 10 nodes cost
// writes, a steady state — healthy or not — costs none.
func TestHealthReportsCostNoWritesInASteadyState(t *testing.T) {
	env, err := envtest.Start(controller.NewScheme())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var agentWrites, managerWrites writes
	mgr, err := ctrl.NewManager(managerWrites.wrap(env.Config), ctrl.Options{Scheme: env.Scheme, Metrics: metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0", Cache: controller.CacheOptions()})
	if err != nil {
		t.Fatal(err)
	}
	if err := controller.Setup(mgr, controller.Options{}); err != nil {
		t.Fatal(err)
	}
	go func() { _ = mgr.Start(ctx) }()

	c := env.Client
	pol := builder.Policy("tcp").Executor(kvv1.ExecutorAgent).Provider(kvv1.ProviderTCP).Obj()
	p := builder.PrefillPool("p").Image("vllm/vllm-openai:v0.32.0").TP(1).InstanceType("").Accelerator(kvv1.AcceleratorCPU, 0).
		Policy("tcp").Replicas(nodes * enginesPerNode).Obj()
	d := builder.DecodePool("d", "p").Image("vllm/vllm-openai:v0.32.0").TP(1).InstanceType("").Accelerator(kvv1.AcceleratorCPU, 0).
		Policy("tcp").Replicas(nodes * enginesPerNode).Obj()
	d.Spec.Router.Enabled = ptr.To(false)
	for _, o := range []client.Object{pol, p, d} {
		o.SetNamespace("default")
		if err := c.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	admin := kubernetes.NewForConfigOrDie(agentWrites.wrap(env.Config))
	engines := map[string][]string{} // by node
	for _, pool := range []string{"p", "d"} {
		sts := &appsv1.StatefulSet{}
		waitFor(t, "StatefulSet "+pool, func() bool { return c.Get(ctx, client.ObjectKey{Namespace: "default", Name: pool}, sts) == nil })
		for i := range nodes * enginesPerNode {
			node := fmt.Sprintf("node-%03d", i%nodes)
			pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%d", pool, i), Namespace: "default", Labels: sts.Spec.Template.Labels,
				OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(sts, appsv1.SchemeGroupVersion.WithKind("StatefulSet"))}},
				Spec: *sts.Spec.Template.Spec.DeepCopy()}
			pod.Spec.NodeName = node
			if err := c.Create(ctx, pod); err != nil {
				t.Fatal(err)
			}
			pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "198.18.1.1", HostIP: "198.18.0.1"}
			if err := c.Status().Update(ctx, pod); err != nil {
				t.Fatal(err)
			}
			engines[node] = append(engines[node], pod.Name+".default")
		}
	}

	// Every node's agent: ready, and publishing its report. Engines register one by one
	// in the first seconds; a node's report is what the test sets for it.
	var mu sync.Mutex
	reports := map[string]health.Report{}
	for i := range nodes {
		node := fmt.Sprintf("node-%03d", i)
		if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := nodelabel.Set(ctx, admin, node, true, "198.18.0.1:7470"); err != nil {
			t.Fatal(err)
		}
		reports[node] = health.Report{Provider: "tcp;ofi_rxm"}
		pub := &health.Publisher{Every: every, MinInterval: every, Log: slog.New(slog.DiscardHandler),
			Write: func(ctx context.Context, v string) error { return nodelabel.SetHealth(ctx, admin, node, v) }}
		go pub.Run(ctx, func(time.Time) health.Report {
			mu.Lock()
			defer mu.Unlock()
			return reports[node]
		})
	}
	set := func(f func(node string, r *health.Report)) {
		mu.Lock()
		defer mu.Unlock()
		for node, r := range reports {
			f(node, &r)
			reports[node] = r
		}
	}
	// A phase that reaches a state (until) waits for it; a steady phase first waits until
	// neither side has written for settle, since a change's last writes (the manager's
	// event after its status patch, a reconcile queued behind the change) land a little
	// after the state shows, later on a loaded machine; then it measures d.
	const settle = 4 * every
	phase := func(name string, d time.Duration, until func() bool) (agents, manager int64) {
		if until == nil {
			waitFor(t, name+" (settling)", func() bool { return agentWrites.quietFor(settle) && managerWrites.quietFor(settle) })
		}
		a0, m0 := agentWrites.n.Load(), managerWrites.n.Load()
		start := time.Now()
		if until != nil {
			waitFor(t, name, until)
		}
		time.Sleep(time.Until(start.Add(d))) // a measuring window, not synchronisation
		a, m := agentWrites.n.Load()-a0, managerWrites.n.Load()-m0
		t.Logf("%-52s %5.1fs  agent writes %4d  manager writes %4d", name, time.Since(start).Seconds(), a, m)
		return a, m
	}
	status := func(pool string) kvv1.PoolStatus {
		if pool == "p" {
			o := &kvv1.PrefillPool{}
			_ = c.Get(ctx, client.ObjectKey{Namespace: "default", Name: pool}, o)
			return o.Status
		}
		o := &kvv1.DecodePool{}
		_ = c.Get(ctx, client.ObjectKey{Namespace: "default", Name: pool}, o)
		return o.Status
	}
	transfer := func(pool string) string {
		if cnd := meta.FindStatusCondition(status(pool).Conditions, kvv1.ConditionTransferHealthy); cnd != nil {
			return cnd.Reason
		}
		return ""
	}
	sessions := func() bool {
		for _, pool := range []string{"p", "d"} {
			es := status(pool).Engines
			if len(es) != nodes*enginesPerNode {
				return false
			}
			for _, e := range es {
				if !e.AgentSession {
					return false
				}
			}
		}
		return true
	}

	phase("start: 100 agents ready, 800 engines, no session", 3*time.Second, nil)
	set(func(node string, r *health.Report) { r.Engines = engines[node] })
	phase("800 engine sessions register", 3*time.Second, sessions)
	a, m := phase("steady, healthy", 10*time.Second, nil)
	if a != 0 || m != 0 {
		t.Errorf("a healthy steady state cost %d agent and %d manager writes, want none; the latest: agents %v, manager %v", a, m, agentWrites.last(), managerWrites.last())
	}
	set(func(node string, r *health.Report) {
		if node < "node-010" {
			r.Problem, r.Message = kvv1.ReasonTransferFailures, "more than 5% of transfers failed in the last 1m0s (reasons: peer_lost)"
		}
	})
	phase("a fault on 10 nodes", 3*time.Second, func() bool {
		return transfer("p") == kvv1.ReasonTransferFailures && transfer("d") == kvv1.ReasonTransferFailures
	})
	a, m = phase("steady, unhealthy", 10*time.Second, nil)
	if a != 0 || m != 0 {
		t.Errorf("an unhealthy steady state cost %d agent and %d manager writes, want none; the latest: agents %v, manager %v", a, m, agentWrites.last(), managerWrites.last())
	}
	set(func(_ string, r *health.Report) { r.Problem, r.Message = "", "" })
	phase("the fault clears", 3*time.Second, func() bool {
		return transfer("p") == kvv1.ReasonTransfersHealthy && transfer("d") == kvv1.ReasonTransfersHealthy
	})
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond) // polling the API server
	}
}
