package rendezvous

import (
	"errors"
	"testing"
	"time"
)

type conn struct{ name string }

func TestAHoldIsReadByOneAttemptAndEndsWithItsReleaseOrLease(t *testing.T) {
	a, b := &conn{"a"}, &conn{"b"}
	h := NewHolds[*conn](10*time.Second, 30*time.Second, 0)
	if err := h.Ready(t0, Part{Request: "r1", Blocks: []uint32{4, 5}, Final: true}); err != nil {
		t.Fatal(err)
	}
	if err := h.Ready(t0, Part{Request: "r1", Offset: 2, Blocks: []uint32{6}}); err == nil {
		t.Fatal("a part after the final one was accepted")
	}
	if _, err := h.Acquire(t0, "r1", 1, a, "", []uint32{4, 9}); err == nil {
		t.Fatal("a block the request does not hold was granted")
	}
	if _, err := h.Acquire(t0, "r1", 1, a, "", []uint32{4, 5}); err != nil {
		t.Fatal(err)
	}
	if !h.Acquired() {
		t.Fatal("an acquired hold is not reported as being read")
	}
	if _, err := h.Acquire(t0, "r1", 2, b, "", []uint32{4, 5}); err == nil {
		t.Fatal("a second attempt was granted blocks another is reading")
	}
	if h.Cancel("r1") {
		t.Fatal("the prefill engine's cancel dropped blocks a decode agent is reading")
	}
	if _, _, ok := h.Release("r1", 1, b); ok {
		t.Fatal("another connection released the hold")
	}
	// Past the blocks TTL but within the lease: still held for the reader.
	if exp := h.Expire(t0.Add(29 * time.Second)); len(exp) != 0 {
		t.Fatalf("expired within the lease: %v", exp)
	}
	if exp := h.Expire(t0.Add(30 * time.Second)); len(exp) != 1 || exp[0].Request != "r1" {
		t.Fatalf("at the lease's end: %v", exp)
	}
	if _, _, ok := h.Release("r1", 1, a); ok {
		t.Fatal("released a hold that had expired")
	}
	if h.Acquired() {
		t.Fatal("an expired hold is still reported as being read")
	}
}

func TestAnUnacquiredHoldExpiresAfterTheBlocksTTL(t *testing.T) {
	h := NewHolds[*conn](10*time.Second, 30*time.Second, 0)
	if err := h.Ready(t0, Part{Request: "r1", Blocks: []uint32{4}, Final: true}); err != nil {
		t.Fatal(err)
	}
	if exp := h.Expire(t0.Add(10*time.Second - time.Millisecond)); len(exp) != 0 {
		t.Fatalf("expired early: %v", exp)
	}
	if exp := h.Expire(t0.Add(10 * time.Second)); len(exp) != 1 {
		t.Fatalf("at the TTL: %v", exp)
	}
}

// A hold whose lease ended before its release still has the decode agent's reads in
// flight: the prefill side must keep polling (Acquired) until that agent releases it,
// its connection is lost, or the drain limit passes — on tcp;ofi_rxm those reads
// complete only while it polls, and the decode request waits on them.
func TestAHoldWhoseLeaseEndedDrainsUntilItsReaderLetsGo(t *testing.T) {
	a, b := &conn{"a"}, &conn{"b"}
	h := NewHolds[*conn](10*time.Second, 30*time.Second, 0)
	for _, req := range []string{"r1", "r2", "r3"} {
		if err := h.Ready(t0, Part{Request: req, Blocks: []uint32{4}, Final: true}); err != nil {
			t.Fatal(err)
		}
	}
	for req, by := range map[string]*conn{"r1": a, "r2": b, "r3": a} {
		if _, err := h.Acquire(t0, req, 1, by, "", []uint32{4}); err != nil {
			t.Fatal(err)
		}
	}
	end := t0.Add(30 * time.Second)
	if exp := h.Expire(end); len(exp) != 3 {
		t.Fatalf("at the lease's end: %v", exp)
	}
	if _, _, ok := h.Release("r1", 1, a); ok || !h.Acquired() {
		t.Fatalf("releasing a draining hold: ok %v (the engine already heard), still read %v (r2, r3 drain)", ok, h.Acquired())
	}
	h.PeerLost(b)
	if !h.Acquired() {
		t.Fatal("r3 stopped draining when another connection was lost")
	}
	h.Expire(end.Add(DrainLimit - time.Millisecond))
	if !h.Acquired() {
		t.Fatal("r3 stopped draining before the drain limit")
	}
	h.Expire(end.Add(DrainLimit))
	if h.Acquired() {
		t.Fatal("r3 still drains after the drain limit")
	}
}

// A pull that comes before its blocks is told they are not ready (the prefill agent then
// waits for them), until the request's final part: a block missing then is refused.
func TestAPullBeforeTheFinalPartIsNotReadyAndAfterItGrantedOrRefused(t *testing.T) {
	a := &conn{"a"}
	h := NewHolds[*conn](10*time.Second, 30*time.Second, 0)
	if _, err := h.Acquire(t0, "r1", 1, a, "", []uint32{4, 5}); !errors.Is(err, ErrNotReady) {
		t.Fatalf("before any part: %v, want ErrNotReady", err)
	}
	if err := h.Ready(t0, Part{Request: "r1", Blocks: []uint32{4}}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.Acquire(t0, "r1", 1, a, "", []uint32{4, 5}); !errors.Is(err, ErrNotReady) {
		t.Fatalf("before the final part: %v, want ErrNotReady", err)
	}
	if err := h.Ready(t0, Part{Request: "r1", Offset: 1, Blocks: []uint32{5}, Final: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.Acquire(t0, "r1", 1, a, "", []uint32{4, 5, 6}); err == nil || errors.Is(err, ErrNotReady) {
		t.Fatalf("a block the final request lacks: %v, want a refusal", err)
	}
	if _, err := h.Acquire(t0, "r1", 1, a, "", []uint32{4, 5}); err != nil {
		t.Fatal(err)
	}
}

// A decode engine holding a prefix reads only the tail's blocks: the release counts what
// was read, the SOURCE_DONE bytes and the pull byte counter with it.
func TestAReleaseCountsTheBlocksRead(t *testing.T) {
	a := &conn{"a"}
	h := NewHolds[*conn](10*time.Second, 30*time.Second, 0)
	if err := h.Ready(t0, Part{Request: "r1", Blocks: []uint32{4, 5, 6, 7}, Final: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.Acquire(t0, "r1", 1, a, "", []uint32{6, 7}); err != nil {
		t.Fatal(err)
	}
	if n, _, ok := h.Release("r1", 1, a); !ok || n != 2 {
		t.Fatalf("release of a 2-block tail of 4: %d blocks (ok %v), want 2", n, ok)
	}
}
