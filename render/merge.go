package render

import (
	"fmt"
	"strings"

	"encoding/json"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
	sigsjson "sigs.k8s.io/json"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/compat"
)

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
		return nil, &compat.Problem{Reason: kvv1.ReasonInvalidTemplate, Message: fmt.Sprintf("spec.template is not a pod template: %v", err)}
	}
	base, err := json.Marshal(rendered)
	if err != nil {
		return nil, err
	}
	merged, err := strategicpatch.StrategicMergePatch(base, user.Raw, corev1.PodTemplateSpec{})
	if err != nil {
		return nil, &compat.Problem{Reason: kvv1.ReasonInvalidTemplate, Message: fmt.Sprintf("spec.template cannot be merged into the engine pod: %v", err)}
	}
	out := &corev1.PodTemplateSpec{}
	if err := json.Unmarshal(merged, out); err != nil {
		return nil, err
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
