package nodelabel

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/controller"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// Against a real API server: the label and the address come and go, and other labels
// stay.
func TestSetAddsAndRemovesOnlyTheReadyLabelAndAddress(t *testing.T) {
	env, err := envtest.Start(controller.NewScheme())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	c := kubernetes.NewForConfigOrDie(env.Config)
	ctx := context.Background()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "ip-10-0-1-7", Labels: map[string]string{"node.kubernetes.io/instance-type": "p5en.48xlarge"}}}
	if _, err := c.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	get := func() *corev1.Node {
		n, err := c.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if err := Set(ctx, c, node.Name, true, "198.18.0.7:7470"); err != nil {
		t.Fatal(err)
	}
	if n := get(); n.Labels[v1alpha1.LabelAgentReady] != "true" || n.Labels["node.kubernetes.io/instance-type"] != "p5en.48xlarge" ||
		n.Annotations[v1alpha1.AnnotationAgentAddress] != "198.18.0.7:7470" {
		t.Fatalf("after Set(true): labels %v, annotations %v", n.Labels, n.Annotations)
	}
	if err := Set(ctx, c, node.Name, false, ""); err != nil {
		t.Fatal(err)
	}
	if n := get(); n.Labels[v1alpha1.LabelAgentReady] != "" || n.Labels["node.kubernetes.io/instance-type"] != "p5en.48xlarge" ||
		n.Annotations[v1alpha1.AnnotationAgentAddress] != "" {
		t.Fatalf("after Set(false): labels %v, annotations %v", n.Labels, n.Annotations)
	}
	if err := Set(ctx, c, "no-such-node", true, "198.18.0.7:7470"); err == nil {
		t.Fatal("labelled a node that does not exist")
	}
}

// The agent's role may patch nodes; config/agent's admission policy narrows that to the
// label on its own node. Against a real API server, as the agent's service account with
// the node-name claim of its pod's token.
func TestTheAgentMayLabelOnlyItsOwnNode(t *testing.T) {
	env, err := envtest.Start(controller.NewScheme())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	ctx := context.Background()
	admin := kubernetes.NewForConfigOrDie(env.Config)
	for i, name := range []string{"node-a", "node-b"} {
		n, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name,
			Labels: map[string]string{"team": "x"}}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		n.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: fmt.Sprintf("198.18.0.%d", 7+i)},
			{Type: corev1.NodeInternalIP, Address: "2001:db8::7"}}
		if _, err := admin.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// The agent's own RBAC and policy, as config/agent installs them.
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kvhandoff-node"}},
		metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"rbac.yaml", "own-node-policy.yaml"} {
		applyFile(t, env, filepath.Join(envtest.RepoRoot(), "config", "agent", f))
	}

	as := func(node string) kubernetes.Interface {
		cfg := rest.CopyConfig(env.Config)
		cfg.Impersonate = rest.ImpersonationConfig{
			UserName: "system:serviceaccount:kvhandoff-node:kvhandoff-transfer-agent",
			Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:kvhandoff-node", "system:authenticated"},
		}
		if node != "" {
			cfg.Impersonate.Extra = map[string][]string{"authentication.kubernetes.io/node-name": {node}}
		}
		return kubernetes.NewForConfigOrDie(cfg)
	}
	agentA := as("node-a")
	const addr = "198.18.0.7:7470"
	// The policy takes effect once the API server has loaded it.
	deadline := time.Now().Add(30 * time.Second)
	for Set(ctx, agentA, "node-b", true, addr) == nil {
		if time.Now().After(deadline) {
			t.Fatal("the agent of node-a labelled node-b: the policy never took effect")
		}
		_ = Set(ctx, admin, "node-b", false, "")
		time.Sleep(50 * time.Millisecond) // polling the API server's policy informer
	}
	if err := Set(ctx, agentA, "node-b", true, addr); err == nil || !strings.Contains(err.Error(), "only the node it runs on") {
		t.Errorf("the agent of node-a labelling node-b: %v", err)
	}
	if err := Set(ctx, as(""), "node-a", true, addr); err == nil {
		t.Error("a token without a node claim labelled a node")
	}
	if err := Set(ctx, agentA, "node-a", true, addr); err != nil {
		t.Errorf("the agent labelling its own node: %v", err)
	}
	if err := SetHealth(ctx, agentA, "node-a", `{"provider":"efa"}`); err != nil {
		t.Errorf("the agent publishing its health on its own node: %v", err)
	}
	if err := SetHealth(ctx, agentA, "node-b", `{"provider":"efa"}`); err == nil {
		t.Error("the agent of node-a published its health on node-b")
	}
	if err := Set(ctx, agentA, "node-a", false, ""); err != nil {
		t.Errorf("the agent removing its own label: %v", err)
	}
	if n, _ := admin.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{}); n.Annotations[v1alpha1.AnnotationAgentHealth] != "" {
		t.Errorf("the agent stopped and left its health report: %v", n.Annotations)
	}
	note := []byte(`{"metadata":{"annotations":{"team":"mine"}}}`)
	if _, err := agentA.CoreV1().Nodes().Patch(ctx, "node-a", types.MergePatchType, note,
		metav1.PatchOptions{}); err == nil || !strings.Contains(err.Error(), "agent-health annotations") {
		t.Errorf("the agent annotating its node with something else: %v", err)
	}
	patch := []byte(`{"metadata":{"labels":{"team":"mine"}}}`)
	if _, err := agentA.CoreV1().Nodes().Patch(ctx, "node-a", types.MergePatchType, patch,
		metav1.PatchOptions{}); err == nil || !strings.Contains(err.Error(), "only its node's kvhandoff.io/agent-ready label") {
		t.Errorf("the agent changing another label of its node: %v", err)
	}
	// The address every agent dials must be one of the node's own.
	for _, bad := range []string{"198.18.0.8:7470", "203.0.113.9:7470", "198.18.0.7", "198.18.0.7:http"} {
		if err := Set(ctx, agentA, "node-a", true, bad); err == nil || !strings.Contains(err.Error(), "status.addresses") {
			t.Errorf("the agent publishing %q on node-a (198.18.0.7): %v", bad, err)
		}
	}
	if err := Set(ctx, agentA, "node-a", true, "[2001:db8::7]:7470"); err != nil {
		t.Errorf("the agent publishing its node's IPv6 address: %v", err)
	}
	for what, p := range map[string]string{
		"an owner reference": `{"metadata":{"ownerReferences":[{"apiVersion":"v1","kind":"ConfigMap","name":"x","uid":"00000000-0000-0000-0000-000000000001"}]}}`,
		"a finalizer":        `{"metadata":{"finalizers":["example.com/hold"]}}`,
	} {
		if _, err := agentA.CoreV1().Nodes().Patch(ctx, "node-a", types.MergePatchType, []byte(p),
			metav1.PatchOptions{}); err == nil || !strings.Contains(err.Error(), "ownerReferences or finalizers") {
			t.Errorf("the agent adding %s to its node: %v", what, err)
		}
	}
	taint := []byte(`{"spec":{"unschedulable":true}}`)
	if _, err := agentA.CoreV1().Nodes().Patch(ctx, "node-a", types.MergePatchType, taint, metav1.PatchOptions{}); err == nil {
		t.Error("the agent cordoned its node")
	}
}

// applyFile creates every object of a YAML file through the admin client.
func applyFile(t *testing.T, env *envtest.Env, path string) {
	t.Helper()
	objs, err := envtest.ReadObjects(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range objs {
		if err := env.Client.Create(context.Background(), u); err != nil {
			t.Fatalf("%s %s: %v", u.GetKind(), u.GetName(), err)
		}
	}
}
