package cli

import (
	"context"
	"fmt"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/kvhandoff/kvhandoff/internal/claimrails"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/engineapi"
)

// enginePods looks engine pods up in the API server (engineapi.Pods): their UID, and
// the EFAs their ResourceClaims were allocated, read from the claims' results and the
// ResourceSlices of the pod's node.
type enginePods struct{ c kubernetes.Interface }

func (p enginePods) Pod(ctx context.Context, namespace, name string) (engineapi.EnginePod, error) {
	pod, err := p.c.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return engineapi.EnginePod{}, err
	}
	out := engineapi.EnginePod{UID: string(pod.UID)}
	var claims []*resourceapi.ResourceClaim
	for _, s := range pod.Status.ResourceClaimStatuses {
		if s.ResourceClaimName == nil {
			continue
		}
		claim, err := p.c.ResourceV1().ResourceClaims(namespace).Get(ctx, *s.ResourceClaimName, metav1.GetOptions{})
		if err != nil {
			return out, fmt.Errorf("reading its ResourceClaim %s: %w", *s.ResourceClaimName, err)
		}
		claims = append(claims, claim)
	}
	if len(claims) == 0 {
		return out, nil
	}
	list, err := p.c.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + pod.Spec.NodeName})
	if err != nil {
		return out, fmt.Errorf("reading node %s's ResourceSlices: %w", pod.Spec.NodeName, err)
	}
	devices := map[string]map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{}
	for _, s := range list.Items {
		for _, d := range s.Spec.Devices {
			devices[s.Spec.Driver+"/"+s.Spec.Pool.Name+"/"+d.Name] = d.Attributes
		}
	}
	efas, problems := claimrails.EFAs(claims, func(driver, pool, device string) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
		return devices[driver+"/"+pool+"/"+device]
	})
	if len(problems) > 0 {
		return out, fmt.Errorf("its EFAs cannot be told: %s", strings.Join(problems, "; "))
	}
	if len(efas) > 0 {
		out.EFAs = efas
	}
	return out, nil
}
