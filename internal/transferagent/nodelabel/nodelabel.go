// Package nodelabel marks the agent's node with kvhandoff.io/agent-ready=true while the
// agent is ready, so engines schedule only where a working agent runs (the manager's
// pods select the label), and publishes the agent's peer address beside it (other agents
// dial only published addresses); it clears both on shutdown.
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

// Set labels node ready with the agent's peer address (ready true), or removes both
// (false). A merge patch touches only these two keys, so it never fights other writers of
// the node's labels and annotations.
func Set(ctx context.Context, c kubernetes.Interface, node string, ready bool, address string) error {
	var value, addr any // null removes the key
	if ready {
		value, addr = "true", address
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{
		"labels":      map[string]any{v1alpha1.LabelAgentReady: value},
		"annotations": map[string]any{v1alpha1.AnnotationAgentAddress: addr},
	}})
	if _, err := c.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType, patch, metav1.PatchOptions{FieldManager: "kvhandoff-transfer-agent"}); err != nil {
		return fmt.Errorf("labelling node %s %s=%v: %w", node, v1alpha1.LabelAgentReady, ready, err)
	}
	return nil
}
