package render

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
	sigsjson "sigs.k8s.io/json"
)

// TemplateError is why a pool's spec.template cannot be merged into the engine pod it
// renders (reported as the InvalidTemplate condition).
type TemplateError struct{ Message string }

func (e *TemplateError) Error() string { return e.Message }

// mergeTemplate merges the pool's template over the rendered pod template with
// Kubernetes' strategic merge: containers, volumes and env merge by name, maps merge by
// key, everything else the template sets replaces the rendered value. The template is
// decoded strictly first, so a misspelt field is reported instead of silently ignored.
func mergeTemplate(rendered *corev1.PodTemplateSpec, user *runtime.RawExtension) (*corev1.PodTemplateSpec, error) {
	if user == nil || len(user.Raw) == 0 {
		return rendered, nil
	}
	var check corev1.PodTemplateSpec
	strictErrs, err := sigsjson.UnmarshalStrict(user.Raw, &check)
	if err == nil && len(strictErrs) > 0 {
		err = joinErrors(strictErrs)
	}
	if err != nil {
		return nil, &TemplateError{fmt.Sprintf("spec.template is not a pod template: %v", err)}
	}
	base, err := json.Marshal(rendered)
	if err != nil {
		return nil, err
	}
	merged, err := strategicpatch.StrategicMergePatch(base, user.Raw, corev1.PodTemplateSpec{})
	if err != nil {
		return nil, &TemplateError{fmt.Sprintf("spec.template cannot be merged into the engine pod: %v", err)}
	}
	out := &corev1.PodTemplateSpec{}
	if err := json.Unmarshal(merged, out); err != nil {
		return nil, err
	}
	if msg := ownedChanged(rendered, out); msg != "" {
		return nil, &TemplateError{msg}
	}
	return out, nil
}

// identityEnv are the engine variables its engine_id and KV side channel come from; the
// API refuses them in spec.env, and the template may not change them either.
var identityEnv = []string{"POD_NAME", "POD_NAMESPACE", "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "KVHANDOFF_AGENT_SOCKET"}

// ownedChanged says what the template changed of the engine container that kvhandoff
// owns: its command and args (the wired kv-transfer-config, parallelism, port) and its
// identity variables. Merged over by a template, they could run an engine with another
// engine's id or without its connector.
func ownedChanged(rendered, merged *corev1.PodTemplateSpec) string {
	find := func(p *corev1.PodTemplateSpec) *corev1.Container {
		for i := range p.Spec.Containers {
			if p.Spec.Containers[i].Name == EngineContainer {
				return &p.Spec.Containers[i]
			}
		}
		return nil
	}
	r, m := find(rendered), find(merged)
	switch {
	case m == nil:
		return "spec.template removed the engine container"
	case !slices.Equal(r.Command, m.Command):
		return "spec.template must not change the engine container's command: kvhandoff runs vllm serve; use spec.engineArgs for extra arguments"
	case !slices.Equal(r.Args, m.Args):
		return "spec.template must not change the engine container's args: they carry the pool's parallelism and its --kv-transfer-config; use " +
			"spec.engineArgs for extra arguments"
	}
	value := func(c *corev1.Container, name string) *corev1.EnvVar {
		for i := range c.Env {
			if c.Env[i].Name == name {
				return &c.Env[i]
			}
		}
		return nil
	}
	for _, name := range identityEnv {
		if !equality.Semantic.DeepEqual(value(r, name), value(m, name)) {
			return fmt.Sprintf("spec.template must not set the engine container's %s: the engine's identity and side channel are rendered from its pod", name)
		}
	}
	return ""
}

func joinErrors(errs []error) error {
	msgs := make([]string, len(errs))
	for i, e := range errs {
		msgs[i] = e.Error()
	}
	return fmt.Errorf("%s", strings.Join(msgs, "; "))
}
