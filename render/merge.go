package render

import (
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
)

// mergeTemplate merges the pool's template over the rendered pod template with
// Kubernetes' strategic merge: containers, volumes and env merge by name, maps merge by
// key, everything else the template sets replaces the rendered value.
func mergeTemplate(rendered *corev1.PodTemplateSpec, user *corev1.PodTemplateSpec) (*corev1.PodTemplateSpec, error) {
	if user == nil {
		return rendered, nil
	}
	base, err := json.Marshal(rendered)
	if err != nil {
		return nil, err
	}
	patch, err := json.Marshal(user)
	if err != nil {
		return nil, err
	}
	// A typed template marshals unset lists as null, which a strategic merge patch reads
	// as "delete": drop the nulls so only what the user wrote takes effect.
	var patchMap map[string]any
	if err := json.Unmarshal(patch, &patchMap); err != nil {
		return nil, err
	}
	dropNulls(patchMap)
	if patch, err = json.Marshal(patchMap); err != nil {
		return nil, err
	}
	merged, err := strategicpatch.StrategicMergePatch(base, patch, corev1.PodTemplateSpec{})
	if err != nil {
		return nil, fmt.Errorf("merging spec.template into the rendered pod: %w", err)
	}
	out := &corev1.PodTemplateSpec{}
	if err := json.Unmarshal(merged, out); err != nil {
		return nil, err
	}
	return out, nil
}

func dropNulls(m map[string]any) {
	for k, v := range m {
		switch v := v.(type) {
		case nil:
			delete(m, k)
		case map[string]any:
			dropNulls(v)
		case []any:
			for _, item := range v {
				if im, ok := item.(map[string]any); ok {
					dropNulls(im)
				}
			}
		}
	}
}
