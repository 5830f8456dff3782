package realnode_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/builder"
	"github.com/kvhandoff/kvhandoff/test/realnode"
)

// The whole system as a user installs it: the chart on a real node, then a CPU pair of
// pools per mode whose engines are the simulated-engine image (`vllm serve` as the
// manager renders it). The pools become Ready; a chat request through each DecodePool's
// router Service returns the engines' answer, its KV moved through the agent pod and
// verified by the decode engine before its first token; the agent counts the bytes.
func TestAChatRequestThroughTheRouterServiceInPushAndPull(t *testing.T) {
	n := installPairs(t, kvv1.TransferPush, kvv1.TransferPull)
	before := agentMetric(t, "kvhandoff_agent_transferred_bytes_total")
	for _, mode := range []string{"push", "pull"} {
		if status, b, err := chat(n, mode, "What moves the KV cache in "+mode+" mode?"); err != nil || status != http.StatusOK {
			t.Errorf("%s: %d %s %v", mode, status, b, err)
		}
	}
	if after := agentMetric(t, "kvhandoff_agent_transferred_bytes_total"); after <= before {
		t.Errorf("the agent pod moved no KV bytes for the two requests (%v before, %v after)", before, after)
	}
}

// installPairs installs the chart on a real node and a CPU pair of pools per mode, named
// <mode>-prefill and <mode>-decode, and waits until they and the decode pool's router
// serve.
func installPairs(t *testing.T, modes ...kvv1.TransferMode) *realnode.Node {
	t.Helper()
	n, _ := startNode(t, "manager", "router", "transfer-agent", "device-plugin", "vllm-connector", "simvllm")
	helmInstall(t, n, `agent.provider="tcp;ofi_rxm"`, `agent.token.create=true`, `agent.metricsSecure=false`,
		"agent.nodeAffinity="+onTheRealNode, "devicePlugin.nodeAffinity="+onTheRealNode)
	image := "ghcr.io/kvhandoff/simvllm:" + realnode.Tag
	for _, mode := range modes {
		name := strings.ToLower(string(mode))
		pol := builder.Policy(name).Mode(mode).Executor(kvv1.ExecutorAgent).Provider(kvv1.ProviderTCP).Obj()
		prefill := builder.PrefillPool(name+"-prefill").Image(image).Model("sim").TP(1).InstanceType("").
			Accelerator(kvv1.AcceleratorCPU, 0).Policy(name).Obj()
		decode := builder.DecodePool(name+"-decode", name+"-prefill").Image(image).Model("sim").TP(1).InstanceType("").
			Accelerator(kvv1.AcceleratorCPU, 0).Policy(name).Obj()
		decode.Spec.Router.Replicas = ptr.To[int32](1)
		for _, o := range []client.Object{pol, prefill, decode} {
			o.SetNamespace("default")
			if err := n.Client.Create(bg, o); err != nil {
				t.Fatalf("creating %s: %v", o.GetName(), err)
			}
		}
	}
	for _, m := range modes {
		waitPair(t, n, strings.ToLower(string(m)))
	}
	return n
}

// waitPair waits until a mode's pools are Ready and its router is available.
func waitPair(t *testing.T, n *realnode.Node, mode string) {
	t.Helper()
	until(t, "the "+mode+" pools to be Ready", 4*time.Minute, func() bool {
		p, d := &kvv1.PrefillPool{}, &kvv1.DecodePool{}
		if n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: mode + "-prefill"}, p) != nil ||
			n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: mode + "-decode"}, d) != nil {
			return false
		}
		return isReady(p.Status.Conditions) && isReady(d.Status.Conditions)
	})
	until(t, "the "+mode+" router to be available", 2*time.Minute, func() bool {
		dep := &appsv1.Deployment{}
		return n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: mode + "-decode-router"}, dep) == nil && dep.Status.AvailableReplicas == 1
	})
	// An available Deployment is not yet a reachable Service: kube-proxy programs the
	// Service's rules once it sees the EndpointSlice, and until then the cluster IP
	// refuses connections. Clients wait for the Service itself to answer.
	until(t, "the "+mode+" router Service to answer", time.Minute, func() bool {
		url, err := routerURL(n, mode, "/readyz")
		if err != nil {
			return false
		}
		resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// routerURL is the URL of path on a mode's router Service.
func routerURL(n *realnode.Node, mode, path string) (string, error) {
	svc := &corev1.Service{}
	if err := n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: mode + "-decode-router"}, svc); err != nil {
		return "", err
	}
	return fmt.Sprintf("http://%s:%d%s", svc.Spec.ClusterIP, svc.Spec.Ports[0].Port, path), nil
}

func isReady(conds []metav1.Condition) bool {
	for _, c := range conds {
		if c.Type == kvv1.ConditionReady {
			return c.Status == metav1.ConditionTrue
		}
	}
	return false
}

// chat sends one chat request through a mode's router Service, with a deadline: a
// request must end, one way or the other.
func chat(n *realnode.Node, mode, prompt string) (int, string, error) {
	url, err := routerURL(n, mode, "/v1/chat/completions")
	if err != nil {
		return 0, "", err
	}
	body, _ := json.Marshal(map[string]any{"model": "sim", "max_tokens": 8, "messages": []map[string]string{{"role": "user", "content": prompt}}})
	c := &http.Client{Timeout: 90 * time.Second}
	resp, err := c.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode == http.StatusOK {
		var answer struct {
			Choices []struct {
				Message struct{ Content string } `json:"message"`
			} `json:"choices"`
		}
		if json.Unmarshal(b, &answer) != nil || len(answer.Choices) != 1 || answer.Choices[0].Message.Content == "" {
			return resp.StatusCode, string(b), errors.New("no answer in a 200")
		}
	}
	return resp.StatusCode, string(b), nil
}

// Pods deleted under traffic: an engine pod, the agent pod, a router pod. Requests in
// flight either complete or fail with a named error (an HTTP status and a message, or a
// refused connection), never hang past their deadline; once the pod is back (the pool
// Ready again, the agent's node label back), requests succeed again.
func TestPodsDeletedUnderTrafficFailByNameAndRecover(t *testing.T) {
	n := installPairs(t, kvv1.TransferPush)
	for _, victim := range []struct{ what, ns, selector string }{
		{"the decode engine", "default", "kvhandoff.io/pool=push-decode"},
		{"the transfer agent", "kvhandoff-node", "app.kubernetes.io/component=transfer-agent"},
		{"the router", "default", "kvhandoff.io/router=push-decode"},
	} {
		stop := make(chan struct{})
		// A collector drains the results as they come, so that workers failing fast
		// (a refused connection) never block on a full channel.
		results := make(chan string, 64)
		counts, collected := map[string]int{}, make(chan struct{})
		go func() {
			defer close(collected)
			for r := range results {
				if strings.HasPrefix(r, "hung") || strings.HasPrefix(r, "unnamed") {
					t.Errorf("%s: a request %s", victim.what, r)
				}
				counts[strings.SplitN(r, ":", 2)[0]]++
			}
		}()
		var wg sync.WaitGroup
		for w := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					status, body, err := chat(n, "push", fmt.Sprintf("request %d of worker %d while %s goes", i, w, victim.what))
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
			}()
		}
		pods := &corev1.PodList{}
		sel, _ := labels.Parse(victim.selector)
		if err := n.Client.List(bg, pods, client.InNamespace(victim.ns), client.MatchingLabelsSelector{Selector: sel}); err != nil || len(pods.Items) == 0 {
			t.Fatalf("%s: %d pods, %v", victim.what, len(pods.Items), err)
		}
		for _, p := range pods.Items {
			if err := n.Client.Delete(bg, &p); err != nil {
				t.Fatal(err)
			}
		}
		// Back: the pool Ready again, the router available again, the agent's label again.
		until(t, victim.what+"'s replacement to serve", 3*time.Minute, func() bool {
			node := &corev1.Node{}
			return n.Client.Get(bg, client.ObjectKey{Name: realnode.Name}, node) == nil && node.Labels[kvv1.LabelAgentReady] == "true"
		})
		waitPair(t, n, "push")
		until(t, "a request to succeed after "+victim.what+" came back", 2*time.Minute, func() bool {
			status, _, err := chat(n, "push", "after "+victim.what)
			return err == nil && status == http.StatusOK
		})
		close(stop)
		wg.Wait()
		close(results)
		<-collected
		t.Logf("%s deleted under traffic: %v", victim.what, counts)
	}
}

// agentMetric sums a metric's series on the agent pod's /metrics (host network, plain
// HTTP in this test's install).
func agentMetric(t *testing.T, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + realnode.NodeIP + ":9470/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var sum float64
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, name+"{") || strings.HasPrefix(line, name+" ") {
			var v float64
			if _, err := fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v); err == nil {
				sum += v
			}
		}
	}
	return sum
}
