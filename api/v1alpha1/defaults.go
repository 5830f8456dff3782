package v1alpha1

// Defaults of KVTransferPolicy's timeouts and limits. The CRD's +kubebuilder:default markers cannot
// name a constant, so they repeat these numbers; the transfer agent's fallbacks (for
// engines that send no policy) and the test builders use these constants, and an envtest
// spec checks that a policy the API server defaults equals the builder's, so no copy can
// change alone.
const (
	// DefaultLeaseSeconds is spec.leaseSeconds' default.
	DefaultLeaseSeconds = 30
	// DefaultRegistrationTimeoutSeconds is spec.registrationTimeoutSeconds' default.
	DefaultRegistrationTimeoutSeconds = 480
	// DefaultBlocksTTLSeconds is spec.blocksTTLSeconds' default.
	DefaultBlocksTTLSeconds = 480
	// DefaultHandoffFailureLimitPercent is spec.handoffFailureLimitPercent's default.
	DefaultHandoffFailureLimitPercent = 5
	// DefaultHealthWindowSeconds is spec.healthWindowSeconds' default.
	DefaultHealthWindowSeconds = 60
	// DefaultOverlapWeight and DefaultLoadWeight are spec.routing's weights' defaults.
	DefaultOverlapWeight = 4
	DefaultLoadWeight    = 1
	// DefaultStabilizationWindowSeconds, DefaultWarmupSeconds and DefaultLatencyPercentile
	// are a DecodePool's spec.autoscaling defaults.
	DefaultStabilizationWindowSeconds = 300
	DefaultWarmupSeconds              = 60
	DefaultLatencyPercentile          = 90
)
