package render

import (
	"slices"
	"strings"
	"testing"

	psaapi "k8s.io/pod-security-admission/api"
	psa "k8s.io/pod-security-admission/policy"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

// baseline is what Pod Security's baseline level refuses in a rendered engine pod, one
// line per check and detail.
func baseline(t *testing.T, template string, pol *kvv1.KVTransferPolicy) []string {
	t.Helper()
	eval, err := psa.NewEvaluator(psa.DefaultChecks(), nil)
	if err != nil {
		t.Fatal(err)
	}
	b := builder.PrefillPool("p").Image("vllm/vllm-openai:v0.33.0").Policy(pol.Name)
	if template != "" {
		b = b.Template(template)
	}
	p := b.Obj()
	w, err := Engines(Input{Role: kvv1.RolePrefill, Name: "p", Namespace: "ns", Spec: &p.Spec.EngineSpec, Policy: &pol.Spec})
	if err != nil {
		t.Fatalf("rendering: %v", err)
	}
	pod := w.StatefulSet.Spec.Template
	var out []string
	for _, r := range eval.EvaluatePod(psaapi.LevelVersion{Level: psaapi.LevelBaseline, Version: psaapi.LatestVersion()}, &pod.ObjectMeta, &pod.Spec) {
		if !r.Allowed {
			out = append(out, r.ForbiddenReason+": "+r.ForbiddenDetail)
		}
	}
	slices.Sort(out)
	return out
}

// The engine pod breaks Pod Security's baseline only where kvhandoff itself must (the
// agent's sockets and the host's libfabric as hostPath volumes, IPC_LOCK for memory
// registration): a template that uses everything a template may set adds nothing to
// that, as judged by the Pod Security admission's own checks.
func TestATemplateAddsNothingPodSecurityBaselineRefuses(t *testing.T) {
	for _, pol := range []*kvv1.KVTransferPolicy{builder.Policy("agent").Executor(kvv1.ExecutorAgent).Obj(), builder.Policy("push").Obj()} {
		own := baseline(t, "", pol)
		t.Logf("policy %s: the engine pod's own exceptions to baseline: %s", pol.Name, strings.Join(own, "; "))
		for _, line := range own {
			if !strings.HasPrefix(line, "hostPath volumes") && !strings.HasPrefix(line, "non-default capabilities") {
				t.Errorf("policy %s: the rendered engine pod breaks baseline with %s", pol.Name, line)
			}
		}
		got := baseline(t, `{
			"metadata": {"labels": {"team": "search"}, "annotations": {"container.apparmor.security.beta.kubernetes.io/engine": "runtime/default"}},
			"spec": {
				"priorityClassName": "inference", "serviceAccountName": "engines", "runtimeClassName": "nvidia",
				"securityContext": {"fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
				"tolerations": [{"key": "dedicated", "operator": "Exists"}],
				"volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
				"containers": [
					{"name": "engine", "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
					 "ports": [{"name": "debug", "containerPort": 9000}],
					 "livenessProbe": {"httpGet": {"path": "/health", "port": 8000}},
					 "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
					 "volumeMounts": [{"name": "models", "mountPath": "/models"}]},
					{"name": "log-shipper", "image": "fluent/fluent-bit", "ports": [{"containerPort": 2020}],
					 "readinessProbe": {"exec": {"command": ["true"]}},
					 "securityContext": {"runAsNonRoot": true, "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]},
					 "seccompProfile": {"type": "RuntimeDefault"}}}]}}`, pol)
		if !slices.Equal(got, own) {
			t.Errorf("policy %s: with the template the pod breaks baseline with\n%s\nwithout it\n%s", pol.Name, strings.Join(got, "\n"), strings.Join(own, "\n"))
		}
	}
}
