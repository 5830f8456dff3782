package agent_test

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// Layer-streamed push over two real agents: each layer group (two of the test layout's
// four regions) is written as soon as it is reported, and decode hears DELIVERED with
// every group in place.
func TestLayerGroupsLandAsTheyAreReported(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	P, D := p.P[0], p.D[0]
	src, dst := alloc(t, P, 6), alloc(t, D, 6)
	P.Cache.Fill("layers", src)
	if err := D.RegisterDestination(bg, "layers", 1, dst, P.Self); err != nil {
		t.Fatal(err)
	}
	if err := P.SourceRegionsReady(bg, "layers", 0, 2, src, false); err != nil {
		t.Fatal(err)
	}
	// The first group lands before the second is even reported.
	until(t, "the first layer group landed", func() bool { return D.Cache.VerifyRegions("layers", dst, 0, 2) == nil })
	if err := D.Cache.VerifyRegions("layers", dst, 2, 4); err == nil {
		t.Fatal("the second layer group landed before prefill reported it")
	}
	if err := P.SourceRegionsReady(bg, "layers", 2, 2, src, true); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, D, "layers", 1), agentv1.Event_DELIVERED)
	if err := D.Cache.Verify("layers", dst); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, P, "layers", 1), agentv1.Event_SOURCE_DONE)
	if n := p.A.Metric(t, `kvhandoff_agent_source_parts_total{kind="layer_group"}`); n != 2 {
		t.Errorf("%v layer groups counted, want 2", n)
	}
}

// A cancel between two groups: nothing lands in the cancelled attempt's blocks after the
// acknowledgement, and the retry gets every group, the one written before included.
func TestACancelBetweenLayerGroupsAndARetry(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	P, D := p.P[0], p.D[0]
	src, first := alloc(t, P, 6), alloc(t, D, 6)
	P.Cache.Fill("cancel-between", src)
	if err := D.RegisterDestination(bg, "cancel-between", 1, first, P.Self); err != nil {
		t.Fatal(err)
	}
	if err := P.SourceRegionsReady(bg, "cancel-between", 0, 2, src, false); err != nil {
		t.Fatal(err)
	}
	until(t, "the first layer group landed", func() bool { return D.Cache.VerifyRegions("cancel-between", first, 0, 2) == nil })
	if err := D.Cancel(bg, "cancel-between", 1); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, D, "cancel-between", 1), agentv1.Event_CANCEL_ACKED)
	sentinel(t, D, first)
	if err := P.SourceRegionsReady(bg, "cancel-between", 2, 2, src, true); err != nil {
		t.Fatal(err)
	}
	retry := alloc(t, D, 6)
	if err := D.RegisterDestination(bg, "cancel-between", 2, retry, P.Self); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, D, "cancel-between", 2), agentv1.Event_DELIVERED)
	if err := D.Cache.Verify("cancel-between", retry); err != nil {
		t.Fatal(err)
	}
	untouched(t, D, first)
}

// Layer groups the agent cannot honour are refused with the field named.
func TestBadLayerGroupsAreRefused(t *testing.T) {
	push := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	src := alloc(t, push.P[0], 2)
	if err := push.P[0].SourceRegionsReady(bg, "no-such-regions", 9, 4, src, true); status.Code(err) != codes.InvalidArgument {
		t.Errorf("regions 9..12 of a four-region engine: %v, want InvalidArgument", err)
	}
	if err := push.P[0].SourceRegionsReady(bg, "twice", 0, 2, src, false); err != nil {
		t.Fatal(err)
	}
	if err := push.P[0].SourceRegionsReady(bg, "twice", 1, 2, src, true); status.Code(err) != codes.InvalidArgument {
		t.Errorf("region 1 reported twice: %v, want InvalidArgument", err)
	}
	pull := newPair(t, agentv1.Mode_MODE_PULL, 1, 64)
	if err := pull.P[0].SourceRegionsReady(bg, "pull", 0, 2, alloc(t, pull.P[0], 2), true); status.Code(err) != codes.InvalidArgument {
		t.Errorf("a layer group in pull mode: %v, want InvalidArgument", err)
	}
}
