package controller

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/load"
)

// The attack: a pool author's router image served /load reports of 350k made-up TTFT
// keys (3.94 MiB), 29.4 MB of manager heap a sample, 1.2 GB a router over a window. The
// manager reads at most load.MaxReportBytes, and keeps of a report only the pair's
// engines; a report not shaped as a router's is refused.
func TestALoadReportHoldsOnlyThePairsEngines(t *testing.T) {
	hist := func(n int) string { return "[" + strings.TrimSuffix(strings.Repeat("1,", n), ",") + "]" }
	full := hist(len(load.Buckets) + 1)
	junk := func(n int) string {
		var b strings.Builder
		for i := range n {
			fmt.Fprintf(&b, `,"p-%d.ns d-%d.ns":%s`, i, i, full)
		}
		return b.String()
	}
	for _, c := range []struct {
		name, body string
		keys       int // -1: refused
	}{
		{"a router's", `{"boot":"b","prefill":{"p-0.ns":{"tokens":5,"itl":[]}},"decode":{"d-0.ns":{"inFlight":1,"itl":` + full + `}},"ttft":{"p-0.ns d-0.ns":` + full + `," d-0.ns":` + full + `}}`, 4},
		{"made-up keys beside the pair's", `{"boot":"b","ttft":{"p-0.ns d-0.ns":` + full + junk(2000) + `},"decode":{"ghost":{},"d-0.ns":{}}}`, 2},
		{"more than MaxReportBytes", `{"boot":"b","ttft":{"p-0.ns d-0.ns":` + full + junk(20000) + `}}`, -1},
		{"a histogram of the wrong length", `{"boot":"b","ttft":{"p-0.ns d-0.ns":` + hist(7) + `}}`, -1},
		{"a negative time", `{"boot":"b","decode":{"d-0.ns":{"busy":-1}}}`, -1},
		{"no boot", `{"ttft":{}}`, -1},
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte(c.body)) }))
		a := newAutoscaler(nil, nil, 0)
		r := a.fetch(t.Context(), srv.URL, map[string]bool{"p-0.ns": true}, map[string]bool{"d-0.ns": true})
		srv.Close()
		switch {
		case c.keys < 0 && r != nil:
			t.Errorf("%s: kept, want refused", c.name)
		case c.keys >= 0 && r == nil:
			t.Errorf("%s: refused", c.name)
		case c.keys >= 0 && len(r.Prefill)+len(r.Decode)+len(r.TTFT) != c.keys:
			t.Errorf("%s: kept %d prefill, %d decode, %d ttft keys; want %d in all", c.name, len(r.Prefill), len(r.Decode), len(r.TTFT), c.keys)
		}
	}
}
