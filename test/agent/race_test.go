package agent_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// The race probe: a decode engine ends 0 to 4 ms into a 64 MiB push. Its engine is gone,
// so no attempt of the request follows; the prefill engine hears a named outcome for the
// request promptly (the transfer delivered, or failed naming the decode engine's end)
// and frees its blocks, instead of holding them for the blocks TTL (19 of 20 rounds had
// no outcome within 5 s).
func TestAPushWhoseDecodeEngineEndsEndsForPrefillToo(t *testing.T) {
	const blocks = 4096 // 16 KiB each across the regions: 64 MiB
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, blocks)
	pe := p.P[0]
	rssA, rssB := rss(t, p.A.Pid()), rss(t, p.B.Pid())
	for round := range 20 {
		req := fmt.Sprintf("race-%d", round)
		de := engine(t, p.B, fmt.Sprintf("decode-r%d.default", round), agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH, 0, p.layout)
		src, dst := alloc(t, pe, blocks), alloc(t, de, blocks)
		if err := de.RegisterDestination(bg, req, 1, dst, pe.Self); err != nil {
			t.Fatal(err)
		}
		if err := pe.SourceReady(bg, req, 0, src, true); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(round%5) * time.Millisecond) // the race's width, not a synchronisation
		de.Stop()
		ctx, cancel := context.WithTimeout(bg, 5*time.Second)
		ev, err := pe.Wait(ctx, req, 1)
		cancel()
		if err != nil {
			t.Fatalf("round %d: the prefill engine heard no outcome within 5 s of its decode engine's end: %v", round, err)
		}
		if ev.Type != agentv1.Event_SOURCE_DONE && ev.Type != agentv1.Event_FAILED {
			t.Fatalf("round %d: the prefill engine heard %s", round, ev.Type)
		}
		pe.Free(src)
	}
	t.Logf("agent RSS over the 20 rounds: prefill %.0f → %.0f MB, decode %.0f → %.0f MB", rssA, rss(t, p.A.Pid()), rssB, rss(t, p.B.Pid()))
}

// A delivery signal lost in the provider (seen under CPU starvation; here the fault hook
// drops the first) does not strand the request: the prefill agent also says it posted
// the signal, and the decode agent, holding that word but no signal after a grace, asks
// for it again. The request is delivered, its bytes verified, and the next one too.
func TestALostDeliverySignalIsAskedForAgain(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64, "--test-drop-delivery-signals", "1")
	transfer(t, p.P[0], p.D[0], "signal-lost")
	transfer(t, p.P[0], p.D[0], "signal-kept")
	if asked := p.B.Metric(t, `kvhandoff_agent_delivery_resignals_total{side="asked"}`); asked < 1 {
		t.Errorf("the decode agent asked for %v signals again; want at least the lost one", asked)
	}
	if sent := p.A.Metric(t, `kvhandoff_agent_delivery_resignals_total{side="sent"}`); sent < 1 {
		t.Errorf("the prefill agent posted %v signals again; want at least the lost one", sent)
	}
}
