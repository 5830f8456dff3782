package router_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/load"
	"github.com/kvhandoff/kvhandoff/internal/router/routertest"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
)

// The router's load report counts what the autoscaler sizes the pools by: prompt tokens
// offered, each prefill engine's completed tokens and busy time, each decode engine's
// streams in flight and token gaps, and TTFT by the pair that served.
func TestTheLoadReportCountsWhatTheAutoscalerReads(t *testing.T) {
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		kv := vllmserver.NewLocalKV()
		p := routertest.StartEngine(t, "p-0", kv, 20*time.Millisecond)
		d := routertest.StartEngine(t, "d-0", kv, 0, func(c *vllmserver.Config) { c.TPOT = 5 * time.Millisecond })
		r := routertest.StartRouter(t, mode, routertest.Engines(p), routertest.Engines(d))
		const n = 5
		for i := range n {
			body := fmt.Sprintf(`{"model":"tiny","prompt":"a b c d %d","max_tokens":8,"stream":true}`, i)
			if resp, data := routertest.Post(t, r.URL, "/v1/completions", body); resp.StatusCode != http.StatusOK {
				t.Fatalf("%s: %s %s", mode, resp.Status, data)
			}
		}
		rec := httptest.NewRecorder()
		r.Admin().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/load", nil))
		var rep load.Report
		if err := json.Unmarshal(rec.Body.Bytes(), &rep); err != nil {
			t.Fatalf("%s: /load: %v: %s", mode, err, rec.Body)
		}
		pf, dc := rep.Prefill["p-0"], rep.Decode["d-0"]
		switch {
		case rep.Boot == "" || rep.Requests != n || rep.PromptTokens == 0:
			t.Errorf("%s: %d requests, %d prompt tokens under boot %q; want %d and some", mode, rep.Requests, rep.PromptTokens, rep.Boot, n)
		case pf.Tokens != rep.PromptTokens || pf.Busy < n*0.02:
			t.Errorf("%s: prefill %d tokens over %.3f s; want all %d over at least %.2f (its prefill time)", mode, pf.Tokens, pf.Busy, rep.PromptTokens, n*0.02)
		case dc.InFlight < n*7*0.005 || dc.ITL.Count() < n*4:
			// 8 tokens 5 ms apart: 7 gaps a stream, of which reads may merge a few.
			t.Errorf("%s: decode %.3f stream-seconds, %d gaps; want at least %.3f and %d", mode, dc.InFlight, dc.ITL.Count(), n*7*0.005, n*4)
		case rep.TTFT[load.PairKey("p-0", "d-0")].Count() != n:
			t.Errorf("%s: TTFT of the pair counted %d times; want %d", mode, rep.TTFT[load.PairKey("p-0", "d-0")].Count(), n)
		}
		if q := dc.ITL.Quantile(0.5); q < 3*time.Millisecond || q > 50*time.Millisecond {
			t.Errorf("%s: median token gap %s; the engine streams every 5ms", mode, q)
		}
	}
}
