// Package nodelabel marks the agent's node with kvhandoff.io/agent-ready=true while the
// agent is ready, so engines schedule only where a working agent runs (the manager's
// pods select the label), and publishes the agent's peer address beside it (other agents
// dial only published addresses) and its health report (the manager reads it); it clears
// all three on shutdown.
package nodelabel

import (
	"context"
	"encoding/json"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// Set labels node ready with the agent's peer address (ready true), or removes both and
// the health report (false). A merge patch touches only these keys, so it never fights
// other writers of the node's labels and annotations.
func Set(ctx context.Context, c kubernetes.Interface, node string, ready bool, address string) error {
	annotations := map[string]any{v1alpha1.AnnotationAgentAddress: nil} // null removes the key
	var value any
	if ready {
		value, annotations[v1alpha1.AnnotationAgentAddress] = "true", address
	} else {
		annotations[v1alpha1.AnnotationAgentHealth] = nil
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{
		"labels":      map[string]any{v1alpha1.LabelAgentReady: value},
		"annotations": annotations,
	}})
	if err := patchNode(ctx, c, node, patch); err != nil {
		return fmt.Errorf("labelling node %s %s=%v: %w", node, v1alpha1.LabelAgentReady, ready, err)
	}
	return nil
}

// SetHealth publishes the agent's health report (package health) on node.
func SetHealth(ctx context.Context, c kubernetes.Interface, node, report string) error {
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{
		"annotations": map[string]any{v1alpha1.AnnotationAgentHealth: report},
	}})
	if err := patchNode(ctx, c, node, patch); err != nil {
		return fmt.Errorf("annotating node %s with %s: %w", node, v1alpha1.AnnotationAgentHealth, err)
	}
	return nil
}

func patchNode(ctx context.Context, c kubernetes.Interface, node string, patch []byte) error {
	_, err := c.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType, patch, metav1.PatchOptions{FieldManager: "kvhandoff-transfer-agent"})
	return err
}
