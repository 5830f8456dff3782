package discovery_test

import (
	"context"
	"os"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/test/builder"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

var env *envtest.Env

func TestMain(m *testing.M) {
	s := runtime.NewScheme()
	_ = clientgoscheme.AddToScheme(s)
	_ = kvv1.AddToScheme(s)
	var err error
	if env, err = envtest.Start(s); err != nil {
		panic(err)
	}
	code := m.Run()
	_ = env.Stop()
	os.Exit(code)
}

// The router's discovery against a real kube-apiserver: it follows the pools' status and
// the pods' readiness, and must react to churn within 2 s.
const churn = 2 * time.Second

func enginePod(ns, name, pool string, role kvv1.Role, ip string, isReady bool) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{
			kvv1.LabelPool: pool, kvv1.LabelRole: string(role), kvv1.LabelCompatHash: "h1"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "engine", Image: "vllm"}}},
	}
}

func setPodStatus(t *testing.T, c client.Client, pod *corev1.Pod, ip string, isReady bool) {
	t.Helper()
	st := corev1.ConditionFalse
	if isReady {
		st = corev1.ConditionTrue
	}
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}},
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}}
	if err := c.Status().Update(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
}

func status(pod, ns, ip string) kvv1.EngineStatus {
	return kvv1.EngineStatus{PodName: pod, EngineID: pod + "." + ns, Host: ip, SideChannelPort: 5600, TensorParallelSize: 8,
		PipelineParallelSize: 1, CompatHash: "h1", Ready: true}
}

func TestClusterFollowsThePoolsStatusAndPodReadiness(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := env.Client
	nsObj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "router-"}}
	if err := c.Create(ctx, nsObj); err != nil {
		t.Fatal(err)
	}
	ns := nsObj.Name
	p := builder.PrefillPool("p").Namespace(ns).Obj()
	d := builder.DecodePool("d", "p").Namespace(ns).Obj()
	for _, o := range []client.Object{builder.Policy("policy").Namespace(ns).Obj(), p, d} {
		if err := c.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	pods := map[string]*corev1.Pod{}
	for _, x := range []struct {
		name, pool, ip string
		role           kvv1.Role
	}{{"p-0", "p", "198.18.0.1", kvv1.RolePrefill}, {"d-0", "d", "198.18.0.2", kvv1.RoleDecode}, {"d-1", "d", "198.18.0.3", kvv1.RoleDecode}} {
		pod := enginePod(ns, x.name, x.pool, x.role, x.ip, true)
		if err := c.Create(ctx, pod); err != nil {
			t.Fatal(err)
		}
		setPodStatus(t, c, pod, x.ip, true)
		pods[x.name] = pod
	}
	// The manager's part: status names the engines.
	p.Status = kvv1.PoolStatus{Mode: kvv1.TransferPush, Engines: []kvv1.EngineStatus{status("p-0", ns, "198.18.0.1")}}
	if err := c.Status().Update(ctx, p); err != nil {
		t.Fatal(err)
	}
	d.Status = kvv1.PoolStatus{Mode: kvv1.TransferPush, HealthWindowSeconds: 20, Engines: []kvv1.EngineStatus{status("d-0", ns, "198.18.0.2")}}
	if err := c.Status().Update(ctx, d); err != nil {
		t.Fatal(err)
	}

	sets := make(chan *discovery.Set, 16)
	go func() {
		if err := (&discovery.Cluster{Config: env.Config, Namespace: ns, DecodePool: "d"}).Run(ctx, sets); err != nil {
			t.Error(err)
		}
	}()
	// next waits up to limit for a set that satisfies ok.
	next := func(what string, limit time.Duration, ok func(*discovery.Set) bool) *discovery.Set {
		t.Helper()
		deadline := time.After(limit)
		for {
			select {
			case s := <-sets:
				if ok(s) {
					return s
				}
			case <-deadline:
				t.Fatalf("no set within %s where %s", limit, what)
			}
		}
	}
	s := next("one engine each", 30*time.Second, func(s *discovery.Set) bool { return len(s.Prefill) == 1 && len(s.Decode) == 1 })
	if s.Mode != kvv1.TransferPush || s.Prefill[0].URL != "http://198.18.0.1:8000" || s.Prefill[0].EngineID != "p-0."+ns ||
		s.Prefill[0].SideChannelPort != 5600 || s.Prefill[0].TensorParallelSize != 8 || s.Prefill[0].CompatHash != "h1" || s.HealthWindowSeconds != 20 {
		t.Errorf("set %+v", s)
	}
	if err := s.Validate(); err != nil {
		t.Error(err)
	}

	// Status names a second decode engine: it joins.
	d.Status.Engines = append(d.Status.Engines, status("d-1", ns, "198.18.0.3"))
	if err := c.Status().Update(ctx, d); err != nil {
		t.Fatal(err)
	}
	next("d-1 joins", churn, func(s *discovery.Set) bool { return len(s.Decode) == 2 })

	// Executor Agent: the prefill engine's KV side channel is its node's agent, which a
	// push decode leg names as remote_host/remote_port.
	p.Status.Engines[0].Agent = "198.19.0.9:7470"
	if err := c.Status().Update(ctx, p); err != nil {
		t.Fatal(err)
	}
	next("the agent becomes p-0's side channel", churn, func(s *discovery.Set) bool {
		return len(s.Prefill) == 1 && s.Prefill[0].Host == "198.19.0.9" && s.Prefill[0].SideChannelPort == 7470
	})

	// The kubelet says d-0 is not ready: it leaves before the manager updates status.
	setPodStatus(t, c, pods["d-0"], "198.18.0.2", false)
	s = next("d-0 leaves", churn, func(s *discovery.Set) bool { return len(s.Decode) == 1 })
	if s.Decode[0].EngineID != "d-1."+ns {
		t.Errorf("left with %v", s.Decode)
	}

	// A pod being deleted leaves at once.
	if err := c.Delete(ctx, pods["p-0"]); err != nil {
		t.Fatal(err)
	}
	next("p-0 leaves", churn, func(s *discovery.Set) bool { return len(s.Prefill) == 0 })

	// The policy's mode changes.
	d.Status.Mode = kvv1.TransferPull
	if err := c.Status().Update(ctx, d); err != nil {
		t.Fatal(err)
	}
	next("the mode follows", churn, func(s *discovery.Set) bool { return s.Mode == kvv1.TransferPull })

	// So does the policy's handoffFailurePolicy.
	d.Status.HandoffFailurePolicy = kvv1.HandoffFailureServeOnDecode
	if err := c.Status().Update(ctx, d); err != nil {
		t.Fatal(err)
	}
	next("the handoff failure policy follows", churn, func(s *discovery.Set) bool { return s.HandoffFailurePolicy == kvv1.HandoffFailureServeOnDecode })

	// And its routing, with the pool's block size to cut prompts at.
	d.Status.Routing = &kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoicePrefixAware, OverlapWeight: 4, LoadWeight: 1, MinPrefillTokens: 128}
	if err := c.Status().Update(ctx, d); err != nil {
		t.Fatal(err)
	}
	next("the routing follows", churn, func(s *discovery.Set) bool {
		return s.Routing != nil && s.Routing.DecodeChoice == kvv1.DecodeChoicePrefixAware && s.Routing.MinPrefillTokens == 128 && s.BlockSize == 16
	})

	// A pod labelled with its kv-events sidecar's port names it; one without does not
	// (a rollout mixes both).
	pods["d-1"].Labels[kvv1.LabelKVEventsPort] = "8102"
	if err := c.Update(ctx, pods["d-1"]); err != nil {
		t.Fatal(err)
	}
	next("d-1's kv-events sidecar", churn, func(s *discovery.Set) bool {
		return len(s.Decode) == 1 && s.Decode[0].KVEventsURL == "http://198.18.0.3:8102"
	})
}
