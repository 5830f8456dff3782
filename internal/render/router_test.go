package render

import (
	"bytes"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/instancetype"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

func TestRouterGolden(t *testing.T) {
	for name, spec := range map[string]kvv1.RouterSpec{
		"router-defaults": {},
		"router-custom": {Replicas: ptr.To[int32](3), Image: "registry.example/router:v1", Resources: &corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("2")},
		}},
	} {
		t.Run(name, func(t *testing.T) {
			w, err := Router(RouterInput{Pool: "qwen3-32b-decode", Namespace: "inference", Spec: &spec, DefaultImage: "ghcr.io/kvhandoff/router:v0.1.0"})
			if err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			for _, obj := range w.Objects() {
				data, err := yaml.Marshal(obj)
				if err != nil {
					t.Fatal(err)
				}
				out.WriteString("---\n")
				out.Write(data)
			}
			checkGolden(t, name, out.Bytes())
		})
	}
}

func TestTheRouterKeepsOffEveryAcceleratorNode(t *testing.T) {
	w, err := Router(RouterInput{Pool: "d", Namespace: "ns", Spec: &kvv1.RouterSpec{}, DefaultImage: "x"})
	if err != nil {
		t.Fatal(err)
	}
	terms := w.Deployment.Spec.Template.Spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms
	if len(terms) != 1 {
		t.Fatalf("%d node selector terms, want 1 (terms are ORed)", len(terms))
	}
	excluded := map[string]bool{}
	for _, e := range terms[0].MatchExpressions {
		if e.Key == "node.kubernetes.io/instance-type" && e.Operator == corev1.NodeSelectorOpNotIn {
			for _, v := range e.Values {
				excluded[v] = true
			}
		}
	}
	agent := false
	for _, p := range w.Deployment.Spec.Template.Spec.Affinity.NodeAffinity.PreferredDuringSchedulingIgnoredDuringExecution {
		for _, e := range p.Preference.MatchExpressions {
			agent = agent || (e.Key == kvv1.LabelAgentReady && e.Operator == corev1.NodeSelectorOpDoesNotExist)
		}
	}
	for _, it := range instancetype.Accelerated() {
		if !excluded[it] {
			t.Errorf("the router may land on %s nodes", it)
		}
	}
	if !agent {
		t.Error("the router does not prefer nodes without a transfer agent")
	}
	// The pool label (the manager caches router pods to poll their health) without the
	// role label, which alone marks engines.
	if l := w.Deployment.Spec.Template.Labels; l[kvv1.LabelPool] != "d" || l[kvv1.LabelRole] != "" {
		t.Errorf("router pods carry labels %v: the manager would not see them, or would take them for engines", l)
	}
}

// Routers and endpoint pickers of engines that serve their KV events hold the token the
// sidecars ask for, read-only, and name it; the engines' sidecars mount the same Secret.
func TestFollowersAndSidecarsShareTheKVEventsToken(t *testing.T) {
	hasToken := func(what string, spec corev1.PodSpec, c corev1.Container, flag string) {
		t.Helper()
		if len(spec.Volumes) == 0 || spec.Volumes[len(spec.Volumes)-1].Secret == nil || spec.Volumes[len(spec.Volumes)-1].Secret.SecretName != "prefill-kv-events" {
			t.Errorf("%s: volumes %+v", what, spec.Volumes)
		}
		found := false
		for _, m := range c.VolumeMounts {
			found = found || (m.Name == "kv-events-token" && m.ReadOnly && m.MountPath == kvEventsTokenDir)
		}
		if !found || !slices.Contains(c.Args, flag+"="+kvEventsTokenFile) {
			t.Errorf("%s: mounts %+v, args %v", what, c.VolumeMounts, c.Args)
		}
	}
	r, err := Router(RouterInput{Pool: "decode", Namespace: "ns", Spec: &kvv1.RouterSpec{}, DefaultImage: "router", KVEventsSecret: KVEventsSecret("prefill")})
	if err != nil {
		t.Fatal(err)
	}
	hasToken("router", r.Deployment.Spec.Template.Spec, r.Deployment.Spec.Template.Spec.Containers[0], "--kv-events-token-file")
	e, err := EndpointPicker(GatewayInput{Pool: "decode", Namespace: "ns", Spec: &kvv1.GatewaySpec{}, Image: "router", KVEventsSecret: KVEventsSecret("prefill")})
	if err != nil {
		t.Fatal(err)
	}
	hasToken("endpoint picker", e.Deployment.Spec.Template.Spec, e.Deployment.Spec.Template.Spec.Containers[0], "--kv-events-token-file")
	_, dw := pairWith(t, builder.PrefillPool("prefill").Policy("p"), builder.DecodePool("decode", "prefill").Policy("p"), builder.Policy("p"), "router")
	spec := dw.StatefulSet.Spec.Template.Spec
	hasToken("decode engine's sidecar", spec, spec.InitContainers[len(spec.InitContainers)-1], "--token-file")
	if r, _ := Router(RouterInput{Pool: "decode", Namespace: "ns", Spec: &kvv1.RouterSpec{}, DefaultImage: "router"}); len(r.Deployment.Spec.Template.Spec.Volumes) != 0 {
		t.Error("a router of engines without sidecars mounts a token")
	}
}

// The sidecar keys blocks by the model name requests give: the first served name.
func TestTheSidecarKeysByTheServedModelName(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "Qwen/Qwen3-32B"},
		{[]string{"--served-model-name", "chat", "qwen"}, "chat"},
		{[]string{"--served-model-name=chat"}, "chat"},
		{[]string{"--served-model-name="}, "Qwen/Qwen3-32B"},
		{[]string{"--served-model-name", "--max-model-len", "8"}, "Qwen/Qwen3-32B"},
	} {
		spec := builder.DecodePool("d", "p").EngineArgs(c.args...).Obj().Spec.EngineSpec
		if got := servedModel(&spec); got != c.want {
			t.Errorf("%v: %q, want %q", c.args, got, c.want)
		}
	}
}
