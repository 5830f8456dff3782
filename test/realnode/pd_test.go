package realnode_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/realnode"
)

// The whole system as a user installs it: the chart on a real node, then a CPU pair of
// pools per mode whose engines are the simulated-engine image (`vllm serve` as the
// manager renders it). The pools become Ready; a chat request through each DecodePool's
// router Service returns the engines' answer, its KV moved through the agent pod and
// verified by the decode engine before its first token; the agent counts the bytes.
func TestAChatRequestThroughTheRouterServiceInPushAndPull(t *testing.T) {
	n := installPairs(t, realnode.SimEngines, kvv1.TransferPush, kvv1.TransferPull)
	before := agentMetric(t, n, "kvhandoff_agent_transferred_bytes_total")
	for _, mode := range []string{"push", "pull"} {
		if status, b, err := chat(n, mode, "What moves the KV cache in "+mode+" mode?"); err != nil || status != http.StatusOK {
			t.Errorf("%s: %d %s %v", mode, status, b, err)
		}
	}
	if after := agentMetric(t, n, "kvhandoff_agent_transferred_bytes_total"); after <= before {
		t.Errorf("the agent pod moved no KV bytes for the two requests (%v before, %v after)", before, after)
	}
	// Transfer health as the chart installs it: the agent pod publishes its report on the
	// node (its admission policy allows it), the manager polls the router pod over the pod
	// network, and each pool says so.
	for _, mode := range []string{"push", "pull"} {
		expectTransferHealth(t, n, mode+"-prefill", &kvv1.PrefillPool{}, "1 transfer agent(s) and 0 router(s)")
		expectTransferHealth(t, n, mode+"-decode", &kvv1.DecodePool{}, "1 transfer agent(s) and 1 router(s)")
	}
}

// expectTransferHealth waits until pool is TransferHealthy saying says, with every engine's
// agent session up on the tcp provider.
func expectTransferHealth(t *testing.T, n *realnode.Node, name string, pool client.Object, says string) {
	t.Helper()
	var last string
	err := wait.PollUntilContextTimeout(bg, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		if err := n.Client.Get(ctx, client.ObjectKey{Namespace: "default", Name: name}, pool); err != nil {
			return false, err
		}
		var st kvv1.PoolStatus
		switch p := pool.(type) {
		case *kvv1.PrefillPool:
			st = p.Status
		case *kvv1.DecodePool:
			st = p.Status
		}
		c := meta.FindStatusCondition(st.Conditions, kvv1.ConditionTransferHealthy)
		last = fmt.Sprintf("%+v %+v", c, st.Engines)
		if c == nil || c.Status != metav1.ConditionTrue || !strings.Contains(c.Message, says) || len(st.Engines) == 0 {
			return false, nil
		}
		for _, e := range st.Engines {
			if !e.AgentSession || e.Fabric != "tcp;ofi_rxm" {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		t.Errorf("%s: not TransferHealthy (%q) with its engines' sessions up: %v; last %s", name, says, err, last)
	}
}

// installPairs installs the chart on a real node and a CPU pair of pools per mode
// running e, and waits until each serves.
func installPairs(t *testing.T, e realnode.Engines, modes ...kvv1.TransferMode) *realnode.Node {
	t.Helper()
	n := createPairs(t, e, modes...)
	for _, m := range modes {
		waitPair(t, n, strings.ToLower(string(m)))
	}
	return n
}

// createPairs is installPairs without the wait.
func createPairs(t *testing.T, e realnode.Engines, modes ...kvv1.TransferMode) *realnode.Node {
	t.Helper()
	n, _ := startNode(t, "manager", "router", "transfer-agent", "device-plugin", "vllm-connector", e.Image)
	if err := n.InstallChart(append(n.ChartValues(), realnode.PlainMetrics)...); err != nil {
		t.Fatal(err)
	}
	for _, mode := range modes {
		if err := n.CreatePair(bg, e, mode); err != nil {
			t.Fatal(err)
		}
	}
	return n
}

// waitPair waits until a mode's pools are Ready and its router Service answers.
func waitPair(t testing.TB, n *realnode.Node, mode string) {
	t.Helper()
	if err := n.WaitPair(bg, mode, 5*time.Minute); err != nil {
		t.Fatal(err)
	}
}

// chat sends one chat request through a mode's router Service.
func chat(n *realnode.Node, mode, prompt string) (int, string, error) {
	status, body, _, err := n.Chat(mode, "sim", prompt)
	return status, body, err
}

// Pods deleted under traffic: an engine pod, the agent pod, a router pod. Requests in
// flight either complete or fail with a named error (an HTTP status and a message, or a
// refused connection), never hang past their deadline; once the pod is back (the pool
// Ready again, the agent's node label back), requests succeed again.
func TestPodsDeletedUnderTrafficFailByNameAndRecover(t *testing.T) {
	n := installPairs(t, realnode.SimEngines, kvv1.TransferPush)
	for _, victim := range []struct{ what, ns, selector string }{
		{"the decode engine", "default", "kvhandoff.io/pool=push-decode,kvhandoff.io/role=decode"},
		{"the transfer agent", "kvhandoff-node", "app.kubernetes.io/component=transfer-agent"},
		{"the router", "default", "kvhandoff.io/router=push-decode"},
	} {
		send := func(prompt string) (int, string, error) { return chat(n, "push", prompt) }
		deleteUnderTraffic(t, n, victim.what, victim.ns, victim.selector, 0, send, func() {
			// Back: the agents Ready with their nodes' label again, the pool Ready again,
			// the router Service answering again.
			until(t, victim.what+"'s replacement to serve", 3*time.Minute, func() bool { return n.AgentsServe(bg) })
			waitPair(t, n, "push")
		})
	}
}

// deleteUnderTraffic deletes the pods of selector in ns (the first max of them; 0: all)
// while four workers send requests with send; every request must be answered or fail by
// name (an HTTP status with a message, or a refused connection), never hang. back waits
// until the pods' replacements serve; then a request through send must succeed again.
func deleteUnderTraffic(t *testing.T, n *realnode.Node, what, ns, selector string, max int, send func(prompt string) (int, string, error), back func()) {
	t.Helper()
	stop := make(chan struct{})
	// A collector drains the results as they come, so that workers failing fast (a
	// refused connection) never block on a full channel.
	results := make(chan string, 64)
	counts, collected := map[string]int{}, make(chan struct{})
	go func() {
		defer close(collected)
		for r := range results {
			if strings.HasPrefix(r, "hung") || strings.HasPrefix(r, "unnamed") {
				t.Errorf("%s: a request %s", what, r)
			}
			counts[strings.SplitN(r, ":", 2)[0]]++
		}
	}()
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				status, body, err := send(fmt.Sprintf("request %d of worker %d while %s goes", i, w, what))
				switch {
				case err != nil && strings.Contains(err.Error(), "Client.Timeout"):
					results <- "hung: " + err.Error()
				case err != nil:
					results <- "error: " + err.Error()
				case status != http.StatusOK && !strings.Contains(body, "message"):
					results <- fmt.Sprintf("unnamed %d: %s", status, body)
				case status != http.StatusOK:
					results <- "failed"
				default:
					results <- "ok"
				}
			}
		})
	}
	pods := &corev1.PodList{}
	sel, _ := labels.Parse(selector)
	if err := n.Client.List(bg, pods, client.InNamespace(ns), client.MatchingLabelsSelector{Selector: sel}); err != nil || len(pods.Items) == 0 {
		t.Fatalf("%s: %d pods, %v", what, len(pods.Items), err)
	}
	if max > 0 {
		pods.Items = pods.Items[:min(max, len(pods.Items))]
	}
	for _, p := range pods.Items {
		if err := n.Client.Delete(bg, &p); err != nil {
			t.Fatal(err)
		}
	}
	back()
	until(t, "a request to succeed after "+what+" came back", 2*time.Minute, func() bool {
		status, _, err := send("after " + what)
		return err == nil && status == http.StatusOK
	})
	close(stop)
	wg.Wait()
	close(results)
	<-collected
	t.Logf("%s deleted under traffic: %v", what, counts)
}

func agentMetric(t *testing.T, n *realnode.Node, name string) float64 {
	t.Helper()
	v, err := n.AgentMetric(name)
	if err != nil {
		t.Fatal(err)
	}
	return v
}
