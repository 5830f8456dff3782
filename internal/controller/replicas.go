package controller

import (
	"context"
	"fmt"
	"strings"

	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// replicas finds how many engines the pool runs: its spec.replicas, or, while a
// DecodePool's autoscaling owns it, the size the autoscaler last wrote into that
// DecodePool's status (before its first decision, spec.replicas within the range). A
// PrefillPool that two autoscaling DecodePools name has no owner: that is a problem.
func (r *PoolReconciler) replicas(ctx context.Context, p pool, v *validation) error {
	v.replicas = ptr.Deref(p.engine().Replicas, 1)
	if d, ok := p.object().(*kvv1.DecodePool); ok {
		if s := d.Spec.Autoscaling; s != nil {
			v.replicas, v.autoscaledBy = clampReplicas(v.replicas, s.Decode), d.Name
			if st := d.Status.Autoscaling; st != nil && st.DecodeReplicas > 0 {
				v.replicas = st.DecodeReplicas
			}
		}
		return nil
	}
	list := &kvv1.DecodePoolList{}
	if err := r.List(ctx, list, client.InNamespace(p.GetNamespace())); err != nil {
		return err
	}
	var owners []*kvv1.DecodePool
	for i := range list.Items {
		if d := &list.Items[i]; d.Spec.Autoscaling != nil && d.Spec.PrefillPoolRef.Name == p.GetName() {
			owners = append(owners, &list.Items[i])
		}
	}
	switch len(owners) {
	case 0:
		return nil
	case 1:
		d := owners[0]
		v.replicas, v.autoscaledBy = clampReplicas(v.replicas, d.Spec.Autoscaling.Prefill), d.Name
		if st := d.Status.Autoscaling; st != nil && st.PrefillReplicas > 0 {
			v.replicas = st.PrefillReplicas
		}
		return nil
	}
	names := make([]string, len(owners))
	for i, d := range owners {
		names[i] = d.Name
	}
	v.problem = &problem{Reason: kvv1.ReasonAutoscalingConflict, Message: fmt.Sprintf("DecodePools %s all set spec.autoscaling and name this "+
		"PrefillPool: only one may size it; remove autoscaling from all but one, or give each its own PrefillPool", strings.Join(names, ", "))}
	return nil
}
