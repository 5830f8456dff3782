package realnode_test

import (
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
	"github.com/kvhandoff/kvhandoff/test/realnode"
)

var (
	targetTTFT, targetITL, budget = realnode.TargetTTFT, realnode.TargetITL, realnode.Budget
	low, prompts, answers         = realnode.LowLoad, realnode.PrefillHeavy, realnode.DecodeHeavy
)

// TestThePairFollowsASteppedLoad runs a stepped load through the router of an autoscaled
// push pair on a real node: low, then prefill-heavy (prefill grows), then decode-heavy
// (prefill shrinks first, then decode grows into what it gave back), then low again
// (both back to their minimums). After each convergence the client-measured TTFT
// (prefill-heavy) and ITL (decode-heavy) meet their targets at p90; no request fails
// across any scale-down (every terminating engine drains first); the pods of both pools,
// counted every 100 ms with terminating ones, never exceed the budget.
func TestThePairFollowsASteppedLoad(t *testing.T) {
	n := createAutoscaledPair(t)
	load, err := n.StartLoad("push", low)
	if err != nil {
		t.Fatal(err)
	}
	defer load.Stop()

	converge(t, n, "low load at the minimums", func(p, d int32) bool { return p == 1 && d == 1 })

	load.Phase(prompts)
	// The manager's leader SIGKILLed as the autoscaler takes its first step up: a new
	// leader (the other replica, or the killed one restarted) takes the lease over and
	// finishes the step; no request fails and the budget holds across it (both asserted
	// below).
	until(t, "the autoscaler to decide to grow prefill", 2*time.Minute, func() bool {
		d := &kvv1.DecodePool{}
		return n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: "push-decode"}, d) == nil &&
			d.Status.Autoscaling != nil && d.Status.Autoscaling.DesiredPrefillReplicas >= 2
	})
	old, took := killLeader(t, n)
	t.Logf("the manager's leader %s SIGKILLed mid-step: a new leader in %s", old, took.Round(100*time.Millisecond))
	converge(t, n, "prefill to grow for prefill-heavy load", func(p, d int32) bool { return p >= 2 })
	if ttft, _ := load.Measure(10 * time.Second); ttft > targetTTFT {
		t.Errorf("prefill-heavy, converged: TTFT p90 %s over the target %s", ttft, targetTTFT)
	}

	load.Phase(answers)
	converge(t, n, "prefill to shrink and decode to grow for decode-heavy load", func(p, d int32) bool { return p == 1 && d >= 2 })
	if _, itl := load.Measure(10 * time.Second); itl > targetITL {
		t.Errorf("decode-heavy, converged: ITL p90 %s over the target %s", itl, targetITL)
	}

	load.Phase(low)
	converge(t, n, "both back to their minimums", func(p, d int32) bool { return p == 1 && d == 1 })
	load.Stop()

	failed, first, most := 0, "", 0
	results := load.Results()
	for _, r := range results {
		if r.Failed() {
			if failed++; first == "" {
				first = r.Phase + " at " + r.At.Format(time.TimeOnly) + ": " + r.Err
			}
		}
	}
	for _, s := range load.Samples() {
		most = max(most, s.PrefillPods+s.DecodePods)
	}
	t.Logf("stepped load: %d requests, %d failed; most engine pods at once %d (budget %d); events: %s", len(results), failed, most, budget,
		strings.Join(scaleEvents(t, n), "; "))
	if failed > 0 {
		t.Errorf("%d of %d requests failed across the scale-ups and scale-downs; the first: %s", failed, len(results), first)
	}
	// Nor did any handoff: an engine removed only once it has drained fails no leg, so
	// the router retried nothing (a retry would hide a failed prefill from the client).
	router := client.MatchingLabels{kvv1.LabelRouter: "push-decode"}
	for _, metric := range []string{"kvhandoff_router_leg_failures_total", "kvhandoff_router_retries_total"} {
		if v, err := n.PodsMetric("default", router, render.RouterAdminPort, metric); err != nil || v != 0 {
			t.Errorf("the router counted %v %s across the scale-downs (%v); want none", v, metric, err)
		}
	}
	if most > budget {
		t.Errorf("the pools held %d engine pods at once, over the budget %d", most, budget)
	}
	if path := os.Getenv("KVHANDOFF_AUTOSCALE_TIMELINE"); path != "" {
		writeTimeline(t, path, load)
	}
}

func createAutoscaledPair(t testing.TB, tune ...func(*kvv1.DecodePool)) *realnode.Node {
	t.Helper()
	n, _ := startNode(t, "manager", "router", "transfer-agent", "device-plugin", "vllm-connector", realnode.LoadFollowingEngines.Image)
	if err := n.InstallChart(append(n.ChartValues(), realnode.PlainMetrics, realnode.AutoscaleInterval)...); err != nil {
		t.Fatal(err)
	}
	if err := n.CreatePair(bg, realnode.LoadFollowingEngines, kvv1.TransferPush, append([]func(*kvv1.DecodePool){realnode.Autoscaled}, tune...)...); err != nil {
		t.Fatal(err)
	}
	waitPair(t, n, "push")
	return n
}

// converge waits until the autoscaler's sizes satisfy want, its last decision was to
// keep them, and each pool runs exactly its size, every engine Ready.
func converge(t *testing.T, n *realnode.Node, what string, want func(prefill, decode int32) bool) {
	t.Helper()
	start := time.Now()
	until(t, what, 4*time.Minute, func() bool {
		d := &kvv1.DecodePool{}
		if err := n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: "push-decode"}, d); err != nil || d.Status.Autoscaling == nil {
			return false
		}
		st, c := d.Status.Autoscaling, meta.FindStatusCondition(d.Status.Conditions, kvv1.ConditionAutoscaling)
		if c == nil || c.Reason != kvv1.ReasonWithinTargets || !want(st.PrefillReplicas, st.DecodeReplicas) ||
			st.PrefillReplicas != st.DesiredPrefillReplicas || st.DecodeReplicas != st.DesiredDecodeReplicas {
			return false
		}
		pAll, pReady := n.Pods("push-prefill", kvv1.RolePrefill)
		dAll, dReady := n.Pods("push-decode", kvv1.RoleDecode)
		return pAll == int(st.PrefillReplicas) && pReady == pAll && dAll == int(st.DecodeReplicas) && dReady == dAll
	})
	t.Logf("%s: converged in %s", what, time.Since(start).Round(100*time.Millisecond))
}

// scaleEvents are the autoscaler's ScaledUp and ScaledDown events on the DecodePool.
func scaleEvents(t *testing.T, n *realnode.Node) []string {
	list := &corev1.EventList{}
	if err := n.Client.List(bg, list, client.InNamespace("default")); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range list.Items {
		if e.InvolvedObject.Name == "push-decode" && (e.Reason == kvv1.ReasonScaledUp || e.Reason == kvv1.ReasonScaledDown) {
			out = append(out, e.Reason+" "+strings.SplitN(e.Message, " (", 2)[0])
		}
	}
	return out
}

// writeTimeline writes every sample and request, one JSON object a line, for the report
// (docs/performance.md#autoscaling).
func writeTimeline(t *testing.T, path string, load *realnode.Load) {
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	enc := json.NewEncoder(f)
	for _, s := range load.Samples() {
		_ = enc.Encode(map[string]any{"kind": "sample", "sample": s})
	}
	for _, r := range load.Results() {
		_ = enc.Encode(map[string]any{"kind": "request", "request": r})
	}
}

// killLeader SIGKILLs the manager replica holding the leader lease and returns its
// identity and how long until another identity held the lease.
func killLeader(t *testing.T, n *realnode.Node) (string, time.Duration) {
	t.Helper()
	lease := &coordinationv1.Lease{}
	key := client.ObjectKey{Namespace: "kvhandoff-system", Name: "kvhandoff-manager.kvhandoff.io"}
	if err := n.Client.Get(bg, key, lease); err != nil || lease.Spec.HolderIdentity == nil {
		t.Fatalf("the manager's leader lease: %+v, %v", lease.Spec, err)
	}
	old := *lease.Spec.HolderIdentity
	pod, _, _ := strings.Cut(old, "_") // controller-runtime's identity: <hostname>_<uuid>
	at := time.Now()
	if _, err := n.KillContainer(bg, key.Namespace, pod, "manager"); err != nil {
		t.Fatal(err)
	}
	until(t, "a new leader", 2*time.Minute, func() bool {
		return n.Client.Get(bg, key, lease) == nil && lease.Spec.HolderIdentity != nil && *lease.Spec.HolderIdentity != old && *lease.Spec.HolderIdentity != ""
	})
	return old, time.Since(at)
}
