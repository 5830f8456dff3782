package kvevents

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/kvfollow"
	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
)

// The sidecar and its followers (package kvfollow, in routers and pickers), over real HTTP.

func newFollower(t *testing.T, history *prefix.Index, tokenValue string) (*kvfollow.Follower, *prometheus.Registry) {
	reg := prometheus.NewRegistry()
	f := kvfollow.NewFollower(1000, token(t, tokenValue), history, reg, kvfollow.Names{Live: "live", Blocks: "blocks", Resets: "resets"}, slog.New(slog.DiscardHandler))
	t.Cleanup(f.Stop)
	return f, reg
}

// A router follows an engine's sidecar: what the engine stores and evicts is what the
// router matches, from the snapshot on; an engine that empties its cache is forgotten by
// history too; a sidecar that goes leaves the engine to history until it is back.
func TestAFollowerMatchesWhatTheEngineHolds(t *testing.T) {
	s := newSidecar(t)
	h := hashes(1, 4)
	s.srv.Apply(Batch{Seq: 0, Events: []Event{stored(h[:2], "", seq(0, 8))}}) // before the router follows: in the snapshot
	history := prefix.NewIndex(100)
	f, reg := newFollower(t, history, poolToken)
	if _, ok := f.Match("e", nil); ok {
		t.Fatal("an engine not followed matched")
	}
	f.Sync([]discovery.Engine{{EngineID: "e", KVEventsURL: s.http.URL}})
	prompt := cut(t, "m", "", seq(0, 17), 4) // 4 whole blocks
	match := func() int { n, ok := f.Match("e", prompt); return map[bool]int{true: n, false: -1}[ok] }
	eventually(t, "the snapshot's 2 blocks", func() bool { return match() == 2 })
	if got := testutil.ToFloat64(gauge(t, reg, "live")); got != 1 {
		t.Errorf("live = %v, want 1", got)
	}
	s.srv.Apply(Batch{Seq: 1, Events: []Event{stored(h[2:4], h[1], seq(8, 8))}})
	eventually(t, "4 blocks after a store", func() bool { return match() == 4 })
	s.srv.Apply(Batch{Seq: 2, Events: []Event{{Kind: KindRemoved, Hashes: h[3:], Medium: "GPU"}, {Kind: KindRemoved, Hashes: h[2:3], Medium: "GPU"}}})
	eventually(t, "2 blocks after evictions", func() bool { return match() == 2 })

	// The engine restarted: its sequence starts again. Routing history of it goes too.
	history.Add("e", prompt)
	s.srv.Apply(Batch{Seq: 0})
	eventually(t, "nothing held after a restart", func() bool { return match() == 0 && history.Len("e") == 0 })
	if got := testutil.ToFloat64(counter(t, reg, "resets", "emptied")); got != 1 {
		t.Errorf("resets{emptied} = %v, want 1", got)
	}

	// Batches lost: the sidecar no longer knows what is held, and the follower drops it.
	s.srv.Apply(Batch{Seq: 1, Events: []Event{stored(h[:2], "", seq(0, 8))}})
	eventually(t, "2 blocks stored again", func() bool { return match() == 2 })
	s.srv.Apply(Batch{Seq: 5})
	eventually(t, "nothing held after a gap", func() bool { return match() == 0 })

	// The sidecar goes: the engine is no longer followed live, its choice is history's.
	s.http.CloseClientConnections()
	s.http.Close()
	eventually(t, "the engine not live", func() bool { return match() == -1 })
	if got := testutil.ToFloat64(counter(t, reg, "resets", "down")); got < 1 {
		t.Errorf("resets{down} = %v, want ≥ 1", got)
	}
	// An engine that leaves the set is no longer followed.
	f.Sync(nil)
	if f.Live() != 0 || f.Blocks() != 0 {
		t.Errorf("after the engine left: %d live, %d blocks", f.Live(), f.Blocks())
	}
}

// A follower without the pool's token gets nothing: the engine stays history's.
func TestAFollowerWithoutTheTokenGetsNoKeys(t *testing.T) {
	s := newSidecar(t)
	s.srv.Apply(Batch{Seq: 0, Events: []Event{stored(hashes(1, 2), "", seq(0, 8))}})
	f, reg := newFollower(t, prefix.NewIndex(100), strings.Repeat("cd", 32))
	f.Sync([]discovery.Engine{{EngineID: "e", KVEventsURL: s.http.URL}})
	eventually(t, "the refusal counted", func() bool { return testutil.ToFloat64(counter(t, reg, "resets", "down")) >= 1 })
	if _, ok := f.Match("e", nil); ok || f.Blocks() != 0 {
		t.Errorf("a refused follower is live, or holds %d blocks", f.Blocks())
	}
}
