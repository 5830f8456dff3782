package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// DecodePoolSpec is the desired state of a DecodePool.
type DecodePoolSpec struct {
	EngineSpec `json:",inline"`

	// prefillPoolRef names the PrefillPool whose KV this pool's engines receive.
	// +required
	PrefillPoolRef PoolReference `json:"prefillPoolRef"`
}

// DecodePool is a set of vLLM engines that generate tokens from KV caches built by the
// engines of the PrefillPool it names.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:subresource:scale:specpath=.spec.replicas,statuspath=.status.replicas,selectorpath=.status.selector
// +kubebuilder:resource:shortName=dcp,categories=kvhandoff
// +kubebuilder:printcolumn:name="Model",type=string,JSONPath=`.spec.model`
// +kubebuilder:printcolumn:name="TP",type=integer,JSONPath=`.spec.tensorParallelSize`
// +kubebuilder:printcolumn:name="Replicas",type=integer,JSONPath=`.spec.replicas`
// +kubebuilder:printcolumn:name="Ready",type=integer,JSONPath=`.status.readyReplicas`
// +kubebuilder:printcolumn:name="Mode",type=string,JSONPath=`.status.mode`
// +kubebuilder:printcolumn:name="Prefill",type=string,JSONPath=`.spec.prefillPoolRef.name`,priority=1
// +kubebuilder:printcolumn:name="Policy",type=string,JSONPath=`.spec.transferPolicyRef.name`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type DecodePool struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the desired state of the pool.
	// +required
	Spec DecodePoolSpec `json:"spec"`

	// status is the observed state of the pool.
	// +optional
	Status PoolStatus `json:"status,omitempty"`
}

// DecodePoolList is a list of DecodePool.
//
// +kubebuilder:object:root=true
type DecodePoolList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []DecodePool `json:"items"`
}
