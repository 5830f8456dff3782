package autoscale

// Step is the sizes to apply now on the way from applied to desired, given the pods each
// role still has (terminating ones hold their accelerators until they are gone): a role
// shrinks at once; a role grows only into accelerators the budget has free after the
// other role's pods. So a rebalance never exceeds the budget, even for a moment: the
// over-provisioned role shrinks first, and the other follows as its pods go.
func Step(desired, applied, pods Sizes, t Targets) (next Sizes, waiting bool) {
	next = Sizes{min(applied.Prefill, desired.Prefill), min(applied.Decode, desired.Decode)}
	if desired.Prefill > next.Prefill {
		free := t.Budget - t.Cost(Sizes{Decode: max(next.Decode, pods.Decode)})
		next.Prefill = max(next.Prefill, min(desired.Prefill, free/max(t.PrefillPerEngine, 1)))
	}
	if desired.Decode > next.Decode {
		free := t.Budget - t.Cost(Sizes{Prefill: max(next.Prefill, pods.Prefill)})
		next.Decode = max(next.Decode, min(desired.Decode, free/max(t.DecodePerEngine, 1)))
	}
	return next, next != desired
}
