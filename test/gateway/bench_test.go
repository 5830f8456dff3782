package gateway

import (
	"bufio"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// BenchmarkGatewayAddedLatency is a report, not a timed test: the time to the first
// streamed token through Envoy → endpoint picker → leg runner against the standalone
// router, over the same simulated engines (no prefill time, so the difference is the
// path's own), one request at a time and the two paths taking turns so that both see the
// same machine. go test ./test/gateway -bench GatewayAddedLatency -run ^$ -benchtime 400x
func BenchmarkGatewayAddedLatency(b *testing.B) {
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		b.Run(string(mode), func(b *testing.B) {
			st := startStack(b, options{mode: mode, policy: kvv1.HandoffFailureFail})
			var viaGateway, viaRouter []time.Duration
			for i := 0; b.Loop(); i++ {
				prompt := fmt.Sprintf("request %d: %s", i, strings.Repeat("word ", 200))
				viaGateway = append(viaGateway, firstToken(b, st.gateway, prompt))
				viaRouter = append(viaRouter, firstToken(b, st.router, prompt))
			}
			g, r := percentiles(viaGateway), percentiles(viaRouter)
			b.ReportMetric(float64(g[0].Microseconds())/1e3, "gateway-p50-ms")
			b.ReportMetric(float64(g[1].Microseconds())/1e3, "gateway-p99-ms")
			b.ReportMetric(float64(r[0].Microseconds())/1e3, "router-p50-ms")
			b.ReportMetric(float64(r[1].Microseconds())/1e3, "router-p99-ms")
		})
	}
}

func percentiles(ds []time.Duration) [2]time.Duration {
	slices.Sort(ds)
	at := func(q float64) time.Duration { return ds[min(len(ds)-1, int(q*float64(len(ds))))] }
	return [2]time.Duration{at(0.5), at(0.99)}
}

// firstToken streams one completion and returns the time to its first token's event.
func firstToken(b *testing.B, url, prompt string) time.Duration {
	body := fmt.Sprintf(`{"model":"tiny","prompt":%q,"max_tokens":4,"stream":true}`, prompt)
	start := time.Now()
	resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b.Fatalf("%s: %s", url, resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	var first time.Duration
	for sc.Scan() {
		if first == 0 && strings.HasPrefix(sc.Text(), "data: {") {
			first = time.Since(start)
		}
	}
	if first == 0 {
		b.Fatalf("%s: no token streamed", url)
	}
	return first
}
