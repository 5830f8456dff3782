package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// DecodePoolSpec is the desired state of a DecodePool.
type DecodePoolSpec struct {
	EngineSpec `json:",inline"`

	// prefillPoolRef names the PrefillPool whose KV this pool's engines receive.
	// +required
	PrefillPoolRef PoolReference `json:"prefillPoolRef"`

	// router is the request router clients reach this pool through: it sends each
	// request's prefill leg to the PrefillPool and its decode leg here, in the policy's mode.
	// +kubebuilder:default={}
	// +optional
	Router RouterSpec `json:"router,omitempty"`

	// gateway puts the pool behind a Gateway API Inference Extension gateway (Istio, NGINX
	// Gateway Fabric, agentgateway, Envoy): an InferencePool for an HTTPRoute to name, the
	// endpoint picker it calls, and a leg runner in each decode engine pod. Off by default;
	// the router above stays the path for clients without a gateway.
	// +kubebuilder:default={}
	// +optional
	Gateway GatewaySpec `json:"gateway,omitempty"`

	// autoscaling sizes this pool and its PrefillPool from TTFT and ITL targets within an
	// accelerator budget (docs/operations.md#autoscaling). Unset, each pool's
	// spec.replicas holds, and /scale (kubectl scale, a HorizontalPodAutoscaler) sets it.
	// +optional
	Autoscaling *AutoscalingSpec `json:"autoscaling,omitempty"`
}

// GatewaySpec is a DecodePool's place behind a Gateway API Inference Extension gateway.
type GatewaySpec struct {
	// inferencePool renders an InferencePool named like the pool
	// (inference.networking.k8s.io/v1) selecting this pool's decode engines on the leg-runner
	// port (8100), the endpoint picker it names (a Deployment and a gRPC Service
	// <pool>-epp, port 9002), and a leg-runner sidecar in each decode engine pod, which
	// runs both legs with the prefill engine the picker chose. Needs the InferencePool CRD
	// in the cluster: without it the pool's InferencePoolReady condition says so. false
	// removes them (decode engines roll to drop the sidecar).
	// +kubebuilder:default=false
	// +optional
	InferencePool bool `json:"inferencePool,omitempty"`

	// failureMode is the InferencePool's endpointPickerRef.failureMode: what the gateway
	// does when the endpoint picker does not answer. FailClose refuses the request;
	// FailOpen sends it to a decode engine of the gateway's choosing, whose leg runner then
	// follows the policy's handoffFailurePolicy. Envoy-based gateways can fail open only
	// while no request body has gone to the picker (docs/gateway.md).
	// +kubebuilder:validation:Enum=FailOpen;FailClose
	// +kubebuilder:default=FailClose
	// +optional
	FailureMode GatewayFailureMode `json:"failureMode,omitempty"`

	// endpointPickerReplicas is the number of endpoint picker pods. They keep no state
	// a request needs after it is routed, so any replica serves any request.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=16
	// +kubebuilder:default=2
	// +optional
	EndpointPickerReplicas *int32 `json:"endpointPickerReplicas,omitempty"`

	// pickerClients are the only peers a NetworkPolicy rendered with the endpoint picker
	// admits to its gRPC port (9002): the gateway's ext_proc client. Unset, the pods of
	// any namespace labelled as a Gateway API gateway's
	// (gateway.networking.k8s.io/gateway-name, or Envoy Gateway's
	// gateway.envoyproxy.io/owning-gateway-name). A gateway whose proxies are not pods of
	// the cluster (a cloud load balancer) needs its source range here as an ipBlock. The
	// picker's metrics port (9003) stays open.
	// +kubebuilder:validation:MaxItems=16
	// +listType=atomic
	// +optional
	PickerClients []PickerClient `json:"pickerClients,omitempty"`
}

// PickerClient is a peer admitted to the endpoint picker: pods by their labels (in
// namespaces by theirs), or an address range.
// +kubebuilder:validation:XValidation:rule="has(self.ipBlock) != (has(self.podSelector) || has(self.namespaceSelector))",message="set ipBlock, or podSelector and/or namespaceSelector"
type PickerClient struct {
	// podSelector selects the client pods (in the namespaces namespaceSelector selects, or
	// the pool's own without it).
	// +optional
	PodSelector *metav1.LabelSelector `json:"podSelector,omitempty"`
	// namespaceSelector selects the namespaces of the client pods; {} is every namespace.
	// +optional
	NamespaceSelector *metav1.LabelSelector `json:"namespaceSelector,omitempty"`
	// ipBlock admits an address range, for clients that are not pods of the cluster.
	// +optional
	IPBlock *PickerIPBlock `json:"ipBlock,omitempty"`
}

// PickerIPBlock is a CIDR range, less the ranges in except.
type PickerIPBlock struct {
	// cidr is the range, as 198.18.0.0/24 or 2001:db8::/64.
	// +kubebuilder:validation:MinLength=1
	CIDR string `json:"cidr"`
	// except are ranges within cidr that are not admitted.
	// +kubebuilder:validation:MaxItems=16
	// +listType=atomic
	// +optional
	Except []string `json:"except,omitempty"`
}

// GatewayFailureMode is what a gateway does when the endpoint picker does not answer.
type GatewayFailureMode string

// Gateway failure modes, the InferencePool's.
const (
	// GatewayFailClose: the gateway refuses the request.
	GatewayFailClose GatewayFailureMode = "FailClose"
	// GatewayFailOpen: the gateway sends the request to a decode engine of its choosing.
	GatewayFailOpen GatewayFailureMode = "FailOpen"
)

// RouterSpec is the Deployment that routes requests to a DecodePool and its PrefillPool.
type RouterSpec struct {
	// enabled renders the router: a Deployment, a Service <pool>-router (port 8000, named
	// http), a PodDisruptionBudget and a ServiceAccount with a Role that can only read the
	// namespace's pools and pods. false removes them.
	// +kubebuilder:default=true
	// +optional
	Enabled *bool `json:"enabled,omitempty"`

	// replicas is the number of router pods. Routers keep no state across requests, so any
	// replica serves any request; two survive a node drain.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=64
	// +kubebuilder:default=2
	// +optional
	Replicas *int32 `json:"replicas,omitempty"`

	// image is the router's container image; empty means the router image of the
	// manager's own version (the manager's --router-image).
	// +kubebuilder:validation:MaxLength=1024
	// +optional
	Image string `json:"image,omitempty"`

	// resources of the router container; empty means a request of 100m CPU and 128Mi memory.
	// +optional
	Resources *corev1.ResourceRequirements `json:"resources,omitempty"`
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
// +kubebuilder:printcolumn:name="Router",type=string,JSONPath=`.status.routerService`
// +kubebuilder:printcolumn:name="Transfer",type=string,JSONPath=`.status.conditions[?(@.type=="TransferHealthy")].reason`,priority=1
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
