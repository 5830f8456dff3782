package realnode_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/builder"
	"github.com/kvhandoff/kvhandoff/test/envtest"
	"github.com/kvhandoff/kvhandoff/test/realnode"
)

func TestMain(m *testing.M) { os.Exit(realnode.Main(m)) }

var bg = context.Background()

// The manager runs as what it is: its Deployment from config/default on a real node,
// from the image make images builds. Its pods run as distroless's nonroot user under the
// namespace's restricted Pod Security, reach the API server through the kubernetes
// Service (kube-proxy) with their service account's token, take the leader lease, and
// turn a pool into its StatefulSet with the RBAC config/rbac grants.
func TestTheManagerRunsAsItsDeploymentOnARealNode(t *testing.T) {
	onThisMachine(t)
	n, _ := startNode(t, "manager")
	objs := kustomize(t, n, "config/default")
	for _, o := range objs {
		if o.GetKind() == "Deployment" {
			// The image built here, never pulled: nothing outside this machine is reachable.
			containers, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
			c := containers[0].(map[string]any)
			c["image"] = "ghcr.io/kvhandoff/manager:" + realnode.Tag
			c["imagePullPolicy"] = "Never"
			_ = unstructured.SetNestedSlice(o.Object, containers, "spec", "template", "spec", "containers")
		}
		if err := n.Client.Patch(bg, o, client.Apply, client.FieldOwner("realnode-test"), client.ForceOwnership); err != nil {
			t.Fatalf("applying %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
	until(t, "the manager's Deployment to be available", 3*time.Minute, func() bool {
		d := &appsv1.Deployment{}
		return n.Client.Get(bg, client.ObjectKey{Namespace: "kvhandoff-system", Name: "kvhandoff-manager"}, d) == nil &&
			d.Status.AvailableReplicas == *d.Spec.Replicas
	})
	pods := &corev1.PodList{}
	if err := n.Client.List(bg, pods, client.InNamespace("kvhandoff-system")); err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		if p.Spec.NodeName != realnode.Name || !strings.HasPrefix(p.Status.PodIP, "198.18.0.") {
			t.Errorf("pod %s on node %q at %q, want the real node and an address of %s", p.Name, p.Spec.NodeName, p.Status.PodIP, realnode.PodCIDR)
		}
	}

	pol := builder.Policy("policy").Obj()
	pool := builder.PrefillPool("p").Obj()
	for _, o := range []client.Object{pol, pool} {
		o.SetNamespace("default")
		if err := n.Client.Create(bg, o); err != nil {
			t.Fatal(err)
		}
	}
	until(t, "the manager to render the pool's StatefulSet", time.Minute, func() bool {
		return n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: "p"}, &appsv1.StatefulSet{}) == nil
	})
	got := &kvv1.PrefillPool{}
	until(t, "the pool's status to name its compat-hash", time.Minute, func() bool {
		return n.Client.Get(bg, client.ObjectKeyFromObject(pool), got) == nil && got.Status.CompatHash != ""
	})
}

// kustomize renders a kustomization of the repository with the node's kubectl.
func kustomize(t *testing.T, n *realnode.Node, path string) []*unstructured.Unstructured {
	t.Helper()
	out, err := exec.Command(n.Kubectl(), "kustomize", filepath.Join(envtest.RepoRoot(), path)).Output()
	if err != nil {
		t.Fatalf("kubectl kustomize %s: %v", path, err)
	}
	var objs []*unstructured.Unstructured
	for _, doc := range strings.Split(string(out), "\n---\n") {
		u := &unstructured.Unstructured{}
		if err := yaml.Unmarshal([]byte(doc), &u.Object); err != nil {
			t.Fatal(err)
		}
		if len(u.Object) > 0 {
			objs = append(objs, u)
		}
	}
	return objs
}

func until(t testing.TB, what string, limit time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waiting %s for %s", limit, what)
		}
		time.Sleep(250 * time.Millisecond) // polling the API server
	}
}
