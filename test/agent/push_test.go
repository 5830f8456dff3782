package agent_test

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/kvhandoff/kvhandoff/test/simengine"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

var bg = context.Background()

// pair is a prefill node and a decode node, each with an agent and one engine per TP rank.
type pair struct {
	A, B      *agentProc // prefill node's agent, decode node's agent
	P, D      []*simengine.Engine
	layout    simengine.Layout
	dirA      string
	dirB      string
	mode      agentv1.Mode
	agentArgs []string
}

func newPair(t *testing.T, mode agentv1.Mode, tp, blocks int, agentArgs ...string) *pair {
	p := &pair{layout: testLayout(tp, blocks), dirA: t.TempDir(), dirB: t.TempDir(), mode: mode, agentArgs: agentArgs}
	p.A = startAgent(t, "prefill-node", p.dirA, agentArgs...)
	p.B = startAgent(t, "decode-node", p.dirB, agentArgs...)
	for r := range tp {
		p.P = append(p.P, engine(t, p.A, "prefill-0.default", agentv1.Role_ROLE_PREFILL, mode, r, p.layout))
		p.D = append(p.D, engine(t, p.B, "decode-0.default", agentv1.Role_ROLE_DECODE, mode, r, p.layout))
	}
	return p
}

func alloc(t *testing.T, e *simengine.Engine, n int) []uint32 {
	t.Helper()
	b, err := e.Allocate(n)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// runs counts the maximal runs where both source and destination ids step by one.
func runs(src, dst []uint32) int {
	n := 0
	for i := range src {
		if i == 0 || src[i] != src[i-1]+1 || dst[i] != dst[i-1]+1 {
			n++
		}
	}
	return n
}

func TestPushDeliversVerifiedBytesInEitherOrder(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 2, 256)
	for _, registrationFirst := range []bool{true, false} {
		t.Run(fmt.Sprintf("registration first %v", registrationFirst), func(t *testing.T) {
			req := fmt.Sprintf("req-order-%v", registrationFirst)
			for r := range p.P {
				src, dst := alloc(t, p.P[r], 20), alloc(t, p.D[r], 20)
				p.P[r].Cache.Fill(req, src)
				register := func() {
					if err := p.D[r].RegisterDestination(bg, req, 1, dst, p.P[r].Self); err != nil {
						t.Fatal(err)
					}
				}
				ready := func() {
					if err := p.P[r].SourceReady(bg, req, 0, src, true); err != nil {
						t.Fatal(err)
					}
				}
				if registrationFirst {
					register()
					ready()
				} else {
					ready()
					register()
				}
				expect(t, wait(t, p.D[r], req, 1), agentv1.Event_DELIVERED)
				done := wait(t, p.P[r], req, 1)
				expect(t, done, agentv1.Event_SOURCE_DONE)
				if err := p.D[r].Cache.Verify(req, dst); err != nil {
					t.Fatal(err)
				}
				// Fresh allocators hand out descending ids, so every block is its own run
				// here unless the ids happen to be contiguous on both sides.
				if want := uint64(runs(src, dst) * p.layout.Regions()); done.Descriptors != want {
					t.Errorf("rank %d: %d descriptors, want %d (%d runs × %d regions)", r, done.Descriptors, want, runs(src, dst), p.layout.Regions())
				}
			}
		})
	}
}

// A push whose decode engine holds a prefix registers the tail only: the prefill agent
// writes the tail's positions into it, whichever half comes first, never the blocks the
// decode engine holds for the prefix, and counts the tail's bytes alone. An agent from
// before tails (it skips the registration's kind) would leave it to time out.
func TestAPushOfTheTailWritesOnlyTheTail(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 128)
	const prompt, cached = 12, 5
	moved := p.A.Metric(t, `kvhandoff_agent_transferred_bytes_total{mode="push"}`)
	for _, registrationFirst := range []bool{true, false} {
		req := fmt.Sprintf("req-tail-%v", registrationFirst)
		src, dst := alloc(t, p.P[0], prompt), alloc(t, p.D[0], prompt)
		p.P[0].Cache.Fill(req, src)
		// The decode engine's cached prefix: a sentinel that must stay.
		if err := p.D[0].Cache.Set(dst[:cached], 0xAB); err != nil {
			t.Fatal(err)
		}
		register := func() {
			if err := p.D[0].RegisterTail(bg, req, 1, cached, dst[cached:], p.P[0].Self); err != nil {
				t.Fatal(err)
			}
		}
		ready := func() {
			if err := p.P[0].SourceReady(bg, req, 0, src, true); err != nil {
				t.Fatal(err)
			}
		}
		if registrationFirst {
			register()
			ready()
		} else {
			ready()
			register()
		}
		expect(t, wait(t, p.D[0], req, 1), agentv1.Event_DELIVERED)
		done := wait(t, p.P[0], req, 1)
		expect(t, done, agentv1.Event_SOURCE_DONE)
		if err := p.D[0].Cache.VerifyTail(req, cached, dst[cached:]); err != nil {
			t.Fatal(err)
		}
		if err := p.D[0].Cache.Load(dst[:cached]); err != nil {
			t.Fatal(err)
		}
		bb := p.layout.BlockBytes()
		sentinel := bytes.Repeat([]byte{0xAB}, bb)
		for _, region := range p.D[0].Cache.Regions {
			for _, b := range dst[:cached] {
				if !bytes.Equal(region[int(b)*bb:(int(b)+1)*bb], sentinel) {
					t.Fatalf("%s: decode's cached block %d was written", req, b)
				}
			}
		}
		tailBytes := uint64((prompt - cached) * p.layout.BlockBytes() * p.layout.Regions())
		if done.Bytes != tailBytes {
			t.Errorf("%s: SOURCE_DONE says %d bytes, want the tail's %d", req, done.Bytes, tailBytes)
		}
	}
	if got, want := p.A.Metric(t, `kvhandoff_agent_transferred_bytes_total{mode="push"}`)-moved, float64(2*(prompt-cached)*p.layout.BlockBytes()*p.layout.Regions()); got != want {
		t.Errorf("prefill agent's transferred bytes: %v, want %v (the tails)", got, want)
	}
}

func TestPushConcurrentRequestsAcrossRanksAndParts(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 2, 512)
	const requests = 12
	var wg sync.WaitGroup
	errs := make(chan error, requests*len(p.P))
	for i := range requests {
		for r := range p.P {
			wg.Add(1)
			go func() {
				defer wg.Done()
				req := fmt.Sprintf("req-%d", i)
				n := 8 + i%5
				src, err := p.P[r].Allocate(n)
				if err != nil {
					errs <- err
					return
				}
				dst, err := p.D[r].Allocate(n)
				if err != nil {
					errs <- err
					return
				}
				p.P[r].Cache.Fill(req, src)
				if err := p.D[r].RegisterDestination(bg, req, 1, dst, p.P[r].Self); err != nil {
					errs <- err
					return
				}
				// Two parts, as a layer-streamed prefill would report them.
				half := n / 2
				if err := p.P[r].SourceReady(bg, req, 0, src[:half], false); err != nil {
					errs <- err
					return
				}
				if err := p.P[r].SourceReady(bg, req, uint32(half), src[half:], true); err != nil {
					errs <- err
					return
				}
				ctx := context.Background()
				ev, err := p.D[r].Wait(ctx, req, 1)
				if err != nil || ev.Type != agentv1.Event_DELIVERED {
					errs <- fmt.Errorf("%s rank %d: %v %v", req, r, ev, err)
					return
				}
				if err := p.D[r].Cache.Verify(req, dst); err != nil {
					errs <- err
				}
				p.D[r].Free(dst)
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestContiguousBlocksMergeIntoOneWritePerRegion(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 256)
	src := []uint32{10, 11, 12, 13, 14, 15, 16, 17, 40, 41, 42, 43}
	dst := []uint32{100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111}
	p.P[0].Cache.Fill("merge", src)
	if err := p.D[0].RegisterDestination(bg, "merge", 1, dst, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	if err := p.P[0].SourceReady(bg, "merge", 0, src, true); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, p.D[0], "merge", 1), agentv1.Event_DELIVERED)
	done := wait(t, p.P[0], "merge", 1)
	if want := uint64(2 * p.layout.Regions()); done.Descriptors != want {
		t.Fatalf("%d descriptors, want %d: two contiguous runs in each of %d regions", done.Descriptors, want, p.layout.Regions())
	}
	if err := p.D[0].Cache.Verify("merge", dst); err != nil {
		t.Fatal(err)
	}
}
