package nodelabel

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/controllers"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// Against a real API server: the label comes and goes, and other labels stay.
func TestSetAddsAndRemovesOnlyTheReadyLabel(t *testing.T) {
	env, err := envtest.Start(controllers.NewScheme())
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
	labels := func() map[string]string {
		n, err := c.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return n.Labels
	}
	if err := Set(ctx, c, node.Name, true); err != nil {
		t.Fatal(err)
	}
	if l := labels(); l[v1alpha1.LabelAgentReady] != "true" || l["node.kubernetes.io/instance-type"] != "p5en.48xlarge" {
		t.Fatalf("after Set(true): %v", l)
	}
	if err := Set(ctx, c, node.Name, false); err != nil {
		t.Fatal(err)
	}
	if l := labels(); l[v1alpha1.LabelAgentReady] != "" || l["node.kubernetes.io/instance-type"] != "p5en.48xlarge" {
		t.Fatalf("after Set(false): %v", l)
	}
	if err := Set(ctx, c, "no-such-node", true); err == nil {
		t.Fatal("labelled a node that does not exist")
	}
}
