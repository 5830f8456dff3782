package choice

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvhandoff/kvhandoff/internal/router/balance"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
)

func engine(id, hash string) discovery.Engine {
	return discovery.Engine{EngineID: id, CompatHash: hash}
}

func newChooser() (*Chooser, *prometheus.GaugeVec) {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "inflight"}, []string{"role", "engine"})
	ix := prefix.NewIndex(0)
	return New(balance.New(5*time.Second), ix, nil, NewMetrics(prometheus.NewRegistry(), Names{"c", "d", "t", "b", "l"}, ix), g), g
}

// Only engines whose compat-hash the other pool has too can be paired; the reason names
// what is missing.
func TestPairableKeepsEnginesOfASharedCompatHash(t *testing.T) {
	set := &discovery.Set{Source: "test",
		Prefill: []discovery.Engine{engine("p1", "a"), engine("p2", "b"), engine("p3", "a")},
		Decode:  []discovery.Engine{engine("d1", "a"), engine("d2", "c")}}
	p, d, why := Pairable(set, nil)
	if why != "" || len(p) != 2 || p[0].EngineID != "p1" || p[1].EngineID != "p3" || len(d) != 1 || d[0].EngineID != "d1" {
		t.Errorf("Pairable = %v %v %q, want p1 p3 / d1", p, d, why)
	}
	if _, _, why := Pairable(set, map[string]bool{"p1": true, "p3": true}); !strings.Contains(why, "share a compat-hash") {
		t.Errorf("with p1 and p3 excluded: why %q", why)
	}
	if _, _, why := Pairable(set, map[string]bool{"d1": true, "d2": true}); !strings.Contains(why, "no other ready decode engine to retry on") {
		t.Errorf("with every decode engine excluded: why %q", why)
	}
	if _, _, why := Pairable(&discovery.Set{Source: "test", Decode: set.Decode}, nil); !strings.Contains(why, "no ready prefill engine") {
		t.Errorf("no prefill: why %q", why)
	}
}

// A push pair is chosen decode first; its prefill engine has the decode engine's hash,
// and both count a leg in flight until released.
func TestPushPicksAPairOfOneHashAndCountsItsLegs(t *testing.T) {
	c, g := newChooser()
	prefills := []discovery.Engine{engine("p1", "a"), engine("p2", "b")}
	decodes := []discovery.Engine{engine("d1", "b")}
	p, d, _ := c.Push(Routing{}, prefills, decodes, Request{Tokens: 100})
	if p.EngineID != "p2" || d.EngineID != "d1" {
		t.Fatalf("Push chose %s and %s, want p2 (hash b) and d1", p.EngineID, d.EngineID)
	}
	if v := value(g.WithLabelValues("prefill", "p2")); v != 1 {
		t.Errorf("inflight of p2 = %v, want 1", v)
	}
	p.Release()
	p.Release() // idempotent
	if v := value(g.WithLabelValues("prefill", "p2")); v != 0 {
		t.Errorf("inflight of p2 after release = %v, want 0", v)
	}
	if n, _ := c.bal.Outstanding(balance.Decode, "d1"); n != 1 {
		t.Errorf("d1 outstanding %d, want 1", n)
	}
	d.Release()
}

// A pull's decode engine is one of its prefill engine's hash; none is a named reason.
func TestPullDecodeFollowsThePrefillEnginesHash(t *testing.T) {
	c, _ := newChooser()
	set := &discovery.Set{Source: "test", Prefill: []discovery.Engine{engine("p1", "a"), engine("p2", "b")},
		Decode: []discovery.Engine{engine("d1", "a"), engine("d2", "b")}}
	d, why := c.PullDecode(set, engine("p2", "b"), 10, nil)
	if why != "" || d.EngineID != "d2" {
		t.Errorf("PullDecode = %s %q, want d2", d.EngineID, why)
	}
	d.Release()
	if _, why := c.PullDecode(set, engine("p9", "z"), 10, nil); !strings.Contains(why, `compat-hash "z"`) {
		t.Errorf("no decode of hash z: why %q", why)
	}
}

// Forget deletes the inflight series of engines that left and have nothing in flight,
// and keeps those that still have a leg.
func TestForgetDropsTheSeriesOfEnginesThatLeft(t *testing.T) {
	c, g := newChooser()
	a := c.Take(balance.Prefill, []discovery.Engine{engine("p1", "a")}, 1)
	b := c.Take(balance.Prefill, []discovery.Engine{engine("p2", "a")}, 1)
	a.Release()
	c.Forget(&discovery.Set{})
	if n := series(g); n != 1 {
		t.Errorf("%d series after Forget, want 1 (p2's, still in flight)", n)
	}
	b.Release()
	c.Forget(&discovery.Set{})
	if n := series(g); n != 0 {
		t.Errorf("%d series after the last leg ended, want 0", n)
	}
}

func value(g prometheus.Gauge) float64 {
	var m dto.Metric
	_ = g.Write(&m)
	return m.GetGauge().GetValue()
}

func series(g *prometheus.GaugeVec) int {
	ch := make(chan prometheus.Metric, 16)
	g.Collect(ch)
	close(ch)
	return len(ch)
}
