package render

import (
	"bytes"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

// A DecodePool behind a gateway: its endpoint picker, its InferencePool, the leg
// runners' identity, and the decode engines with their leg-runner sidecar.
func TestGatewayGolden(t *testing.T) {
	pol := builder.Policy("agent").Executor(kvv1.ExecutorAgent).Obj()
	d := builder.DecodePool("qwen3-32b-decode", "qwen3-32b-prefill").Image("vllm/vllm-openai:v0.33.0").Policy("agent").Obj()
	in := GatewayInput{Pool: d.Name, Namespace: d.Namespace, Spec: &kvv1.GatewaySpec{InferencePool: true, FailureMode: kvv1.GatewayFailOpen},
		Image: "ghcr.io/kvhandoff/router:v0.1.0"}
	epp, err := EndpointPicker(in)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := InferencePool(in)
	if err != nil {
		t.Fatal(err)
	}
	sa, role, rb, err := LegRunnerAccount(d.Name, d.Namespace)
	if err != nil {
		t.Fatal(err)
	}
	w, err := Engines(Input{Role: kvv1.RoleDecode, Name: d.Name, Namespace: d.Namespace, Spec: &d.Spec.EngineSpec, Policy: &pol.Spec,
		PrefillPool: d.Spec.PrefillPoolRef.Name, LegRunnerImage: in.Image})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	for _, obj := range append(epp.Objects(), pool, sa, role, rb, w.StatefulSet) {
		data, err := yaml.Marshal(obj)
		if err != nil {
			t.Fatal(err)
		}
		out.WriteString("---\n")
		out.Write(data)
	}
	checkGolden(t, "gateway", out.Bytes())
}

// The engine container gets no API token; the leg runner alone mounts one, and its
// readiness does not wait for engine pairs (its own pod's readiness is one of them).
func TestOnlyTheLegRunnerHoldsAToken(t *testing.T) {
	w := agentDecode(t, "router")
	spec := w.StatefulSet.Spec.Template.Spec
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken || spec.ServiceAccountName != "d-leg-runner" {
		t.Fatalf("pod account %q, automount %v: want d-leg-runner without an automounted token", spec.ServiceAccountName, spec.AutomountServiceAccountToken)
	}
	holders := map[string]bool{}
	for _, c := range append(spec.InitContainers, spec.Containers...) {
		for _, m := range c.VolumeMounts {
			if m.Name == "leg-runner-token" {
				holders[c.Name] = true
			}
		}
		if c.Name == "leg-runner" {
			if c.RestartPolicy == nil || *c.RestartPolicy != corev1.ContainerRestartPolicyAlways {
				t.Error("the leg runner is not a native sidecar: it would not outlive the engine's requests")
			}
			if c.ReadinessProbe.HTTPGet.Path != "/healthz" {
				t.Errorf("leg runner readiness on %s: it would wait for its own pod", c.ReadinessProbe.HTTPGet.Path)
			}
		}
	}
	if len(holders) != 1 || !holders["leg-runner"] {
		t.Fatalf("containers mounting the token: %v; want the leg runner alone", holders)
	}
	// Without a gateway, nothing of it.
	w = agentDecode(t, "")
	if s := w.StatefulSet.Spec.Template.Spec; s.ServiceAccountName != "" || len(s.InitContainers) != 1 {
		t.Fatalf("a decode pool without a gateway got account %q and %d init containers", s.ServiceAccountName, len(s.InitContainers))
	}
}

// A probe on a port name the container does not declare is never run by the kubelet
// (it reports "port not found", and the container is never ready).
func TestEveryProbeNamesAPortOfItsContainer(t *testing.T) {
	w := agentDecode(t, "router")
	in := GatewayInput{Pool: "d", Namespace: "ns", Spec: &kvv1.GatewaySpec{InferencePool: true}, Image: "router"}
	epp, err := EndpointPicker(in)
	if err != nil {
		t.Fatal(err)
	}
	router, err := Router(RouterInput{Pool: "d", Namespace: "ns", Spec: &kvv1.RouterSpec{}, DefaultImage: "router"})
	if err != nil {
		t.Fatal(err)
	}
	for _, spec := range []corev1.PodSpec{w.StatefulSet.Spec.Template.Spec, epp.Deployment.Spec.Template.Spec, router.Deployment.Spec.Template.Spec} {
		for _, c := range append(spec.InitContainers, spec.Containers...) {
			ports := map[string]bool{}
			for _, p := range c.Ports {
				ports[p.Name] = true
			}
			for _, p := range []*corev1.Probe{c.ReadinessProbe, c.LivenessProbe, c.StartupProbe} {
				if p != nil && p.HTTPGet != nil && p.HTTPGet.Port.StrVal != "" && !ports[p.HTTPGet.Port.StrVal] {
					t.Errorf("container %s probes port %q, which it does not declare", c.Name, p.HTTPGet.Port.StrVal)
				}
			}
		}
	}
}

// agentDecode renders decode pool d (prefill pool "p", executor Agent), with the leg
// runner from image legRunner ("" none).
func agentDecode(t *testing.T, legRunner string) *Workload {
	t.Helper()
	pol := builder.Policy("agent").Executor(kvv1.ExecutorAgent).Obj()
	d := builder.DecodePool("d", "p").Image("vllm/vllm-openai:v0.33.0").Policy("agent").Obj()
	w, err := Engines(Input{Role: kvv1.RoleDecode, Name: d.Name, Namespace: d.Namespace, Spec: &d.Spec.EngineSpec, Policy: &pol.Spec, PrefillPool: "p",
		LegRunnerImage: legRunner})
	if err != nil {
		t.Fatal(err)
	}
	return w
}
