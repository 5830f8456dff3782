package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// AutoscalingSpec sizes a DecodePool and its PrefillPool together from the latency their
// clients see: prefill engines from the prompt tokens offered against what one engine
// prefills within the TTFT target, decode engines from the requests in flight against
// what one engine generates within the ITL target, both within one accelerator budget.
// While it is set the manager owns both pools' replicas: spec.replicas (and /scale) of
// either pool is then only where the pair starts.
//
// +kubebuilder:validation:XValidation:rule="self.prefill.minReplicas <= self.prefill.maxReplicas",message="autoscaling.prefill.minReplicas must not exceed autoscaling.prefill.maxReplicas"
// +kubebuilder:validation:XValidation:rule="self.decode.minReplicas <= self.decode.maxReplicas",message="autoscaling.decode.minReplicas must not exceed autoscaling.decode.maxReplicas"
// +kubebuilder:validation:XValidation:rule="self.prefill.minReplicas + self.decode.minReplicas <= self.acceleratorBudget",message="autoscaling.acceleratorBudget must hold both roles' minReplicas (each engine takes at least one accelerator)"
type AutoscalingSpec struct {
	// ttft is the time-to-first-token target, as the router measures it (from a request's
	// arrival to the first byte of its answer). Prefill engines are sized to meet it.
	// +required
	TTFT LatencyTarget `json:"ttft"`

	// itl is the inter-token latency target: the gap between a streamed answer's tokens,
	// as the router relays them. Decode engines are sized to meet it.
	// +required
	ITL LatencyTarget `json:"itl"`

	// prefill bounds the PrefillPool's replicas.
	// +required
	Prefill ReplicaRange `json:"prefill"`

	// decode bounds this pool's replicas.
	// +required
	Decode ReplicaRange `json:"decode"`

	// acceleratorBudget is the most accelerators both pools may hold together, counted
	// from each pool's accelerator.count (or tensorParallelSize × pipelineParallelSize); a
	// CPU engine counts as one. No decision exceeds it, nor does any moment of a
	// rebalance: the role that shrinks does so first, and the other grows only into what
	// its pods gave back.
	// +kubebuilder:validation:Minimum=1
	// +required
	AcceleratorBudget int32 `json:"acceleratorBudget"`

	// stabilizationWindowSeconds is how long a scale-down waits: a role shrinks only to
	// the largest size recommended over this window (the HorizontalPodAutoscaler's rule),
	// so a dip in load does not release engines a moment before they are needed again.
	// Scale-ups are not delayed.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=3600
	// +kubebuilder:default=300
	// +optional
	StabilizationWindowSeconds *int32 `json:"stabilizationWindowSeconds,omitempty"`

	// warmupSeconds is how long a new engine's latency is not counted: its first
	// requests pay for compilation, CUDA graphs and empty caches, and would make the pool
	// look slower than it is. Its load still counts.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=3600
	// +kubebuilder:default=60
	// +optional
	WarmupSeconds *int32 `json:"warmupSeconds,omitempty"`

	// windowSeconds is how far back each decision looks at the routers' measurements.
	// +kubebuilder:validation:Minimum=5
	// +kubebuilder:validation:Maximum=600
	// +kubebuilder:default=60
	// +optional
	WindowSeconds int32 `json:"windowSeconds,omitempty"`
}

// LatencyTarget is a latency objective at a percentile.
type LatencyTarget struct {
	// percentile of the requests (ttft) or token gaps (itl) that must be within milliseconds.
	// +kubebuilder:validation:Enum=50;90;95;99
	// +kubebuilder:default=90
	// +optional
	Percentile int32 `json:"percentile,omitempty"`

	// milliseconds is the target.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=600000
	// +required
	Milliseconds int32 `json:"milliseconds"`
}

// ReplicaRange bounds one role's replicas.
type ReplicaRange struct {
	// minReplicas is the fewest engines of the role, also when idle.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:default=1
	// +optional
	MinReplicas int32 `json:"minReplicas,omitempty"`

	// maxReplicas is the most engines of the role.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1024
	// +required
	MaxReplicas int32 `json:"maxReplicas"`
}

// AutoscalingStatus is what the autoscaler decided for a pair, and why.
type AutoscalingStatus struct {
	// owner is, on a PrefillPool, the DecodePool whose autoscaling sets its replicas.
	// +optional
	Owner string `json:"owner,omitempty"`

	// prefillReplicas and decodeReplicas are the replicas the pools run with now. They
	// may trail desired* while a rebalance waits for the other role's pods to go.
	// +optional
	PrefillReplicas int32 `json:"prefillReplicas,omitempty"`
	// +optional
	DecodeReplicas int32 `json:"decodeReplicas,omitempty"`

	// desiredPrefillReplicas and desiredDecodeReplicas are the last decision's sizes.
	// +optional
	DesiredPrefillReplicas int32 `json:"desiredPrefillReplicas,omitempty"`
	// +optional
	DesiredDecodeReplicas int32 `json:"desiredDecodeReplicas,omitempty"`

	// lastScaleTime is when the replicas last changed.
	// +optional
	LastScaleTime *metav1.Time `json:"lastScaleTime,omitempty"`

	// signals are the measurements the last decision was made from.
	// +optional
	Signals *AutoscalingSignals `json:"signals,omitempty"`
}

// AutoscalingSignals are the measurements over the last window, and what was learned
// from them.
type AutoscalingSignals struct {
	// promptTokensPerSecond is the prompt tokens the routers received per second.
	// +optional
	PromptTokensPerSecond int64 `json:"promptTokensPerSecond,omitempty"`
	// prefillTokensPerSecondPerEngine is the prefill rate one engine was measured at.
	// +optional
	PrefillTokensPerSecondPerEngine int64 `json:"prefillTokensPerSecondPerEngine,omitempty"`
	// decodeInFlight is the mean number of decode streams in flight.
	// +optional
	DecodeInFlight int64 `json:"decodeInFlight,omitempty"`
	// ttftMilliseconds is the TTFT at the target's percentile.
	// +optional
	TTFTMilliseconds int64 `json:"ttftMilliseconds,omitempty"`
	// itlMilliseconds is the inter-token latency at the target's percentile.
	// +optional
	ITLMilliseconds int64 `json:"itlMilliseconds,omitempty"`
}

// ConditionAutoscaling is, on a DecodePool with autoscaling, what the last decision did
// and why; its message carries the numbers. Informational: it never makes the pool
// Degraded (a pool that cannot meet its targets within its budget still serves).
const ConditionAutoscaling = "Autoscaling"

// Reasons of the Autoscaling condition (status True unless said otherwise).
const (
	// ReasonWithinTargets: the pair meets its targets at its current size.
	ReasonWithinTargets = "WithinTargets"
	// ReasonScaledUp: a role grew to meet a target.
	ReasonScaledUp = "ScaledUp"
	// ReasonScaledDown: a role shrank: the load needs fewer engines.
	ReasonScaledDown = "ScaledDown"
	// ReasonRebalancing: one role waits for the other's engines to go before it grows, to
	// stay within the budget.
	ReasonRebalancing = "Rebalancing"
	// ReasonBudgetExhausted: the targets need more accelerators than the budget holds
	// (False).
	ReasonBudgetExhausted = "BudgetExhausted"
	// ReasonAtMaxReplicas: a role needs more engines than its maxReplicas (False).
	ReasonAtMaxReplicas = "AtMaxReplicas"
	// ReasonMetricsUnavailable: no router reported over the window; the sizes hold
	// (Unknown).
	ReasonMetricsUnavailable = "MetricsUnavailable"
	// ReasonAutoscalingBudgetTooSmall: the budget does not hold both roles' minReplicas
	// at their accelerators per engine; nothing is scaled until it does (False).
	ReasonAutoscalingBudgetTooSmall = "BudgetTooSmall"
)
