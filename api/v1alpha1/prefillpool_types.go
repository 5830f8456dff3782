package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// PrefillPoolSpec is the desired state of a PrefillPool.
type PrefillPoolSpec struct {
	EngineSpec `json:",inline"`
}

// PrefillPool is a set of vLLM engines that process prompts and build the KV cache that
// a DecodePool's engines then generate from.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:subresource:scale:specpath=.spec.replicas,statuspath=.status.replicas,selectorpath=.status.selector
// +kubebuilder:resource:shortName=pfp,categories=kvhandoff
// +kubebuilder:printcolumn:name="Model",type=string,JSONPath=`.spec.model`
// +kubebuilder:printcolumn:name="TP",type=integer,JSONPath=`.spec.tensorParallelSize`
// +kubebuilder:printcolumn:name="Replicas",type=integer,JSONPath=`.spec.replicas`
// +kubebuilder:printcolumn:name="Ready",type=integer,JSONPath=`.status.readyReplicas`
// +kubebuilder:printcolumn:name="Mode",type=string,JSONPath=`.status.mode`
// +kubebuilder:printcolumn:name="Policy",type=string,JSONPath=`.spec.transferPolicyRef.name`,priority=1
// +kubebuilder:printcolumn:name="Transfer",type=string,JSONPath=`.status.conditions[?(@.type=="TransferHealthy")].reason`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type PrefillPool struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the desired state of the pool.
	// +required
	Spec PrefillPoolSpec `json:"spec"`

	// status is the observed state of the pool.
	// +optional
	Status PoolStatus `json:"status,omitempty"`
}

// PrefillPoolList is a list of PrefillPool.
//
// +kubebuilder:object:root=true
type PrefillPoolList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []PrefillPool `json:"items"`
}
