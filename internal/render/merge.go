package render

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
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
// key, tolerations add to the rendered ones (a user's toleration of their own node
// taint must not drop the accelerator's: the pod would fit no GPU node), everything else
// the template sets replaces the rendered value. The template is
// decoded strictly first, so a misspelt field is reported instead of silently ignored,
// and checked against what a template may set (template.go).
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
	if err := checkTemplate(user.Raw, rendered); err != nil {
		return nil, err
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
	for _, tol := range rendered.Spec.Tolerations {
		if !slices.ContainsFunc(out.Spec.Tolerations, func(u corev1.Toleration) bool { return tol.MatchToleration(&u) }) {
			out.Spec.Tolerations = append(out.Spec.Tolerations, tol)
		}
	}
	return out, nil
}

func joinErrors(errs []error) error {
	msgs := make([]string, len(errs))
	for i, e := range errs {
		msgs[i] = e.Error()
	}
	return fmt.Errorf("%s", strings.Join(msgs, "; "))
}
