// Package nodelabel marks the agent's node with kvhandoff.io/agent-ready=true while the
// agent is ready, so engines schedule only where a working agent runs (the manager's
// pods select the label), and clears it on shutdown.
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

// Set labels node ready (true) or removes the label (false). A merge patch touches only
// this one label, so it never fights other writers of the node's labels.
func Set(ctx context.Context, c kubernetes.Interface, node string, ready bool) error {
	var value any // null removes the label
	if ready {
		value = "true"
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{v1alpha1.LabelAgentReady: value}}})
	if _, err := c.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType, patch, metav1.PatchOptions{FieldManager: "kvhandoff-transfer-agent"}); err != nil {
		return fmt.Errorf("labelling node %s %s=%v: %w", node, v1alpha1.LabelAgentReady, ready, err)
	}
	return nil
}
