package agent_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	ctrlenvtest "sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/controller"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// The agent process labels its node ready once it serves and removes the label on
// SIGTERM, against a real API server.
func TestAgentLabelsItsNodeWhileReady(t *testing.T) {
	env, err := envtest.Start(controller.NewScheme())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	user, err := env.AddUser(ctrlenvtest.User{Name: "transfer-agent", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := user.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "kubeconfig"), kubeconfig, 0o600); err != nil {
		t.Fatal(err)
	}
	c := kubernetes.NewForConfigOrDie(env.Config)
	ctx := context.Background()
	if _, err := c.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "p5en-a"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	label := func() string {
		n, err := c.CoreV1().Nodes().Get(ctx, "p5en-a", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return n.Labels[v1alpha1.LabelAgentReady]
	}
	a := startAgent(t, "labelling", dir, "--node-name", "p5en-a", "--kubeconfig", filepath.Join(dir, "kubeconfig"))
	// The agent labels before it logs "serving", so the label is there now.
	if got := label(); got != "true" {
		t.Fatalf("label while serving: %q", got)
	}
	if err := a.Stop(); err != nil {
		t.Fatal(err)
	}
	if got := label(); got != "" {
		t.Fatalf("label after shutdown: %q", got)
	}
}
